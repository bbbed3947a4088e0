"""The handshake and the liveness watch of a stage whose ranks span several hosts (--num-nodes > 1).

Role: before any rank process starts, the nodes of one stage meet on node 0's TCPStore, at the same
--master-addr:--master-port that the stage's torch.distributed process group uses afterwards (the store lives in
node 0's server process and serves both: torch's tcp:// rendezvous reuses it, `multi_tenant`). Every node
publishes what it believes about the stage (`NodeSpec.view`: stage, pp, tp, num_nodes, model fingerprint, dtype,
backend, partition, load format); node 0 compares and answers each node with a verdict, so a mismatch, a node rank claimed
twice or a node that never comes is an error on every node that joined, naming the values and the nodes —
never a hang. After start-up the same store carries heartbeats, so a node that dies is noticed within
HEARTBEAT_TIMEOUT_S even while the stage idles, and node 0's end (a clean stop or a failure) reaches the others.

Data flow (keys under "omnimesh/nodes/"):
    node R>0  NodeMember()       reach A:P (bounded) -> add("joined") = i -> set("join/i", view) -> wait "verdict/i"
                                 -> set "heard/i" (a refusing node 0 waits for that before it exits)
    node 0    NodeHost()         listen on P -> handshake(): read join/1.. until N-1 distinct agreeing nodes, a
                                 disagreement or the deadline -> set "verdict/i" ("" = ok, else the error) for each
    node R>0  ready(error)       once its ranks built their programs: set "ready/R" ("" or what failed)
    node 0    wait_ready()       every ready/R (bounded)
    serving   node R>0 add("beat/R") every HEARTBEAT_S and reads "state"; node 0's watch thread checks that each
              beat/R advances, reads "failed/R" and refuses late joiners; node 0 sets "state" to "stopping" (a clean
              shutdown: the others set "left/R" once their ranks ended and exit 0; node 0 waits for that, bounded)
              or "failed: <why>" (they exit non-zero)
Run: through `omnimesh stage NAME --num-nodes N --node-rank R ...` (node 0: MpExecutor; R>0:
omnimesh/parallel/headless_ranks.py). tests/parallel/test_node_rendezvous.py drives both ends in one process.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore

log = logging.getLogger(__name__)

PREFIX = "omnimesh/nodes"
HEARTBEAT_S = 1.0
HEARTBEAT_TIMEOUT_S = 15.0  # a node silent this long is gone (its host, its process or the network to it)
POLL_S = 0.1
VERDICT_READ_S = 5.0  # how long a refusing node 0 waits for the refused nodes to read why
COMPARED = ("stage", "pp", "tp", "num_nodes", "model", "dtype", "backend", "partition", "load_format")
SAME_FLAGS = ("Start every node of a stage with the same stage, -pp, -tp, --num-nodes, model, --dtype, --load-format "
              "and device, each with its own --node-rank")


class RendezvousError(RuntimeError):
    """The nodes of a stage could not meet or do not agree; the message names the values and the nodes."""


class NodeLost(RendezvousError):
    """Node 0's rendezvous store stopped answering (its process or host is gone)."""


def model_fingerprint(model_dir: Path) -> str:
    """A short hash of the model's config.json and its safetensors files' names and sizes: equal on every host
    that holds the same checkpoint, wherever its folder is (cheap: no weight is read)."""
    digest = hashlib.sha256((Path(model_dir) / "config.json").read_bytes())
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        digest.update(f"{path.name}:{path.stat().st_size}".encode())
    return digest.hexdigest()[:12]


@dataclass(frozen=True)
class NodeSpec:
    """This host's part in a stage spread over `num_nodes` hosts, and what it believes about the stage."""

    stage: str
    num_nodes: int
    node_rank: int
    model: str  # model_fingerprint(model_dir)
    dtype: str = "float32"
    load_format: str = "auto"  # --load-format: nodes that disagree would run real and random weights side by side
    partition: tuple[int, ...] | None = None
    timeout_s: float = 120.0  # --rendezvous-timeout
    model_dir: str = ""  # shown in messages only (folders may differ between hosts)
    host: str = field(default_factory=socket.gethostname)

    def __post_init__(self) -> None:
        if self.num_nodes < 2 or not 0 <= self.node_rank < self.num_nodes:
            raise ValueError(f"node rank {self.node_rank} of num_nodes {self.num_nodes}: a multi-node stage needs "
                             f"num_nodes >= 2 and 0 <= node rank < num_nodes")
        if self.timeout_s <= 0:
            raise ValueError(f"rendezvous timeout {self.timeout_s} must be > 0 seconds")

    def view(self, pp: int, tp: int, backend: str) -> dict[str, Any]:
        """What this node publishes at the rendezvous (COMPARED keys, plus who it is)."""
        return {"stage": self.stage, "pp": pp, "tp": tp, "num_nodes": self.num_nodes, "model": self.model,
                "dtype": self.dtype, "backend": backend, "load_format": self.load_format,
                "partition": list(self.partition) if self.partition else None,
                "node_rank": self.node_rank, "host": self.host, "pid": os.getpid(), "model_dir": self.model_dir}


def describe(view: dict[str, Any]) -> str:
    return f"node {view['node_rank']} ({view['host']}, pid {view['pid']})"


def disagreements(mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    return [f"{key}: {describe(mine)} has {mine[key]!r}, {describe(theirs)} has {theirs[key]!r}"
            for key in COMPARED if mine.get(key) != theirs.get(key)]


def _check_own_address(addr: str) -> None:
    """Node 0 listens at --master-addr and its own ranks connect there: it must be an address of this host."""
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.bind(sockaddr)
    except OSError as exc:
        raise RendezvousError(f"--master-addr {addr} is not an address of node 0 itself ({exc}): node 0 listens for "
                              f"the stage's rendezvous there and its own ranks connect to it; give this host's "
                              f"address, the one the other nodes reach it at") from None


def _listen(addr: str, port: int, timeout_s: float) -> TCPStore:
    _check_own_address(addr)
    try:  # multi_tenant: torch's tcp:// rendezvous of rank 0 (this process) then reuses this server
        return TCPStore(addr, port, is_master=True, wait_for_workers=False, multi_tenant=True,
                        timeout=timedelta(seconds=timeout_s))
    except dist.DistError as exc:
        first = str(exc).splitlines()[0]
        if "EADDRINUSE" in first or "address already in use" in first:
            raise RendezvousError(f"node 0 could not listen for the stage's rendezvous on port {port} ({first}); "
                                  f"another process holds it: choose another --master-port") from None
        raise RendezvousError(f"node 0 could not open the stage's rendezvous at {addr}:{port} ({first})") from None


def _reach(addr: str, port: int, timeout_s: float) -> TCPStore:
    """A client of node 0's store; RendezvousError within `timeout_s` when nothing answers there. A plain TCP
    connect first, so a refused or filtered port gives one clear line instead of c10d's retry log."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((addr, port), timeout=max(0.1, min(5.0, left))):
                break
        except OSError as exc:
            last = exc
        if time.monotonic() >= deadline:
            raise RendezvousError(
                f"could not reach node 0's rendezvous at {addr}:{port} within {timeout_s:.0f}s ({last}); check "
                f"--master-addr and --master-port, that node 0 runs this stage with the same --master-port, and "
                f"that no firewall blocks TCP port {port} (--rendezvous-timeout sets the wait)")
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    try:
        return TCPStore(addr, port, is_master=False, wait_for_workers=False,
                        timeout=timedelta(seconds=max(1.0, deadline - time.monotonic())))
    except dist.DistError as exc:
        raise RendezvousError(f"{addr}:{port} answers but is not a stage's rendezvous ({exc}); is --master-port "
                              f"another service's port?") from None


class NodeHost:
    """Node 0's end: the store, the handshake, the ready wait and the liveness watch (see the module doc)."""

    def __init__(self, addr: str, port: int, spec: NodeSpec, pp: int, tp: int, backend: str):
        self.addr, self.port, self.spec = addr, port, spec
        self.view = spec.view(pp, tp, backend)
        self._server = _listen(addr, port, spec.timeout_s)
        self.store = PrefixStore(PREFIX, self._server)
        self.store.set("state", "starting")
        self.members: dict[int, dict[str, Any]] = {}  # node rank -> its view
        self._read = 0  # join/<i> entries read so far
        self._stop = threading.Event()
        self._failed = False

    def _joiners(self) -> list[tuple[int, dict[str, Any]]]:
        out = []
        while self._read < self.store.add("joined", 0):
            self._read += 1
            out.append((self._read, json.loads(self.store.get(f"join/{self._read}"))))
        return out

    def _problems(self, view: dict[str, Any]) -> list[str]:
        n, rank = self.spec.num_nodes, view.get("node_rank")
        problems = disagreements(self.view, view)
        if rank in self.members:
            problems.append(f"two nodes claim --node-rank {rank}: {describe(self.members[rank])} and {describe(view)}; "
                            f"give every host its own rank 1..{n - 1}")
        elif not isinstance(rank, int) or not 1 <= rank < n:
            problems.append(f"{describe(view)} has --node-rank {rank}, outside 1..{n - 1} for --num-nodes {n} of node 0")
        return problems

    def handshake(self) -> None:
        """Wait (bounded) for the other num_nodes - 1 nodes and compare; every joined node hears the verdict."""
        n, deadline, answered = self.spec.num_nodes, time.monotonic() + self.spec.timeout_s, []
        log.info("stage %s: node 0 of %d, waiting for the other nodes at %s:%d (up to %.0fs)", self.spec.stage, n,
                 self.addr, self.port, self.spec.timeout_s)
        while len(self.members) < n - 1:
            for index, view in self._joiners():
                answered.append(index)
                problems = self._problems(view)
                if problems:
                    self._refuse(answered, f"stage {self.spec.stage}: the nodes disagree at the rendezvous "
                                           f"{self.addr}:{self.port}: {'; '.join(problems)}. {SAME_FLAGS}")
                self.members[view["node_rank"]] = view
                log.info("stage %s: %s joined", self.spec.stage, describe(view))
            if len(self.members) < n - 1 and time.monotonic() > deadline:
                missing = sorted(set(range(1, n)) - set(self.members))
                self._refuse(answered, f"stage {self.spec.stage}: node(s) {missing} of {n} did not join the rendezvous "
                                       f"at {self.addr}:{self.port} within {self.spec.timeout_s:.0f}s (joined: "
                                       f"{[describe(v) for v in self.members.values()] or 'none'}); start "
                                       f"`omnimesh stage {self.spec.stage} --num-nodes {n} --node-rank R "
                                       f"--master-addr {self.addr} --master-port {self.port}` on each, or raise "
                                       f"--rendezvous-timeout")
            time.sleep(POLL_S)
        for index in answered:
            self.store.set(f"verdict/{index}", "")

    def _refuse(self, indices: list[int], message: str) -> None:
        """Every joined node hears `message` (this process may exit right after: wait, bounded, until they read
        it), then raise it here."""
        for index in indices:
            self.store.set(f"verdict/{index}", message)
        self.failed(message)
        deadline = time.monotonic() + VERDICT_READ_S
        while time.monotonic() < deadline and not all(self.store.check([f"heard/{i}"]) for i in indices):
            time.sleep(POLL_S)
        raise RendezvousError(message)

    def wait_joining(self, deadline: float) -> None:
        """Every other node's ranks are about to join the process group (or one says why they cannot), by
        `deadline`: node 0 joins only then, so a rank that cannot start on another host (a device that host
        lacks, a factory it cannot build) is named at once instead of node 0 waiting out the rendezvous."""
        self._wait_nodes("joining", deadline, "reach the rendezvous")

    def wait_ready(self, deadline: float) -> None:
        """Every other node's ranks have built their programs (or one says why it could not), by `deadline`."""
        self._wait_nodes("ready", deadline, "report their ranks ready")

    def _wait_nodes(self, key: str, deadline: float, what: str) -> None:
        """Until every member has set `key`/R ("joining" or "ready"; ready implies joining); a member's start-up
        error (ready/R) or failure (failed/R) raises. ready/R is read once, after it is there, so an error written
        between two reads is never taken for a success."""
        pending = set(self.members)
        while pending:
            for rank in sorted(pending):
                if self.store.check([f"failed/{rank}"]):
                    raise RendezvousError(f"{describe(self.members[rank])}: {self.store.get(f'failed/{rank}').decode()}")
                if self.store.check([f"ready/{rank}"]):
                    if error := self.store.get(f"ready/{rank}").decode():
                        raise RendezvousError(f"{describe(self.members[rank])}: {error}")
                    pending.discard(rank)
                elif key == "joining" and self.store.check([f"joining/{rank}"]):
                    pending.discard(rank)
            if pending and time.monotonic() > deadline:
                raise RendezvousError(f"node(s) {sorted(pending)} did not {what} in time")
            time.sleep(POLL_S)

    def watch(self, on_failure: Callable[[str], None]) -> None:
        """From now on, a silent or failed node (or a store error) calls `on_failure` once, on a daemon thread."""
        self.store.set("state", "serving")
        threading.Thread(target=self._watch, args=(on_failure,), name="omnimesh-node-watch", daemon=True).start()

    def _watch(self, on_failure: Callable[[str], None]) -> None:
        beats = {rank: (-1, time.monotonic()) for rank in self.members}
        while not self._stop.wait(HEARTBEAT_S):
            try:
                problem = self._check_members(beats)
            except dist.DistError as exc:
                problem = f"the stage's rendezvous store failed: {exc}"
            if problem is not None and not self._stop.is_set():
                self.failed(problem)
                on_failure(problem)
                return

    def _check_members(self, beats: dict[int, tuple[int, float]]) -> str | None:
        for index, view in self._joiners():  # a node that comes after the handshake: refused
            self.store.set(f"verdict/{index}", f"stage {self.spec.stage} already has its {self.spec.num_nodes} nodes "
                                               f"({', '.join(describe(v) for v in self.members.values())} and node 0); "
                                               f"{describe(view)} came late — is --node-rank {view['node_rank']} "
                                               f"given twice?")
        now = time.monotonic()
        for rank, view in self.members.items():
            if self.store.check([f"failed/{rank}"]):
                return f"{describe(view)}: {self.store.get(f'failed/{rank}').decode()}"
            count = self.store.add(f"beat/{rank}", 0)
            if count != beats[rank][0]:
                beats[rank] = (count, now)
            elif now - beats[rank][1] > HEARTBEAT_TIMEOUT_S:
                return (f"{describe(view)} sent no heartbeat for {HEARTBEAT_TIMEOUT_S:.0f}s: its host, its omnimesh "
                        f"process or the network to it is down")
        return None

    def failed(self, message: str) -> None:
        """Tell every other node the stage failed (they exit non-zero); best effort."""
        self._failed = True
        self._set_state(f"failed: {message}")

    def stopping(self) -> None:
        """Tell every other node this is a clean shutdown (they exit 0 once their ranks end)."""
        self._stop.set()
        if not self._failed:
            self._set_state("stopping")

    def wait_left(self, timeout_s: float) -> None:
        """After a clean stop: wait (bounded) until every other node says its ranks ended, so none of them finds
        this store gone first (a node that does still exits 0 once its ranks end; this only keeps it quiet)."""
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline and not all(self.store.check([f"left/{r}"]) for r in self.members):
                time.sleep(POLL_S)
        except dist.DistError:
            pass

    def _set_state(self, state: str) -> None:
        try:
            self.store.set("state", state)
        except dist.DistError:
            pass


class NodeMember:
    """A node R>0's end: reach node 0, join, hear the verdict, then report ready and beat."""

    def __init__(self, addr: str, port: int, spec: NodeSpec, pp: int, tp: int, backend: str):
        self.addr, self.port, self.spec = addr, port, spec
        self.view = spec.view(pp, tp, backend)
        self._client = _reach(addr, port, spec.timeout_s)
        self.store = PrefixStore(PREFIX, self._client)

    def handshake(self) -> None:
        """Join and wait (bounded) for node 0's verdict; RendezvousError with node 0's message on a refusal."""
        index = self.store.add("joined", 1)
        self.store.set(f"join/{index}", json.dumps(self.view))
        deadline = time.monotonic() + self.spec.timeout_s
        try:  # polled, not one long store.wait: a signal to this process is handled meanwhile
            while not self.store.check([f"verdict/{index}"]):
                if time.monotonic() > deadline:
                    raise RendezvousError(f"node 0 at {self.addr}:{self.port} gave no verdict within "
                                          f"{self.spec.timeout_s:.0f}s")
                time.sleep(POLL_S)
            verdict = self.store.get(f"verdict/{index}").decode()
            self.store.set(f"heard/{index}", "")
        except dist.DistError as exc:
            raise RendezvousError(f"node 0 at {self.addr}:{self.port} stopped answering during the handshake "
                                  f"({str(exc).splitlines()[0]})") from None
        if verdict:
            raise RendezvousError(verdict)
        # from now on a silent node 0 is noticed within HEARTBEAT_TIMEOUT_S (each store call waits at most that)
        self._client.set_timeout(timedelta(seconds=HEARTBEAT_TIMEOUT_S))

    def joining(self) -> None:
        """This node's ranks all run and hold their devices: they join the process group next (best effort: a node 0
        that is gone is noticed by the next heartbeat)."""
        self._set(f"joining/{self.spec.node_rank}", "")

    def ready(self, error: str | None) -> None:
        self.store.set(f"ready/{self.spec.node_rank}", error or "")

    def beat(self) -> str:
        """One heartbeat; returns node 0's state ("starting", "serving", "stopping", "failed: ..."), NodeLost when
        node 0's store does not answer."""
        try:
            self.store.add(f"beat/{self.spec.node_rank}", 1)
            return self.store.get("state").decode()
        except dist.DistError as exc:
            raise NodeLost(f"lost node 0 (the stage's driver) at {self.addr}:{self.port}: "
                           f"{str(exc).splitlines()[0]}") from None

    def fail(self, message: str) -> None:
        """Tell node 0 why this node's part of the stage ended (best effort: node 0 may be gone)."""
        self._set(f"failed/{self.spec.node_rank}", message)

    def left(self) -> None:
        """Tell node 0 this node's ranks ended after its stop (best effort)."""
        self._set(f"left/{self.spec.node_rank}", "")

    def _set(self, key: str, value: str) -> None:
        try:
            self.store.set(key, value)
        except dist.DistError:
            pass
