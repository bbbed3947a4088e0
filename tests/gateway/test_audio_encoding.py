"""Output audio encoding: PCM16 conversion (clip, round, NaN) and the WAV container."""

from __future__ import annotations

import io
import wave

import numpy as np
import pytest

from gateway.audio_encoding import encode_audio, float_to_pcm16, pcm16_bytes, wav_bytes
from gateway.media import decode_wav


def test_float_to_pcm16_clips_and_rounds() -> None:
    x = np.array([0.0, 0.25, -0.25, 1.0, -1.0, 1.5, -3.0, np.nan, 1 / 32767 * 0.6], np.float32)
    assert float_to_pcm16(x).tolist() == [0, 8192, -8192, 32767, -32767, 32767, -32767, 0, 1]
    assert float_to_pcm16(x).dtype == np.int16


def test_pcm16_bytes_are_little_endian() -> None:
    assert pcm16_bytes(np.array([1.0, -1.0, 0.5], np.float32)) == b"\xff\x7f\x01\x80\x00\x40"


def test_wav_bytes_is_a_24khz_mono_16bit_file_of_the_samples() -> None:
    x = (0.5 * np.sin(np.arange(2400) / 10)).astype(np.float32)
    data = wav_bytes(x, 24_000)
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()) == (1, 2, 24_000, 2400)
    samples, rate = decode_wav(data, max_seconds=1)
    assert rate == 24_000
    np.testing.assert_allclose(samples[:, 0], x, atol=1 / 32767)
    assert encode_audio(x, 24_000, "pcm16") == pcm16_bytes(x) and encode_audio(x, 24_000, "wav") == data


def test_empty_audio_and_bad_arguments() -> None:
    with wave.open(io.BytesIO(wav_bytes(np.zeros(0, np.float32), 24_000))) as w:
        assert w.getnframes() == 0
    with pytest.raises(ValueError, match="sample_rate must be positive"):
        wav_bytes(np.zeros(3), 0)
    with pytest.raises(ValueError, match="supported: wav, pcm16"):
        encode_audio(np.zeros(3), 24_000, "mp3")  # type: ignore[arg-type]
