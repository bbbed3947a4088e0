"""The tiny Qwen3-Omni folder: byte-identical builds, offline loading, sane weights, generate, processor."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from transformers import (
    AutoTokenizer,
    Qwen2VLImageProcessor,
    Qwen3OmniMoeForConditionalGeneration,
    WhisperFeatureExtractor,
)
from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import (
    Qwen3OmniMoeProcessor,
    _get_feat_extract_output_lengths,
)

from omnimesh.models.qwen3_omni.processor import Qwen3OmniPromptProcessor, load_processor
from omnimesh.models.qwen3_omni.tiny import FOLDER_FILES, build_tiny_model, build_tiny_qwen3_omni
from omnimesh.models.qwen3_omni.tiny_config import ROLE_TOKENS, SPECIAL_TOKENS

AUDIO_PAD = SPECIAL_TOKENS["<|audio_pad|>"]
IMAGE_PAD = SPECIAL_TOKENS["<|image_pad|>"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen3_omni(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def model(folder: Path) -> Qwen3OmniMoeForConditionalGeneration:
    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(folder, local_files_only=True).eval()


@pytest.fixture(scope="module")
def processor(folder: Path) -> Qwen3OmniPromptProcessor:
    return load_processor(folder)


def test_folder_holds_the_expected_files(folder: Path) -> None:
    assert sorted(p.name for p in folder.iterdir()) == sorted(FOLDER_FILES)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen3_omni_moe"
    assert config["im_end_token_id"] == SPECIAL_TOKENS["<|im_end|>"]
    gen = json.loads((folder / "generation_config.json").read_text())
    assert gen["do_sample"] is False and SPECIAL_TOKENS["<|im_end|>"] in gen["eos_token_id"]
    pre = json.loads((folder / "preprocessor_config.json").read_text())
    assert pre["processor_class"] == "Qwen3OmniMoeProcessor"
    assert pre["feature_extractor_type"] == "WhisperFeatureExtractor"
    assert pre["image_processor_type"] == "Qwen2VLImageProcessor"


def test_two_builds_are_byte_identical(folder: Path, tmp_path: Path) -> None:
    again = build_tiny_qwen3_omni(tmp_path / "again", seed=0)
    for name in FOLDER_FILES:
        assert (again / name).read_bytes() == (folder / name).read_bytes(), name
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_another_seed_changes_only_the_weights(folder: Path, tmp_path: Path) -> None:
    other = build_tiny_qwen3_omni(tmp_path / "seed1", seed=1)
    differ = sorted(n for n in FOLDER_FILES if (other / n).read_bytes() != (folder / n).read_bytes())
    assert differ == ["model.safetensors"]


def test_build_leaves_the_callers_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_refuses_a_folder_with_foreign_files(tmp_path: Path) -> None:
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"stale")
    with pytest.raises(ValueError, match="does not write"):
        build_tiny_qwen3_omni(tmp_path)


def test_from_pretrained_gives_the_built_weights(model: Qwen3OmniMoeForConditionalGeneration) -> None:
    ref = build_tiny_model(seed=0).state_dict()
    got = model.state_dict()
    assert got.keys() == ref.keys()
    different = [k for k in ref if not torch.equal(got[k], ref[k])]
    assert different == []


def test_weights_are_finite_and_initialised(model: Qwen3OmniMoeForConditionalGeneration) -> None:
    std = model.config.talker_config.text_config.initializer_range
    for name, tensor in model.state_dict().items():
        if not tensor.is_floating_point():
            continue
        assert torch.isfinite(tensor).all(), name
        assert tensor.abs().max() < 100, name  # torch.empty garbage reaches 1e30
    experts = {n: p.detach() for n, p in model.named_parameters()
               if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))}
    assert any(n.startswith("talker.") for n in experts) and any(n.startswith("thinker.") for n in experts)
    for name, p in experts.items():
        assert 0.5 * std < float(p.std()) < 1.5 * std, name
        assert abs(float(p.mean())) < 0.2 * std, name


def test_sub_processors_load_offline(folder: Path) -> None:
    fe = WhisperFeatureExtractor.from_pretrained(folder, local_files_only=True)
    assert (fe.feature_size, fe.sampling_rate, fe.hop_length, fe.n_fft) == (128, 16000, 160, 400)
    ip = Qwen2VLImageProcessor.from_pretrained(folder, local_files_only=True)
    assert (ip.patch_size, ip.merge_size, ip.temporal_patch_size) == (16, 2, 2)
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert tok.chat_template is not None and len(tok) == 512


def test_processor_expands_placeholders_like_the_real_one(processor: Qwen3OmniPromptProcessor) -> None:
    assert isinstance(processor, Qwen3OmniMoeProcessor)
    messages = [{"role": "user", "content": [
        {"type": "audio", "audio": "a.wav"}, {"type": "image", "image": "b.png"}, {"type": "text", "text": "Hi"},
    ]}]
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    wave = np.sin(np.arange(24000) / 16000 * 2 * np.pi * 440).astype(np.float32)  # 1.5 s
    batch = processor(text=[text], audio=[wave], images=[Image.new("RGB", (64, 64), (200, 30, 30))],
                      return_tensors="pt")
    assert set(batch) == {"input_ids", "attention_mask", "input_features", "feature_attention_mask",
                          "pixel_values", "image_grid_thw"}
    ids = batch["input_ids"][0]
    n_frames = int(batch["feature_attention_mask"].sum())
    assert n_frames == 150
    assert int((ids == AUDIO_PAD).sum()) == int(_get_feat_extract_output_lengths(torch.tensor(n_frames)))
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4]]  # 64x64 stays 64x64: 4x4 patches of 16
    assert int((ids == IMAGE_PAD).sum()) == 16 // 4
    assert tuple(batch["pixel_values"].shape) == (16, 3 * 2 * 16 * 16)
    assert ids[-2].item() == ROLE_TOKENS["assistant"]


def test_processor_refuses_undecoded_soundtracks_and_wrong_rate(processor: Qwen3OmniPromptProcessor) -> None:
    with pytest.raises(ValueError, match="soundtracks already decoded"):  # transformers would need torchcodec
        processor(text="<|vision_start|><|video_pad|><|vision_end|>", videos=[np.zeros((2, 32, 32, 3), np.uint8)],
                  use_audio_in_video=True)
    with pytest.raises(ValueError, match="resample"):
        processor(text="<|audio_start|><|audio_pad|><|audio_end|>", audio=[np.zeros(8000)], sampling_rate=8000)


def test_generate_greedy_text_and_audio(model: Qwen3OmniMoeForConditionalGeneration,
                                        processor: Qwen3OmniPromptProcessor) -> None:
    text = processor.tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}],
                                                   tokenize=False, add_generation_prompt=True)
    inputs = processor(text=text, return_tensors="pt")
    kwargs: dict[str, Any] = dict(thinker_eos_token_id=model.config.im_end_token_id, thinker_max_new_tokens=6,
                                  talker_max_new_tokens=6, talker_do_sample=False)
    with torch.no_grad():
        first = model.generate(**inputs, return_audio=False, **kwargs)
        again = model.generate(**inputs, return_audio=False, **kwargs)
        sequences, audio = model.generate(**inputs, return_audio=True, speaker="Ethan", **kwargs)
    n_prompt = inputs["input_ids"].shape[1]
    assert torch.equal(first, again)
    assert n_prompt < first.shape[1] <= n_prompt + 6
    assert torch.equal(first[0, :n_prompt], inputs["input_ids"][0])
    assert torch.equal(sequences, first)
    assert audio.numel() > 0 and torch.isfinite(audio).all()


def test_generate_with_audio_and_image_inputs(model: Qwen3OmniMoeForConditionalGeneration,
                                              processor: Qwen3OmniPromptProcessor) -> None:
    messages = [{"role": "user", "content": [
        {"type": "image", "image": "x"}, {"type": "audio", "audio": "y"}, {"type": "text", "text": "What?"},
    ]}]
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    wave = np.random.default_rng(0).uniform(-0.5, 0.5, 40000).astype(np.float32)  # 2.5 s: crosses a window
    inputs = processor(text=text, images=[Image.new("RGB", (96, 64), (0, 90, 200))], audio=[wave],
                       return_tensors="pt")
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 6]]
    with torch.no_grad():
        out = model.generate(**inputs, return_audio=False, thinker_eos_token_id=model.config.im_end_token_id,
                             thinker_max_new_tokens=4)
    assert out.shape[1] > inputs["input_ids"].shape[1]


def test_the_thinker_only_build_is_laid_out_as_a_thinking_checkpoint(folder: Path, tmp_path: Path) -> None:
    """`omnimesh make-tiny --thinker-only`: config `enable_audio_output: false`, weights `thinker.*` only and equal to the full
    build's, `<think>` / `</think>` as added tokens decoded as text; the stages it has; transformers loads it
    without a talker."""
    from omnimesh.models.qwen3_omni.checkpoint_stages import model_stages
    from omnimesh.models.qwen3_omni.tiny_config import THINK_TOKENS

    from omnimesh.cli import main

    out = tmp_path / "thinking"
    assert main(["make-tiny", "--family", "qwen3-omni", "--out", str(out), "--thinker-only"]) == 0  # the command
    assert json.loads((out / "config.json").read_text())["enable_audio_output"] is False
    with safe_open(str(out / "model.safetensors"), "pt") as f, safe_open(str(folder / "model.safetensors"), "pt") as g:
        keys = list(f.keys())
        assert keys and all(k.startswith("thinker.") for k in keys)
        assert sorted(keys) == sorted(k for k in g.keys() if k.startswith("thinker."))
        assert all(torch.equal(f.get_tensor(k), g.get_tensor(k)) for k in keys)
    assert model_stages(out) == ("encoder", "thinker") and model_stages(folder) == ("encoder", "thinker", "talker", "vocoder")
    tok, full = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(folder)
    ids = tok.encode("<think>\nhm</think>ok", add_special_tokens=False)
    assert ids[0] == THINK_TOKENS["<think>"] and THINK_TOKENS["</think>"] in ids
    assert tok.decode(ids, skip_special_tokens=True) == "<think>\nhm</think>ok"
    assert tok.encode("The sea is calm.") == full.encode("The sea is calm.")
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(out)
    assert not model.has_talker and not hasattr(model, "talker")
