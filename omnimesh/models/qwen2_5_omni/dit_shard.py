"""DiTShard: what one rank of a Qwen2.5-Omni vocoder stage runs — its decoder layers of the token2wav DiT.

Role: the `RankProgram` of the vocoder stage split over pp x tp ranks (and, with `ParallelState.single()`,
in-process). Each rank builds `ParallelDiT` over its own layer range and loads only those tensors (sharded
for its TP rank). The rest of token2wav (DiT embeddings, speaker encoder, input projection, norm_out /
proj_out, the RK4 loop, BigVGAN) stays in the stage's driver process, which calls `DiTBackend` once per
DiT evaluation (~40 per decode) in place of transformers' `dit.transformer_blocks` loop. No state is
kept between steps but the last step's geometry (rotary table, window masks), reused while the rows'
frame counts stay the same.

Commands:  DiTStep(hidden (R, T, H), time_embedding (R, H), frames (R,))
                -> hidden (R, T, H) after the DiT's last layer, from the last pp rank (tp rank 0);
                   row r real up to frames[r], padded frames finite garbage to drop
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from omnimesh.models.qwen2_5_omni.parallel_dit import ParallelDiT, dit_pipeline_step
from omnimesh.parallel.mp_executor import MpExecutor, start_program
from omnimesh.parallel.parallel_state import ParallelState
from omnimesh.parallel.partition import partition_layers


@dataclass(frozen=True)
class DiTStep:
    hidden: torch.Tensor  # (R, T, H) the input projection's output, rows right-padded to T
    time_embedding: torch.Tensor  # (R, H) `dit.time_embed(t)`, every rank uses it
    frames: tuple[int, ...]  # (R,) real frames per row, 1..T


@dataclass(frozen=True)
class DiTShardSpec:
    model_dir: Path
    dtype: torch.dtype = torch.float32
    partition: tuple[int, ...] | None = None


def load_dit_config(model_dir: Path) -> Any:
    """The folder's `token2wav_config.dit_config` (the config classes only: a rank imports no modeling code)."""
    from transformers import AutoConfig

    config: Any = AutoConfig.from_pretrained(Path(model_dir), local_files_only=True)
    if config.model_type != "qwen2_5_omni":
        raise ValueError(f"{model_dir} holds a {type(config).__name__} ({config.model_type}), not a Qwen2.5-Omni "
                         f"model: only Qwen2.5-Omni's token2wav has a DiT")
    return config.token2wav_config.dit_config


class DiTShard:
    def __init__(self, spec: DiTShardSpec, ps: ParallelState):
        config = load_dit_config(spec.model_dir)
        custom = list(spec.partition) if spec.partition else None
        ranges = partition_layers(config.num_hidden_layers, ps.pp_size, custom)
        self.ps = ps
        self.model = ParallelDiT(config, ps, ranges[ps.pp_rank], spec.dtype)
        self.keys = self.model.load_weights(spec.model_dir)

    def execute(self, command: DiTStep) -> torch.Tensor | None:
        hidden = command.hidden.to(self.ps.device, self.model.dtype) if self.ps.is_first_pp_rank else None
        out = dit_pipeline_step(self.model, hidden, command.time_embedding, command.frames,
                                int(command.hidden.shape[1]))  # (R, T, H)
        if not (self.ps.is_last_pp_rank and self.ps.tp_rank == 0):
            return None
        return out if self.ps.world_size == 1 else out.cpu()  # in-process: stays on the driver's device


def build_dit_shard(spec: DiTShardSpec, ps: ParallelState) -> DiTShard:
    return DiTShard(spec, ps)


class DiTBackend:
    """The DiT's decoder layers behind `dit_batch.sample_mels`: one call per DiT evaluation, on our ranks."""

    def __init__(self, run: Any, executor: MpExecutor | None = None):
        self._run = run
        self.executor = executor

    @classmethod
    def build(cls, spec: DiTShardSpec, pp: int = 1, tp: int = 1, **executor_args: Any) -> DiTBackend:
        run, executor, _ = start_program(partial(build_dit_shard, spec), pp, tp, **executor_args)
        return cls(run, executor)

    def __call__(self, hidden: torch.Tensor, time_embedding: torch.Tensor, frames: Sequence[int]) -> torch.Tensor:
        """hidden (R, T, H), time_embedding (R, H), frames (R,) real frames per row -> the DiT's last layer's
        hidden (R, T, H), on hidden's device and dtype."""
        if len(frames) != hidden.shape[0]:
            raise ValueError(f"frames must give one count per row of hidden ({hidden.shape[0]}), got {len(frames)}")
        if self.executor is None:  # in-process: no copy
            out = self._run(DiTStep(hidden, time_embedding, tuple(int(n) for n in frames)))
        else:  # the command is pickled to every rank: host tensors
            out = self._run(DiTStep(hidden.cpu(), time_embedding.cpu(), tuple(int(n) for n in frames)))
        return out.to(hidden.device, hidden.dtype)

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown()
