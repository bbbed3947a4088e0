"""Output audio encoding: the pipeline's float32 waveform -> PCM16 bytes, WAV files and compressed files.

Data flow: `AudioDelta.pcm` (float32 in [-1, 1]) -> `float_to_pcm16` (clip, round) -> `pcm16_bytes`
(mono little-endian int16; the streamed `delta.audio.data` and the gRPC `AudioChunk.pcm16`) or, for the
non-streaming `message.audio.data` in the format the client asked for (OpenAI's `audio.format`):
`wav_bytes` (a whole 16-bit mono WAV file), or `compressed_bytes` (mp3, flac, opus in Ogg, aac in ADTS),
encoded by FFmpeg's encoders through PyAV (already here for video input) from the same PCM16 samples.
Streamed files (mp3, aac, opus written as the samples come): `gateway/audio_file_stream.py`.
"""

from __future__ import annotations

import io
import wave
from typing import Literal, cast

import numpy as np

OutputAudioFormat = Literal["wav", "pcm16", "mp3", "flac", "opus", "aac"]
OUTPUT_AUDIO_FORMATS: tuple[OutputAudioFormat, ...] = ("wav", "pcm16", "mp3", "flac", "opus", "aac")  # OpenAI's
# format -> (container, FFmpeg encoder)
_COMPRESSED = {"mp3": ("mp3", "libmp3lame"), "flac": ("flac", "flac"), "opus": ("ogg", "libopus"),
               "aac": ("adts", "aac")}
_OPUS_RATES = (8000, 12000, 16000, 24000, 48000)  # what Opus encodes; other rates are resampled to 48 kHz

_PCM16_MAX = 32767


def compressed_format(fmt: str) -> tuple[str, str]:
    """A compressed format -> (FFmpeg container, FFmpeg encoder)."""
    return _COMPRESSED[fmt]


def codec_rate(codec: str, sample_rate: int) -> int:
    """The rate `codec` encodes `sample_rate` audio at: its own, except Opus's when it is not one of Opus's."""
    return sample_rate if codec != "libopus" or sample_rate in _OPUS_RATES else 48000


def float_to_pcm16(waveform: np.ndarray) -> np.ndarray:
    """float samples (any shape) -> int16 of the same shape: NaN -> 0, clip to [-1, 1], scale, round.
    One float64 copy, every step in place on it (a 2 s window: 0.6 -> 0.09 ms, the same values)."""
    x = np.array(waveform, dtype=np.float64)
    np.nan_to_num(x, copy=False, nan=0.0, posinf=1.0, neginf=-1.0)
    np.clip(x, -1.0, 1.0, out=x)
    x *= _PCM16_MAX
    return np.rint(x, out=x).astype(np.int16)


def pcm16_bytes(waveform: np.ndarray) -> bytes:
    """float samples (samples,) -> raw mono little-endian int16 bytes."""
    return float_to_pcm16(np.ravel(waveform)).astype("<i2").tobytes()


def wav_bytes(waveform: np.ndarray, sample_rate: int) -> bytes:
    """float samples (samples,) -> a complete 16-bit mono WAV file at `sample_rate`."""
    if sample_rate <= 0:
        raise ValueError(f"sample_rate must be positive, got {sample_rate}")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm16_bytes(waveform))
    return buf.getvalue()


def compressed_bytes(waveform: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """float samples (samples,) -> a whole mono file in `fmt` (mp3, flac, opus, aac) at the encoder's default
    bit rate; the encoder converts the sample format itself (and Opus the rate, when it is not one of its own).
    An empty waveform (nothing was spoken) becomes 20 ms of silence: these formats have no valid empty file."""
    import av  # only the compressed formats need it
    from av.audio.stream import AudioStream

    container, codec = compressed_format(fmt)
    if sample_rate <= 0:
        raise ValueError(f"sample_rate must be positive, got {sample_rate}")
    rate = codec_rate(codec, sample_rate)
    pcm = float_to_pcm16(np.ravel(waveform)).reshape(1, -1)
    if not pcm.size:
        pcm = np.zeros((1, max(1, sample_rate // 50)), np.int16)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as out:
        stream = cast(AudioStream, out.add_stream(codec, rate=rate, layout="mono"))
        frame = av.AudioFrame.from_ndarray(pcm, format="s16", layout="mono")
        frame.sample_rate = sample_rate
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def encode_audio(waveform: np.ndarray, sample_rate: int, fmt: OutputAudioFormat) -> bytes:
    """The whole response audio in the client's requested format."""
    if fmt == "wav":
        return wav_bytes(waveform, sample_rate)
    if fmt == "pcm16":
        return pcm16_bytes(waveform)
    if fmt in _COMPRESSED:
        return compressed_bytes(waveform, sample_rate, fmt)
    raise ValueError(f"unsupported output audio format {fmt!r}; supported: {', '.join(OUTPUT_AUDIO_FORMATS)}")
