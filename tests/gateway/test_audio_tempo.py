"""`speed` on spoken audio (gateway/audio_tempo.py, FFmpeg's atempo through PyAV): the answer's length divides
by the speed, a tone keeps its pitch, speed 1 is untouched, and pushing the answer delta by delta (any split)
gives the same samples as pushing it whole, so a streamed answer equals the file."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.audio_tempo import Tempo, atempo_factors

RATE = 24_000


def tone(seconds: float, freq: float = 440.0) -> np.ndarray:
    return (0.4 * np.sin(2 * np.pi * freq * np.arange(int(seconds * RATE)) / RATE)).astype(np.float32)


def peak_hz(x: np.ndarray) -> float:
    spectrum = np.abs(np.fft.rfft(x * np.hanning(x.size)))
    return float(np.argmax(spectrum)) * RATE / x.size


@pytest.mark.parametrize(("speed", "factors"), [(1.0, [1.0]), (1.5, [1.5]), (4.0, [2.0, 2.0]), (3.0, [2.0, 1.5]),
                                                 (0.25, [0.5, 0.5]), (0.3, [0.5, 0.6])])
def test_factors_stay_in_atempos_range(speed: float, factors: list[float]) -> None:
    assert atempo_factors(speed) == pytest.approx(factors)
    for bad in (0.2, 4.5):
        with pytest.raises(ValueError, match=r"speed must be in \[0.25, 4.0\]"):
            atempo_factors(bad)


@pytest.mark.parametrize("speed", [0.25, 0.7, 1.5, 4.0])
def test_length_scales_and_pitch_stays(speed: float) -> None:
    x = tone(2.0)
    y = Tempo(speed, RATE).whole(x)
    assert y.dtype == np.float32
    assert abs(y.size - x.size / speed) <= 0.03 * x.size / speed + 512
    middle = y[y.size // 4: 3 * y.size // 4]
    assert abs(peak_hz(middle) - 440.0) < 15.0  # resampling would have moved it to 440 x speed


def test_speed_one_is_untouched() -> None:
    x = tone(0.3)
    t = Tempo(1.0, RATE)
    assert np.array_equal(t.push(x[:1000]), x[:1000]) and t.finish().size == 0


def test_pushed_in_pieces_equals_pushed_whole() -> None:
    rng = np.random.default_rng(5)
    x = (tone(1.5, 300.0) + 0.05 * rng.standard_normal(int(1.5 * RATE))).astype(np.float32)
    whole = Tempo(1.7, RATE).whole(x)
    cuts = np.sort(rng.choice(np.arange(1, x.size), size=23, replace=False))
    t = Tempo(1.7, RATE)
    pieces = [t.push(p) for p in np.split(x, cuts)]
    assert np.array_equal(np.concatenate([*pieces, t.finish()]), whole)
