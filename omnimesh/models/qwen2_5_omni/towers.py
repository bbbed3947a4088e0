"""Qwen2.5-Omni's audio and vision towers behind the interface the encoder stage calls.

Role: `omnimesh.models.qwen3_omni.encoder.Qwen3OmniEncoder` is family-agnostic; it calls its two towers
the way it calls Qwen3-Omni's. transformers' Qwen2.5-Omni towers differ in three small ways, bridged here:
the audio tower wants `aftercnn_lens` as well (the thinker computes it in `get_audio_features`), its token
count per audio follows another formula (`output_lengths`), and the vision tower has no deepstack features.
`load_qwen2_5_encoder` loads ONLY the two towers out of a Qwen2.5-Omni folder (the real Qwen2.5-Omni-7B key
layout: `thinker.audio_tower.*`, `thinker.visual.*`) through the checked loader, which fails on any missing
key.

Data flow:
    frames (n_mel, sum T_valid) + feature_lens (n_audios,)
        -> aftercnn_lens = (T - 1) // 2 + 1 -> Qwen2_5OmniAudioEncoder -> .last_hidden_state (n_audio_tokens, H)
           n_audio_tokens per audio = (aftercnn_lens - 2) // 2 + 1    (`Qwen2_5OmniAudioTower.output_lengths`)
    pixel_values (n_patches, C*tp*p*p) + grid_thw (n_images, 3)
        -> Qwen2_5OmniVisionEncoder -> .pooler_output (sum t*h*w / merge**2, H), deepstack_features = []

Run: python -c "from omnimesh.models.qwen2_5_omni.towers import load_qwen2_5_encoder; \
print(load_qwen2_5_encoder('/tmp/tiny-qwen2.5-omni').audio_tower.config)"
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import torch
from transformers import AutoConfig, Qwen2_5OmniConfig
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
    Qwen2_5OmniAudioEncoder,
    Qwen2_5OmniVisionEncoder,
)

from omnimesh.models.loader import build_submodule
from omnimesh.models.qwen3_omni.encoder import Qwen3OmniEncoder

AUDIO_PREFIX = "thinker.audio_tower."
VISION_PREFIX = "thinker.visual."


class Qwen2_5OmniAudioTower:
    """Called like the encoder's audio tower: (frames (n_mel, sum T), feature_lens) -> .last_hidden_state."""

    def __init__(self, module: Qwen2_5OmniAudioEncoder) -> None:
        self.module = module
        self.config: Any = module.config

    def output_lengths(self, feature_lengths: torch.Tensor) -> torch.Tensor:
        """Audio tokens per audio of `feature_lengths` (n_audios,) valid mel frames: conv2's stride 2, then
        the tower's stride-2 average pooling (the processor's `_get_feat_extract_output_lengths`)."""
        lengths = cast(torch.LongTensor, feature_lengths.long())
        return self.module._get_feat_extract_output_lengths(lengths)[1]  # (n_audios,)

    def __call__(self, frames: torch.Tensor, feature_lens: torch.Tensor, return_dict: bool = True) -> Any:
        device = self.module.conv1.weight.device
        lens = cast(torch.LongTensor, feature_lens.to(device))
        aftercnn_lens, _ = self.module._get_feat_extract_output_lengths(lens)  # (n_audios,) frames after conv2
        out = self.module(frames.to(device), feature_lens=lens, aftercnn_lens=aftercnn_lens)
        return SimpleNamespace(last_hidden_state=out.last_hidden_state.cpu())  # the edge's tensors live on the host


class Qwen2_5OmniVisionTower:
    """Called like the encoder's vision tower: (pixel_values, grid_thw) -> .pooler_output, .deepstack_features."""

    def __init__(self, module: Qwen2_5OmniVisionEncoder) -> None:
        self.module = module
        self.config: Any = module.config

    @property
    def dtype(self) -> torch.dtype:
        """The tower's weight dtype (the encoder casts pixel values to it, as the thinker does)."""
        return self.module.dtype

    def __call__(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> Any:
        device = self.module.patch_embed.proj.weight.device
        out = self.module(pixel_values.to(device), grid_thw=grid_thw.to(device))
        # Qwen2.5-Omni feeds the LM no intermediate vision layers: the deepstack list is always empty
        return SimpleNamespace(pooler_output=out.pooler_output.cpu(), deepstack_features=[])  # (n_tokens, H)


def load_qwen2_5_encoder(model_dir: str | Path, dtype: torch.dtype = torch.float32,
                         device: str | torch.device = "cpu") -> Qwen3OmniEncoder:
    """Both towers of the Qwen2.5-Omni folder `model_dir` (nothing else is read), in `dtype` on `device` (the
    stage's: a CUDA stage runs them on its GPU; inputs go there, outputs come back to the host), each checked
    for missing weights (ValueError naming the key)."""
    model_dir = Path(model_dir)
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    if not isinstance(config, Qwen2_5OmniConfig):
        raise ValueError(f"{model_dir} holds a {type(config).__name__} ({config.model_type}), "
                         f"not a Qwen2.5-Omni model")
    audio = cast(Qwen2_5OmniAudioEncoder, build_submodule(
        model_dir, config_path="thinker_config.audio_config", factory=Qwen2_5OmniAudioEncoder, prefix=AUDIO_PREFIX,
        dtype=dtype))
    visual = cast(Qwen2_5OmniVisionEncoder, build_submodule(
        model_dir, config_path="thinker_config.vision_config", factory=Qwen2_5OmniVisionEncoder, prefix=VISION_PREFIX,
        dtype=dtype))
    for tower in (audio, visual):
        torch.nn.Module.to(tower, device)  # in place (PreTrainedModel.to's typing wants a dtype or device object)
    return Qwen3OmniEncoder(Qwen2_5OmniAudioTower(audio), Qwen2_5OmniVisionTower(visual))
