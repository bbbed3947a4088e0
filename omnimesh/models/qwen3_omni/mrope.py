"""M-RoPE positions for one Qwen3-Omni or Qwen2.5-Omni request, computed outside the model (request-safe).

Role: the thinker and the talker both keep `rope_deltas` as module state, which is wrong as soon as two
requests share a module. This file computes the same positions as the model's own `get_rope_index` for
ONE sequence and hands back the rope delta as a plain int, so each request carries its own.

Data flow:
    prompt ids (L,) + image_grid_thw / audio lengths
        -> `prompt_positions`  -> position_ids (4, 1, L) float32 (row 0: text positions, rows 1..3: t/h/w)
                                  + rope_delta (int)
    decode step: `decode_positions(seq_len, rope_delta)` -> (4, 1, 1): row 0 = seq_len, rows 1..3 =
                                  seq_len + rope_delta (what `generate` gets by adding 1 to the last column)

The index logic itself is transformers' (`Qwen3OmniMoePreTrainedModelForConditionalGeneration
.get_rope_index`, or Qwen2.5-Omni's, picked by `MropeSpec.family`), run against a tiny context object
holding only the ids and sizes it reads. That also
sidesteps a transformers bug: the talker config has no `audio_config`, so the talker's own
`get_rope_index` fails on prompts with audio AND an image; here the audio `n_window` is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeConfig
from transformers import Qwen2_5OmniConfig
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
    Qwen2_5OmniPreTrainedModelForConditionalGeneration as _Qwen2_5RopeOwner,
)
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoePreTrainedModelForConditionalGeneration as _RopeOwner,
)

_OWNERS: dict[str, Any] = {"qwen3_omni": _RopeOwner, "qwen2_5_omni": _Qwen2_5RopeOwner}


@dataclass(frozen=True)
class MropeSpec:
    """The ids and sizes `get_rope_index` reads; identical for thinker and talker in Qwen3-Omni."""

    image_token_id: int
    video_token_id: int
    audio_token_id: int
    vision_start_token_id: int
    audio_start_token_id: int
    spatial_merge_size: int
    position_id_per_seconds: float
    audio_n_window: int
    family: str = "qwen3_omni"  # whose get_rope_index: "qwen3_omni" | "qwen2_5_omni"
    seconds_per_chunk: float = 2.0  # Qwen2.5-Omni: a video's frames and soundtrack interleave per this many seconds

    @classmethod
    def for_thinker(cls, config: Qwen3OmniMoeConfig | Qwen2_5OmniConfig) -> MropeSpec:
        """The thinker's ids and sizes; for a `Qwen2_5OmniConfig` also Qwen2.5-Omni's index and audio/video chunking."""
        tc: Any = config.thinker_config
        qwen2_5 = isinstance(config, Qwen2_5OmniConfig)
        return cls(
            image_token_id=tc.image_token_id, video_token_id=tc.video_token_id, audio_token_id=tc.audio_token_id,
            vision_start_token_id=tc.vision_start_token_id, audio_start_token_id=tc.audio_start_token_id,
            spatial_merge_size=tc.vision_config.spatial_merge_size,
            position_id_per_seconds=tc.position_id_per_seconds, audio_n_window=tc.audio_config.n_window,
            family="qwen2_5_omni" if qwen2_5 else "qwen3_omni",
            seconds_per_chunk=float(tc.seconds_per_chunk) if qwen2_5 else 2.0,
        )

    @classmethod
    def for_talker(cls, config: Qwen3OmniMoeConfig | Qwen2_5OmniConfig) -> MropeSpec:
        """The talker's ids and sizes (its positions follow its own prompt ids, with the thinker's media)."""
        tk: Any = config.talker_config
        qwen2_5 = isinstance(config, Qwen2_5OmniConfig)
        return cls(
            image_token_id=tk.image_token_id, video_token_id=tk.video_token_id, audio_token_id=tk.audio_token_id,
            vision_start_token_id=tk.vision_start_token_id, audio_start_token_id=tk.audio_start_token_id,
            spatial_merge_size=tk.spatial_merge_size, position_id_per_seconds=tk.position_id_per_seconds,
            # The talker config lacks `audio_config`; the audio tower's window lives in the thinker config.
            audio_n_window=_audio_n_window(config),
            family="qwen2_5_omni" if qwen2_5 else "qwen3_omni",
            seconds_per_chunk=float(tk.seconds_per_chunk) if qwen2_5 else 2.0,
        )


def _audio_n_window(config: Qwen3OmniMoeConfig | Qwen2_5OmniConfig) -> int:
    thinker: Any = config.thinker_config
    return int(thinker.audio_config.n_window)


class _RopeContext:
    """Stands in for `self` in `get_rope_index`: exactly the attributes that method reads."""

    def __init__(self, spec: MropeSpec) -> None:
        self.owner: Any = _OWNERS[spec.family]
        self.spatial_merge_size = spec.spatial_merge_size
        self.config = SimpleNamespace(
            image_token_id=spec.image_token_id, video_token_id=spec.video_token_id,
            audio_token_id=spec.audio_token_id, vision_start_token_id=spec.vision_start_token_id,
            audio_start_token_id=spec.audio_start_token_id, position_id_per_seconds=spec.position_id_per_seconds,
            audio_config=SimpleNamespace(n_window=spec.audio_n_window), seconds_per_chunk=spec.seconds_per_chunk,
        )

    def get_llm_pos_ids_for_vision(self, *args: object) -> torch.Tensor:
        return self.owner.get_llm_pos_ids_for_vision(self, *args)

    def get_chunked_index(self, *args: object) -> list[tuple[int, int]]:  # Qwen2.5-Omni's audio-in-video chunks
        return self.owner.get_chunked_index(self, *args)


def prompt_positions(
    input_ids: torch.Tensor,
    spec: MropeSpec,
    image_grid_thw: torch.Tensor | None = None,
    audio_feature_lengths: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    video_second_per_grid: torch.Tensor | None = None,
    use_audio_in_video: bool = False,
) -> tuple[torch.Tensor, int]:
    """Positions of a whole prompt `input_ids (L,)` as `generate` builds them: ((4, 1, L) float32, delta)."""
    if input_ids.dim() != 1:
        raise ValueError(f"input_ids must be 1-D (L,), got shape {tuple(input_ids.shape)}")
    ids = input_ids.view(1, -1)  # (1, L)
    mask = torch.ones_like(ids)  # (1, L): one request, no padding
    context = _RopeContext(spec)
    mrope, delta = context.owner.get_rope_index(
        context,
        ids, image_grid_thw, video_grid_thw, mask, use_audio_in_video, audio_feature_lengths, video_second_per_grid,
    )  # (3, 1, L), (1, 1)
    text = torch.arange(ids.shape[1], device=ids.device, dtype=mrope.dtype).view(1, 1, -1)  # (1, 1, L)
    return torch.cat([text, mrope], dim=0), int(delta.view(-1)[0].item())  # (4, 1, L)


def decode_positions(seq_len: int, rope_delta: int, device: torch.device | None = None) -> torch.Tensor:
    """Positions of the token appended at cache length `seq_len`: (4, 1, 1) float32."""
    return decode_positions_batch([seq_len], [rope_delta], device).view(4, 1, 1)


def decode_positions_batch(seq_lens: list[int], rope_deltas: list[int], device: torch.device | None = None
                           ) -> torch.Tensor:
    """`decode_positions` of B requests in one tensor: (4, B) float32, column b for request b (text row =
    seq_len, then t / h / w = seq_len + rope_delta)."""
    rows = [(n, n + d, n + d, n + d) for n, d in zip(seq_lens, rope_deltas)]
    return torch.tensor(rows, dtype=torch.float32, device=device).t()  # (4, B)
