"""The Qwen2.5-Omni encoder stage (its towers behind `Qwen3OmniEncoder`) equals transformers' thinker.

Reference: `Qwen2_5OmniForConditionalGeneration.from_pretrained(tiny folder).thinker.get_audio_features /
get_image_features`. Ours: the encoder stage's `load_encoder(folder)` (our own towers, `ParallelAudioTower2_5`
and `ParallelVisionTower2_5` on one in-process rank; tests/parallel/test_qwen2_5_{audio,vision}_tower.py split
them over gloo ranks), which reads only the two towers' weights.
Also: one batched tower call (what services/encoder/encoder_batcher.py makes) equals each request alone,
a missing tower weight fails naming the key, and an image grid the merger cannot take is refused.

Run: python -m pytest tests/models/test_qwen2_5_encoder.py -q
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen2_5OmniForConditionalGeneration
from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import _get_feat_extract_output_lengths

from omnimesh.models.qwen2_5_omni.tiny import build_tiny_qwen2_5_omni
from omnimesh.models.qwen3_omni.encoder import Qwen3OmniEncoder
from omnimesh.models.qwen3_omni.stage_loading import load_encoder
from services.encoder.encoder_batcher import EncoderInputs, encode_batch

N_MEL = 128
AUDIO_LENGTHS = (300, 457)  # valid mel frames of two audios (both cross the tower's 200-frame chunks)
GRIDS = [[1, 4, 4], [1, 4, 8]]  # two images: one vision window (window 112 px = 4 merged patches), then two
PATCH_DIM = 3 * 2 * 14 * 14  # C * temporal_patch * patch**2


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen2_5_omni(tmp_path_factory.mktemp("tiny25") / "model")


@pytest.fixture(scope="module")
def thinker(folder: Path) -> Any:
    return Qwen2_5OmniForConditionalGeneration.from_pretrained(folder).thinker.eval()


@pytest.fixture(scope="module")
def encoder(folder: Path) -> Qwen3OmniEncoder:
    return load_encoder(folder)


def audio_batch(lengths: tuple[int, ...], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random mel features padded to the longest (B, n_mel, T_max) + feature_attention_mask (B, T_max)."""
    gen = torch.Generator().manual_seed(seed)
    feats = torch.randn(len(lengths), N_MEL, max(lengths), generator=gen)
    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
        feats[i, :, n:] = 0.0  # what the feature extractor pads with does not matter: the mask drops it
    return feats, mask


def image_batch(grids: list[list[int]], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    grid = torch.tensor(grids, dtype=torch.long)  # (n_images, 3)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(int(grid.prod(-1).sum()), PATCH_DIM, generator=gen), grid  # (sum t*h*w, C*tp*p*p)


def test_audio_embeds_equal_thinker(encoder: Qwen3OmniEncoder, thinker: Any) -> None:
    feats, mask = audio_batch(AUDIO_LENGTHS)
    with torch.no_grad():
        ref = thinker.get_audio_features(feats, feature_attention_mask=mask).last_hidden_state  # (n_tokens, H)
    ours = encoder.encode_audio(feats, mask)
    counts = encoder.audio_output_lengths(torch.tensor(AUDIO_LENGTHS))
    # the processor's count of <|AUDIO|> placeholders (Qwen3-Omni's formula would give [26, 34])
    assert counts.tolist() == _get_feat_extract_output_lengths(torch.tensor(AUDIO_LENGTHS)).tolist() == [75, 114]
    assert ours.shape == ref.shape == (int(counts.sum()), thinker.config.text_config.hidden_size)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)


def test_image_embeds_equal_thinker(encoder: Qwen3OmniEncoder, thinker: Any) -> None:
    pixels, grid = image_batch(GRIDS)
    with torch.no_grad():
        ref = torch.cat(thinker.get_image_features(pixels, image_grid_thw=grid).pooler_output)  # (n_tokens, H)
    embeds, deepstack = encoder.encode_image(pixels, grid)
    assert deepstack == []
    assert encoder.image_token_counts(grid).tolist() == [4, 8]
    assert embeds.shape == ref.shape == (12, thinker.config.text_config.hidden_size)
    torch.testing.assert_close(embeds, ref, rtol=0, atol=1e-5)


def test_one_batched_call_equals_each_request_alone(encoder: Qwen3OmniEncoder) -> None:
    """Request A: one audio + one image; request B: two audios + two images (one of two windows). The
    batcher's single call per tower must give each request what it gets alone."""
    feats_a, mask_a = audio_batch((300,), seed=2)
    feats_b, mask_b = audio_batch((457, 120), seed=3)
    pixels_a, grid_a = image_batch([[1, 4, 8]], seed=4)
    pixels_b, grid_b = image_batch([[1, 4, 4], [1, 8, 12]], seed=5)
    requests = []
    for feats, mask, pixels, grid in ((feats_a, mask_a, pixels_a, grid_a), (feats_b, mask_b, pixels_b, grid_b)):
        frames, lens = encoder.audio_frames(feats, mask)
        requests.append(EncoderInputs(frames, lens, pixels, encoder.check_image(pixels, grid)))
    batched = encode_batch(encoder, requests)
    alone = [encode_batch(encoder, [r])[0] for r in requests]
    for joint, solo in zip(batched, alone):
        assert joint.keys() == solo.keys() and joint.keys() >= {"audio_embeds", "image_embeds"}
        assert not any(k.startswith("deepstack") and v.numel() for k, v in joint.items())
        for key in joint:
            torch.testing.assert_close(joint[key], solo[key], rtol=0, atol=1e-5, msg=key)
    # the solo outputs are the plain encoder's (the batcher adds nothing of its own)
    torch.testing.assert_close(alone[1]["audio_embeds"], encoder.encode_audio(feats_b, mask_b), rtol=0, atol=0)
    torch.testing.assert_close(alone[1]["image_embeds"], encoder.encode_image(pixels_b, grid_b)[0], rtol=0, atol=0)


def test_missing_tower_key_is_named(folder: Path, tmp_path: Path) -> None:
    key = "thinker.audio_tower.layers.1.fc2.weight"
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(folder / "config.json", broken / "config.json")
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors[key]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_encoder(broken)


def test_check_image_refuses_grid_not_divisible_by_merge(encoder: Qwen3OmniEncoder) -> None:
    pixels, grid = image_batch([[1, 4, 6], [1, 3, 4]])
    with pytest.raises(ValueError, match="spatial_merge_size=2"):
        encoder.check_image(pixels, grid)
