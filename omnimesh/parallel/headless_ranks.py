"""The ranks of one stage on a node other than node 0 (`--node-rank R > 0`), run headless.

Role: what `omnimesh stage NAME --num-nodes N --node-rank R` runs on hosts R > 0: no gRPC server, no engine,
only this host's L = pp x tp / N ranks of the stage. They join node 0's process group and execute the driver's
commands exactly as node 0's own worker ranks do (`rank_worker.worker_main`: the command protocol is all
torch.distributed, so it crosses hosts).

Data flow:
    NodeMember: reach node 0, handshake (bounded; node 0's verdict names any disagreement)
    -> spawn global ranks [R*L, (R+1)*L) -> they meet node 0's ranks at --master-addr:--master-port and build
       their programs -> ready/R
    -> supervise, once per HEARTBEAT_S: a heartbeat to node 0, which answers with the stage's state
       exit 0: node 0 shut the stage down (its ranks got STOP, or node 0 said "stopping"), or a signal here
       exit 1: a rank died (node 0 hears why), node 0 reports the stage failed, or node 0 went silent for
               HEARTBEAT_TIMEOUT_S — always with a line saying which; never a hang
       EXIT_NO_NODE0 (4): node 0 could not be reached at all (--rendezvous-timeout)
Run: `omnimesh stage thinker --num-nodes 2 --node-rank 1 --master-addr HOST0 --master-port 29500 -pp 2 ...`
(omnimesh/node_launcher.py builds the program factory; tests/parallel/test_mp_executor_nodes.py runs a toy one).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import signal
import time
from collections.abc import Callable
from typing import Any

from omnimesh.parallel.node_rendezvous import HEARTBEAT_S, NodeLost, NodeMember, NodeSpec, RendezvousError
from omnimesh.parallel.rank_worker import JOINING, ProgramFactory, Rendezvous, worker_main

log = logging.getLogger(__name__)

EXIT_NO_NODE0 = 4  # the rendezvous at --master-addr:--master-port never answered
STOP_GRACE_S = 10.0  # after node 0's stop (or loss), how long this host's ranks get to end on their own


class _Stop(Exception):
    """SIGTERM / SIGINT on this headless node."""


def run_headless(factory: ProgramFactory, pp: int, tp: int, rdzv: Rendezvous, spec: NodeSpec,
                 threads: int = 1) -> int:
    """Join node 0's stage with this host's ranks and serve its commands until it ends; the exit status."""
    per = pp * tp // spec.num_nodes
    ranks = range(spec.node_rank * per, (spec.node_rank + 1) * per)
    log.info("headless node %d of %d for stage %s: ranks %s of pp=%d x tp=%d (%s); rendezvous %s:%d",
             spec.node_rank, spec.num_nodes, spec.stage, list(ranks), pp, tp, rdzv.backend,
             rdzv.master_addr, rdzv.master_port)
    where = f"stage {spec.stage}, node {spec.node_rank}"

    # raised at once while this node only waits for node 0; once its ranks spawn, only noted and read by the
    # supervisor (an exception raised inside a fork hook, as spawning runs them, would be lost)
    stop: dict[str, Any] = {"signal": None, "raise": True}

    def on_signal(signum: int, frame: object) -> None:
        stop["signal"] = signal.Signals(signum).name
        if stop["raise"]:
            raise _Stop(stop["signal"])

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    member: NodeMember | None = None
    procs: dict[int, Any] = {}
    try:
        try:
            member = NodeMember(rdzv.master_addr, rdzv.master_port, spec, pp, tp, rdzv.backend)
        except RendezvousError as exc:
            log.error("%s: %s", where, exc)
            return EXIT_NO_NODE0
        try:
            member.handshake()
        except RendezvousError as exc:  # node 0's verdict, as node 0 prints it
            log.error("%s: %s", where, str(exc).removeprefix(f"stage {spec.stage}: "))
            return 1
        log.info("stage %s: node 0 accepted node %d; starting its ranks", spec.stage, spec.node_rank)
        stop["raise"] = False
        ctx = mp.get_context("spawn")
        ready = ctx.Queue()
        level = logging.getLogger().getEffectiveLevel()
        for rank in ranks:
            procs[rank] = ctx.Process(target=worker_main, name=f"omnimesh-rank{rank}", daemon=True,
                                      args=(rank, pp, tp, rdzv, factory, threads, ready, level))
            procs[rank].start()
        return _Supervisor(member, procs, ready, spec, rdzv.timeout_s, lambda: stop["signal"]).run()
    except _Stop as stop:
        if member is not None:
            member.fail(f"its headless process was stopped ({stop})")
        log.info("%s: stopped by %s; its ranks end", where, stop)
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for proc in procs.values():
            if proc.pid is None:  # never started
                continue
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)


class _Supervisor:
    def __init__(self, member: NodeMember, procs: dict[int, Any], ready: Any, spec: NodeSpec, start_timeout_s: float,
                 stopped: Callable[[], str | None]):
        self.member, self.procs, self.ready, self.spec, self.stopped = member, procs, ready, spec, stopped
        self.pending = set(procs)  # ranks that have not reported ready
        self.joining: set[int] = set()  # ranks that reported JOINING; all of them: node 0 hears it (NodeMember.joining)
        self.start_deadline = time.monotonic() + spec.timeout_s + start_timeout_s
        self.where = f"stage {spec.stage}, node {spec.node_rank}"

    def run(self) -> int:
        while True:
            if (why := self.stopped()) is not None:
                raise _Stop(why)
            if (code := self._collect_ready()) is not None:
                return code
            exited = {rank: p.exitcode for rank, p in self.procs.items() if p.exitcode is not None}
            if exited and all(code == 0 for code in exited.values()) and len(exited) == len(self.procs):
                log.info("%s: node 0 shut the stage down; all ranks ended", self.where)
                self.member.left()
                return 0
            try:
                state = self.member.beat()
            except NodeLost as exc:
                return self._wait_ranks("node 0 ended", lost=exc)
            if state == "stopping":
                return self._wait_ranks("node 0 shut the stage down", lost=None)
            if state.startswith("failed: "):
                log.error("%s: node 0 reports the stage failed: %s", self.where, state.removeprefix("failed: "))
                return 1
            bad = {rank: code for rank, code in exited.items() if code != 0}
            if bad:
                rank, code = min(bad.items())
                message = f"rank {rank} (pid {self.procs[rank].pid}) exited with code {code}"
                log.error("%s: %s; ending this node's part of the stage", self.where, message)
                self.member.fail(message)
                return 1

    def _collect_ready(self) -> int | None:
        """Wait up to HEARTBEAT_S for ready reports; report this node ready (or failed) to node 0 once known."""
        try:
            rank, error = self.ready.get(timeout=HEARTBEAT_S)
        except queue.Empty:
            if self.pending and time.monotonic() > self.start_deadline:
                message = f"ranks {sorted(self.pending)} did not start in time"
                log.error("%s: %s", self.where, message)
                self.member.ready(message)
                return 1
            return None
        if error == JOINING:  # on its way to the rendezvous; once every rank is, node 0 may join too
            self.joining.add(rank)
            if self.joining == set(self.procs):
                self.member.joining()
            return None
        if error is not None:
            message = f"rank {rank} failed to start: {error}"
            log.error("%s: %s", self.where, message)
            self.member.ready(message)
            return 1
        self.pending.discard(rank)
        if not self.pending:
            self.member.ready(None)
            log.info("%s: ranks %s ready; serving node 0's commands", self.where, sorted(self.procs))
        return None

    def _wait_ranks(self, why: str, lost: NodeLost | None) -> int:
        """Node 0 stopped (`lost` None) or its store is gone: after a clean stop the ranks end by themselves (got
        STOP: exit 0); ranks still running after STOP_GRACE_S, or failed ones, after a loss: it died."""
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline and any(p.is_alive() for p in self.procs.values()):
            time.sleep(0.1)
        codes = {rank: p.exitcode for rank, p in self.procs.items()}
        if lost is None:  # node 0 said "stopping": whatever the ranks did on the way out, a clean stop
            log.info("%s: %s; ranks ended with %s", self.where, why, codes)
            self.member.left()
            return 0
        if all(code == 0 for code in codes.values()):
            log.info("%s: node 0 shut the stage down; all ranks ended", self.where)
            return 0
        log.error("%s: %s; ranks: %s", self.where, lost, {r: "running" if c is None else f"exit {c}" for r, c in codes.items()})
        return 1
