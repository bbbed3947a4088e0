"""Batched BigVGAN (`decode_mels`) gives each request the samples of its solo decode.

Mels of different lengths decoded in one call equal each decoded alone (to float rounding: the convolutions may
sum in another order for another batch size; measured max |diff| ~1e-7 on the tiny model, asserted 1e-6) with
exactly 240 samples per frame; one mel is the module's own forward bit for bit; equal lengths equal solo too; and
the boundary fills matter: plain right-padding differs from solo near the shorter rows' ends by far more.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from omnimesh.models.qwen2_5_omni.bigvgan_batch import decode_mels
from omnimesh.models.qwen2_5_omni.tiny import build_tiny_qwen2_5_omni
from omnimesh.models.qwen2_5_omni.token2wav import load_token2wav

ATOL = 1e-6


@pytest.fixture(scope="module")
def bigvgan(tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = build_tiny_qwen2_5_omni(tmp_path_factory.mktemp("q25") / "model")
    return load_token2wav(folder).module.code2wav_bigvgan_model


def _mels(lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(80, n, generator=generator) * 2 - 5 for n in lengths]  # log-mel-like values


@torch.no_grad()
def _solo(bigvgan: Any, mel: torch.Tensor) -> torch.Tensor:
    return bigvgan(mel.unsqueeze(0)).reshape(-1).float()


def test_batched_equals_solo(bigvgan: Any) -> None:
    spf = math.prod(bigvgan.config.upsample_rates)
    assert spf == 240
    mels = _mels([7, 40, 23, 64])
    got = decode_mels(bigvgan, mels)
    for mel, wave in zip(mels, got):
        solo = _solo(bigvgan, mel)
        assert wave.shape == solo.shape == (spf * mel.shape[-1],) and wave.dtype == torch.float32
        assert (wave - solo).abs().max() <= ATOL
    assert got[3].abs().max() > 1e-2  # audible: the comparison is not between near-zeros


def test_single_mel_is_the_module_forward(bigvgan: Any) -> None:
    (mel,) = _mels([31], seed=1)
    (wave,) = decode_mels(bigvgan, [mel.unsqueeze(0)])  # (1, 80, L) is accepted too
    assert torch.equal(wave, _solo(bigvgan, mel))


@torch.no_grad()
def test_naive_right_padding_differs(bigvgan: Any) -> None:
    """The guard: without the fills, the shorter rows' ends are wrong by far more than the tolerance."""
    mels = _mels([7, 40, 23, 64], seed=2)
    padded = torch.stack([torch.nn.functional.pad(mel, (0, 64 - mel.shape[-1]), value=-5.0) for mel in mels])
    naive = bigvgan(padded)
    for row, mel in enumerate(mels[:3]):
        n = 240 * mel.shape[-1]
        tail = (naive[row, :n] - _solo(bigvgan, mel))[-240:].abs().max()
        assert tail > 1000 * ATOL


def test_equal_lengths_equal_solo(bigvgan: Any) -> None:
    mels = _mels([16, 16, 16], seed=3)
    for mel, wave in zip(mels, decode_mels(bigvgan, mels)):
        assert (wave - _solo(bigvgan, mel)).abs().max() <= ATOL
