"""Output audio encoding: PCM16 conversion (clip, round, NaN), the WAV container, and the compressed formats
OpenAI offers (mp3, flac, opus, aac): each decodes (PyAV) to the same duration at the right rate, flac to the
very PCM16 samples, the lossy ones to the same tone (high correlation); an empty waveform still makes a file."""

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
    with pytest.raises(ValueError, match="supported: wav, pcm16, mp3, flac, opus, aac"):
        encode_audio(np.zeros(3), 24_000, "ogg")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sample_rate must be positive"):
        encode_audio(np.zeros(3), 0, "mp3")


def _decoded(data: bytes) -> tuple[np.ndarray, int, str]:
    """A file -> (mono float samples, rate, codec name)."""
    import av

    with av.open(io.BytesIO(data)) as f:
        stream = f.streams.audio[0]
        frames = [fr.to_ndarray() for fr in f.decode(stream)]
        name, rate = stream.codec_context.name, stream.codec_context.sample_rate
    if not frames:
        return np.zeros(0, np.float32), rate, name
    x = np.concatenate([fr.reshape(-1) for fr in frames])
    return (x / 32768.0 if x.dtype == np.int16 else x).astype(np.float32), rate, name


@pytest.mark.parametrize("fmt, codec, rate", [("mp3", "mp3", 24_000), ("flac", "flac", 24_000),
                                              ("opus", "opus", 48_000), ("aac", "aac", 24_000)])
def test_compressed_formats_decode_to_the_same_audio(fmt: str, codec: str, rate: int) -> None:
    x = (0.5 * np.sin(2 * np.pi * 440 * np.arange(48_000) / 24_000)).astype(np.float32)  # 2 s at 24 kHz
    data = encode_audio(x, 24_000, fmt)  # type: ignore[arg-type]
    got, got_rate, name = _decoded(data)
    assert name.startswith(codec) and got_rate == rate  # opus decoders always give 48 kHz
    if got_rate != 24_000:
        got = got[::got_rate // 24_000]
    if fmt == "flac":  # lossless: the PCM16 samples themselves
        np.testing.assert_array_equal(np.rint(got * 32768).astype(np.int16), float_to_pcm16(x))
        return
    assert abs(got.size - x.size) <= 2048  # the encoder's priming / padding, at most a couple of frames
    best = max(np.corrcoef(got[lag:lag + 40_000], x[:40_000])[0, 1] for lag in range(0, 1100, 1))
    assert best > 0.99, f"{fmt}: the decoded tone correlates {best:.3f} with the original"
    silent, _, _ = _decoded(encode_audio(np.zeros(0, np.float32), 24_000, fmt))  # type: ignore[arg-type]
    assert silent.size <= 0.1 * rate and np.abs(silent).max(initial=0) < 1e-3  # nothing said: a moment of silence
