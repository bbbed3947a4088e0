"""The encoder stage of Qwen3-Omni: the audio tower and the vision tower, one request at a time.

Role: turns raw media features into the embeddings the thinker scatters into its placeholder positions.
It holds only `thinker.model.audio_tower` and `thinker.model.visual` (an encoder process loads nothing else)
and computes the same numbers as the thinker's own `get_audio_features` / `get_image_features`.

Data flow:
    input_features (n_mel, T) | (B, n_mel, T) + feature_attention_mask (B, T)
        -> valid frames only (n_mel, sum T_valid) -> audio_tower -> audio_embeds (n_audio_tokens, H)
    pixel_values (n_patches, C * tp * p * p) + image_grid_thw (n_images, 3)
        -> visual -> image_embeds (n_image_tokens, H) + deepstack [(n_image_tokens, H)] * len(deepstack idx)

`n_audio_tokens` per audio is `audio_output_lengths(feature_lengths)`; `n_image_tokens` per image is
`t * h * w / spatial_merge_size**2`. The prompt must hold exactly that many placeholder ids.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths


class Qwen3OmniEncoder:
    """Audio + vision towers of an already-loaded Qwen3-Omni thinker; stateless, request-safe."""

    def __init__(self, audio_tower: Any, visual: Any) -> None:
        """The towers: transformers' modules, or `encoder_shard`'s stand-ins over the stage's pp x tp ranks
        (same call signature and output fields); None for a tower this encoder does not serve."""
        self.audio_tower: Any = audio_tower
        self.visual: Any = visual

    def audio_output_lengths(self, feature_lengths: torch.Tensor) -> torch.Tensor:
        """Audio tokens produced for each audio of `feature_lengths` (n_audios,) valid mel frames."""
        if self.audio_tower is None:
            raise ValueError("this encoder was built without an audio tower")
        return _get_feat_extract_output_lengths(feature_lengths, self.audio_tower.config.n_window)

    @torch.no_grad()
    def encode_audio(
        self, input_features: torch.Tensor, feature_attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Mel features (n_mel, T) or (B, n_mel, T) (+ mask (B, T)) -> audio_embeds (n_audio_tokens, H)."""
        if self.audio_tower is None:
            raise ValueError("this encoder was built without an audio tower")
        feats = input_features.unsqueeze(0) if input_features.dim() == 2 else input_features  # (B, n_mel, T)
        if feats.dim() != 3 or feats.shape[1] != self.audio_tower.config.num_mel_bins:
            raise ValueError(
                f"input_features must be (n_mel, T) or (B, n_mel, T) with n_mel="
                f"{self.audio_tower.config.num_mel_bins}, got {tuple(input_features.shape)}"
            )
        if feature_attention_mask is None:
            feature_attention_mask = torch.ones(feats.shape[0], feats.shape[2], dtype=torch.long)
        mask = feature_attention_mask.view(feats.shape[0], -1)  # (B, T)
        if mask.shape[1] != feats.shape[2]:
            raise ValueError(f"feature_attention_mask has {mask.shape[1]} frames, input_features {feats.shape[2]}")
        lengths = mask.sum(dim=1)  # (B,)
        valid = feats.permute(0, 2, 1)[mask.bool()].permute(1, 0)  # (n_mel, sum T_valid)
        out = self.audio_tower(valid, feature_lens=lengths, return_dict=True)
        return out.last_hidden_state  # (n_audio_tokens, H)

    @torch.no_grad()
    def encode_image(
        self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Patches (n_patches, C*tp*p*p) + grid (n_images, 3) -> (embeds (n_tokens, H), deepstack list)."""
        if self.visual is None:
            raise ValueError("this encoder was built without a vision tower")
        cfg = self.visual.config
        patch_dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
        n_patches = int(image_grid_thw.prod(-1).sum())
        if pixel_values.shape != (n_patches, patch_dim):
            raise ValueError(
                f"pixel_values must be (sum(t*h*w)={n_patches}, C*tp*p*p={patch_dim}) for image_grid_thw "
                f"{image_grid_thw.tolist()}, got {tuple(pixel_values.shape)}"
            )
        out = self.visual(pixel_values.type(self.visual.dtype), grid_thw=image_grid_thw)
        return out.pooler_output, list(out.deepstack_features)  # (n_tokens, H), [(n_tokens, H)]
