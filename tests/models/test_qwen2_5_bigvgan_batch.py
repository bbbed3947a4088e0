"""Batched BigVGAN (`decode_mels`) gives each request the samples of its solo decode.

Mels of different lengths decoded in one call equal each decoded alone (to float rounding: the convolutions may
sum in another order for another batch size; measured max |diff| ~1e-7 on the tiny model, asserted 1e-6) with
exactly 240 samples per frame; one mel is the module's own forward bit for bit; equal lengths equal solo too; and
the boundary fills matter: plain right-padding differs from solo near the shorter rows' ends by far more.
Windowed (`decode_windowed`): mels cut into pieces of 50 frames, each read with `reach_frames` of context either side,
equal their whole decode to the same tolerance, one piece a call or batched within the call's frame bound; a quarter
of that context moves them.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from omnimesh.models.qwen2_5_omni import bigvgan_windows
from omnimesh.models.qwen2_5_omni.bigvgan_batch import decode_mels
from omnimesh.models.qwen2_5_omni.bigvgan_windows import decode_windowed, reach_frames
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


def test_windowed_equals_whole(bigvgan: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mels decoded in pieces of 50 frames (+ the reach either side) equal their whole decode, one piece a call
    and batched; no call exceeds its bounds; a mel within one window is the module's forward bit for bit."""
    context = reach_frames(bigvgan)
    assert context == 44  # the real checkpoint's kernels, strides and dilations (the tiny one keeps them)
    calls: list[tuple[int, int]] = []

    def counted(module: Any, mels: list[torch.Tensor]) -> list[torch.Tensor]:
        calls.append((len(mels), max(m.shape[-1] for m in mels)))
        return decode_mels(module, mels)

    monkeypatch.setattr(bigvgan_windows, "decode_mels", counted)
    mels = _mels([300, 131, 77, 50, 0], seed=4)
    whole = [_solo(bigvgan, mel) if mel.shape[-1] else torch.zeros(0) for mel in mels]
    for batched in (False, True):
        calls.clear()
        got = decode_windowed(bigvgan, mels, batched, window=50, call_frames=400)
        for mel, wave, want in zip(mels, got, whole):
            assert wave.shape == want.shape == (240 * mel.shape[-1],)
            assert mel.shape[-1] == 0 or (wave - want).abs().max() <= ATOL
        assert all(length <= 50 + 2 * context for _, length in calls)
        assert all(rows == 1 for rows, _ in calls) != batched
        assert all(rows * length <= 400 for rows, length in calls)
        assert sum(rows for rows, _ in calls) == 6 + 3 + 2 + 1 + 1  # the pieces of 300, 131, 77, 50 and 0 frames
    (short,) = decode_windowed(bigvgan, mels[3:4], False, window=50)
    assert torch.equal(short, whole[3])


def test_windows_need_their_context(bigvgan: Any) -> None:
    """The guard: a quarter of the reach as context moves the samples near every seam by far more than ATOL."""
    (mel,) = _mels([300], seed=5)
    (narrow,) = decode_windowed(bigvgan, [mel], False, window=50, context=reach_frames(bigvgan) // 4)
    assert (narrow - _solo(bigvgan, mel)).abs().max() > 100 * ATOL
