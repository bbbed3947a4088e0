"""Streaming code2wav equals one-piece decoding: same length (n * 1920 - 555), values within 1e-5.

Uses `audible_code2wav` (tiny config, convs re-drawn so the waveform has a realistic ~0.35 peak), because the
default random init gives ~1e-6 audio where any absolute tolerance would pass trivially.

Run: python -m pytest tests/models/test_code2wav_stream.py -q
"""

from __future__ import annotations

import pytest
import torch
from qwen3_omni_fixtures import audible_code2wav, torch_threads

from omnimesh.models.qwen3_omni.code2wav import Code2WavStreamer, conv_left_context, stream_decode


@pytest.fixture(scope="module", autouse=True)
def one_thread():  # type: ignore[no-untyped-def]
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def code2wav(one_thread):  # type: ignore[no-untyped-def]
    return audible_code2wav()


def random_codes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (4, n), generator=torch.Generator().manual_seed(seed))  # (Q, n)


def one_piece(code2wav, codes: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        return code2wav(codes.unsqueeze(0)).view(-1)  # (n * 1920 - 555,)


def test_left_context_is_derived_from_modules(code2wav) -> None:  # type: ignore[no-untyped-def]
    # upsample x2 x2 (ConvNeXt k7) + decoder k7 + 4 blocks (trans conv 2r/r, dilations 1,3,9) + k7: 10 frames
    assert conv_left_context(code2wav) == 10
    assert int(code2wav.total_upsample) == 1920


def test_reference_is_audible(code2wav) -> None:  # type: ignore[no-untyped-def]
    ref = one_piece(code2wav, random_codes(40))
    assert ref.shape == (40 * 1920 - 555,)
    assert 0.05 < float(ref.abs().max()) < 1.0  # realistic amplitude, not clamped flat


@pytest.mark.parametrize("window,n_codes", [(1, 40), (7, 210), (25, 210), (50, 210), (200, 210)])
def test_stream_equals_one_piece(code2wav, window: int, n_codes: int) -> None:  # type: ignore[no-untyped-def]
    codes = random_codes(n_codes, seed=window)
    ref = one_piece(code2wav, codes)
    pieces = stream_decode(code2wav, codes, window)
    out = torch.cat(pieces)
    assert out.shape == ref.shape == (n_codes * 1920 - 555,)
    assert float((out - ref).abs().max()) <= 1e-5
    # audio leaves as soon as it is final: every full window emits, the flush only the remainder
    full_windows = n_codes // window
    assert all(p.numel() > 0 for p in pieces[:full_windows])
    assert pieces[0].numel() == min(window, n_codes) * 1920 - 555


def test_too_little_context_is_wrong(code2wav) -> None:  # type: ignore[no-untyped-def]
    codes = random_codes(60, seed=3)
    ref = one_piece(code2wav, codes)
    out = torch.cat(stream_decode(code2wav, codes, 7, left_context=0))
    assert out.shape == ref.shape
    assert float((out - ref).abs().max()) > 1e-3


def test_uneven_feeds_and_window_holding(code2wav) -> None:  # type: ignore[no-untyped-def]
    codes = random_codes(53, seed=5)
    ref = one_piece(code2wav, codes)
    streamer = Code2WavStreamer(code2wav, window=10)
    out: list[torch.Tensor] = []
    start = 0
    for size in (3, 4, 1, 12, 0, 9, 24):
        piece = streamer.feed(codes[:, start : start + size])
        start += size
        out.append(piece)
    assert out[0].numel() == 0 and out[1].numel() == 0  # 3 then 7 pending: below the window of 10
    out.append(streamer.flush())
    assert start == 53 and streamer.emitted_samples == 53 * 1920 - 555
    assert float((torch.cat(out) - ref).abs().max()) <= 1e-5
    assert streamer.flush().numel() == 0


def test_rejects_bad_input(code2wav) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="num_quantizers"):
        Code2WavStreamer(code2wav).feed(torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="window"):
        Code2WavStreamer(code2wav, window=0)
