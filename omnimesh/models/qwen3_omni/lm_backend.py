"""LM backends: where the thinker's / talker's decoder layers actually run, behind one small interface.

Role: the step logic (`thinker.py`, `talker.py`) decides what to feed and what to emit; a backend runs
the decoder stack + head on it for one request and keeps that request's KV cache:

    handle = backend.open()                                  a new request (its KV cache)
    backend.forward(handle, x (1, T, H), position_ids, ...)  -> LMOutput(logits (V,), last_hidden, captured)
    backend.close(handle)                                    frees the cache (on every rank)

`HFBackend` runs transformers' own modules in this process (the reference the tests compare with).
`ShardedBackend.start` runs our tensor-/pipeline-parallel `LMShard` on every rank of the stage: in-process
for pp = tp = 1, or through an `MpExecutor` driving pp x tp rank processes.
"""

from __future__ import annotations

import itertools
from concurrent.futures import Future
from functools import partial
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
from transformers import DynamicCache

from omnimesh.models.qwen3_omni.decoder import run_decoder
from omnimesh.models.qwen3_omni.lm_shard import (
    LMFree,
    LMPredict,
    LMPredictResult,
    LMShard,
    LMShardSpec,
    LMStep,
    LMStepResult,
    build_shard,
)
from omnimesh.models.qwen3_omni.sampling import SamplingParams
from omnimesh.parallel.mp_executor import MpExecutor, start_program


@dataclass(frozen=True)
class LMOutput:
    logits: torch.Tensor  # (V,) of the last position
    last_hidden: torch.Tensor  # (1, 1, H) final-norm hidden of the last position
    captured: torch.Tensor | None  # (1, T, H) at capture_layer


class LMBackend(Protocol):
    def open(self) -> Any:
        """Called once per request before its first forward; returns the request's handle."""
        ...

    def forward(self, handle: Any, x: torch.Tensor, position_ids: torch.Tensor, *,
                visual_pos_mask: torch.Tensor | None = None, deepstack: list[torch.Tensor] | None = None,
                capture_layer: int | None = None) -> LMOutput:
        """Called per prefill / decode step with the step's input embeddings (1, T, H)."""
        ...

    def close(self, handle: Any) -> None:
        """Called once when the request ends; frees its KV cache."""
        ...


class HFBackend:
    """transformers' decoder module + head in this process (one DynamicCache per request)."""

    def __init__(self, text_model: Any, head: Any):
        self.text_model = text_model
        self.head = head

    def open(self) -> DynamicCache:
        return DynamicCache(config=self.text_model.config)

    def forward(self, handle: DynamicCache, x: torch.Tensor, position_ids: torch.Tensor, *,
                visual_pos_mask: torch.Tensor | None = None, deepstack: list[torch.Tensor] | None = None,
                capture_layer: int | None = None) -> LMOutput:
        out = run_decoder(self.text_model, x, position_ids, handle, visual_pos_mask=visual_pos_mask,
                          deepstack=deepstack, capture_layer=capture_layer)
        last = out.last_hidden[:, -1:]  # (1, 1, H)
        return LMOutput(logits=self.head(last)[0, -1], last_hidden=last, captured=out.captured)

    def close(self, handle: DynamicCache) -> None:
        pass


class ShardedBackend:
    """Our parallel LM: one `LMShard` per rank, driven in lock-step (see lm_shard.py)."""

    def __init__(self, run: Any, executor: MpExecutor | None, local_shard: LMShard):
        self._run = run  # LMShard.execute (in-process) or MpExecutor.execute
        self.executor = executor
        self.local_shard = local_shard  # rank 0's shard, in this process
        self._ids = itertools.count()

    @classmethod
    def start(cls, spec: LMShardSpec, pp: int = 1, tp: int = 1, **executor_args: Any) -> ShardedBackend:
        """pp x tp ranks (this process is rank 0, the others are spawned, bounded start-up); pp = tp = 1 runs
        in this process with no process group. `executor_args` go to `MpExecutor` (backend, devices, ...)."""
        run, executor, shard = start_program(partial(build_shard, spec), pp, tp, **executor_args)
        return cls(run, executor, cast(LMShard, shard))

    def open(self) -> int:
        return next(self._ids)

    @property
    def in_process(self) -> bool:
        """pp = tp = 1: commands run in the calling thread (`run`), with no rank processes to keep in order."""
        return self.executor is None

    def run(self, command: Any) -> Any:
        """An in-process stage: run `command` in the calling thread -> its result."""
        return self._run(command)

    def submit(self, command: Any) -> Future:
        """Run `command` on every rank; the future resolves with the owner's result. With an executor this
        returns once rank 0's part is done, so another thread can submit the next pipeline micro-batch."""
        if self.executor is not None:
            return self.executor.submit(command)
        done: Future = Future()
        try:
            done.set_result(self._run(command))
        except Exception as exc:
            done.set_exception(exc)
        return done

    @property
    def result_timeout_s(self) -> float:
        return self.executor.rdzv.timeout_s if self.executor is not None else float("inf")

    def predict(self, prefix: torch.Tensor, params: SamplingParams) -> tuple[list[int], torch.Tensor]:
        """Talker stages: the code predictor over the stage's ranks -> (residual codes, codec sum (1, 1, H))."""
        (codes, codec_sum), = self.predict_batch(prefix, (params,))
        return codes, codec_sum

    def predict_batch(self, prefix: torch.Tensor, params: tuple[SamplingParams, ...]
                      ) -> list[tuple[list[int], torch.Tensor]]:
        """The code predictor for B requests in one call: prefix (B, 2, H) -> per request (codes, sum (1, 1, H))."""
        key = next(self._ids)
        result: LMPredictResult = self._run(LMPredict(key, prefix, params))
        sums = result.codec_sum
        if sums is None:  # made on rank 0 (the first pipeline rank, this process), kept by key
            sums = self.local_shard.codec_sums.pop(key)
        return [(list(codes), sums[b:b + 1]) for b, codes in enumerate(result.codes)]

    def forward(self, handle: int, x: torch.Tensor, position_ids: torch.Tensor, *,
                visual_pos_mask: torch.Tensor | None = None, deepstack: list[torch.Tensor] | None = None,
                capture_layer: int | None = None) -> LMOutput:
        result: LMStepResult = self._run(LMStep(handle, x, position_ids, visual_pos_mask, deepstack, capture_layer))
        return LMOutput(logits=result.logits, last_hidden=result.last_hidden, captured=result.captured)

    def close(self, handle: int) -> None:
        if self.executor is None or self.executor.failure is None:
            self._run(LMFree(handle))

    def shutdown(self) -> None:
        if self.executor is not None:
            self.executor.shutdown()
