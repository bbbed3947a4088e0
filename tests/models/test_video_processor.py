"""The torchvision-free video processor: Qwen2-VL's frame sampling, sizes and patch layout, through the real
`Qwen3OmniMoeProcessor` (placeholder expansion and video_second_per_grid are the library's).

Checks: sampled indices for short, long, slow and one-frame videos; a clip of one repeated frame gives
exactly the image processor's patches of that frame (the same PIL resize, normalization and patch order,
each temporal pair repeating the frame); every patch row holds the pixels of the frame block the tower
expects (an independent index computation); the settings fall back to preprocessor_config.json and the
Qwen3-Omni processor's video sizes when the folder has no video_preprocessor_config.json.

Run: python -m pytest tests/models/test_video_processor.py -q
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from omnimesh.models.qwen3_omni.processor import Qwen3OmniPromptProcessor, load_processor
from omnimesh.models.qwen3_omni.tiny import build_tiny_qwen3_omni
from omnimesh.models.qwen3_omni.tiny_config import SPECIAL_TOKENS
from omnimesh.models.qwen3_omni.video_processor import VideoFrameProcessor, VideoSampling, video_settings

VIDEO_PAD = SPECIAL_TOKENS["<|video_pad|>"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen3_omni(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture(scope="module")
def processor(folder: Path) -> Qwen3OmniPromptProcessor:
    return load_processor(folder)


@pytest.mark.parametrize(("total", "native_fps", "expected"), [
    (20, 10.0, [0, 5, 10, 15]),  # 2 s at 10 fps: 4 frames at 2 fps
    (8, 10.0, [0, 2, 4, 6]),  # 0.8 s: 1.6 frames at 2 fps, raised to min_frames
    (7, 1.0, [0, 1, 2, 3, 4, 5]),  # 7 s at 1 fps: 14 wanted, 7 exist, rounded down to a multiple of 2
    (1, 25.0, [0]),  # one frame: kept (patchify repeats it to fill the temporal patch)
    (3000, 30.0, [0, 187, 375, 562, 750, 937, 1125, 1312, 1500, 1687, 1875, 2062, 2250, 2437, 2625, 2812]),
    # 100 s at 30 fps: 200 frames wanted, max_frames=16 caps it (uniform over the whole video)
])
def test_sampling_indices(total: int, native_fps: float, expected: list[int]) -> None:
    sampling = VideoSampling(fps=2.0, min_frames=4, max_frames=16)
    assert sampling.indices(total, native_fps) == expected
    with pytest.raises(ValueError, match="no frames"):
        sampling.indices(0, 10.0)
    with pytest.raises(ValueError, match="frame rate"):
        sampling.indices(10, 0.0)


def test_repeated_frame_equals_the_image_processor(processor: Qwen3OmniPromptProcessor) -> None:
    frame = np.random.default_rng(0).integers(0, 256, (48, 80, 3), dtype=np.uint8)  # resized like an image
    video = processor.video_processor(videos=[np.stack([frame] * 4)], return_tensors="pt")
    image = processor.image_processor(images=[Image.fromarray(frame)], return_tensors="pt")
    t, h, w = video["video_grid_thw"][0].tolist()
    assert t == 2 and [1, h, w] == image["image_grid_thw"][0].tolist()
    for k in range(t):  # each temporal pair repeats the frame: exactly the image's patches
        assert torch.equal(video["pixel_values_videos"][k * h * w:(k + 1) * h * w], image["pixel_values"])


def test_patch_rows_hold_the_right_pixels() -> None:
    vp = VideoFrameProcessor(patch_size=2, merge_size=2, temporal_patch_size=2, min_pixels=16, max_pixels=64,
                             image_mean=[0.0] * 3, image_std=[1.0] * 3)
    frames = np.random.default_rng(1).random((3, 3, 8, 4)).astype(np.float32)  # (T, C, h, w): 3 frames
    patches, grid = vp.patchify(frames)
    assert grid == [2, 4, 2]  # the third frame is repeated to fill the second temporal pair
    padded = np.concatenate([frames, frames[-1:]])
    row = 0
    for gt in range(2):
        for bh in range(2):
            for bw in range(1):
                for mh in range(2):
                    for mw in range(2):
                        y, x = (bh * 2 + mh) * 2, (bw * 2 + mw) * 2
                        block = padded[gt * 2:gt * 2 + 2, :, y:y + 2, x:x + 2]  # (tps, C, ps, ps)
                        assert np.array_equal(patches[row], block.transpose(1, 0, 2, 3).reshape(-1))
                        row += 1


def test_processor_expands_video_placeholders(processor: Qwen3OmniPromptProcessor) -> None:
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}]
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    frames = np.random.default_rng(2).integers(0, 256, (6, 120, 160, 3), dtype=np.uint8)
    batch = processor(text=[text], videos=[frames], fps=4.0, return_tensors="pt")
    t, h, w = batch["video_grid_thw"][0].tolist()
    assert t == 3 and h * w * 16 * 16 <= 64 * 64  # VIDEO_MAX_PIXELS of the tiny folder
    assert int((batch["input_ids"][0] == VIDEO_PAD).sum()) == t * h * w // 4
    assert batch["video_second_per_grid"].tolist() == [0.5]  # temporal_patch_size / fps
    assert tuple(batch["pixel_values_videos"].shape) == (t * h * w, 3 * 2 * 16 * 16)
    with pytest.raises(ValueError, match="uint8 RGB frames"):
        processor(text=[text], videos=[frames.astype(np.float32)])


def test_settings_fall_back_to_the_image_config(folder: Path, tmp_path: Path) -> None:
    own = video_settings(folder)
    assert (own["fps"], own["max_frames"], own["max_pixels"], own["patch_size"]) == (2.0, 16, 64 * 64, 16)
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(folder / "preprocessor_config.json", bare)
    fallback = video_settings(bare)
    image_cfg = json.loads((folder / "preprocessor_config.json").read_text())
    assert fallback["patch_size"] == image_cfg["patch_size"] and fallback["image_mean"] == image_cfg["image_mean"]
    assert (fallback["min_pixels"], fallback["max_pixels"]) == (128 * 32 * 32, 768 * 32 * 32)
    assert (fallback["fps"], fallback["min_frames"], fallback["max_frames"]) == (2.0, 4, 768)
