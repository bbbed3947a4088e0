"""Qwen3-Omni video preprocessing without torchvision: frame sampling and frames -> vision patches.

Role: fills the `video_processor` slot of `Qwen3OmniMoeProcessor`, which transformers only offers as
`Qwen2VLVideoProcessor` (torchvision tensors; torchvision does not import beside the CPU torch here, see
shared/MODELS.md). The rules are that class's:
- sampling (`VideoSampling.indices`, `Qwen2VLVideoProcessor.sample_frames` with `fps`): `fps` frames per
  second of video, at least `min_frames`, at most `max_frames`, a multiple of `temporal_patch_size`;
- resizing: one `smart_resize` size per video (a multiple of patch_size * merge_size, area within the
  video's min/max pixels), rescale, normalize — done per frame by the PIL image processor's own methods
  (`Qwen2VLImageProcessorPil.resize / rescale / normalize`, bicubic like Qwen2-VL's images);
- patchify: frames grouped by `temporal_patch_size` (the last frame repeated to fill a group), patches in
  merge-block order, exactly the layout of `Qwen2VLVideoProcessor.patchify`.
Resizing goes through PIL where torchvision's tensor bicubic would run: the pixels differ in the last
bits from a GPU server that uses torchvision, like our images do.

Data flow:
    video file -> gateway/media_video.py (PyAV; decodes only `VideoSampling.indices` frames)
      -> frames (T, H, W, 3) uint8 RGB + the sampling fps
      -> VideoFrameProcessor(videos=[frames, ...]) -> pixel_values_videos (sum t*h*w, C*tps*ps*ps) float32,
         video_grid_thw (n_videos, 3) int64
      -> Qwen3OmniMoeProcessor: `<|video_pad|>` x t*h*w / merge**2 per video, video_second_per_grid =
         temporal_patch_size / fps
Settings come from `video_preprocessor_config.json` when the model folder has one, else from
`preprocessor_config.json` with the Qwen3-Omni processor's video size defaults (`video_settings`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import numpy as np
from transformers import BatchFeature, Qwen2VLImageProcessorPil
from transformers.image_processing_utils import SizeDict
from transformers.image_utils import PILImageResampling
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import Qwen3OmniMoeProcessor

from omnimesh.models.qwen3_omni.video_sampling import (DEFAULT_FPS, DEFAULT_MAX_FRAMES, DEFAULT_MIN_FRAMES,
                                                        VideoSampling)

__all__ = ["VideoFrameProcessor", "VideoSampling", "video_settings"]

def video_settings(model_dir: Path) -> dict[str, Any]:
    """The video processor's settings of a model folder (see the module docstring for the sources)."""
    video_cfg = model_dir / "video_preprocessor_config.json"
    image_cfg = json.loads((model_dir / "preprocessor_config.json").read_text(encoding="utf-8"))
    cfg = json.loads(video_cfg.read_text(encoding="utf-8")) if video_cfg.is_file() else {}
    size = cfg.get("size") or dict(cast(dict[str, int], Qwen3OmniMoeProcessor.videos_kwargs["size"]))
    get = lambda key, default: cfg.get(key, image_cfg.get(key, default))  # noqa: E731
    return {
        "patch_size": int(get("patch_size", 14)), "merge_size": int(get("merge_size", 2)),
        "temporal_patch_size": int(get("temporal_patch_size", 2)),
        "min_pixels": int(cfg.get("min_pixels", size["shortest_edge"])),
        "max_pixels": int(cfg.get("max_pixels", size["longest_edge"])),
        "image_mean": list(get("image_mean", [0.48145466, 0.4578275, 0.40821073])),
        "image_std": list(get("image_std", [0.26862954, 0.26130258, 0.27577711])),
        "fps": float(cfg.get("fps") or DEFAULT_FPS),
        "min_frames": int(cfg.get("min_frames", DEFAULT_MIN_FRAMES)),
        "max_frames": int(cfg.get("max_frames", DEFAULT_MAX_FRAMES)),
    }


class VideoFrameProcessor:
    """The processor's `video_processor`: sampled RGB frames -> `pixel_values_videos`, `video_grid_thw`."""

    model_input_names = ["pixel_values_videos", "video_grid_thw"]

    def __init__(self, *, patch_size: int, merge_size: int, temporal_patch_size: int, min_pixels: int,
                 max_pixels: int, image_mean: list[float], image_std: list[float], fps: float = DEFAULT_FPS,
                 min_frames: int = DEFAULT_MIN_FRAMES, max_frames: int = DEFAULT_MAX_FRAMES) -> None:
        self.patch_size = patch_size
        self.merge_size = merge_size
        self.temporal_patch_size = temporal_patch_size
        self.sampling = VideoSampling(fps=fps, min_frames=min_frames, max_frames=max_frames,
                                      temporal_patch_size=temporal_patch_size)
        self.size = SizeDict(shortest_edge=min_pixels, longest_edge=max_pixels)
        self.image_mean, self.image_std = image_mean, image_std
        # the frame-level steps (smart_resize + PIL bicubic, rescale, normalize) are the image processor's
        self._frames = Qwen2VLImageProcessorPil(patch_size=patch_size, merge_size=merge_size,
                                                temporal_patch_size=temporal_patch_size, min_pixels=min_pixels,
                                                max_pixels=max_pixels, image_mean=image_mean, image_std=image_std)

    @classmethod
    def from_pretrained(cls, model_dir: Path | str) -> VideoFrameProcessor:
        return cls(**video_settings(Path(model_dir)))

    def token_count(self, video: np.ndarray) -> int:
        """`<|video_pad|>` tokens a video (T, H, W, 3) becomes, from its shape alone (no pixel is touched):
        lets a caller refuse a video that cannot fit before paying for its resizing."""
        t, h, w = video.shape[:3]
        ps, m = self.patch_size, self.merge_size
        rh, rw = smart_resize(h, w, factor=ps * m, min_pixels=int(self.size.shortest_edge or 0),
                              max_pixels=int(self.size.longest_edge or 0))
        return -(-t // self.temporal_patch_size) * (rh // ps) * (rw // ps) // m**2

    def _frames_chw(self, video: np.ndarray) -> np.ndarray:
        """(T, H, W, 3) uint8 -> resized, normalized (T, 3, h, w) float32."""
        if video.ndim != 4 or video.shape[-1] != 3 or video.shape[0] < 1 or video.dtype != np.uint8:
            raise ValueError(f"a video must be uint8 RGB frames (T >= 1, H, W, 3), got {video.shape} {video.dtype}")
        factor = self.patch_size * self.merge_size
        out = []
        for frame in video:
            chw = np.ascontiguousarray(frame.transpose(2, 0, 1))  # (3, H, W)
            chw = self._frames.resize(chw, size=self.size, resample=PILImageResampling.BICUBIC, factor=factor)
            chw = self._frames.rescale(chw, 1 / 255)
            out.append(self._frames.normalize(chw, self.image_mean, self.image_std))
        return np.stack(out).astype(np.float32)  # (T, 3, h, w)

    def patchify(self, frames: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """(T, C, h, w) -> patches (t*gh*gw, C*tps*ps*ps) in the vision tower's order, and [t, gh, gw]."""
        tps, ps, m = self.temporal_patch_size, self.patch_size, self.merge_size
        if pad := -frames.shape[0] % tps:
            frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
        t, c, h, w = frames.shape
        gt, gh, gw = t // tps, h // ps, w // ps
        patches = frames.reshape(gt, tps, c, gh // m, m, ps, gw // m, m, ps)
        patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # gt, bh, bw, mh, mw, C, tps, ps, ps
        return patches.reshape(gt * gh * gw, c * tps * ps * ps), [gt, gh, gw]

    def __call__(self, videos: Any, return_tensors: str | None = None, **_: Any) -> BatchFeature:
        """Already sampled videos (each (T, H, W, 3) uint8) -> pixel_values_videos, video_grid_thw."""
        videos = [videos] if isinstance(videos, np.ndarray) and videos.ndim == 4 else list(videos)
        patches, grids = [], []
        for video in videos:
            p, grid = self.patchify(self._frames_chw(np.asarray(video)))
            patches.append(p)
            grids.append(grid)
        return BatchFeature(data={"pixel_values_videos": np.concatenate(patches),
                                  "video_grid_thw": np.asarray(grids, dtype=np.int64)}, tensor_type=return_tensors)
