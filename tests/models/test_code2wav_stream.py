"""Streaming code2wav equals one-piece decoding: same length (n * 1920 - 555), values within 1e-5.

Uses `audible_code2wav` (tiny config, convs re-drawn so the waveform has a realistic ~0.35 peak), because the
default random init gives ~1e-6 audio where any absolute tolerance would pass trivially.

Run: python -m pytest tests/models/test_code2wav_stream.py -q
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from qwen3_omni_fixtures import audible_code2wav, torch_threads

from omnimesh.kernels import cpu_kernels
from omnimesh.models.qwen3_omni import snake_kernel
from omnimesh.models.qwen3_omni.code2wav import Code2WavStreamer, stream_decode


@pytest.fixture(scope="module", autouse=True)
def one_thread():  # type: ignore[no-untyped-def]
    with torch_threads(1):
        yield


@pytest.fixture(scope="module", params=["eager", "compiled", "fused"], autouse=True)
def kernel(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test runs with eager PyTorch math (SnakeBeta and the pre-transformer's ops), with the compiled
    SnakeBeta kernel, and with omnimesh's fused CPU kernels (what a vocoder stage runs on CPU)."""
    before = snake_kernel._active
    if request.param == "fused":
        assert cpu_kernels.load()
        yield request.param
        return
    with cpu_kernels.disabled():
        if request.param == "compiled":
            assert snake_kernel.compile_snake("cpu")
        else:
            snake_kernel.use_eager()
        yield request.param
    snake_kernel._active = before


@pytest.fixture(scope="module")
def code2wav(one_thread):  # type: ignore[no-untyped-def]
    return audible_code2wav()


def random_codes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (4, n), generator=torch.Generator().manual_seed(seed))  # (Q, n)


def one_piece(code2wav, codes: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        return code2wav(codes.unsqueeze(0)).view(-1)  # (n * 1920 - 555,)


def test_each_window_runs_the_convs_on_its_new_frames_only(code2wav) -> None:  # type: ignore[no-untyped-def]
    """No frame goes through the conv stack twice: the convs keep state instead of re-reading context."""
    assert int(code2wav.total_upsample) == 1920
    seen: list[int] = []
    hook = code2wav.upsample[0][0].register_forward_hook(lambda _m, args, _out: seen.append(args[0].shape[-1]))
    try:
        stream_decode(code2wav, random_codes(64, seed=1), 25)
    finally:
        hook.remove()
    assert seen == [25, 25, 14]


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


def test_forgetting_the_conv_state_is_audible(code2wav) -> None:  # type: ignore[no-untyped-def]
    """The comparisons above would see a state kept at the wrong length: dropping it moves the audio far."""
    codes = random_codes(60, seed=3)
    ref = one_piece(code2wav, codes)
    streamer = Code2WavStreamer(code2wav, window=7)
    out = [streamer.feed(codes[:, :30])]
    streamer.convs.kept.clear()  # zeros instead of the last inputs (the trans convs' look-ahead stays)
    out += [streamer.feed(codes[:, 30:]), streamer.flush()]
    got = torch.cat(out)
    assert got.shape == ref.shape
    assert float((got[: 30 * 1920 - 555] - ref[: 30 * 1920 - 555]).abs().max()) <= 1e-5
    assert float((got - ref).abs().max()) > 1e-3


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


def test_snake_with_its_constants_made_once_equals_transformers(kernel: str) -> None:
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeSnakeBeta

    from omnimesh.models.qwen3_omni.streaming_convs import _snake

    if kernel != "eager":
        pytest.skip("bit-identity is the eager kernel's (the others: test_snake_kernel)")
    m = Qwen3OmniMoeSnakeBeta(8)
    x = torch.randn(2, 8, 100, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        m.alpha.normal_(generator=torch.Generator().manual_seed(1))
        m.beta.normal_(generator=torch.Generator().manual_seed(2))
    assert torch.equal(_snake(m, x), m(x))
    with torch.no_grad():
        m.alpha.add_(1.0)  # changed in place after first use: the constants are made again
    assert torch.equal(_snake(m, x), m(x))
