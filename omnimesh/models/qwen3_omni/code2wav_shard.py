"""Code2WavShard: what one rank of a vocoder stage runs — its layers of code2wav's pre-transformer.

Role: the `RankProgram` of a vocoder stage split over pp x tp ranks (and, with `ParallelState.single()`,
in-process). Each rank builds `ParallelCode2WavTransformer` over its own layer range, loads only those
tensors (sharded for its TP rank) and keeps one sliding-window KV cache per open request. The code
embedding and the causal conv stack (upsampling + decoder) stay in the stage's driver process, which
embeds the codes, sends the frames here and turns the returned hidden frames into samples. One step
carries the next window of one or many requests (the vocoder's continuous batching), right-padded to
the longest, and runs every rank's layers once for all of them.

Commands:  C2WStep(handles (B,), x (B, T, H), positions (B, T), lengths (B,))
                -> hidden (B, T, H) from the last pp rank (row b real up to lengths[b])
           C2WFree(handle)       every rank drops the request's cache
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from omnimesh.models.qwen3_omni.parallel_code2wav_transformer import ParallelCode2WavTransformer, batch_pipeline_step
from omnimesh.parallel.mp_executor import MpExecutor, start_program
from omnimesh.parallel.parallel_state import ParallelState
from omnimesh.parallel.partition import partition_layers


@dataclass(frozen=True)
class C2WStep:
    handles: tuple[int, ...]  # (B,) one open request per row
    x: torch.Tensor  # (B, T, H) mean code embeddings of each request's new codes, right-padded to T
    positions: torch.Tensor  # (B, T) absolute positions seen_b .. seen_b + T - 1
    lengths: tuple[int, ...]  # (B,) real codes per row, 1..T


@dataclass(frozen=True)
class C2WFree:
    handle: int


@dataclass(frozen=True)
class C2WShardSpec:
    model_dir: Path
    partition: tuple[int, ...] | None = None
    dtype: torch.dtype = torch.float32


class Code2WavShard:
    def __init__(self, spec: C2WShardSpec, ps: ParallelState):
        from omnimesh.models.model_config import load_config

        config: Any = load_config(spec.model_dir).code2wav_config
        ranges = partition_layers(config.num_hidden_layers, ps.pp_size, list(spec.partition) if spec.partition else None)
        self.ps = ps
        self.model = ParallelCode2WavTransformer(config, ps, ranges[ps.pp_rank], spec.dtype)
        self.model.load_weights(spec.model_dir)
        self.caches: dict[int, Any] = {}

    def execute(self, command: C2WStep | C2WFree) -> torch.Tensor | None:
        if isinstance(command, C2WFree):
            self.caches.pop(command.handle, None)
            return None
        for h in command.handles:
            if h not in self.caches:
                self.caches[h] = self.model.new_cache()
        caches = [self.caches[h] for h in command.handles]
        x = command.x.to(self.ps.device) if self.ps.is_first_pp_rank else None
        hidden = batch_pipeline_step(self.model, x, command.positions, caches, command.lengths)  # (B, T, H)
        if not (self.ps.is_last_pp_rank and self.ps.tp_rank == 0):
            return None
        return hidden if self.ps.world_size == 1 else hidden.cpu()  # in-process: stays on the driver's device


def build_code2wav_shard(spec: C2WShardSpec, ps: ParallelState) -> Code2WavShard:
    return Code2WavShard(spec, ps)


class Code2WavTransformerBackend:
    """The pre-transformer behind `Code2WavStreamer`: open / close per request, forward per step for a batch
    of requests, on our ranks."""

    def __init__(self, run: Any, executor: MpExecutor | None = None):
        self._run = run
        self.executor = executor
        self._next = 0

    @classmethod
    def build(cls, spec: C2WShardSpec, pp: int = 1, tp: int = 1, **executor_args: Any) -> Code2WavTransformerBackend:
        run, executor, _ = start_program(partial(build_code2wav_shard, spec), pp, tp, **executor_args)
        return cls(run, executor)

    def open(self) -> int:
        self._next += 1
        return self._next

    def forward(self, handles: Sequence[int], x: torch.Tensor, positions: torch.Tensor,
                lengths: Sequence[int]) -> torch.Tensor:
        """The next codes of requests `handles`: x (B, T, H), positions (B, T), lengths (B,) -> frames (B, T, H)."""
        if len(set(handles)) != len(handles):
            raise ValueError(f"a request may appear once per step, got handles {list(handles)}")
        if self.executor is not None:  # the command is pickled to every rank: host tensors (a CUDA one would be
            x, positions = x.cpu(), positions.cpu()  # unpickled onto the driver's GPU in every rank's process)
        return self._run(C2WStep(tuple(handles), x, positions, tuple(int(n) for n in lengths)))

    def close(self, handle: int) -> None:
        if self.executor is None or self.executor.failure is None:
            self._run(C2WFree(handle))
