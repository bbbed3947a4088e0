"""Which frames of a video the model sees: `VideoSampling`, Qwen2-VL's rule (`Qwen2VLVideoProcessor.sample_frames`).

Role: shared by the gateway's video decoding (gateway/media_video.py, which keeps only these frames, in a
child process: this module imports torch but not transformers, so that process starts fast) and the
prompt's video processor (video_processor.py). `fps` frames per second of video, at least `min_frames`,
at most `max_frames`, a multiple of `temporal_patch_size`; the indices come from the same `torch.arange`
arithmetic as transformers', so the frames kept are exactly the library's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DEFAULT_FPS = 2.0  # Qwen-Omni's reference video reader samples 2 frames per second
DEFAULT_MIN_FRAMES = 4  # Qwen2VLVideoProcessor.min_frames
DEFAULT_MAX_FRAMES = 768  # Qwen2VLVideoProcessor.max_frames


@dataclass(frozen=True)
class VideoSampling:
    """Which frames of a video the model sees."""

    fps: float = DEFAULT_FPS
    min_frames: int = DEFAULT_MIN_FRAMES
    max_frames: int = DEFAULT_MAX_FRAMES
    temporal_patch_size: int = 2

    def __post_init__(self) -> None:
        if not self.fps > 0:
            raise ValueError(f"video fps must be positive, got {self.fps}")
        if self.temporal_patch_size < 1 or self.min_frames < 1 or self.max_frames < self.temporal_patch_size:
            raise ValueError(f"video sampling needs 1 <= min_frames and temporal_patch_size <= max_frames, got "
                             f"min_frames={self.min_frames} max_frames={self.max_frames} "
                             f"temporal_patch_size={self.temporal_patch_size}")

    def count(self, total_frames: int, native_fps: float) -> int:
        """How many of `total_frames` frames (at `native_fps`) are sampled (`sample_frames`' arithmetic).
        A video shorter than one temporal patch keeps all its frames (patchify repeats the last)."""
        if total_frames < 1:
            raise ValueError("the video has no frames")
        if not native_fps > 0:
            raise ValueError(f"the video's frame rate must be positive, got {native_fps}")
        tps = self.temporal_patch_size
        if total_frames < tps:
            return total_frames
        max_frames = math.floor(min(self.max_frames, total_frames) / tps) * tps
        n = min(max(total_frames / native_fps * self.fps, self.min_frames), max_frames, total_frames)
        return math.floor(n / tps) * tps

    def indices(self, total_frames: int, native_fps: float) -> list[int]:
        """The sampled frame indices, ascending: uniform over the video as `sample_frames` picks them."""
        n = self.count(total_frames, native_fps)
        return torch.arange(0, total_frames, total_frames / n).int().tolist()
