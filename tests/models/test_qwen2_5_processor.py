"""The Qwen2.5-Omni prompt processor (omnimesh/models/qwen3_omni/processor.py) on the tiny Qwen2.5-Omni folder.

Checks: `load_processor` picks the class from config.json `model_type` (Qwen2.5-Omni and Qwen3-Omni tiny
folders) and names the supported types otherwise; text + two audio clips + an image give exactly the batch of
transformers' own `Qwen2_5OmniProcessor` built from the same parts, and the placeholder counts of the 2.5
formulas; a video with its soundtrack (`load_audio_from_video`) is laid out chunk by chunk as the 2.5 rule
says, with the library's default `seconds_per_chunk` / `position_id_per_seconds` and with one passed in; a
folder without video_preprocessor_config.json gets Qwen2.5-Omni's own video frame area.

The library class as is cannot be built here: `ProcessorMixin.__init__` type-checks the video slot against
transformers' video processor classes, which need torchvision (it fails with "VIDEO_PROCESSOR_MAPPING has no
attribute '_extra_content'"). `LibraryProcessor` changes only that check; its own `__init__` and every method
that makes the batch are the library's, so it is an independent reference for our class, whose `__init__`
is ours.

Run: python -m pytest tests/models/test_qwen2_5_processor.py -q
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import Qwen2_5OmniProcessor
from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import Qwen3OmniMoeProcessor

from omnimesh.models.qwen2_5_omni.tiny import build_tiny_qwen2_5_omni
from omnimesh.models.qwen3_omni.processor import (
    Qwen2_5OmniPromptProcessor,
    Qwen3OmniPromptProcessor,
    load_processor,
    processor_class,
)
from omnimesh.models.qwen3_omni.tiny import build_tiny_qwen3_omni

RATE = 16000


class LibraryProcessor(Qwen2_5OmniProcessor):
    """transformers' `Qwen2_5OmniProcessor`, but for the video slot's type check (see the module docstring)."""

    def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
        if argument_name == "video_processor":
            return type(argument)
        return super().check_argument_for_proper_class(argument_name, argument)


def audio_tokens(mel_frames: int) -> int:
    """Qwen2.5-Omni's audio encoder output length for `mel_frames` (two stride-2 steps)."""
    return (((mel_frames - 1) // 2 + 1) - 2) // 2 + 1


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = build_tiny_qwen2_5_omni(tmp_path_factory.mktemp("tiny25") / "model")
    # the builder's video config: frames of area in [28*28, 56*56], so a 56x56 frame stays 56x56 (4x4 patches
    # of 14 -> 4 tokens per pair of frames)
    assert json.loads((out / "video_preprocessor_config.json").read_text())["max_pixels"] == 56 * 56
    return out


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen3_omni(tmp_path_factory.mktemp("tiny3") / "model")


@pytest.fixture(scope="module")
def processor(folder: Path) -> Qwen2_5OmniPromptProcessor:
    built = load_processor(folder)
    assert isinstance(built, Qwen2_5OmniPromptProcessor)
    return built


@pytest.fixture(scope="module")
def library(processor: Qwen2_5OmniPromptProcessor) -> LibraryProcessor:
    return LibraryProcessor(image_processor=processor.image_processor, video_processor=processor.video_processor,
                            feature_extractor=processor.feature_extractor, tokenizer=processor.tokenizer,
                            chat_template=processor.chat_template)


def prompt(processor: Qwen2_5OmniPromptProcessor, *parts: str) -> str:
    content = [{"type": p} for p in parts] + [{"type": "text", "text": "What is this?"}]
    text = processor.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                   add_generation_prompt=True)
    return str(text)


def tokens(processor: Qwen2_5OmniPromptProcessor, ids: torch.Tensor) -> list[str]:
    return [str(t) for t in processor.tokenizer.convert_ids_to_tokens(ids.tolist())]


def test_the_class_follows_the_model_type(folder: Path, qwen3_folder: Path,
                                          processor: Qwen2_5OmniPromptProcessor) -> None:
    assert processor_class(folder) is Qwen2_5OmniPromptProcessor
    assert isinstance(processor, Qwen2_5OmniProcessor) and not isinstance(processor, Qwen3OmniMoeProcessor)
    assert (processor.audio_token, processor.image_token, processor.video_token) == ("<|AUDIO|>", "<|IMAGE|>",
                                                                                     "<|VIDEO|>")
    assert processor.video_processor.patch_size == 14
    assert processor_class(qwen3_folder) is Qwen3OmniPromptProcessor
    qwen3 = load_processor(qwen3_folder)
    assert isinstance(qwen3, Qwen3OmniPromptProcessor) and isinstance(qwen3, Qwen3OmniMoeProcessor)
    assert not isinstance(qwen3, Qwen2_5OmniProcessor) and qwen3.audio_token == "<|audio_pad|>"


def test_text_audio_image_equal_transformers(processor: Qwen2_5OmniPromptProcessor,
                                             library: LibraryProcessor) -> None:
    text = prompt(processor, "audio", "image", "audio")
    rng = np.random.default_rng(0)
    waves = [rng.uniform(-0.5, 0.5, n).astype(np.float32) for n in (24000, 11200)]  # 1.5 s, 0.7 s
    image = Image.fromarray(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8))
    ours = processor(text=[text], audio=waves, images=[image], return_tensors="pt")
    theirs = library(text=[text], audio=waves, images=[image], return_tensors="pt")
    keys = ["input_ids", "attention_mask", "input_features", "feature_attention_mask", "pixel_values",
            "image_grid_thw"]
    assert sorted(ours) == sorted(theirs) == sorted(keys)
    for key in keys:
        assert ours[key].shape == theirs[key].shape and torch.equal(ours[key], theirs[key]), key
    # and the 2.5 formulas: 100 mel frames a second; a 56x56 image is 4x4 patches of 14 -> 4 tokens
    frames = ours["feature_attention_mask"].sum(-1).tolist()
    assert frames == [150, 70]
    seq = tokens(processor, ours["input_ids"][0])
    starts = [i + 1 for i, t in enumerate(seq) if t == "<|audio_bos|>"]
    spans = [seq[i:seq.index("<|audio_eos|>", i)] for i in starts]  # each clip's placeholders, in prompt order
    assert all(set(span) == {"<|AUDIO|>"} for span in spans)
    assert [len(span) for span in spans] == [audio_tokens(n) for n in frames] == [37, 17]
    assert ours["image_grid_thw"].tolist() == [[1, 4, 4]] and seq.count("<|IMAGE|>") == 4
    assert tuple(ours["pixel_values"].shape) == (16, 3 * 2 * 14 * 14)


def test_video_soundtrack_interleaves_by_chunks(processor: Qwen2_5OmniPromptProcessor,
                                                library: LibraryProcessor) -> None:
    """8 frames at 2 fps: 4 temporal grids of 1 s; a 5 s soundtrack: 125 audio tokens. 2.5's rule: position
    ids at 25 a second, cut into chunks of `seconds_per_chunk`; per chunk its video tokens, then its audio."""
    text = prompt(processor, "video")
    frames = np.random.default_rng(1).integers(0, 256, (8, 56, 56, 3), dtype=np.uint8)
    sound = np.random.default_rng(2).uniform(-0.5, 0.5, 5 * RATE).astype(np.float32)
    kwargs: dict[str, Any] = {"videos": [frames], "audio": [sound], "audio_from_video_indices": [0],
                              "return_tensors": "pt"}
    batch = processor(text=text, load_audio_from_video=True, **kwargs)  # fps, chunk, position rate: defaults
    assert batch["video_grid_thw"].tolist() == [[4, 4, 4]]  # 56x56 frames stay 56x56 (the tiny video config)
    assert batch["video_second_per_grid"].tolist() == [1.0]  # temporal_patch_size 2 / 2 fps
    assert int(batch["feature_attention_mask"].sum()) == 500 and audio_tokens(500) == 125
    per_grid = 4 * 4 // 4

    def layout(seconds_per_chunk: float) -> list[str]:
        chunk = int(25 * seconds_per_chunk)  # position ids per chunk
        grid_chunks = [int(g * 1.0 * 25) // chunk for g in range(4)]  # grid g starts at g s
        audio_chunks = [i // chunk for i in range(125)]  # audio token i is at position id i
        out = ["<|audio_bos|>"]
        for j in range(max(grid_chunks + audio_chunks) + 1):
            out += ["<|VIDEO|>"] * per_grid * grid_chunks.count(j) + ["<|AUDIO|>"] * audio_chunks.count(j)
        return out + ["<|audio_eos|>"]

    def placeholders(ids: torch.Tensor) -> list[str]:
        seq = tokens(processor, ids[0])
        return seq[seq.index("<|vision_bos|>") + 1:seq.index("<|vision_eos|>")]

    expected = layout(2.0)
    assert expected[:2 + 2 * per_grid] == ["<|audio_bos|>"] + ["<|VIDEO|>"] * 2 * per_grid + ["<|AUDIO|>"]
    assert placeholders(batch["input_ids"]) == expected
    assert torch.equal(batch["input_ids"], library(text=text, load_audio_from_video=True, **kwargs)["input_ids"])
    old_name = processor(text=text, use_audio_in_video=True, **kwargs)  # the deprecated flag, translated by us
    assert torch.equal(old_name["input_ids"], batch["input_ids"])

    one_second = processor(text=text, load_audio_from_video=True, seconds_per_chunk=1.0, **kwargs)
    assert placeholders(one_second["input_ids"]) == layout(1.0) != expected
    alone = processor(text=text, videos=[frames], return_tensors="pt")  # no soundtrack: the video tokens only
    assert placeholders(alone["input_ids"]) == ["<|VIDEO|>"] * 4 * per_grid
    with pytest.raises(ValueError, match="soundtracks already decoded"):
        processor(text=text, videos=[frames], load_audio_from_video=True)


def test_without_a_video_config_the_frame_area_is_qwen2_5s(folder: Path, qwen3_folder: Path, tmp_path: Path) -> None:
    """No video_preprocessor_config.json: transformers then sizes frames by the processor class's
    `videos_kwargs` (128..768 x 28*28 pixels for 2.5, x 32*32 for Qwen3-Omni)."""
    for source, name in ((folder, "q25"), (qwen3_folder, "q3")):
        bare = tmp_path / name
        bare.mkdir()
        for file in ("config.json", "preprocessor_config.json", "tokenizer.json", "tokenizer_config.json",
                     "chat_template.jinja"):
            shutil.copy(source / file, bare)
    q25, q3 = load_processor(tmp_path / "q25"), load_processor(tmp_path / "q3")
    size = q25.video_processor.size
    assert (size.shortest_edge, size.longest_edge) == (128 * 28 * 28, 768 * 28 * 28)
    assert q25.video_processor.patch_size == 14 and q25.video_processor.sampling.fps == 2.0
    size = q3.video_processor.size
    assert (size.shortest_edge, size.longest_edge) == (128 * 32 * 32, 768 * 32 * 32)
    small = load_processor(tmp_path / "q25", {"max_pixels": 56 * 56, "min_pixels": 28 * 28})  # overrides still win
    assert (small.video_processor.size.shortest_edge, small.video_processor.size.longest_edge) == (28 * 28, 56 * 56)


def test_unknown_or_missing_model_type_is_refused(folder: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(folder / "preprocessor_config.json", other)
    (other / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    with pytest.raises(ValueError, match=r"model_type 'qwen2_vl'.*'qwen3_omni_moe' or 'qwen2_5_omni'"):
        load_processor(other)
    (other / "config.json").unlink()
    with pytest.raises(ValueError, match=r"no config.json; is it a Qwen3-Omni or Qwen2.5-Omni model folder\?"):
        load_processor(other)
