"""Code2WavShard: what one rank of a vocoder stage runs — its layers of code2wav's pre-transformer.

Role: the `RankProgram` of a vocoder stage split over pp x tp ranks (and, with `ParallelState.single()`,
in-process). Each rank builds `ParallelCode2WavTransformer` over its own layer range, loads only those
tensors (sharded for its TP rank) and keeps one sliding-window KV cache per open request. The code
embedding and the causal conv stack (upsampling + decoder) stay in the stage's driver process, which
embeds the codes, sends the frames here and turns the returned hidden frames into samples.

Commands:  C2WStep(handle, x (1, n, H), positions (1, n)) -> hidden (1, n, H) from the last pp rank
           C2WFree(handle)                                   every rank drops the request's cache
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from omnimesh.models.qwen3_omni.parallel_code2wav_transformer import ParallelCode2WavTransformer, pipeline_step
from omnimesh.parallel.mp_executor import MpExecutor, start_program
from omnimesh.parallel.parallel_state import ParallelState
from omnimesh.parallel.partition import partition_layers


@dataclass(frozen=True)
class C2WStep:
    handle: int
    x: torch.Tensor  # (1, n, H) mean code embeddings of n new codes
    positions: torch.Tensor  # (1, n) absolute positions seen .. seen + n


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
        from omnimesh.models.qwen3_omni.stage_loading import load_config

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
        cache = self.caches.get(command.handle)
        if cache is None:
            cache = self.caches[command.handle] = self.model.new_cache()
        x = command.x.to(self.ps.device) if self.ps.is_first_pp_rank else None
        hidden = pipeline_step(self.model, x, command.positions, cache)  # (1, n, H)
        return hidden.cpu() if self.ps.is_last_pp_rank and self.ps.tp_rank == 0 else None


def build_code2wav_shard(spec: C2WShardSpec, ps: ParallelState) -> Code2WavShard:
    return Code2WavShard(spec, ps)


class Code2WavTransformerBackend:
    """The pre-transformer behind `Code2WavStreamer`: open / forward / close per request, on our ranks."""

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

    def forward(self, handle: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self._run(C2WStep(handle, x, positions))

    def close(self, handle: int) -> None:
        if self.executor is None or self.executor.failure is None:
            self._run(C2WFree(handle))
