"""Inline and remote media -> the typed parts of a `ChatRequest` (16 kHz mono audio, RGB images, videos).

Data flow: a content part's payload (base64 WAV, a `data:` URI, or an http(s) URL on an operator-allowed
domain) -> bytes (`parse_data_uri` / `fetch_url`) -> `decode_wav` (RIFF PCM 8/16/24/32-bit or IEEE float,
any channel count) -> mono mix -> `resample` (windowed-sinc polyphase, band-limited) to 16 kHz ->
`AudioPart`; or `decode_image` (PIL, pixel limit checked before decoding) -> RGB -> `ImagePart`; or
`gateway.media_video.decode_video` (PyAV; only the frames `VideoSampling` keeps, as RGB) -> `VideoPart`.
`MediaLoader` bundles the policy (limits + allowed domains) for the REST and gRPC front ends. Every
refusal is a `PipelineError` (400, or 413 for a size limit) whose message says why and what to do.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import binascii
import io
import math
import struct
import urllib.parse
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np
from PIL import Image, UnidentifiedImageError

from gateway.events import AudioPart, ImagePart, PipelineError, VideoPart
from gateway.input_limits import InputLimits

if TYPE_CHECKING:
    from gateway.media_budget import MediaBudget
    from omnimesh.models.qwen3_omni.video_sampling import VideoSampling

TARGET_SAMPLE_RATE = 16_000  # what the Qwen-Omni audio towers (Whisper features) expect
# the shortest clip the feature extractor can frame: one 25 ms STFT window (n_fft 400 at 16 kHz; its reflect
# padding needs more than n_fft / 2 samples, so shorter clips fail inside the processor)
MIN_AUDIO_SAMPLES = 400
# OpenAI's input_audio formats (wav, mp3) and the other files FFmpeg reads (decoded in a child process)
SUPPORTED_INPUT_AUDIO_FORMATS: tuple[str, ...] = ("wav", "mp3", "flac", "ogg", "opus", "m4a", "aac", "webm")

_GRPC_INVALID_ARGUMENT = 3
_GRPC_UNIMPLEMENTED = 12


def invalid_request(message: str, param: str | None = None) -> PipelineError:
    """A 400 / INVALID_ARGUMENT error about the client's input."""
    return PipelineError(message, http_status=400, grpc_code=_GRPC_INVALID_ARGUMENT,
                         kind="invalid_request_error", param=param)


def media_not_from_user(where: str, role: str) -> PipelineError:
    """A media part in a message of another role than user (REST and gRPC chats alike)."""
    return invalid_request(f"{where}: only user messages may carry audio, images or video (this is "
                           f"{'an' if role[:1] in 'aeiou' else 'a'} '{role}' message)", where)


def _av_missing() -> ImportError | None:
    """Why FFmpeg's decoders (PyAV) cannot load here, or None when they can."""
    try:  # PyAV loads with the first file FFmpeg decodes (and media_video imports this module)
        import gateway.media_video  # noqa: F401
    except ImportError as e:
        return e
    return None


class UnsupportedWavEncoding(PipelineError):
    """A WAV whose encoding this module does not parse (A-law, mu-law, ADPCM, ...): FFmpeg may read it."""


def too_large(message: str, param: str | None = None) -> PipelineError:
    """A 413 / INVALID_ARGUMENT error: the input breaks one of the `InputLimits`."""
    return PipelineError(message, http_status=413, grpc_code=_GRPC_INVALID_ARGUMENT,
                         kind="invalid_request_error", param=param)


# ----------------------------------------------------------------------------------------- bytes in
def decode_base64(data: str, param: str) -> bytes:
    """Strict base64 (whitespace tolerated) -> bytes."""
    try:
        return base64.b64decode("".join(data.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise invalid_request(f"{param}: not valid base64 ({e})", param) from None


def _data_uri_parts(uri: str) -> tuple[list[str], str] | None:
    """`data:<mime>[;params],<payload>` -> (its header's fields: mime first, then params; the payload as sent);
    None when it is no data URI."""
    header, sep, payload = uri.partition(",")
    if not sep or not header.lower().startswith("data:"):
        return None
    return header[5:].split(";"), payload


def _is_base64(fields: list[str]) -> bool:
    return "base64" in (f.strip().lower() for f in fields[1:])


def parse_data_uri(uri: str, param: str) -> tuple[str, bytes]:
    """`data:<mime>[;params];base64,<payload>` -> (mime type, bytes)."""
    parts = _data_uri_parts(uri)
    if parts is None:
        raise invalid_request(f"{param}: malformed data URI; expected 'data:<mime>;base64,<payload>'", param)
    fields, payload = parts
    if not _is_base64(fields):
        raise invalid_request(f"{param}: data URIs must be base64-encoded ('data:<mime>;base64,...')", param)
    return fields[0].strip().lower(), decode_base64(payload, param)


async def fetch_url(url: str, *, allowed_domains: frozenset[str], limits: InputLimits, param: str,
                    transport: httpx.AsyncBaseTransport | None = None) -> bytes:
    """GET an http(s) URL whose host the operator allowed (exact host match, no wildcard subdomains);
    bounded in time and size; redirects are refused (they could lead off the allowed hosts)."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        shown = f"'{scheme}:'" if scheme else "(none)"
        raise invalid_request(
            f"{param}: URL scheme {shown} is not allowed; send the media inline (base64 or a "
            "'data:<mime>;base64,...' URI) or as an http(s) URL on a domain the operator allowed", param)
    host = (parts.hostname or "").lower()
    if not allowed_domains:
        raise invalid_request(
            f"{param}: remote media URLs are disabled on this server (no allowed media domains are "
            "configured); send the media inline as a 'data:<mime>;base64,...' URI", param)
    if host not in allowed_domains:
        raise invalid_request(
            f"{param}: domain '{host}' is not in this server's allowed media domains "
            f"({', '.join(sorted(allowed_domains))})", param)
    try:
        async with asyncio.timeout(limits.fetch_timeout_s):
            return await _download(url, limits.max_fetch_bytes, limits.fetch_timeout_s, param, transport)
    except TimeoutError:
        raise invalid_request(f"{param}: fetching {url} took longer than {limits.fetch_timeout_s:g} s",
                              param) from None
    except httpx.HTTPError as e:
        raise invalid_request(f"{param}: could not fetch {url}: {type(e).__name__}: {e}", param) from None


async def _download(url: str, max_bytes: int, timeout_s: float, param: str,
                    transport: httpx.AsyncBaseTransport | None) -> bytes:
    async with httpx.AsyncClient(timeout=timeout_s, follow_redirects=False, trust_env=False,
                                 transport=transport) as client:
        async with client.stream("GET", url) as resp:
            if resp.is_redirect:
                raise invalid_request(f"{param}: {url} answered with a redirect (HTTP {resp.status_code}); "
                                      "redirects are not followed, give the final URL", param)
            if resp.status_code != 200:
                raise invalid_request(f"{param}: fetching {url} failed with HTTP {resp.status_code}", param)
            declared = resp.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > max_bytes:
                raise too_large(f"{param}: {url} is {int(declared)} bytes; the limit is {max_bytes}", param)
            buf = bytearray()
            async for chunk in resp.aiter_bytes():
                buf += chunk
                if len(buf) > max_bytes:
                    raise too_large(f"{param}: {url} is larger than the limit of {max_bytes} bytes", param)
            return bytes(buf)


# -------------------------------------------------------------------------------------------- audio
_WAVE_FORMAT_PCM, _WAVE_FORMAT_FLOAT, _WAVE_FORMAT_EXTENSIBLE = 1, 3, 0xFFFE


def decode_wav(data: bytes, *, max_seconds: float, param: str = "audio") -> tuple[np.ndarray, int]:
    """A RIFF/WAVE file -> (samples (frames, channels) float32, sample rate). PCM 8/16/24/32 or float."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise invalid_request(f"{param}: not a WAV file (no RIFF/WAVE header); supported formats: "
                              f"{', '.join(SUPPORTED_INPUT_AUDIO_FORMATS)}", param)
    fmt: tuple[int, int, int, int, int] | None = None  # (format tag, channels, rate, block align, bits)
    pcm: bytes | None = None
    pos = 12
    while pos + 8 <= len(data):
        chunk_id, size = data[pos:pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        body = data[pos + 8:pos + 8 + size]
        if chunk_id == b"fmt ":
            if len(body) < 16:
                raise invalid_request(f"{param}: WAV 'fmt ' chunk is truncated", param)
            tag, channels, rate, _, block_align, bits = struct.unpack_from("<HHIIHH", body)
            if tag == _WAVE_FORMAT_EXTENSIBLE and len(body) >= 26:
                tag = struct.unpack_from("<H", body, 24)[0]  # first 2 bytes of the sub-format GUID
            fmt = (tag, channels, rate, block_align, bits)
        elif chunk_id == b"data":
            pcm = body  # streaming writers leave size 0xFFFFFFFF: the slice then takes the rest
            break
        pos += 8 + size + (size & 1)
    if fmt is None or pcm is None:
        raise invalid_request(f"{param}: WAV file has no {'fmt ' if fmt is None else 'data'} chunk", param)
    tag, channels, rate, block_align, bits = fmt
    if not ((tag == _WAVE_FORMAT_PCM and bits in (8, 16, 24, 32)) or (tag == _WAVE_FORMAT_FLOAT and bits in (32, 64))):
        # before the PCM checks: a compressed encoding's block_align is its own (ADPCM: a block of many samples)
        raise UnsupportedWavEncoding(f"{param}: unsupported WAV encoding (format tag {tag}, {bits} bits); "
                                     "supported: PCM 8/16/24/32-bit, IEEE float 32/64-bit", http_status=400,
                                     grpc_code=_GRPC_INVALID_ARGUMENT, kind="invalid_request_error", param=param)
    if channels < 1 or rate < 1 or block_align != channels * ((bits + 7) // 8):
        raise invalid_request(f"{param}: WAV header is inconsistent (channels={channels}, rate={rate}, "
                              f"bits={bits}, block_align={block_align})", param)
    frames = len(pcm) // block_align
    if frames / rate > max_seconds:
        raise too_large(f"{param}: audio is {frames / rate:.1f} s long; the limit is {max_seconds:g} s", param)
    raw = pcm[:frames * block_align]
    if tag == _WAVE_FORMAT_PCM and bits == 8:
        x = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif tag == _WAVE_FORMAT_PCM and bits == 16:
        x = np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0
    elif tag == _WAVE_FORMAT_PCM and bits == 24:
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)  # (n, 3) little-endian bytes
        v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        x = (np.where(v >= 1 << 23, v - (1 << 24), v)).astype(np.float32) / float(1 << 23)
    elif tag == _WAVE_FORMAT_PCM:  # 32-bit
        x = (np.frombuffer(raw, "<i4").astype(np.float64) / float(1 << 31)).astype(np.float32)
    else:  # IEEE float, 32 or 64-bit; a 64-bit sample past float32's range becomes inf, refused as not finite later
        with np.errstate(over="ignore"):  # not a RuntimeWarning in the gateway's log for each such request
            x = np.frombuffer(raw, "<f4" if bits == 32 else "<f8").astype(np.float32)
    return x.reshape(frames, channels), rate


# Measured 44.1 kHz -> 16 kHz: flat (< 0.01 dB) to 6.5 kHz, -0.5 dB at 7 kHz, >= 85 dB rejection of
# everything that would alias (input above 8.2 kHz); ~0.1 s of CPU per minute of audio.
_RESAMPLE_ZERO_CROSSINGS = 32  # sinc lobes each side of the centre tap (sets the transition width)
_RESAMPLE_KAISER_BETA = 8.6  # ~ 85 dB stop-band
_RESAMPLE_ROLLOFF = 0.92  # cutoff as a fraction of the lower Nyquist: the transition band ends below it
_RESAMPLE_BLOCK = 8192  # output samples gathered per matmul (the temporary is block x taps) ...
_RESAMPLE_TEMP = 2**22  # ... fewer when the taps are many (a large down-sampling): at most 16 MB of float32
# The largest term of the reduced ratio dst/src: the filter has 2 x 32 x that many taps (a 2**31 Hz header would
# ask for 10**9 of them, ~8 GB each array). Real rates stay far below (44.1 kHz -> 16 kHz is 160/441).
MAX_RESAMPLE_TERM = 2**14


def resample_ratio(src_rate: int, dst_rate: int) -> tuple[int, int]:
    """(up, down): dst/src in lowest terms."""
    g = math.gcd(src_rate, dst_rate)
    return dst_rate // g, src_rate // g


def resample(x: np.ndarray, src_rate: int, dst_rate: int) -> np.ndarray:
    """Band-limited resampling of a mono signal (samples,) by the rational factor dst/src.

    Windowed-sinc (Kaiser) FIR evaluated polyphase: conceptually zero-stuff by `up`, low-pass at
    min(src, dst)/2, keep every `down`-th sample; only the taps that meet non-zero inputs are computed.
    Output length ceil(len * up / down), aligned so output sample i sits at time i / dst_rate.
    """
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    if src_rate <= 0 or dst_rate <= 0:
        raise ValueError(f"sample rates must be positive, got {src_rate} -> {dst_rate}")
    if src_rate == dst_rate or x.size == 0:
        return x.copy()
    up, down = resample_ratio(src_rate, dst_rate)
    max_rate = max(up, down)
    if max_rate > MAX_RESAMPLE_TERM:
        raise ValueError(f"resampling {src_rate} Hz -> {dst_rate} Hz takes the ratio {up}/{down}; terms above "
                         f"{MAX_RESAMPLE_TERM} are not supported (the filter would have {64 * max_rate} taps)")
    half = _RESAMPLE_ZERO_CROSSINGS * max_rate  # filter half-length, in the up-sampled domain
    n = np.arange(-half, half + 1, dtype=np.float64)
    cutoff = _RESAMPLE_ROLLOFF / max_rate  # in units of the up-sampled Nyquist
    h = cutoff * np.sinc(cutoff * n) * np.kaiser(2 * half + 1, _RESAMPLE_KAISER_BETA)
    h *= up / h.sum()  # unit DC gain after zero-stuffing by `up`
    taps = 2 * half // up + 1  # input samples under the filter, per output sample
    n_out = -(-x.size * up // down)
    # output i sits at up-sampled time t = i*down; it reads inputs m_lo(i) .. m_lo(i)+taps-1 with
    # m_lo = ceil((t - half) / up), weights h[t + half - m*up] (zero outside the filter).
    first_m = -((half - 0) // up)
    last_m = -((half - (n_out - 1) * down) // up) + taps - 1
    pad_left, pad_right = max(0, -first_m), max(0, last_m - x.size + 1)
    xp = np.concatenate([np.zeros(pad_left, np.float32), x, np.zeros(pad_right, np.float32)])
    windows = np.lib.stride_tricks.sliding_window_view(xp, taps)  # (len(xp)-taps+1, taps), a view
    hp = np.concatenate([h, np.zeros(up, np.float64)])  # so out-of-range tap indices read zero
    y = np.empty(n_out, np.float32)
    block = max(1, min(_RESAMPLE_BLOCK, _RESAMPLE_TEMP // taps))
    for c in range(min(up, n_out)):  # outputs c, c+up, ... share one phase of the filter
        m0 = -((half - c * down) // up)
        r = c * down + half - m0 * up  # tap index for the first input of the window
        idx = r - up * np.arange(taps)  # (taps,)
        phase = np.where(idx >= 0, hp[np.clip(idx, 0, None)], 0.0).astype(np.float32)
        starts = m0 + pad_left + down * np.arange(len(range(c, n_out, up)))
        out = y[c::up]
        for b in range(0, starts.size, block):
            out[b:b + block] = windows[starts[b:b + block]] @ phase
    return y


def wav_to_audio_part(data: bytes, *, max_seconds: float, param: str) -> AudioPart:
    """WAV bytes -> 16 kHz mono float32 `AudioPart` (CPU-bound: call it off the event loop)."""
    return samples_to_audio_part(*decode_wav(data, max_seconds=max_seconds, param=param), param=param)


def samples_to_audio_part(samples: np.ndarray, rate: int, *, param: str) -> AudioPart:
    """Decoded samples (frames, channels) float32 at `rate` -> 16 kHz mono `AudioPart` (channels averaged).
    Float files can hold NaN or infinities (or values float32 cannot hold): a 400, as the features would be NaN."""
    if not np.isfinite(samples).all():
        raise invalid_request(f"{param}: the audio has samples that are NaN or infinite; send finite samples "
                              "(float audio is expected in [-1, 1])", param)
    if max(resample_ratio(rate, TARGET_SAMPLE_RATE)) > MAX_RESAMPLE_TERM:
        raise invalid_request(f"{param}: a sample rate of {rate} Hz is not supported: converting it to "
                              f"{TARGET_SAMPLE_RATE} Hz would need too long a filter; send a common rate (8, 11.025, "
                              "16, 22.05, 24, 32, 44.1, 48, 96 or 192 kHz, ...)", param)
    mono = samples.mean(axis=1, dtype=np.float32) if samples.shape[1] > 1 else samples[:, 0]
    waveform = resample(mono, rate, TARGET_SAMPLE_RATE)
    if waveform.size < MIN_AUDIO_SAMPLES:
        raise invalid_request(
            f"{param}: the audio is {samples.shape[0]} samples at {rate} Hz ({samples.shape[0] / rate:.4f} s); at "
            f"least {MIN_AUDIO_SAMPLES / TARGET_SAMPLE_RATE:g} s is needed (one feature window)", param)
    return AudioPart(waveform=waveform, sample_rate=TARGET_SAMPLE_RATE)


# ------------------------------------------------------------------------------------------- images
HEADER_PEEK_BYTES = 64 * 1024  # where an image's size is looked for before anything is decoded (a JPEG's EXIF
# comes before its frame header, and is rarely longer)


def image_header_size(data: bytes | str) -> tuple[int, int] | None:
    """(width, height) from the start of an image file (bytes) or of a `data:` URI (only its first
    HEADER_PEEK_BYTES are decoded), without decoding pixels; None when the start says nothing readable (the
    image's own decode then gives the error, or the size)."""
    if isinstance(data, str):
        parts = _data_uri_parts(data)
        if parts is None or not _is_base64(parts[0]):  # what parse_data_uri refuses: the decode says why
            return None
        chars = "".join(parts[1][:HEADER_PEEK_BYTES * 4 // 3 + 256].split())
        try:
            data = base64.b64decode(chars[:len(chars) // 4 * 4], validate=True)
        except (binascii.Error, ValueError):
            return None
    try:
        with Image.open(io.BytesIO(data[:HEADER_PEEK_BYTES])) as img:
            return img.size
    except Exception:  # PIL raises what its format plugins raise on a cut or bad header
        return None


def decode_image(data: bytes, *, max_pixels: int, param: str,
                 admit: Callable[[int, int], None] | None = None) -> ImagePart:
    """Image file bytes (PNG, JPEG, ...) -> RGB `ImagePart`; the size is checked before decoding, and told to
    `admit(width, height)` (which may refuse it: gateway/prompt.py `ImageTokens`)."""
    try:
        img = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise too_large(f"{param}: image too large to decode ({e})", param) from None
    except UnidentifiedImageError:  # its message names a BytesIO object, nothing the client sent
        raise invalid_request(f"{param}: could not decode the image: {len(data)} bytes in no image format "
                              f"this server reads (PNG, JPEG, WebP, GIF, BMP, ...)", param) from None
    except (OSError, ValueError) as e:
        raise invalid_request(f"{param}: could not decode the image ({e})", param) from None
    w, h = img.size
    if w * h > max_pixels:
        raise too_large(f"{param}: image is {w}x{h} = {w * h} pixels; the limit is {max_pixels}", param)
    if admit is not None:
        admit(w, h)
    try:
        return ImagePart(image=img.convert("RGB"))
    except (OSError, ValueError, SyntaxError) as e:  # truncated / corrupt pixel data
        raise invalid_request(f"{param}: could not decode the image ({e})", param) from None


# ------------------------------------------------------------------------------------------- policy
def video_sampling_of(prompt_builder: object) -> VideoSampling | None:
    """The sampling of a `PromptBuilder`'s processor (its `video_processor.sampling`); None when the builder
    is absent or its processor has no video processor (the loader then uses the default)."""
    processor = getattr(prompt_builder, "processor", None)
    return getattr(getattr(processor, "video_processor", None), "sampling", None)


def part_audio_seconds(part: object) -> float:
    """Seconds of audio in one decoded part (a clip, or a video's soundtrack); 0 for any other part."""
    audio = part if isinstance(part, AudioPart) else part.audio if isinstance(part, VideoPart) else None
    return 0.0 if audio is None else audio.waveform.size / audio.sample_rate


class AudioTotal:
    """A request's decoded audio so far against max_audio_seconds (all its clips and soundtracks together),
    checked as each part is decoded: the 413 comes at the part that crosses the limit, and the parts after it are
    never decoded (checked once all were decoded, a request of many clips of nearly the limit each had every one
    decoded, FFmpeg's work in child processes included, before its refusal)."""

    def __init__(self, loader: MediaLoader, param: str = "messages") -> None:
        self.loader, self.param, self.seconds = loader, param, 0.0

    def add(self, part: object) -> None:
        self.seconds += part_audio_seconds(part)
        self.loader.check_audio_seconds(self.seconds, self.param)


class MediaLoader:
    """Turns client media references into `AudioPart` / `ImagePart` / `VideoPart` under one policy (limits,
    domains, which video frames are kept: `video_sampling`, None = Qwen-Omni's default `VideoSampling()`)."""

    def __init__(self, limits: InputLimits, allowed_domains: frozenset[str] = frozenset(),
                 transport: httpx.AsyncBaseTransport | None = None,
                 video_sampling: VideoSampling | None = None, budget: MediaBudget | None = None) -> None:
        self.limits = limits
        self.budget = budget  # what a decode in a child process may take at once with the others and the builds
        self.allowed_domains = frozenset(d.lower() for d in allowed_domains)
        self._transport = transport  # tests inject one; None = a real network client
        self._video_sampling = video_sampling

    @property
    def video_sampling(self) -> VideoSampling:
        if self._video_sampling is None:  # built at the first video: its module imports transformers
            from omnimesh.models.qwen3_omni.video_sampling import VideoSampling

            self._video_sampling = VideoSampling()  # Qwen-Omni's reference: 2 fps, 4 to 768 frames, pairs
        return self._video_sampling

    async def _bytes_from_url(self, url: str, param: str) -> tuple[str | None, bytes]:
        if url[:5].lower() == "data:":
            return parse_data_uri(url, param)
        data = await fetch_url(url, allowed_domains=self.allowed_domains, limits=self.limits, param=param,
                               transport=self._transport)
        return None, data

    async def audio_from_base64(self, data: str, fmt: str, param: str) -> AudioPart:
        """OpenAI `input_audio`: base64 file bytes (a data URI is tolerated) in format `fmt`: "wav" is parsed
        here, the others (mp3, ...) are decoded by FFmpeg in a child process, whatever container they hold."""
        if fmt.lower() not in SUPPORTED_INPUT_AUDIO_FORMATS:
            raise invalid_request(f"{param}.format: input audio format '{fmt}' is not supported; supported: "
                                  f"{', '.join(SUPPORTED_INPUT_AUDIO_FORMATS)}", f"{param}.format")
        raw = parse_data_uri(data, param)[1] if data[:5].lower() == "data:" else decode_base64(data, param)
        if fmt.lower() == "wav":
            return await self.audio_from_wav(raw, param)
        return await self.audio_from_file(raw, param)

    async def audio_from_url(self, url: str, param: str) -> AudioPart:
        """vLLM-style `audio_url`: a data URI or an allowed http(s) URL of an audio file (`audio_from_bytes`)."""
        return await self.audio_from_bytes((await self._bytes_from_url(url, param))[1], param)

    async def audio_from_bytes(self, data: bytes, param: str) -> AudioPart:
        """An audio file of any format: a WAV is parsed here, anything else decoded by FFmpeg in a child process."""
        if data[:4] == b"RIFF":
            return await self.audio_from_wav(data, param)
        return await self.audio_from_file(data, param)

    async def audio_from_file(self, data: bytes, param: str) -> AudioPart:
        """A compressed audio file (MP3, FLAC, Ogg, M4A, WebM, ...) -> 16 kHz mono, decoded in a child process
        (`gateway/video_process.py`, kind "audio"), waited on off the loop."""
        self._need_av(param, "audio other than WAV")
        return await self._in_child(data, sampling=None, param=param, kind="audio")

    async def audio_from_wav(self, data: bytes, param: str) -> AudioPart:
        """PCM and float WAVs are parsed here; other encodings (telephony's A-law and mu-law, ADPCM, ...) go to
        FFmpeg as any other file does, where PyAV is installed."""
        try:
            return await asyncio.to_thread(wav_to_audio_part, data, max_seconds=self.limits.max_audio_seconds,
                                           param=param)
        except UnsupportedWavEncoding as unsupported:
            if _av_missing() is not None:  # the encoding's own 400 then stands
                raise unsupported from None
            return await self.audio_from_file(data, param)

    async def image_from_url(self, url: str, param: str, admit: Callable[[int, int], None] | None = None
                             ) -> ImagePart:
        """OpenAI `image_url.url`: a `data:image/...;base64,` URI or an allowed http(s) URL."""
        mime, data = await self._bytes_from_url(url, param)
        if mime is not None and not mime.startswith("image/"):
            raise invalid_request(f"{param}: data URI has type '{mime}', expected an image/* type", param)
        return await self.image_from_bytes(data, param, admit)

    async def image_from_bytes(self, data: bytes, param: str, admit: Callable[[int, int], None] | None = None
                               ) -> ImagePart:
        """`admit(width, height)` is told the image's size before its pixels are decoded (and may refuse it)."""
        return await asyncio.to_thread(decode_image, data, max_pixels=self.limits.max_image_pixels, param=param,
                                       admit=admit)

    def sampling_with(self, settings: dict[str, Any]) -> VideoSampling | None:
        """The video sampling of a request whose mm_processor_kwargs set `settings` (fps / min_frames /
        max_frames over this loader's); None when they set none of those."""
        video = {k: settings[k] for k in ("fps", "min_frames", "max_frames") if k in settings}
        if not video:
            return None
        try:
            return dataclasses.replace(self.video_sampling, **video)
        except ValueError as e:
            raise invalid_request(f"mm_processor_kwargs: {e}", "mm_processor_kwargs") from None

    async def video_from_url(self, url: str, param: str, with_audio: bool = False,
                             sampling: VideoSampling | None = None) -> VideoPart:
        """vLLM's `video_url.url`: a `data:video/...;base64,` URI or an allowed http(s) URL of a video file."""
        mime, data = await self._bytes_from_url(url, param)
        if mime is not None and not mime.startswith("video/"):
            raise invalid_request(f"{param}: data URI has type '{mime}', expected a video/* type (e.g. "
                                  "'data:video/mp4;base64,...')", param)
        return await self.video_from_bytes(data, param, with_audio, sampling)

    async def video_from_bytes(self, data: bytes, param: str, with_audio: bool = False,
                               sampling: VideoSampling | None = None) -> VideoPart:
        """Video file bytes (MP4, WebM, ...) -> the sampled frames (`gateway/media_video.py`), and the
        soundtrack when `with_audio` (use_audio_in_video), in a child process (`gateway/video_process.py`)
        waited on off the loop."""
        self._need_av(param, "video")
        return await self._in_child(data, sampling=sampling or self.video_sampling, param=param, with_audio=with_audio)

    async def _in_child(self, data: bytes, **kw: Any) -> Any:
        """`video_process.decode_in_child` in a worker thread; the memory the child says it needs is waited for
        in the media budget first, and a caller that leaves while that wait is in line withdraws it."""
        from gateway.media_budget import ThreadAdmission, in_admission_thread
        from gateway.video_process import decode_in_child

        admit = ThreadAdmission(self.budget, asyncio.get_running_loop()) if self.budget is not None else None
        try:  # its own threads: waiting for memory, it must not take one a build needs (in_admission_thread)
            return await in_admission_thread(decode_in_child, data, limits=self.limits, admit=admit, **kw)
        except asyncio.CancelledError:
            if admit is not None:
                admit.cancel()
            raise

    @staticmethod
    def _need_av(param: str, what: str) -> None:
        """501 naming PyAV when this server lacks it (the decoders need FFmpeg)."""
        if (e := _av_missing()) is not None:
            raise PipelineError(f"{param}: this server cannot decode {what}: {e}; its operator must install PyAV "
                                "(pip install av)", http_status=501, grpc_code=_GRPC_UNIMPLEMENTED,
                                kind="server_error", param=param)

    def check_counts(self, kinds: Sequence[str], param: str = "messages") -> None:
        """The request's media parts by modality ('audio', 'image', 'video'), checked before any is decoded:
        `max_media_items` in all and `--limit-mm-per-prompt` per modality (400 naming `param`, the field that
        holds them)."""
        if len(kinds) > self.limits.max_media_items:
            raise invalid_request(f"request has {len(kinds)} audio/image/video parts; the limit is "
                                  f"{self.limits.max_media_items}", param)
        for kind, limit in self.limits.limit_mm_per_prompt.items():
            if (n := kinds.count(kind)) > limit:
                raise invalid_request(f"this server takes no {kind} input (--limit-mm-per-prompt {kind}=0)" if limit == 0
                                      else f"request has {n} {kind} parts; at most {limit} may be given in one "
                                      f"request (--limit-mm-per-prompt)", param)

    def check_audio_seconds(self, seconds: float, param: str = "messages") -> None:
        """The request's decoded audio in all (413 naming `param`)."""
        if seconds > self.limits.max_audio_seconds:
            raise too_large(f"request has {seconds:.1f} s of audio in all; the limit is "
                            f"{self.limits.max_audio_seconds:g} s", param)
