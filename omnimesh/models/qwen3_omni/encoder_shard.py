"""EncoderShard: what one rank of an encoder stage runs — its blocks of the audio tower and of the vision
tower — and the two tower stand-ins `Qwen3OmniEncoder` calls in the stage's driver.

Role: the `RankProgram` of an encoder stage split over pp x tp ranks (in-process for pp = tp = 1). Each
rank builds the family's audio and vision towers over its own block ranges (Qwen3-Omni: `ParallelAudioTower`,
`ParallelVisionTower`; Qwen2.5-Omni: `ParallelAudioTower2_5`, `ParallelVisionTower2_5`; each tower split over
the same pp ranks: the audio tower by the stage's partition if one is given, the vision tower evenly), loads
only those tensors, sharded for its TP rank. The towers are stateless per request, so nothing is cached
between commands.

Commands:  EncodeAudio(features (n_mel, sum T_valid), feature_lens (B,)) -> (n_tokens, H)
           EncodeImage(pixel_values (N, C*T*P*P), grid_thw (n, 3)) -> (image_embeds, [deepstack]) (Qwen2.5: [])
`ShardedAudioTower` / `ShardedVisionTower` call those with the same signature and return the same fields
as transformers' towers, so `Qwen3OmniEncoder`'s checks and bookkeeping stay as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from omnimesh.models.qwen3_omni.parallel_audio_tower import ParallelAudioTower, audio_pipeline_step
from omnimesh.models.qwen3_omni.parallel_vision_tower import ParallelVisionTower, vision_pipeline_step
from omnimesh.parallel.mp_executor import MpExecutor, start_program
from omnimesh.parallel.parallel_state import ParallelState
from omnimesh.parallel.partition import partition_layers


@dataclass(frozen=True)
class EncodeAudio:
    features: torch.Tensor  # (n_mel, sum T_valid) valid frames of every clip, concatenated
    feature_lens: torch.Tensor  # (B,) valid frames per clip


@dataclass(frozen=True)
class EncodeImage:
    pixel_values: torch.Tensor  # (N, C * T * P * P)
    grid_thw: torch.Tensor  # (n_images, 3)


@dataclass(frozen=True)
class EncoderShardSpec:
    model_dir: Path
    dtype: torch.dtype = torch.float32
    partition: tuple[int, ...] | None = None  # audio-tower layers per pp rank (the stage's main stack)


class EncoderShard:
    def __init__(self, spec: EncoderShardSpec, ps: ParallelState):
        from omnimesh.models.model_config import is_qwen2_5, load_config

        config = load_config(spec.model_dir)
        tc: Any = config.thinker_config
        custom = list(spec.partition) if spec.partition else None
        a_range = partition_layers(tc.audio_config.encoder_layers, ps.pp_size, custom)[ps.pp_rank]
        v_range = partition_layers(tc.vision_config.depth, ps.pp_size)[ps.pp_rank]
        self.ps = ps
        if is_qwen2_5(config):
            from omnimesh.models.qwen2_5_omni import parallel_audio_tower as audio25
            from omnimesh.models.qwen2_5_omni import parallel_vision_tower as vision25

            self.audio: Any = audio25.ParallelAudioTower2_5(tc.audio_config, ps, a_range, spec.dtype)
            self.vision: Any = vision25.ParallelVisionTower2_5(tc.vision_config, ps, v_range, spec.dtype)
        else:  # (both families' towers run through the same pipeline steps)
            self.audio = ParallelAudioTower(tc.audio_config, ps, a_range, spec.dtype)
            self.vision = ParallelVisionTower(tc.vision_config, ps, v_range, spec.dtype)
        self.audio.load_weights(spec.model_dir)
        self.vision.load_weights(spec.model_dir)

    @torch.no_grad()
    def execute(self, command: EncodeAudio | EncodeImage) -> Any:
        owner = self.ps.is_last_pp_rank and self.ps.tp_rank == 0
        first = self.ps.is_first_pp_rank
        if isinstance(command, EncodeAudio):
            out = audio_pipeline_step(self.audio, command.features.to(self.ps.device) if first else None,
                                  command.feature_lens)
            return out.cpu() if owner else None
        result = vision_pipeline_step(self.vision, command.pixel_values.to(self.ps.device) if first else None,
                                  command.grid_thw)
        if not owner or result.image_embeds is None:
            return None
        return result.image_embeds.cpu(), [d.cpu() for d in result.deepstack]


def build_encoder_shard(spec: EncoderShardSpec, ps: ParallelState) -> EncoderShard:
    return EncoderShard(spec, ps)


def encoder_runner(spec: EncoderShardSpec, pp: int = 1, tp: int = 1, **executor_args: Any) -> tuple[Any, MpExecutor | None]:
    """`run(command)` over the encoder's ranks (in-process for pp = tp = 1), and the executor if any."""
    run, executor, _ = start_program(partial(build_encoder_shard, spec), pp, tp, **executor_args)
    return run, executor


class ShardedAudioTower:
    """Called like transformers' audio tower: (features (n_mel, sum T), feature_lens) -> .last_hidden_state;
    `output_lengths(feature_lens)` counts each clip's tokens by the family's rule."""

    def __init__(self, config: Any, run: Any, output_lengths: Callable[[torch.Tensor], torch.Tensor]):
        self.config = config
        self._run = run
        self.output_lengths = output_lengths

    def __call__(self, features: torch.Tensor, feature_lens: torch.Tensor, return_dict: bool = True) -> Any:
        return SimpleNamespace(last_hidden_state=self._run(EncodeAudio(features, feature_lens)))


class ShardedVisionTower:
    """Called like transformers' vision tower: (pixel_values, grid_thw) -> .pooler_output, .deepstack_features."""

    def __init__(self, config: Any, run: Any, dtype: torch.dtype):
        self.config = config
        self.dtype = dtype
        self._run = run

    def __call__(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> Any:
        embeds, deepstack = self._run(EncodeImage(pixel_values, grid_thw))
        return SimpleNamespace(pooler_output=embeds, deepstack_features=deepstack)
