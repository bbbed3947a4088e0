"""MpExecutor: runs one stage's pp x tp ranks as local processes and drives them from the server.

Rank 0 lives in the stage's server process (the driver); ranks 1..N-1 are spawned processes. Every
rank builds its `RankProgram` once (its layers, its shard) from the same picklable factory, then all
ranks run the same commands in lock-step:

    driver: execute(cmd) --broadcast cmd (gloo metadata group)--> every rank: program.execute(cmd)
            ranks exchange activations between themselves (send/recv, all-reduce on the device group)
            the rank that owns the result (last pp rank, tp rank 0) sends it back to the driver

Failure handling: a monitor thread watches every worker process; one that exits marks the executor
failed with a message naming the rank, its pid and exit code, and calls `on_failure` (the stage goes
NOT_SERVING). Commands after that raise `RankFailure` at once; a command in flight fails when the
collective notices the dead peer, or at the process-group timeout — never an unbounded hang. Workers get
PR_SET_PDEATHSIG, so they die with the server even when it is killed outright.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from omnimesh.log_setup import setup_logging
from omnimesh.parallel.parallel_state import ParallelState, init_parallel_state

log = logging.getLogger(__name__)

_STOP = "__omnimesh_stop__"


class RankFailure(RuntimeError):
    """A rank of the stage died, or a command failed on some rank."""


class RankProgram(Protocol):
    """What one rank runs. Built once per rank by the factory; `run` is called with the same command on
    every rank, in the same order, and returns the result on the rank that owns it (None elsewhere)."""

    def execute(self, command: Any) -> Any: ...


ProgramFactory = Callable[[ParallelState], RankProgram]


@dataclass(frozen=True)
class Rendezvous:
    master_addr: str
    master_port: int
    backend: str  # "gloo" on CPU, "nccl" on CUDA
    timeout_s: float


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _result_owner(ps: ParallelState) -> int:
    """Global rank that holds a command's result: tp rank 0 of the last pipeline stage."""
    return (ps.pp_size - 1) * ps.tp_size


def _worker_main(rank: int, pp: int, tp: int, rdzv: Rendezvous, factory: ProgramFactory, threads: int,
                 ready: Any, log_level: int = logging.INFO) -> None:
    _die_with_parent()
    setup_logging(logging.getLevelName(log_level))
    torch.set_num_threads(threads)
    try:
        ps = init_parallel_state(pp, tp, rank, rdzv.master_addr, rdzv.master_port, rdzv.backend, rdzv.timeout_s)
        program = factory(ps)
    except Exception as exc:  # report start-up failures to the driver, then exit non-zero
        ready.put((rank, f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from exc
    ready.put((rank, None))
    owner = _result_owner(ps)
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=ps.cpu_group)
        command = box[0]
        if command == _STOP:
            break
        try:
            result: Any = program.execute(command)
        except (RuntimeError, dist.DistError):
            raise  # a collective broke: this rank is out of step for good
        except Exception as exc:  # raised alike on every rank, before any collective
            result = RankFailure(f"rank {rank}: {type(exc).__name__}: {exc}")
        if rank == owner and rank != 0:
            dist.send_object_list([result], dst=0, group=ps.cpu_group)
    dist.destroy_process_group()


class MpExecutor:
    def __init__(self, pp: int, tp: int, factory: ProgramFactory, *, backend: str = "gloo",
                 master_addr: str = "127.0.0.1", master_port: int | None = None, timeout_s: float = 60.0,
                 threads_per_rank: int = 1, on_failure: Callable[[str], None] | None = None):
        if pp < 1 or tp < 1:
            raise ValueError(f"pp and tp must be >= 1, got pp={pp}, tp={tp}")
        self.pp, self.tp, self.world = pp, tp, pp * tp
        self.factory = factory
        self.rdzv = Rendezvous(master_addr, master_port or free_port(master_addr), backend, timeout_s)
        self.threads = threads_per_rank
        self.on_failure = on_failure
        self.failure: str | None = None
        self.procs: dict[int, Any] = {}
        self.ps: ParallelState | None = None
        self.program: RankProgram | None = None
        self._lock = threading.Lock()
        self._stopping = False

    def start(self) -> None:
        """Spawn ranks 1..N-1, join the rendezvous as rank 0, build every rank's program (bounded wait)."""
        ctx = mp.get_context("spawn")
        ready = ctx.Queue()
        for rank in range(1, self.world):
            proc = ctx.Process(target=_worker_main, name=f"omnimesh-rank{rank}", daemon=True,
                               args=(rank, self.pp, self.tp, self.rdzv, self.factory, self.threads, ready,
                                     logging.getLogger().getEffectiveLevel()))
            proc.start()
            self.procs[rank] = proc
        try:
            self.ps = init_parallel_state(self.pp, self.tp, 0, self.rdzv.master_addr, self.rdzv.master_port,
                                          self.rdzv.backend, self.rdzv.timeout_s)
            self.program = self.factory(self.ps)
            self._wait_ready(ready)
        except BaseException:
            self.shutdown()
            raise
        threading.Thread(target=self._monitor, name="omnimesh-rank-monitor", daemon=True).start()
        log.info("stage ranks up: pp=%d tp=%d world=%d (rendezvous %s:%d, %s)", self.pp, self.tp, self.world,
                 self.rdzv.master_addr, self.rdzv.master_port, self.rdzv.backend)

    def _wait_ready(self, ready: Any) -> None:
        pending = set(self.procs)
        deadline = time.monotonic() + self.rdzv.timeout_s
        while pending:
            try:
                rank, error = ready.get(timeout=0.2)
            except Exception:
                for rank in sorted(pending):
                    proc = self.procs[rank]
                    if proc.exitcode is not None:
                        raise RankFailure(f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode} during start-up") from None
                if time.monotonic() > deadline:
                    raise RankFailure(f"ranks {sorted(pending)} did not start within {self.rdzv.timeout_s:.0f}s") from None
                continue
            if error is not None:
                raise RankFailure(f"rank {rank} failed to start: {error}")
            pending.discard(rank)

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
            if self.on_failure is not None:
                self.on_failure(message)

    def execute(self, command: Any) -> Any:
        """Run `command` on every rank; return the owner's result. Thread-safe (one command at a time).

        An error every rank raises alike (bad input, a shape mismatch) fails only this command; a failed
        collective (a peer died, a timeout) fails the stage: later commands raise at once."""
        with self._lock:
            if self.failure is not None:
                raise RankFailure(f"this stage lost a rank: {self.failure}")
            if self.ps is None or self.program is None:
                raise RankFailure("the executor is not started")
            local_error: Exception | None = None
            try:
                if self.world > 1:
                    dist.broadcast_object_list([command], src=0, group=self.ps.cpu_group)
                try:
                    result = self.program.execute(command)
                except (RuntimeError, dist.DistError):
                    raise
                except Exception as exc:  # raised alike on every rank, before any collective
                    local_error, result = exc, None
                owner = _result_owner(self.ps)
                if owner != 0:
                    box: list[Any] = [None]
                    dist.recv_object_list(box, src=owner, group=self.ps.cpu_group)
                    result = box[0]
            except Exception as exc:
                time.sleep(0.5)  # let the monitor name a dead rank if that is what happened
                self._fail(self.failure or f"a collective failed: {type(exc).__name__}: {exc}")
                raise RankFailure(f"this stage lost a rank: {self.failure}") from exc
            if local_error is not None:
                raise RankFailure(f"rank 0: {type(local_error).__name__}: {local_error}") from local_error
            if isinstance(result, RankFailure):
                raise result
            return result

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        if self.ps is not None and self.failure is None and self.world > 1:
            try:
                with self._lock:
                    dist.broadcast_object_list([_STOP], src=0, group=self.ps.cpu_group)
            except Exception:
                pass
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        if self.ps is not None and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        self.ps = None

    @property
    def pids(self) -> dict[int, int]:
        return {0: os.getpid(), **{r: p.pid for r, p in self.procs.items() if p.pid is not None}}
