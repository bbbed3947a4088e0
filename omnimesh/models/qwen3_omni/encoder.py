"""The encoder stage of Qwen3-Omni and Qwen2.5-Omni: the audio tower and the vision tower.

Role: turns raw media features into the embeddings the thinker scatters into its placeholder positions.
It holds only the thinker's audio tower and vision tower (an encoder process loads nothing else) and
computes the same numbers as the thinker's own `get_audio_features` / `get_image_features`. Nothing here
depends on the family: the towers are `encoder_shard`'s stand-ins over the stage's ranks (Qwen3-Omni's or
Qwen2.5-Omni's rank models; Qwen2.5-Omni has no deepstack: an empty list) or transformers' modules.

Data flow:
    input_features (n_mel, T) | (B, n_mel, T) + feature_attention_mask (B, T)
        -> valid frames only (n_mel, sum T_valid) -> audio_tower -> audio_embeds (n_audio_tokens, H)
    pixel_values (n_patches, C * tp * p * p) + image_grid_thw (n_images, 3)
        -> visual -> image_embeds (n_image_tokens, H) + deepstack [(n_image_tokens, H)] * len(deepstack idx)
    pixel_values_videos + video_grid_thw (t = frame pairs): the same tower, the same outputs (video_embeds)

`n_audio_tokens` per audio is `audio_output_lengths(feature_lengths)` (the tower's own `output_lengths`
when it has one, else Qwen3-Omni's formula); `n_image_tokens` per image is
`t * h * w / spatial_merge_size**2`. The prompt must hold exactly that many placeholder ids.

Batching: `audio_frames` / `check_image` check one request's media (ValueError for anything a tower would
refuse); `audio_tower_call` / `vision_tower_call` run ONE tower call over the concatenated media of many
requests (services/encoder/encoder_batcher.py splits the outputs back). `encode_audio` / `encode_image`
are the two steps for one request.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths


class Qwen3OmniEncoder:
    """Audio + vision towers of an already-loaded Qwen3-Omni or Qwen2.5-Omni thinker; stateless, request-safe."""

    def __init__(self, audio_tower: Any, visual: Any) -> None:
        """The towers: transformers' modules, or `encoder_shard`'s stand-ins over the stage's pp x tp ranks
        (same call signature and output fields); None for a tower this encoder does not serve."""
        self.audio_tower: Any = audio_tower
        self.visual: Any = visual

    def audio_output_lengths(self, feature_lengths: torch.Tensor) -> torch.Tensor:
        """Audio tokens produced for each audio of `feature_lengths` (n_audios,) valid mel frames: the tower's
        `output_lengths` (the stage's stand-ins count by their family's rule), else Qwen3-Omni's formula
        (transformers' Qwen3-Omni module)."""
        if self.audio_tower is None:
            raise ValueError("this encoder was built without an audio tower")
        if hasattr(self.audio_tower, "output_lengths"):
            return self.audio_tower.output_lengths(feature_lengths)  # (n_audios,)
        return _get_feat_extract_output_lengths(feature_lengths, self.audio_tower.config.n_window)

    def audio_frames(
        self, input_features: torch.Tensor, feature_attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Check one request's audio and keep its valid frames: features (n_mel, T) or (B, n_mel, T) (+ mask
        (B, T) of 0/1) -> (frames (n_mel, sum T_valid), feature_lens (B,) long). Everything the tower would
        refuse is a ValueError here, so a batch of checked requests never fails for one request's input."""
        if self.audio_tower is None:
            raise ValueError("this encoder was built without an audio tower")
        feats = input_features.unsqueeze(0) if input_features.dim() == 2 else input_features  # (B, n_mel, T)
        n_mel = self.audio_tower.config.num_mel_bins
        if feats.dim() != 3 or feats.shape[1] != n_mel or feats.shape[0] == 0 or not feats.is_floating_point():
            raise ValueError(
                f"input_features must be floating point (n_mel, T) or (B >= 1, n_mel, T) with n_mel={n_mel}, "
                f"got {tuple(input_features.shape)} {input_features.dtype}"
            )
        B, T = feats.shape[0], feats.shape[2]
        if feature_attention_mask is None:
            feature_attention_mask = torch.ones(B, T, dtype=torch.long)
        if feature_attention_mask.numel() != B * T:
            raise ValueError(f"feature_attention_mask must be ({B}, {T}) for input_features "
                             f"{tuple(input_features.shape)}, got {tuple(feature_attention_mask.shape)}")
        mask = feature_attention_mask.reshape(B, T)
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("feature_attention_mask must hold only 0 and 1")
        lengths = mask.sum(dim=1).long()  # (B,)
        if int(lengths.min()) < 1:
            raise ValueError(f"every audio needs at least one valid frame; valid frames per audio: {lengths.tolist()}")
        valid = feats.permute(0, 2, 1)[mask.bool()].permute(1, 0)  # (n_mel, sum T_valid)
        return valid, lengths

    @torch.no_grad()
    def audio_tower_call(self, frames: torch.Tensor, feature_lens: torch.Tensor) -> torch.Tensor:
        """ONE tower call over the valid frames of any number of audios (n_mel, sum T_valid) -> (n_tokens, H)."""
        if self.audio_tower is None:
            raise ValueError("this encoder was built without an audio tower")
        return self.audio_tower(frames, feature_lens=feature_lens, return_dict=True).last_hidden_state

    @torch.no_grad()
    def encode_audio(
        self, input_features: torch.Tensor, feature_attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Mel features (n_mel, T) or (B, n_mel, T) (+ mask (B, T)) -> audio_embeds (n_audio_tokens, H)."""
        return self.audio_tower_call(*self.audio_frames(input_features, feature_attention_mask))

    def check_image(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor, kind: str = "image") -> torch.Tensor:
        """Check one request's images (or videos: `kind="video"`) against the tower's rules (ValueError naming
        the problem); returns the grid (n_items, 3) as long."""
        if self.visual is None:
            raise ValueError("this encoder was built without a vision tower")
        grid_name, pixels_name = (("image_grid_thw", "pixel_values") if kind == "image"
                                  else ("video_grid_thw", "pixel_values_videos"))
        cfg = self.visual.config
        m = cfg.spatial_merge_size
        if image_grid_thw.dim() != 2 or image_grid_thw.shape[0] == 0 or image_grid_thw.shape[1] != 3 \
                or not torch.equal(image_grid_thw.long().to(image_grid_thw.dtype), image_grid_thw) \
                or int(image_grid_thw.min()) < 1:
            raise ValueError(f"{grid_name} must be (n_{kind}s >= 1, 3) whole numbers t, h, w >= 1, got "
                             f"{image_grid_thw.tolist()}")
        grid = image_grid_thw.long()
        if bool((grid[:, 1:] % m).any()):
            raise ValueError(f"every {grid_name} h and w must divide by spatial_merge_size={m}, got {grid.tolist()}")
        patch_dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
        n_patches = int(grid.prod(-1).sum())
        if pixel_values.shape != (n_patches, patch_dim) or not pixel_values.is_floating_point():
            raise ValueError(
                f"{pixels_name} must be a floating-point tensor of shape (sum(t*h*w), C*tp*p*p) = ({n_patches}, "
                f"{patch_dim}) for {grid_name} {grid.tolist()}, got {tuple(pixel_values.shape)} {pixel_values.dtype}"
            )
        return grid

    def image_token_counts(self, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """Tokens (rows of image_embeds / video_embeds and of each deepstack feature) per image or video:
        t*h*w / merge**2."""
        if self.visual is None:
            raise ValueError("this encoder was built without a vision tower")
        return image_grid_thw.long().prod(-1) // self.visual.config.spatial_merge_size**2  # (n_images,)

    @torch.no_grad()
    def vision_tower_call(
        self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """ONE tower call over the patches of any number of images -> (embeds (n_tokens, H), deepstack list)."""
        if self.visual is None:
            raise ValueError("this encoder was built without a vision tower")
        out = self.visual(pixel_values.type(self.visual.dtype), grid_thw=image_grid_thw)
        return out.pooler_output, list(out.deepstack_features)  # (n_tokens, H), [(n_tokens, H)]

    @torch.no_grad()
    def encode_image(
        self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Patches (n_patches, C*tp*p*p) + grid (n_images, 3) -> (embeds (n_tokens, H), deepstack list)."""
        return self.vision_tower_call(pixel_values, self.check_image(pixel_values, image_grid_thw))
