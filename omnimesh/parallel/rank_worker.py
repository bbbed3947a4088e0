"""What one rank process of a stage runs: join the process group, build its program, then take the driver's
commands in order until STOP — the same on node 0 (spawned by MpExecutor), on a headless node (spawned by
headless_ranks) and in a Ray actor (ray_executor.py), since every command travels over torch.distributed.

Data flow: `worker_main(rank, ...)` -> its device (`select_device`) -> JOINING on the queue (rank 0 joins the
rendezvous only once every local rank got this far, so one that cannot start fails the stage at once with its own
error) -> `setup_rank`: init_parallel_state (rendezvous at master_addr:master_port,
bounded) -> factory(ps) -> ("ready" on the queue, or the start-up error) -> `serve_commands`: command = recv from
rank 0 (gloo cpu_group) -> program.execute(command) -> the result owner (last pp rank, tp rank 0) sends the result to rank 0 on a
two-rank gloo group. A lost driver (its connection closes) ends the rank with code 1 and one log line.
Every recv is bounded by the process-group timeout (--rendezvous-timeout), the wait for the next command too:
an idle driver sends KEEPALIVE (a no-op every rank answers like a command) often enough that a quiet stage
never reaches it (MpExecutor._keep_alive).
"""

from __future__ import annotations

import logging
import pickle
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from omnimesh.log_setup import setup_logging
from omnimesh.parallel.parallel_state import ParallelState, init_parallel_state, select_device
from omnimesh.proc_utils import die_with_parent

log = logging.getLogger(__name__)

STOP = "__omnimesh_stop__"
KEEPALIVE = "__omnimesh_keepalive__"  # a no-op: the owner's result is None
# a rank's report (rank, JOINING) on the ready queue: its process runs and has its device; it joins the rendezvous
# next. Its other reports: (rank, None) ready, (rank, "Error: message") its start failed.
JOINING = "\0joining"


class RankFailure(RuntimeError):
    """A rank of the stage died, or a command failed on some rank."""


class RankProgram(Protocol):
    """What one rank runs. Built once per rank by the factory; `execute` is called with the same command on
    every rank, in the same order, and returns the result on the rank that owns it (None elsewhere)."""

    def execute(self, command: Any) -> Any: ...


ProgramFactory = Callable[[ParallelState], RankProgram]


@dataclass(frozen=True)
class Rendezvous:
    master_addr: str
    master_port: int
    backend: str  # "gloo" on CPU, "nccl" on CUDA
    timeout_s: float
    devices: tuple[str, ...] = ()  # device per rank of a host, e.g. ("cuda:2", "cuda:3"); () = the default placement

    def device(self, rank: int) -> str | None:
        """Global rank -> its device: ranks of one host take `devices` in order (every host has the same list)."""
        return self.devices[rank % len(self.devices)] if self.devices else None


def send_obj(obj: Any, dst: int, group: Any) -> list[Any]:
    """Non-blocking: pickled `obj` to `dst` as (size, bytes); returns (Work, tensor) pairs to keep alive."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    return [(dist.isend(size, dst, group=group), size), (dist.isend(data, dst, group=group), data)]


def recv_obj(src: int, group: Any) -> Any:
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src, group=group)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(data, src, group=group)
    return pickle.loads(data.numpy().tobytes())


def prune_sends(sends: list[Any]) -> list[Any]:
    return [(w, t) for w, t in sends if not w.is_completed()]


def result_group(ps: ParallelState) -> Any:
    """A gloo group of rank 0 and the result owner (every rank must create it, in the same order)."""
    owner = ps.last_pp_rank_driver
    return dist.new_group([0, owner], backend="gloo") if owner != 0 else None


def setup_rank(rank: int, pp: int, tp: int, rdzv: Rendezvous, factory: ProgramFactory,
               device: str | None = None) -> tuple[ParallelState, Any, RankProgram]:
    """Join the stage's process group as `rank` (bounded by rdzv.timeout_s) and build its program; returns
    (its ParallelState, the result group, the program). `device` overrides `rdzv.device(rank)`."""
    ps = init_parallel_state(pp, tp, rank, rdzv.master_addr, rdzv.master_port, rdzv.backend, rdzv.timeout_s,
                             device=device or rdzv.device(rank))
    return ps, result_group(ps), factory(ps)


def serve_commands(rank: int, ps: ParallelState, results: Any, program: RankProgram) -> None:
    """Take the driver's commands in order until STOP; raises RankFailure when the driver (rank 0) or its host
    went away, and lets a broken collective's error through (this rank is out of step for good)."""
    owner = ps.last_pp_rank_driver
    sends: list[Any] = []
    while True:
        try:
            command = recv_obj(0, ps.cpu_group)
        except (RuntimeError, dist.DistError) as exc:
            raise RankFailure(f"rank {rank}: lost the stage's driver (rank 0): {str(exc).splitlines()[0]}") from None
        if command == STOP:
            if rank == owner:
                for work, _ in send_obj(STOP, 0, results):  # releases the driver's receiver thread
                    work.wait()
            break
        result: Any = None
        try:
            if command != KEEPALIVE:
                with torch.inference_mode():  # as the driver's engine thread runs its part
                    result = program.execute(command)
        except (RuntimeError, dist.DistError):
            raise  # a collective broke: this rank is out of step for good
        except Exception as exc:  # raised alike on every rank, before any collective
            result = RankFailure(f"rank {rank}: {type(exc).__name__}: {exc}")
        if rank == owner:
            sends = prune_sends(sends) + send_obj(result, 0, results)
    for work, _ in sends:
        work.wait()
    dist.destroy_process_group()


def worker_main(rank: int, pp: int, tp: int, rdzv: Rendezvous, factory: ProgramFactory, threads: int,
                 ready: Any, log_level: int = logging.INFO) -> None:
    die_with_parent(signal.SIGKILL)
    # Ctrl-C in a terminal reaches the whole process group: the driver stops its ranks (STOP, then a kill); a
    # KeyboardInterrupt here would only print a traceback from inside a collective
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    setup_logging(logging.getLevelName(log_level))
    torch.set_num_threads(threads)
    try:
        select_device(rank, rdzv.backend, rdzv.device(rank))
        ready.put((rank, JOINING))
        ps, results, program = setup_rank(rank, pp, tp, rdzv, factory)
    except Exception as exc:  # report start-up failures to the driver, then exit non-zero
        ready.put((rank, f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from exc
    ready.put((rank, None))
    try:
        serve_commands(rank, ps, results, program)
    except RankFailure as exc:  # the driver (rank 0) or its host went away
        log.error("%s", exc)
        raise SystemExit(1) from None
