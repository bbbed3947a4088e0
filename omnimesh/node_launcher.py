"""Multi-node start-up (--num-nodes N): the layout checks, the flags each spread stage gets, and the headless side.

Role: a stage of more than one rank spans the N hosts, pp x tp / N consecutive ranks on each. Node 0 runs the
stages' servers (and, with `serve`, the gateway) exactly as on one host; its launcher hands each spread stage
`node_argv`: --num-nodes, --node-rank 0, --master-addr and its own --master-port (base + stage index). Hosts
R > 0 run headless:
    `omnimesh stage NAME --node-rank R ...` -> run_headless_stage: this host's ranks of the stage, no server
                                              (omnimesh/parallel/headless_ranks.py)
    `omnimesh serve --node-rank R ...`      -> HeadlessNode: one headless `omnimesh stage` process per spread
                                              stage, no gateway, supervised:
        exit 0 (node 0 stopped that stage, e.g. to restart it): join its next start at once;
        exit EXIT_NO_NODE0 right after such a stop (node 0 did not start it again within --rendezvous-timeout):
            that stage is over; once every stage is over, this node exits 0 (node 0 stopped the mesh);
        any other exit: restart after a backoff as MeshLauncher does (--stage-restarts within 10 minutes); one
            more stops this node with code 1. SIGTERM / Ctrl-C: stop the children (they tell node 0), exit 0.
Run: node 0 `omnimesh serve M --num-nodes 2 --node-rank 0 --master-addr HOST0 --master-port 29500 -pp 2`,
node 1 the same with `--node-rank 1` (see MULTINODE_README.md).
"""

from __future__ import annotations

import ipaddress
import math
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from omnimesh.config.serve_args import ServeArgs
from omnimesh.config.stage_config import STAGES

POLL_S = 0.5


def spread_stages(args: ServeArgs) -> dict[str, int]:
    """Stages whose ranks span the nodes -> their rendezvous port (--master-port + stage index)."""
    if args.num_nodes == 1 or args.master_port is None:
        return {}
    cfgs = args.stage_configs()
    return {stage: args.master_port + i for i, stage in enumerate(STAGES) if cfgs[stage].num_nodes > 1}


def node_argv(args: ServeArgs, stage: str) -> list[str]:
    """The multi-node flags `omnimesh serve` gives one stage's process ([] for a stage on node 0 only)."""
    port = spread_stages(args).get(stage)
    if port is None:
        return []
    return ["--num-nodes", str(args.num_nodes), "--node-rank", str(args.node_rank), "--master-addr", args.master_addr,
            "--master-port", str(port), "--rendezvous-timeout", str(args.rendezvous_timeout)]


def check_nodes(args: ServeArgs, only: str | None = None) -> list[str]:
    """ValueError when --num-nodes cannot apply (a lone `stage` of one rank, a `serve` with nothing to spread);
    else advice lines (tp ranks of one pipeline rank split across hosts)."""
    if args.num_nodes == 1:
        return []
    cfgs = args.stage_configs()
    if only is not None:
        cfg = cfgs[only]
        if cfg.num_nodes != args.num_nodes:
            why = "its num_nodes is 1 in --stage-overrides" if cfg.world_size > 1 else "a single rank cannot be split"
            raise ValueError(f"stage {only}: pp x tp = {cfg.pp} x {cfg.tp} = {cfg.world_size} rank(s) cannot span "
                             f"--num-nodes {args.num_nodes} hosts ({why}); give -pp/-tp with pp x tp a multiple of "
                             f"{args.num_nodes}, e.g. -pp {args.num_nodes}")
        cfgs = {only: cfg}
    elif not spread_stages(args):
        raise ValueError(f"--num-nodes {args.num_nodes}: no stage has more than one rank to spread over the hosts "
                         f"(pp x tp = 1 for every stage); give -pp/-tp or a stage's pp/tp in --stage-overrides")
    advice = [line] if (line := gloo_address_advice(args.master_addr)) else []
    for stage, cfg in cfgs.items():
        per = cfg.ranks_per_node
        if cfg.num_nodes > 1 and per % cfg.tp:
            tp = math.gcd(cfg.tp, per)
            advice.append(f"stage {stage}: the tp = {cfg.tp} ranks of a pipeline rank are split across hosts ({per} "
                          f"rank(s) per host), so every layer's all-reduce crosses the network; tp is best inside a "
                          f"host: a tp that divides {per}, e.g. -tp {tp} -pp {cfg.world_size // tp}")
    return advice


def _loopback_only(host: str) -> bool:
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addrs) and all(ipaddress.ip_address(str(a).split("%")[0]).is_loopback for a in addrs)


def gloo_address_advice(master_addr: str) -> str | None:
    """gloo (the stages' command channel, and every collective on CPU) tells the other hosts the address this
    host's name resolves to; a name that resolves only to loopback (Debian's 127.0.1.1 in /etc/hosts) makes
    them connect to themselves, and the start fails at the process-group timeout. Nodes on one host (a
    loopback --master-addr) are fine."""
    if os.environ.get("GLOO_SOCKET_IFNAME") or _loopback_only(master_addr):
        return None
    name = socket.gethostname()
    if not _loopback_only(name):
        return None
    return (f"this host's name {name!r} resolves only to a loopback address, which gloo would give the other hosts "
            f"(they could not connect back); set GLOO_SOCKET_IFNAME to the interface that reaches {master_addr} "
            f"(e.g. GLOO_SOCKET_IFNAME=eth0; on CUDA also NCCL_SOCKET_IFNAME), or map the name to that address in "
            f"/etc/hosts")


def run_headless_stage(stage: str, model_dir: Path, args: ServeArgs) -> int:
    """`omnimesh stage NAME --node-rank R>0`: this host's ranks of the stage until node 0 ends it."""
    from omnimesh.parallel.headless_ranks import run_headless
    from omnimesh.parallel.mp_executor import Rendezvous
    from omnimesh.server.stage_failure import StageFailure
    from omnimesh.stage_registry import lm_layout, rank_program

    layout = lm_layout(args, stage, StageFailure(), model_dir)
    if layout.nodes is None or layout.master_port is None:
        raise ValueError(f"stage {stage} does not span --num-nodes {args.num_nodes} hosts; nothing runs headless here")
    nice = args.stage_configs()[stage].nice
    if nice:
        os.nice(nice)  # as run_stage does on node 0; the ranks inherit it
    rdzv = Rendezvous(layout.master_addr, layout.master_port, layout.backend, layout.timeout_s, layout.devices)
    return run_headless(rank_program(args, stage, model_dir), layout.pp, layout.tp, rdzv, layout.nodes)


@dataclass
class _Child:
    argv: list[str]
    proc: subprocess.Popen
    restarts: list[float] = field(default_factory=list)  # monotonic times within the restart window
    due: float | None = None  # a restart planned for then
    after_stop: bool = False  # node 0 stopped the stage; this process waits for its next start


class HeadlessNode:
    """`omnimesh serve --node-rank R>0`: the headless stage processes of this host (see the module doc)."""

    def __init__(self, args: ServeArgs, model_dir: Path):
        self.args, self.model_dir = args, model_dir
        self.children: dict[str, _Child] = {}
        self.where = f"node {args.node_rank} of {args.num_nodes}"
        self.stopping = False  # SIGTERM / SIGINT

    def run(self) -> int:
        from omnimesh.launcher import MeshLauncher, _popen

        def on_signal(signum: int, frame: object) -> None:
            self.stopping = True  # noted, not raised: an exception inside a fork hook (spawning) would be lost

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
        from omnimesh.models.qwen3_omni.checkpoint_stages import model_stages

        launcher = MeshLauncher(self.args, self.model_dir)
        cfgs, has = self.args.stage_configs(), model_stages(self.model_dir)
        ports = {s: p for s, p in spread_stages(self.args).items()
                 if s in has and cfgs[s].num_replicas > 0}  # the stages node 0 runs
        try:
            for stage in ports:
                argv = launcher._stage_argv(stage, 0)  # its flags as node 0 gives them, with this --node-rank
                self.children[stage] = _Child(argv, _popen(argv))
            _say(f"{self.where}: headless ranks of " + ", ".join(
                f"{s} (rendezvous {self.args.master_addr}:{p})" for s, p in ports.items()) + "; no gateway here")
            return self._watch(_popen)
        finally:
            self._stop()

    def _watch(self, popen) -> int:  # noqa: ANN001 - launcher._popen
        from omnimesh.launcher import MAX_RESTART_BACKOFF_S, RESTART_WINDOW_S
        from omnimesh.parallel.headless_ranks import EXIT_NO_NODE0

        limit = self.args.stage_restarts
        while self.children:
            if self.stopping:
                _say(f"{self.where}: stopping its headless stages")
                return 0
            now = time.monotonic()
            for stage, child in list(self.children.items()):
                if self.stopping:  # the signal reached the children too: their exits are no failures
                    break
                if child.due is not None:
                    if now >= child.due:
                        child.due, child.proc = None, popen(child.argv)
                    continue
                code = child.proc.poll()
                if code is None:
                    continue
                if code == 0:
                    _say(f"{self.where}: node 0 stopped stage {stage}; waiting up to {self.args.rendezvous_timeout:.0f}s "
                         f"for its next start")
                    child.after_stop, child.proc = True, popen(child.argv)
                elif code == EXIT_NO_NODE0 and child.after_stop:
                    _say(f"{self.where}: stage {stage} is over (node 0 did not start it again)")
                    del self.children[stage]
                else:
                    child.after_stop = False
                    child.restarts = [t for t in child.restarts if now - t < RESTART_WINDOW_S]
                    said = f"{self.where}: headless stage {stage} (pid {child.proc.pid}) exited with code {code}"
                    if len(child.restarts) >= limit:
                        _say(f"{said}; --stage-restarts {limit} used up: stopping this node")
                        return 1
                    delay = min(MAX_RESTART_BACKOFF_S, 2.0 ** len(child.restarts))
                    child.restarts.append(now)
                    child.due = now + delay
                    _say(f"{said}; starting it again in {delay:.0f}s (see its log above)")
            time.sleep(POLL_S)
        _say(f"{self.where}: node 0 stopped every stage of this node; exiting")
        return 0

    def _stop(self) -> None:
        for child in self.children.values():
            if child.proc.poll() is None:
                child.proc.terminate()
        deadline = time.monotonic() + 10.0
        for child in self.children.values():
            try:
                child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()


def _say(line: str) -> None:
    print(f"omnimesh: {line}", file=sys.stderr, flush=True)
