"""A two-layer MLP split over pp x tp ranks, for testing the executor without a real model.

Layer l is on pipeline rank l * pp // 2; inside a layer, W_in is split by columns and W_out by rows over
the TP ranks (one all-reduce per layer) — the same shape of work a transformer block does. Weights come
from a fixed seed, so every rank can build its own shard and the test can compute the unsharded answer.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

from omnimesh.parallel.parallel_state import ParallelState, pp_recv, pp_send, tp_all_reduce

H, F, LAYERS = 8, 16, 2


def full_weights() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(H, F, generator=g), torch.randn(F, H, generator=g)) for _ in range(LAYERS)]


def reference(x: torch.Tensor) -> torch.Tensor:
    for w_in, w_out in full_weights():
        x = torch.relu(x @ w_in) @ w_out  # (T, H)
    return x


class ToyProgram:
    def __init__(self, ps: ParallelState):
        self.ps = ps
        per = F // ps.tp_size
        self.layers = [
            (w_in[:, ps.tp_rank * per:(ps.tp_rank + 1) * per], w_out[ps.tp_rank * per:(ps.tp_rank + 1) * per])
            for layer, (w_in, w_out) in enumerate(full_weights())
            if layer * ps.pp_size // LAYERS == ps.pp_rank
        ]

    def execute(self, command: tuple) -> torch.Tensor | str | None:
        kind = command[0]
        if kind == "crash":  # one rank dies; the others wait for it in a collective
            if self.ps.rank == command[1]:
                os._exit(3)
            tp_all_reduce(torch.zeros(1), self.ps)
            return None
        if kind == "fail":  # a deterministic error: every rank raises it, before any collective
            raise ValueError("bad input on purpose")
        if kind == "whoami":
            return f"rank {self.ps.rank}" if self.ps.rank == self.ps.last_pp_rank_driver else None
        x = command[1] if self.ps.is_first_pp_rank else pp_recv(command[1].shape, torch.float32, self.ps)
        for w_in, w_out in self.layers:
            x = tp_all_reduce(torch.relu(x @ w_in) @ w_out, self.ps)  # (T, H)
        pp_send(x, self.ps)
        return x if self.ps.is_last_pp_rank and self.ps.tp_rank == 0 else None


def make_toy(ps: ParallelState) -> ToyProgram:
    return ToyProgram(ps)


class ParentOnly:
    """A factory that unpickles in the process that made it and in no other, as one whose module a rank's host
    lacks: the rank fails before it ever reaches the rendezvous."""

    def __init__(self) -> None:
        self.parent = os.getpid()

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return _parent_only, (self.parent,)

    def __call__(self, ps: ParallelState) -> ToyProgram:
        return ToyProgram(ps)


def _parent_only(parent: int) -> ParentOnly:
    if os.getpid() != parent:
        raise ImportError("No module named 'weights_plugin' (on purpose: this rank cannot build the factory)")
    factory = ParentOnly.__new__(ParentOnly)
    factory.parent = parent
    return factory


def make_broken(ps: ParallelState) -> ToyProgram:
    if ps.rank == 1:
        raise RuntimeError("weights for rank 1 are missing")
    return ToyProgram(ps)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def check_lock_step(ex: Any, pp: int, tp: int) -> None:
    """A started executor over the toy: results equal the unsharded MLP, come from the owner rank, an error
    every rank raises fails only its command."""
    from omnimesh.parallel.rank_worker import RankFailure

    x = torch.randn(3, H, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        torch.testing.assert_close(ex.execute(("run", x)), reference(x), rtol=1e-5, atol=1e-5)
    assert ex.execute(("whoami",)) == f"rank {(pp - 1) * tp}"
    with pytest.raises(RankFailure, match="bad input on purpose"):
        ex.execute(("fail",))
    torch.testing.assert_close(ex.execute(("run", x)), reference(x), rtol=1e-5, atol=1e-5)


def check_crash_is_named(ex: Any, failures: list[str], named: str) -> None:
    """Rank 1 dies inside a collective: the command fails within the timeout, the stage hears `named`
    (a regex) first, and every later command fails at once."""
    import re

    from omnimesh.parallel.rank_worker import RankFailure

    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="lost a rank"):
        ex.execute(("crash", 1))  # rank 1 dies while rank 0 waits in the all-reduce
    assert time.monotonic() - t0 < 20
    assert failures and re.search(named, failures[0]), failures
    with pytest.raises(RankFailure, match="lost a rank"):
        ex.execute(("run", torch.zeros(1, H)))
