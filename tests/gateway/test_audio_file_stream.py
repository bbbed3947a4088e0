"""Compressed answers written as their samples come (gateway/audio_file_stream.py): mp3, aac and opus bytes go
out delta by delta, before the answer ends; the file decodes (PyAV) to the answer's length and pitch; how the
deltas split the answer changes no mp3 or aac byte and no decoded opus sample; an answer with no audio is a
short silent file; a file dropped midway refuses more samples."""

from __future__ import annotations

import io

import numpy as np
import pytest

from gateway.audio_file_stream import AudioFileStream

RATE = 24_000


def tone(seconds: float, freq: float = 440.0) -> np.ndarray:
    return (0.3 * np.sin(2 * np.pi * freq * np.arange(int(seconds * RATE)) / RATE)).astype(np.float32)


def decode(data: bytes) -> tuple[np.ndarray, int]:
    import av

    with av.open(io.BytesIO(data)) as container:
        frames = list(container.decode(audio=0))
    return np.concatenate([f.to_ndarray().reshape(-1) for f in frames]), frames[0].sample_rate


def streamed(fmt: str, x: np.ndarray, pieces: int) -> list[bytes]:
    s = AudioFileStream(fmt, RATE)
    return [s.push(p) for p in np.array_split(x, pieces)] + [s.finish()]


@pytest.mark.parametrize("fmt", ["mp3", "aac", "opus"])
def test_bytes_come_before_the_end_and_decode_to_the_answer(fmt: str) -> None:
    x = tone(2.0)
    parts = streamed(fmt, x, 10)
    assert parts[0] and sum(len(p) for p in parts[:-1]) > len(parts[-1])  # most of the file before the end
    audio, rate = decode(b"".join(parts))
    assert abs(audio.size / rate - 2.0) < 0.1  # mp3 keeps the encoder's delay: no gapless header in a stream
    spectrum = np.abs(np.fft.rfft(audio[audio.size // 4: 3 * audio.size // 4]))
    assert abs(np.argmax(spectrum) * rate / (audio.size // 2) - 440.0) < 10.0


@pytest.mark.parametrize("fmt", ["mp3", "aac", "opus"])
def test_the_split_changes_nothing(fmt: str) -> None:
    x = tone(1.0, 300.0)
    a, b = b"".join(streamed(fmt, x, 3)), b"".join(streamed(fmt, x, 17))
    if fmt == "opus":  # each Ogg stream draws a random serial number: compare the audio
        assert np.array_equal(decode(a)[0], decode(b)[0])
    else:
        assert a == b


def test_no_audio_is_a_short_silent_file_and_a_dropped_one_takes_no_more() -> None:
    silent, rate = decode(AudioFileStream("mp3", RATE).finish())
    assert silent.size / rate < 0.2 and not np.any(np.abs(silent) > 1e-3)
    s = AudioFileStream("aac", RATE)
    s.push(tone(0.1))
    s.close()
    assert s.finish() == b""
    with pytest.raises(RuntimeError, match="closed"):
        s.push(tone(0.1))
    with pytest.raises(ValueError, match="not written front to back"):
        AudioFileStream("wav", RATE)
