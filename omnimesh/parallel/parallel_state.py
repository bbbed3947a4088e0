"""Who this process is inside a stage's pp x tp grid, and the process groups it talks over.

Role: the one object every parallel piece receives explicitly (no module-level process-group globals).
Built once per worker process by `init_parallel_state` (multi-rank) or `ParallelState.single()` (pp = tp = 1,
no process group at all: every collective below is then a no-op). The collective helpers at the bottom are
the only places that call `torch.distributed`; each is a no-op when its group has size 1.

Data flow:
    launcher/executor -> init_parallel_state(pp, tp, rank, master_addr, master_port, backend, timeout_s)
        -> torch.distributed.init_process_group (TCP rendezvous, bounded timeout)
        -> TP groups (one per pipeline row) and PP groups (one per TP column), device groups
           (NCCL on CUDA, gloo on CPU), plus a gloo CPU twin over the whole stage for metadata
        -> ParallelState, passed to the model layers and the pipeline send/recv

Run (two ranks on CPU):  see tests/parallel/test_tp_pp_gloo.py, which spawns gloo workers that call
`init_parallel_state(pp, tp, rank, "127.0.0.1", port, "gloo", timeout_s=...)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")


def rank_table(pp: int, tp: int) -> list[list[int]]:
    """Global ranks laid out as `arange(pp * tp).reshape(pp, tp)`: row = pipeline rank, column = TP rank."""
    return torch.arange(pp * tp).reshape(pp, tp).tolist()


@dataclass(frozen=True)
class ParallelState:
    """This process's place in the stage's grid, plus its process groups.

    Rank layout: `rank = pp_rank * tp_size + tp_rank` (`arange(world).reshape(pp, tp)`). Worked example,
    pp = 2, tp = 2 (world 4):

        rank | pp_rank | tp_rank | TP group | PP group | prev / next pp rank | layers / extras
        -----+---------+---------+----------+----------+--------------------+----------------------------
          0  |    0    |    0    |  [0, 1]  |  [0, 2]  |   -   / 2          | first half, embedding shard
          1  |    0    |    1    |  [0, 1]  |  [1, 3]  |   -   / 3          | first half, embedding shard
          2  |    1    |    0    |  [2, 3]  |  [0, 2]  |   0   / -          | second half, norm, head shard
          3  |    1    |    1    |  [2, 3]  |  [1, 3]  |   1   / -          | second half, norm, head shard

    A TP group is one pipeline row (same layers, different shards: all-reduce / all-gather inside it);
    a PP group is one TP column (same shard index, consecutive layer ranges: send/recv inside it), so TP
    rank t of pipeline rank p sends its hidden states to TP rank t of pipeline rank p + 1.
    `tp_group` / `pp_group` are device groups (NCCL on CUDA, gloo on CPU; None when that size is 1);
    `cpu_group` is the gloo twin over all ranks of the stage, for small metadata (commands, token counts,
    sampled ids) that should not touch the device stream (None only for `single()`).
    """

    world_size: int
    rank: int
    pp_size: int
    tp_size: int
    pp_rank: int
    tp_rank: int
    backend: str  # "gloo" | "nccl" | "none" (single process)
    device: torch.device
    tp_group: Any = None  # torch.distributed.ProcessGroup | None
    pp_group: Any = None
    cpu_group: Any = None  # gloo, all ranks of the stage (driver broadcasts: commands, sampled ids)

    def __post_init__(self) -> None:
        if self.pp_size < 1 or self.tp_size < 1:
            raise ValueError(f"pp_size={self.pp_size} and tp_size={self.tp_size} must both be >= 1")
        if self.world_size != self.pp_size * self.tp_size:
            raise ValueError(
                f"world_size={self.world_size} must equal pp_size * tp_size = {self.pp_size} * {self.tp_size}"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank} is outside 0..{self.world_size - 1} (world_size={self.world_size})")
        if (self.pp_rank, self.tp_rank) != divmod(self.rank, self.tp_size):
            raise ValueError(
                f"rank {self.rank} with tp_size={self.tp_size} is (pp_rank, tp_rank)={divmod(self.rank, self.tp_size)}, "
                f"got ({self.pp_rank}, {self.tp_rank}); the layout is rank = pp_rank * tp_size + tp_rank"
            )
        if self.tp_size > 1 and self.tp_group is None:
            raise ValueError(f"tp_size={self.tp_size} needs a TP process group; build it with init_parallel_state")
        if self.pp_size > 1 and self.pp_group is None:
            raise ValueError(f"pp_size={self.pp_size} needs a PP process group; build it with init_parallel_state")

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> ParallelState:
        """pp = tp = 1 in this process: no process group, every collective is a no-op."""
        return cls(world_size=1, rank=0, pp_size=1, tp_size=1, pp_rank=0, tp_rank=0, backend="none",
                   device=torch.device(device))

    @property
    def is_first_pp_rank(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_pp_rank(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def prev_pp_rank(self) -> int | None:
        """Global rank this rank receives hidden states from (same tp_rank, pp_rank - 1); None on the first."""
        return None if self.is_first_pp_rank else self.rank - self.tp_size

    @property
    def next_pp_rank(self) -> int | None:
        """Global rank this rank sends hidden states to (same tp_rank, pp_rank + 1); None on the last."""
        return None if self.is_last_pp_rank else self.rank + self.tp_size

    @property
    def last_pp_rank_driver(self) -> int:
        """Global rank of TP rank 0 on the last pipeline rank: where logits (and sampled ids) appear."""
        return (self.pp_size - 1) * self.tp_size


def check_grid(pp: int, tp: int, rank: int) -> None:
    """Validate a (pp, tp, rank) triple before any process-group work."""
    if pp < 1 or tp < 1:
        raise ValueError(f"pipeline-parallel size {pp} and tensor-parallel size {tp} must both be >= 1")
    if not 0 <= rank < pp * tp:
        raise ValueError(f"rank {rank} is outside 0..{pp * tp - 1} for pp={pp} x tp={tp} (world size {pp * tp})")


def select_device(rank: int, backend: str, device: torch.device | str | None = None) -> torch.device:
    """The rank's device, made current on CUDA: `device`, else "cpu" for gloo and "cuda:<rank % device_count>"
    for nccl. A rank process calls it before it reports that it joins the rendezvous (rank_worker.JOINING), so a
    device it cannot take is its own start-up error, not a rendezvous that times out on rank 0."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {BACKENDS} (NCCL on CUDA, gloo on CPU)")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA, which this process does not see; use backend 'gloo' on CPU")
    if device is None:
        device = f"cuda:{rank % torch.cuda.device_count()}" if backend == "nccl" else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev


def init_parallel_state(
    pp: int,
    tp: int,
    rank: int,
    master_addr: str,
    master_port: int,
    backend: str = "gloo",
    timeout_s: float = 60.0,
    device: torch.device | str | None = None,
) -> ParallelState:
    """Join the stage's process group over TCP and build the TP / PP groups and the gloo metadata group.

    Every rank of the stage calls this with the same pp, tp, master_addr and master_port. The rendezvous
    and every later collective time out after `timeout_s`, so an unreachable master or a missing rank is
    an error, not a hang. `device` defaults to "cpu" for gloo and "cuda:<rank % device_count>" for nccl.
    """
    check_grid(pp, tp, rank)
    if not 0 < master_port < 65536:
        raise ValueError(f"master_port {master_port} is not a TCP port (1..65535)")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s} must be > 0")
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process; build ParallelState once")
    dev = select_device(rank, backend, device)

    world = pp * tp
    timeout = timedelta(seconds=timeout_s)
    # torch names each process group's rendezvous keys after a per-process group counter; a process that
    # already had (and destroyed) a process group — a driver whose stage restarted its ranks — would wait on
    # keys its fresh peers never write. Every rank of a new stage starts counting from zero.
    world_state = getattr(dist.distributed_c10d, "_world", None)
    if world_state is not None and hasattr(world_state, "group_count"):
        world_state.group_count = 0
    try:
        dist.init_process_group(
            backend=backend, init_method=f"tcp://{master_addr}:{master_port}", world_size=world, rank=rank,
            timeout=timeout,
        )
    except Exception as exc:  # DistStoreError / RuntimeError: unreachable master, port in use, timeout
        raise RuntimeError(
            f"rank {rank} of {world} (pp={pp} x tp={tp}) could not join the process group at "
            f"tcp://{master_addr}:{master_port} within {timeout_s:.0f}s: {exc}. Check that every rank uses "
            "the same --master-addr/--master-port, that rank 0 is up, and that the port is reachable."
        ) from exc

    table = rank_table(pp, tp)
    pp_rank, tp_rank = divmod(rank, tp)

    def my_group(rank_lists: list[list[int]]) -> Any:
        """Create every group (all ranks must call new_group in the same order); return this rank's."""
        mine = None
        for ranks in rank_lists:
            group = dist.new_group(ranks=ranks, backend=backend, timeout=timeout)
            if rank in ranks:
                mine = group
        return mine

    tp_group = my_group(table) if tp > 1 else None
    pp_group = my_group([list(col) for col in zip(*table)]) if pp > 1 else None
    cpu_group = dist.group.WORLD if backend == "gloo" else dist.new_group(list(range(world)), backend="gloo",
                                                                          timeout=timeout)
    return ParallelState(
        world_size=world, rank=rank, pp_size=pp, tp_size=tp, pp_rank=pp_rank, tp_rank=tp_rank, backend=backend,
        device=dev, tp_group=tp_group, pp_group=pp_group, cpu_group=cpu_group,
    )


def destroy_parallel_state(ps: ParallelState) -> None:
    """Tear down the process groups `init_parallel_state` made (no-op for `ParallelState.single()`)."""
    if ps.backend != "none" and dist.is_initialized():
        dist.destroy_process_group()


# ---- collectives: each a no-op when its group has size 1 (or `ps` is None: a simulated shard in a test) ----

def tp_all_reduce(x: torch.Tensor, ps: ParallelState | None) -> torch.Tensor:
    """Sum `x` over the TP group, in place; returns `x`."""
    if ps is None or ps.tp_size == 1:
        return x
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=ps.tp_group)
    return x


def tp_all_gather(x: torch.Tensor, ps: ParallelState | None, dim: int = -1) -> torch.Tensor:
    """Concatenate every TP rank's `x` along `dim`, in TP-rank order."""
    if ps is None or ps.tp_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(ps.tp_size)]
    dist.all_gather(parts, x, group=ps.tp_group)
    return torch.cat(parts, dim=dim)


def cpu_broadcast(x: torch.Tensor, src: int, ps: ParallelState | None) -> torch.Tensor:
    """Overwrite the CPU tensor `x` on every rank of the stage with global rank `src`'s, in place (gloo
    `cpu_group`: sampled ids, small metadata); returns `x`. A no-op for a single rank."""
    if ps is None or ps.world_size == 1:
        return x
    dist.broadcast(x, src=src, group=ps.cpu_group)
    return x


def pp_send(x: torch.Tensor, ps: ParallelState) -> None:
    """Send `x` to the same TP rank of the next pipeline rank (blocking); a no-op on the last pipeline rank."""
    if ps.next_pp_rank is None:
        return
    dist.send(x.contiguous(), dst=ps.next_pp_rank, group=ps.pp_group)


def pp_recv(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, ps: ParallelState) -> torch.Tensor:
    """Receive a `shape` / `dtype` tensor from the previous pipeline rank (blocking).

    The receiver must know the shape: the executor's per-step metadata (token counts) says it. The first
    pipeline rank has no previous rank; asking it to receive is a caller bug and raises.
    """
    if ps.prev_pp_rank is None:
        raise ValueError(f"pp_recv on pipeline rank {ps.pp_rank} (the first of {ps.pp_size}): nothing to receive")
    buf = torch.empty(tuple(shape), dtype=dtype, device=ps.device)
    dist.recv(buf, src=ps.prev_pp_rank, group=ps.pp_group)
    return buf
