"""The Realtime API's audio formats: OpenAI's `pcm16` (24 kHz) and the telephone's `g711_ulaw` / `g711_alaw`
(8 kHz, one byte a sample, ITU-T G.711), in and out.

Data flow:
    in:  base64 audio of the session's `input_audio_format` -> `decode` -> float32 samples at that format's
         rate (24 kHz or 8 kHz): the input buffer, the server VAD and the committed clip keep that rate (the
         prompt builder resamples a clip to the encoder's 16 kHz in one piece)
    out: the pipeline's float32 pcm (24 kHz) -> `OutputEncoder` of the session's `output_audio_format` ->
         pcm16 bytes as they are, or for G.711 a low-pass FIR decimation to 8 kHz that carries its state
         from one delta to the next (so the streamed bytes equal encoding the whole answer at once: no seam
         at a delta's edges) and the G.711 companding; `flush()` at the answer's end gives the filter's tail

The G.711 codecs are the standard's segment tables in numpy (equal to CPython's former `audioop` on every
16-bit value: the tests check it).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import numpy as np

from gateway.audio_encoding import float_to_pcm16, pcm16_bytes

RATES = {"pcm16": 24_000, "g711_ulaw": 8_000, "g711_alaw": 8_000}  # the Realtime API's formats
TAPS = 63  # the decimator's low-pass FIR (odd: a whole-sample delay of TAPS // 2 at the source rate)


class AudioFormatError(ValueError):
    """Audio that does not decode as the session's format (the session answers an error event naming it)."""


def decode(data: Any, fmt: str, where: str) -> np.ndarray:
    """Base64 audio in `fmt` -> float32 samples in [-1, 1) at RATES[fmt]."""
    if not isinstance(data, str) or not data:
        raise AudioFormatError(f"{where} must be base64 {fmt} audio")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise AudioFormatError(f"{where} is not valid base64") from None
    if fmt == "pcm16":
        if len(raw) % 2:
            raise AudioFormatError(f"{where}: pcm16 has 2 bytes per sample, got {len(raw)} bytes")
        return np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0
    codes = np.frombuffer(raw, dtype=np.uint8)
    linear = ulaw_to_linear(codes) if fmt == "g711_ulaw" else alaw_to_linear(codes)
    return linear.astype(np.float32) / 32768.0


# ------------------------------------------------------------------------------------------- G.711 codecs
_ULAW_BIAS = 0x84


def linear_to_ulaw(pcm: np.ndarray) -> np.ndarray:
    """16-bit linear samples -> mu-law bytes (G.711 on the 14-bit range, as the reference g711.c does)."""
    x = np.asarray(pcm, dtype=np.int32) >> 2
    mask = np.where(x < 0, 0x7F, 0xFF)
    mag = np.minimum(np.abs(x), 8159) + (_ULAW_BIAS >> 2)
    segment = np.clip(np.floor(np.log2(mag)).astype(np.int32) - 5, 0, 8)  # 0x40 << s bounds segment s
    code = np.where(segment >= 8, 0x7F, (np.minimum(segment, 7) << 4) | ((mag >> (np.minimum(segment, 7) + 1)) & 0x0F))
    return (code ^ mask).astype(np.uint8)


def ulaw_to_linear(codes: np.ndarray) -> np.ndarray:
    u = ~np.asarray(codes, dtype=np.int32) & 0xFF
    exponent, mantissa = (u >> 4) & 0x07, u & 0x0F
    magnitude = ((mantissa << 3) + _ULAW_BIAS) << exponent
    return np.where(u & 0x80, _ULAW_BIAS - magnitude, magnitude - _ULAW_BIAS).astype(np.int16)


def linear_to_alaw(pcm: np.ndarray) -> np.ndarray:
    """16-bit linear samples -> A-law bytes (G.711, 13-bit magnitude, even bits inverted)."""
    x = np.asarray(pcm, dtype=np.int32) >> 3  # 13 bits
    sign = np.where(x >= 0, 0x80, 0x00)
    mag = np.where(x >= 0, x, -x - 1)
    mag = np.minimum(mag, 0x0FFF)
    exponent = np.where(mag < 32, 0, np.floor(np.log2(np.maximum(mag, 1))).astype(np.int32) - 4)
    mantissa = np.where(exponent == 0, mag >> 1, mag >> exponent) & 0x0F
    return ((sign | (exponent << 4) | mantissa) ^ 0x55).astype(np.uint8)


def alaw_to_linear(codes: np.ndarray) -> np.ndarray:
    a = np.asarray(codes, dtype=np.int32) ^ 0x55
    exponent, mantissa = (a >> 4) & 0x07, a & 0x0F
    magnitude = np.where(exponent == 0, (mantissa << 4) + 8, ((mantissa << 4) + 0x108) << (exponent - 1))
    return np.where(a & 0x80, magnitude, -magnitude).astype(np.int16)


# ---------------------------------------------------------------------------------------------- output
def _lowpass(factor: int) -> np.ndarray:
    """A Hamming-windowed sinc for decimating by `factor` (cut-off at 0.9 of the new Nyquist), unit DC gain."""
    n = np.arange(TAPS) - TAPS // 2
    cutoff = 0.9 / factor  # of the source Nyquist
    h = cutoff * np.sinc(cutoff * n) * np.hamming(TAPS)
    return h / h.sum()


class OutputEncoder:
    """One answer's audio in the session's output format, delta by delta (see the module docstring)."""

    def __init__(self, fmt: str, source_rate: int) -> None:
        self.fmt = fmt
        self.rate = RATES[fmt]
        if fmt == "pcm16":
            if source_rate != self.rate:
                raise AudioFormatError(f"pcm16 output is {self.rate} Hz; this model speaks at {source_rate} Hz")
            return
        if source_rate % self.rate:
            raise AudioFormatError(f"{fmt} output is {self.rate} Hz; this model's {source_rate} Hz does not decimate "
                                   "to it by a whole factor")
        self.factor = source_rate // self.rate
        self.h = _lowpass(self.factor)
        self.history = np.zeros(TAPS - 1)  # the input before this delta the filter still reads
        self.phase = 0  # input samples to skip before the next output sample (its index is a multiple of factor)

    def __call__(self, pcm: np.ndarray) -> bytes:
        """This delta's samples (float32 at the source rate) -> bytes in the output format."""
        if self.fmt == "pcm16":
            return pcm16_bytes(pcm)
        return self._encode(self._decimate(np.asarray(pcm, dtype=np.float64).reshape(-1)))

    def flush(self) -> bytes:
        """The filter's tail at the answer's end (its delay of TAPS // 2 source samples, as zeros): b"" for pcm16."""
        if self.fmt == "pcm16":
            return b""
        return self._encode(self._decimate(np.zeros(TAPS // 2)))

    def _decimate(self, x: np.ndarray) -> np.ndarray:
        ext = np.concatenate([self.history, x])
        full = np.convolve(ext, self.h, mode="valid")  # full[i]: the filter ending at x's i-th sample
        out = full[self.phase::self.factor]
        self.phase = (self.phase - len(full)) % self.factor
        self.history = ext[len(ext) - (TAPS - 1):]
        return out

    def _encode(self, y: np.ndarray) -> bytes:
        pcm = float_to_pcm16(y)  # as pcm16 output rounds
        codes = linear_to_ulaw(pcm) if self.fmt == "g711_ulaw" else linear_to_alaw(pcm)
        return codes.tobytes()
