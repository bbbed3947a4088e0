"""MpExecutor: runs one stage's pp x tp ranks as local processes and drives them from the server.

Rank 0 lives in the stage's server process (the driver); ranks 1..N-1 are spawned processes (what each
runs: omnimesh/parallel/rank_worker.py). Every rank builds its `RankProgram` once (its layers, its shard)
from the same picklable factory, then all ranks run the same commands in lock-step:

    driver: submit(cmd) --cmd to every rank (non-blocking sends, gloo metadata group)--> program.execute(cmd)
            ranks exchange activations between themselves (send/recv, all-reduce on the device group)
            the rank that owns the result (last pp rank, tp rank 0) sends it back on a result group; a
            receiver thread in the driver hands results to the waiting futures in command order

Pipelining: `submit` returns once rank 0 has done ITS part of the command, so the driver can dispatch the
next request's step while later pipeline ranks still work on this one (several engine threads call
`execute` at once; commands still reach every rank in one order, which the lock keeps).

Failure handling: a monitor thread watches every worker process; one that exits marks the executor
failed with a message naming the rank, its pid and exit code, and calls `on_failure` (the stage goes
NOT_SERVING). Commands after that raise `RankFailure` at once; a command in flight fails when the
collective notices the dead peer, or at the process-group timeout — never an unbounded hang. Workers get
PR_SET_PDEATHSIG, so they die with the server even when it is killed outright.

Idle stages: a rank waits for its next command, and the driver's receiver for the owner's next result, in a
recv bounded by the same timeout (gloo's, per operation). While no command goes out for a quarter of it, a
keep-alive thread sends KEEPALIVE (a no-op every rank answers like a command), so a stage that idles for hours
still serves, and a lost peer is still found within the timeout.

Several hosts (`nodes`, --num-nodes N): the driver is node 0 and spawns only its own ranks 1..L-1 (L =
world / N); node R's ranks [R*L, (R+1)*L) run headless there (omnimesh/parallel/headless_ranks.py) and take
the same commands over the same process group. Before any rank starts, node 0 hosts the handshake and then
watches the other nodes' heartbeats (omnimesh/parallel/node_rendezvous.py): a node that dies or leaves fails
the stage like a dead local rank, and a clean shutdown (also at interpreter exit) tells them to exit 0.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from omnimesh.parallel.node_rendezvous import NodeHost, NodeSpec
from omnimesh.parallel.parallel_state import ParallelState, init_parallel_state, select_device
from omnimesh.parallel.rank_worker import (  # noqa: F401 - RankProgram: part of this module's interface
    JOINING,
    KEEPALIVE,
    STOP,
    ProgramFactory,
    RankFailure,
    RankProgram,
    Rendezvous,
    prune_sends,
    recv_obj,
    result_group,
    send_obj,
    worker_main,
)
from omnimesh.proc_utils import free_port

log = logging.getLogger(__name__)

class _Pending:
    """One submitted command: resolved once rank 0's part is done AND the owner's result has arrived
    (either may come first: with pp > 1 the result can arrive before rank 0 returns from its send)."""

    _UNSET = object()

    def __init__(self) -> None:
        self.future: Future = Future()
        self._lock = threading.Lock()
        self._local_done = False
        self._local_error: Exception | None = None
        self._result: Any = self._UNSET

    def local(self, error: Exception | None) -> None:
        with self._lock:
            self._local_done, self._local_error = True, error
            self._resolve()

    def remote(self, result: Any) -> None:
        with self._lock:
            self._result = result
            self._resolve()

    def _resolve(self) -> None:
        if not self._local_done or self._result is self._UNSET or self.future.done():
            return
        if self._local_error is not None:
            error = self._local_error
            self.future.set_exception(RankFailure(f"rank 0: {type(error).__name__}: {error}"))
        elif isinstance(self._result, RankFailure):
            self.future.set_exception(self._result)
        else:
            self.future.set_result(self._result)

    def fail(self, error: RankFailure) -> None:
        with self._lock:
            if not self.future.done():
                self.future.set_exception(error)


class MpExecutor:
    def __init__(self, pp: int, tp: int, factory: ProgramFactory, *, backend: str = "gloo",
                 master_addr: str = "127.0.0.1", master_port: int | None = None, timeout_s: float = 60.0,
                 threads_per_rank: int = 1, on_failure: Callable[[str], None] | None = None,
                 devices: tuple[str, ...] = (), nodes: NodeSpec | None = None, start_timeout_s: float | None = None):
        """`timeout_s`: the process group's (every collective's, and the rendezvous'); `start_timeout_s`: how long
        this host's ranks may take to report in (a fresh process importing torch, then building its program;
        default `timeout_s`)."""
        if pp < 1 or tp < 1:
            raise ValueError(f"pp and tp must be >= 1, got pp={pp}, tp={tp}")
        num_nodes = nodes.num_nodes if nodes is not None else 1
        if (pp * tp) % num_nodes or (nodes is not None and nodes.node_rank != 0):
            raise ValueError(f"the driver is node 0 of a stage whose pp x tp = {pp} x {tp} = {pp * tp} ranks divide "
                             f"evenly over its {num_nodes} nodes")
        self.pp, self.tp, self.world = pp, tp, pp * tp
        self.local_world = self.world // num_nodes  # ranks 0..local_world-1 are this host's
        if devices and len(devices) != self.local_world:
            raise ValueError(f"{len(devices)} devices given for the {self.local_world} ranks on this host (pp x tp = "
                             f"{pp} x {tp} over {num_nodes} host(s)); give one per rank")
        self.nodes = nodes
        self.node_host: NodeHost | None = None
        self.factory = factory
        self.rdzv = Rendezvous(master_addr, master_port or free_port(master_addr), backend, timeout_s, tuple(devices))
        self.start_timeout_s = timeout_s if start_timeout_s is None else start_timeout_s
        self.threads = threads_per_rank
        self.on_failure = on_failure
        self.failure: str | None = None
        self.procs: dict[int, Any] = {}
        self.ps: ParallelState | None = None
        self.program: RankProgram | None = None
        self._lock = threading.Lock()
        self._stopping = False
        self._sends: list[Any] = []
        self._waiting: collections.deque[_Pending] = collections.deque()
        self._last_command = time.monotonic()  # when the last command went out (the keep-alive's clock)
        self._quiet = threading.Event()  # set at shutdown: the keep-alive thread ends
        self._results: Any = None
        self._joining: set[int] = set()  # ranks that reported JOINING (or ready)
        self._server: Any = None  # the rendezvous server (_open_rendezvous), held until shutdown
        self._threads: list[threading.Thread] = []  # the result receiver and keep-alive: joined at shutdown
        self._ready: set[int] = set()

    def start(self) -> None:
        """Spawn ranks 1..N-1 (this host's, after the other hosts' handshake), join the rendezvous as rank 0,
        build every rank's program (bounded wait)."""
        if self.nodes is not None:  # before any rank starts: a disagreement fails here, on every node
            self.node_host = NodeHost(self.rdzv.master_addr, self.rdzv.master_port, self.nodes, self.pp, self.tp,
                                      self.rdzv.backend)
            self.node_host.handshake()
        try:
            ready = self._spawn_ranks()
            self._open_rendezvous()
            self._await_ranks(ready, joining=True)  # before rank 0 blocks in the rendezvous
            if self.node_host is not None:  # the other hosts' ranks too
                self.node_host.wait_joining(time.monotonic() + self.rdzv.timeout_s)
            self.ps = init_parallel_state(self.pp, self.tp, 0, self.rdzv.master_addr, self.rdzv.master_port,
                                          self.rdzv.backend, self.rdzv.timeout_s, device=self.rdzv.device(0))
            self._results = result_group(self.ps)
            self.program = self.factory(self.ps)
            self._await_ranks(ready, joining=False)
            if self.node_host is not None:
                self.node_host.wait_ready(time.monotonic() + self.rdzv.timeout_s)
        except BaseException as exc:
            if self.node_host is not None:
                self.node_host.failed(f"node 0 could not start its ranks: {type(exc).__name__}: {exc}")
            self.shutdown(abort=True)
            raise
        threading.Thread(target=self._monitor, name="omnimesh-rank-monitor", daemon=True).start()
        if self.node_host is not None:
            self.node_host.watch(self._fail)
        # any exit, a start-up refusal after the ranks came up included: the ranks hear STOP and the process group
        # ends before the interpreter does (else gloo's threads abort its exit); other nodes hear a clean stop
        atexit.register(self.shutdown)
        if self.ps.last_pp_rank_driver != 0:
            self._threads.append(threading.Thread(target=self._receive_results, name="omnimesh-rank-results",
                                                  daemon=True))
        if self.world > 1:
            self._threads.append(threading.Thread(target=self._keep_alive, name="omnimesh-rank-keepalive",
                                                  daemon=True))
        for thread in self._threads:
            thread.start()
        log.info("stage ranks up: pp=%d tp=%d world=%d%s (rendezvous %s:%d, %s)", self.pp, self.tp, self.world,
                 f" over {self.nodes.num_nodes} nodes" if self.nodes else "", self.rdzv.master_addr,
                 self.rdzv.master_port, self.rdzv.backend)

    def _spawn_ranks(self) -> Any:
        """Start this host's ranks 1..L-1 (each runs rank_worker.worker_main); returns their ready queue."""
        ctx = mp.get_context("spawn")
        ready = ctx.Queue()
        for rank in range(1, self.local_world):
            proc = ctx.Process(target=worker_main, name=f"omnimesh-rank{rank}", daemon=True,
                               args=(rank, self.pp, self.tp, self.rdzv, self.factory, self.threads, ready,
                                     logging.getLogger().getEffectiveLevel()))
            with _sigint_ignored():
                proc.start()
            self.procs[rank] = proc
        return ready

    def _open_rendezvous(self) -> None:
        """Rank 0's rendezvous server, listening before any rank dials it (torch's tcp:// rendezvous in this process
        then reuses it: multi_tenant, as NodeHost's store on several hosts). The ranks connect at once and wait
        there while rank 0 waits for their JOINING reports, instead of retrying against a closed port (each try a
        new ephemeral port of this host), and the port is held from now on."""
        if self.node_host is not None:  # NodeHost already listens there
            return
        addr, port = self.rdzv.master_addr, self.rdzv.master_port
        try:
            self._server = dist.TCPStore(addr, port, is_master=True, wait_for_workers=False, multi_tenant=True,
                                         timeout=timedelta(seconds=self.rdzv.timeout_s))
        except dist.DistError as exc:
            raise RankFailure(f"rank 0 could not listen for the stage's rendezvous at {addr}:{port}: "
                              f"{str(exc).splitlines()[0]}; choose another --master-port") from None

    def _await_ranks(self, ready: Any, joining: bool) -> None:
        """Read this host's ranks' reports until each is about to join the rendezvous (`joining`) or is ready. One
        that reports an error, exits (a factory it cannot unpickle, a killed process) or stays silent past the
        timeout fails the start, named: before the rendezvous this is what keeps rank 0 from waiting out the
        whole timeout for a rank that will never come and then blaming the network."""
        reached = self._joining if joining else self._ready
        deadline = time.monotonic() + self.start_timeout_s
        while pending := sorted(set(self.procs) - reached):
            try:
                rank, status = ready.get(timeout=0.2)
            except queue.Empty:
                for rank in pending:
                    proc = self.procs[rank]
                    if proc.exitcode is not None:
                        raise RankFailure(f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode} during "
                                          f"start-up") from None
                if time.monotonic() > deadline:
                    what = "reach the rendezvous" if joining else "start"
                    raise RankFailure(f"ranks {pending} did not {what} within {self.start_timeout_s:.0f}s") from None
                continue
            if status not in (None, JOINING):
                raise RankFailure(f"rank {rank} failed to start: {status}")
            self._joining.add(rank)
            if status is None:
                self._ready.add(rank)

    def _monitor(self) -> None:
        sentinels = {proc.sentinel: rank for rank, proc in self.procs.items()}
        while sentinels and not self._stopping:
            for s in multiprocessing.connection.wait(list(sentinels), timeout=0.5):
                rank = sentinels.pop(s)
                if self._stopping:
                    return
                proc = self.procs[rank]
                proc.join(timeout=1)
                self._fail(f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}")

    def _fail(self, message: str) -> None:
        if self.failure is None:
            self.failure = message
            log.error("stage rank failure: %s", message)
            if self.node_host is not None:
                self.node_host.failed(message)
            if self.on_failure is not None:
                self.on_failure(message)
        while self._waiting:
            self._waiting.popleft().fail(RankFailure(f"this stage lost a rank: {self.failure}"))

    def _receive_results(self) -> None:
        """Results come back from the owner in command order; hand each to the oldest waiting future."""
        if self.ps is None:
            return
        owner = self.ps.last_pp_rank_driver
        while True:
            try:
                result = recv_obj(owner, self._results)
            except Exception as exc:
                if not self._stopping:
                    time.sleep(0.5)  # let the monitor name a dead rank if that is what happened
                    where = f"rank {owner}" + (f" on node {owner // self.local_world}" if self.nodes else "")
                    self._fail(self.failure or f"the result channel from {where} failed: {type(exc).__name__}: "
                                               f"{str(exc).splitlines()[0]}")
                return
            if result == STOP:
                return
            if not self._waiting:
                self._fail("a result arrived that no command was waiting for")
                return
            self._waiting.popleft().remote(result)

    def _keep_alive(self) -> None:
        """KEEPALIVE to every rank whenever no command went out for a quarter of the collective timeout."""
        every = self.rdzv.timeout_s / 4
        while not self._quiet.is_set() and self.failure is None:
            due = self._last_command + every - time.monotonic()
            if due > 0:
                self._quiet.wait(due)
                continue
            try:
                self.submit(KEEPALIVE)
            except RankFailure:  # the stage failed or stops: nothing left to keep alive
                return

    def submit(self, command: Any) -> Future:
        """Send `command` to every rank and run rank 0's part; the future gets the owner's result.

        Returns once rank 0's part is done, so another thread can submit the next step while later
        pipeline ranks work on this one. An error every rank raises alike (bad input, a shape mismatch)
        fails only this command; a failed collective (a peer died, a timeout) fails the stage: later
        commands raise at once."""
        pending = _Pending()
        with self._lock:
            if self.failure is not None:
                raise RankFailure(f"this stage lost a rank: {self.failure}")
            if self.ps is None or self.program is None:
                raise RankFailure("the executor is not started")
            if self._stopping:  # the ranks may have had their STOP: nothing would answer
                raise RankFailure("the stage is shutting down")
            self._last_command = time.monotonic()
            owner = self.ps.last_pp_rank_driver
            if owner != 0:
                self._waiting.append(pending)  # before any rank can answer
            local_error: Exception | None = None
            result: Any = None
            try:
                self._sends = prune_sends(self._sends)
                for rank in range(1, self.world):
                    self._sends += send_obj(command, rank, self.ps.cpu_group)
                try:
                    result = None if command is KEEPALIVE else self.program.execute(command)
                except (RuntimeError, dist.DistError):
                    raise
                except Exception as exc:  # raised alike on every rank, before any collective
                    local_error = exc
            except Exception as exc:
                time.sleep(0.5)  # let the monitor name a dead rank if that is what happened
                self._fail(self.failure or f"a collective failed: {type(exc).__name__}: {exc}")
                raise RankFailure(f"this stage lost a rank: {self.failure}") from exc
            if owner == 0:
                pending.remote(result)
            pending.local(local_error)
        return pending.future

    def execute(self, command: Any) -> Any:
        """`submit` and wait for the result (bounded by the process-group timeout)."""
        future = self.submit(command)
        try:
            return future.result(timeout=self.rdzv.timeout_s)
        except TimeoutError:
            self._fail(f"no result within {self.rdzv.timeout_s:.0f}s")
            raise RankFailure(f"this stage lost a rank: {self.failure}") from None

    def shutdown(self, timeout_s: float = 10.0, abort: bool = False) -> None:
        """STOP to every rank, then wait up to `timeout_s` for them to end before killing what is left. `abort`
        (a start that failed): no STOP and no wait, since a rank that failed to build its program takes no
        commands, and a STOP sent to it would block until the collective timeout (a Ray actor outlives its
        failed start)."""
        atexit.unregister(self.shutdown)  # once is enough, and the exit hook no longer keeps this executor alive
        self._stopping = True
        self._quiet.set()
        if self.node_host is not None:
            self.node_host.stopping()
        if self.ps is not None and self.failure is None and self.world > 1 and not abort:
            try:
                with self._lock:
                    for rank in range(1, self.world):
                        for work, _ in send_obj(STOP, rank, self.ps.cpu_group):
                            work.wait()
            except Exception:
                pass
        deadline = time.monotonic() + (0.0 if abort else timeout_s)
        self._join_ranks(deadline)
        if self.node_host is not None and self.failure is None:
            self.node_host.wait_left(max(1.0, deadline - time.monotonic()))
        self._join_threads()
        if self.ps is not None and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        self.ps, self._server = None, None

    def _join_threads(self, timeout_s: float = 5.0) -> None:
        """Before the process group goes: wait for the threads that call into it to return. The result receiver
        leaves its `recv` when the owner echoes STOP (or its rank is gone); one still on its way out of gloo's C++
        code when the interpreter finalizes is ended by the runtime mid-frame, and the process aborts ("terminate
        called without an active exception", exit -6 where a refused start exits 2)."""
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if stuck := [t.name for t in self._threads if t.is_alive() and t is not threading.current_thread()]:
            log.warning("stage shutdown: %s still running after %.0fs", ", ".join(stuck), timeout_s)
        self._threads = []

    def _join_ranks(self, deadline: float) -> None:
        """After STOP: wait for this host's ranks to exit until `deadline`, then kill what is left."""
        for proc in self.procs.values():
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)

    @property
    def pids(self) -> dict[int, int]:
        return {0: os.getpid(), **{r: p.pid for r, p in self.procs.items() if p.pid is not None}}


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """While a rank process is spawned: Ctrl-C ignored, a disposition the new interpreter keeps from its first
    line (Python then installs no KeyboardInterrupt of its own). A terminal's Ctrl-C reaches the whole process
    group, and a rank still importing torch printed a traceback; the driver stops its ranks instead."""
    before = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    if before is None:  # not the main thread (only it may set handlers), or a handler Python cannot restore
        yield
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def start_program(factory: ProgramFactory, pp: int = 1, tp: int = 1,
                  **executor_args: Any) -> tuple[Callable[[Any], Any], MpExecutor | None, RankProgram]:
    """Run `factory`'s program on pp x tp ranks: in this process without any process group when pp = tp = 1
    (on the device rank 0 would have: with `backend="nccl"` the first of `devices`, else cuda:0; CPU
    otherwise), else through a started `MpExecutor` (`executor="ray"`: a `RayExecutor` on the cluster at
    `ray_address`; this process is rank 0). Returns (run(command) -> result, the executor or None, rank 0's
    program). `load_format` (--load-format) is set in every rank's process before its program loads."""
    kind, ray_address = executor_args.pop("executor", "mp"), executor_args.pop("ray_address", None)
    from omnimesh.models.loader import with_load_format

    factory = with_load_format(factory, executor_args.pop("load_format", "auto"))
    if pp * tp == 1:
        devices = executor_args.get("devices") or ("cuda:0",)
        nccl = executor_args.get("backend") == "nccl"  # the device made current, as a rank process's is
        program = factory(ParallelState.single(select_device(0, "nccl", devices[0]) if nccl else "cpu"))
        return program.execute, None, program
    executor: MpExecutor
    if kind == "ray":
        from omnimesh.parallel.ray_executor import RayExecutor

        executor = RayExecutor(pp, tp, factory, ray_address=ray_address, **executor_args)
    else:
        executor = MpExecutor(pp, tp, factory, **executor_args)
    executor.start()
    if executor.program is None:
        raise RankFailure("the executor started without a rank-0 program")
    return executor.execute, executor, executor.program
