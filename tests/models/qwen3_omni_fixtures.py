"""Test helpers for the Qwen3-Omni adapter: a seeded tiny model and hand-built prompts.

Role: builds the tiny random `Qwen3OmniMoeForConditionalGeneration` deterministically (transformers leaves the
talker's routed-expert tensors uninitialised, so they are filled here under a seeded generator) and the
token-id prompts / random media the parity tests feed it. Imported by tests, never by the package.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers import Qwen3OmniMoeForConditionalGeneration
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeCode2Wav,
    _get_feat_extract_output_lengths,
)

from omnimesh.models.qwen3_omni import tiny
from omnimesh.models.qwen3_omni.tiny_config import ROLE_TOKENS, SPECIAL_TOKENS

IM_START = SPECIAL_TOKENS["<|im_start|>"]
IM_END = SPECIAL_TOKENS["<|im_end|>"]
AUDIO_START = SPECIAL_TOKENS["<|audio_start|>"]
AUDIO_END = SPECIAL_TOKENS["<|audio_end|>"]
AUDIO_PAD = SPECIAL_TOKENS["<|audio_pad|>"]
VISION_START = SPECIAL_TOKENS["<|vision_start|>"]
VISION_END = SPECIAL_TOKENS["<|vision_end|>"]
IMAGE_PAD = SPECIAL_TOKENS["<|image_pad|>"]
VIDEO_PAD = SPECIAL_TOKENS["<|video_pad|>"]
USER = ROLE_TOKENS["user"]
ASSISTANT = ROLE_TOKENS["assistant"]
SYSTEM = ROLE_TOKENS["system"]
NEWLINE = 10  # any ordinary id < 400 stands in for "\n"


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run with `n` intra-op threads. Tiny models are fastest on one thread, and on a shared 2-core box
    OpenMP's spinning threads make every small op ~20x slower; test modules wrap themselves in this."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def build_tiny_model(seed: int = 0) -> Qwen3OmniMoeForConditionalGeneration:
    """The tiny random model exactly as `omnimesh make-tiny` builds it (experts filled, vocoder audible)."""
    return tiny.build_tiny_model(seed)


@dataclass
class Media:
    """Random media inputs in the processor's layout, plus the placeholder counts they need."""

    input_features: torch.Tensor | None = None  # (1, n_mel, T)
    feature_attention_mask: torch.Tensor | None = None  # (1, T)
    n_audio_tokens: int = 0
    pixel_values: torch.Tensor | None = None  # (n_patches, C * tp * p * p)
    image_grid_thw: torch.Tensor | None = None  # (1, 3)
    n_image_tokens: int = 0
    pixel_values_videos: torch.Tensor | None = None  # (n_patches, C * tp * p * p)
    video_grid_thw: torch.Tensor | None = None  # (1, 3)
    video_second_per_grid: torch.Tensor | None = None  # (1,)
    n_video_tokens: int = 0


def audio_output_length(n_frames: int, n_window: int) -> int:
    """The audio tower's output length for `n_frames` mel frames (the model's own formula)."""
    return int(_get_feat_extract_output_lengths(torch.tensor(n_frames), n_window))


def make_media(model: Qwen3OmniMoeForConditionalGeneration, audio: bool, image: bool, seed: int = 1,
               video: bool = False) -> Media:
    """Random media; a video is 3 temporal patches (6 frames) of 4x6 patches, 1.5 s each (so its M-RoPE time
    positions are not the frame index)."""
    gen = torch.Generator().manual_seed(seed)
    media = Media()
    if audio:
        cfg: Any = model.config.thinker_config.audio_config  # type: ignore[union-attr]
        n_frames, n_valid = 320, 300  # padded to 320 frames, 300 real
        media.input_features = torch.randn(1, cfg.num_mel_bins, n_frames, generator=gen)
        mask = torch.zeros(1, n_frames, dtype=torch.long)
        mask[:, :n_valid] = 1
        media.feature_attention_mask = mask
        media.n_audio_tokens = audio_output_length(n_valid, cfg.n_window)
    if image:
        vcfg: Any = model.config.thinker_config.vision_config  # type: ignore[union-attr]
        grid = torch.tensor([[1, 4, 4]])
        n_patches = int(grid.prod())
        patch_dim = vcfg.in_channels * vcfg.temporal_patch_size * vcfg.patch_size**2
        media.pixel_values = torch.randn(n_patches, patch_dim, generator=gen)
        media.image_grid_thw = grid
        media.n_image_tokens = n_patches // vcfg.spatial_merge_size**2
    if video:
        vcfg = model.config.thinker_config.vision_config  # type: ignore[union-attr]
        grid = torch.tensor([[3, 4, 6]])
        patch_dim = vcfg.in_channels * vcfg.temporal_patch_size * vcfg.patch_size**2
        media.pixel_values_videos = torch.randn(int(grid.prod()), patch_dim, generator=gen)
        media.video_grid_thw = grid
        media.video_second_per_grid = torch.tensor([1.5])
        media.n_video_tokens = int(grid.prod()) // vcfg.spatial_merge_size**2
    return media


def chat_prompt(media: Media, text: tuple[int, ...] = (20, 21, 22, 23)) -> torch.Tensor:
    """`<im_start>system ... <im_end>\\n<im_start>user [media] text <im_end>\\n<im_start>assistant\\n` as ids."""
    ids: list[int] = [IM_START, SYSTEM, NEWLINE, 30, 31, IM_END, NEWLINE, IM_START, USER, NEWLINE]
    if media.n_audio_tokens:
        ids += [AUDIO_START] + [AUDIO_PAD] * media.n_audio_tokens + [AUDIO_END]
    if media.n_image_tokens:
        ids += [VISION_START] + [IMAGE_PAD] * media.n_image_tokens + [VISION_END]
    if media.n_video_tokens:
        ids += [VISION_START] + [VIDEO_PAD] * media.n_video_tokens + [VISION_END]
    ids += list(text) + [IM_END, NEWLINE, IM_START, ASSISTANT, NEWLINE]
    return torch.tensor(ids, dtype=torch.long)


def audible_code2wav(seed: int = 0) -> Qwen3OmniMoeCode2Wav:
    """The tiny model's code2wav: its convs are re-drawn at build time so the waveform has a realistic
    amplitude (~0.3 peak) and absolute tolerances mean something."""
    return tiny.build_tiny_model(seed).code2wav
