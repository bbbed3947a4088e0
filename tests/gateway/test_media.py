"""Media decoding: WAV variants, resampling accuracy, data URIs, images, and the URL policy (schemes,
domains, a loopback fetch, its size / time / redirect limits)."""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import re
import struct
import threading
import time
import wave
from collections.abc import Iterator

import numpy as np
import pytest
from PIL import Image

from gateway.events import PipelineError
from gateway.input_limits import InputLimits
from gateway.media import (MAX_RESAMPLE_TERM, MediaLoader, decode_image, decode_wav, fetch_url, parse_data_uri,
                           resample, resample_ratio, wav_to_audio_part)


def sine(freq: float, rate: int, seconds: float, amp: float = 0.5) -> np.ndarray:
    return amp * np.sin(2 * np.pi * freq * np.arange(int(rate * seconds)) / rate)  # (samples,) float64


def riff(fmt_tag: int, channels: int, rate: int, bits: int, payload: bytes, extensible: bool = False) -> bytes:
    """A WAV file built by hand (the stdlib `wave` writes PCM only)."""
    block = channels * bits // 8
    fmt = struct.pack("<HHIIHH", 0xFFFE if extensible else fmt_tag, channels, rate, rate * block, block, bits)
    if extensible:
        fmt += struct.pack("<HHI", 22, bits, 0) + struct.pack("<H", fmt_tag) + b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"
    chunks = b"fmt " + struct.pack("<I", len(fmt)) + fmt
    chunks += b"LIST" + struct.pack("<I", 3) + b"abc\x00"  # an odd-sized chunk before data (padded)
    chunks += b"data" + struct.pack("<I", len(payload)) + payload
    return b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks


def pcm16_wav(x: np.ndarray, rate: int) -> bytes:
    """x: (frames, channels) float in [-1, 1]."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(x.shape[1]), w.setsampwidth(2), w.setframerate(rate)
        w.writeframes(np.rint(x * 32767).astype("<i2").tobytes())
    return buf.getvalue()



# ------------------------------------------------------------------------------------------- WAV
def test_pcm16_stereo_is_decoded_and_mixed_to_mono() -> None:
    left, right = sine(440, 16_000, 0.5), np.full(8000, 0.25)
    data = pcm16_wav(np.stack([left, right], axis=1), 16_000)
    samples, rate = decode_wav(data, max_seconds=10)
    assert rate == 16_000 and samples.shape == (8000, 2) and samples.dtype == np.float32
    part = wav_to_audio_part(data, max_seconds=10, param="a")
    assert part.sample_rate == 16_000
    np.testing.assert_allclose(part.waveform, (left + right) / 2, atol=2 / 32768)


@pytest.mark.parametrize(("tag", "bits", "encode"), [
    (1, 8, lambda x: np.rint(x * 127 + 128).astype(np.uint8).tobytes()),
    (1, 24, lambda x: b"".join(int(v).to_bytes(3, "little", signed=True) for v in np.rint(x * (2**23 - 1)))),
    (1, 32, lambda x: np.rint(x * (2**31 - 1)).astype("<i4").tobytes()),
    (3, 32, lambda x: x.astype("<f4").tobytes()),
    (3, 64, lambda x: x.astype("<f8").tobytes()),
])
@pytest.mark.parametrize("extensible", [False, True])
def test_other_sample_formats(tag: int, bits: int, encode: object, extensible: bool) -> None:
    x = sine(300, 8000, 0.05)
    samples, rate = decode_wav(riff(tag, 1, 8000, bits, encode(x), extensible), max_seconds=1)  # type: ignore[operator]
    assert rate == 8000 and samples.shape == (400, 1)
    np.testing.assert_allclose(samples[:, 0], x, atol=1 / 120 if bits == 8 else 1e-6)


@pytest.mark.parametrize(("data", "needle"), [
    (b"ID3\x03\x00 mp3 bytes", "not a WAV file"),
    (riff(1, 1, 8000, 16, b"")[:40], "no data chunk"),
    (riff(2, 1, 8000, 16, b"\x00" * 16), "unsupported WAV encoding"),
    (riff(1, 0, 8000, 16, b"\x00" * 16), "inconsistent"),
])
def test_bad_wav_files_are_400(data: bytes, needle: str) -> None:
    with pytest.raises(PipelineError, match=needle) as e:
        decode_wav(data, max_seconds=10, param="input_audio")
    assert e.value.http_status == 400 and e.value.param == "input_audio"


@pytest.mark.parametrize(("frames", "rate"), [(0, 16_000), (1, 16_000), (399, 16_000), (100, 8_000)])
def test_audio_shorter_than_one_feature_window_is_400(frames: int, rate: int) -> None:
    # the processor's STFT (n_fft 400, reflect-padded) cannot frame it: a 400, not a crash in the processor
    with pytest.raises(PipelineError, match=r"at least 0\.025 s is needed") as e:
        wav_to_audio_part(pcm16_wav(np.zeros((frames, 1)), rate), max_seconds=10, param="input_audio")
    assert e.value.http_status == 400 and e.value.param == "input_audio"
    assert wav_to_audio_part(pcm16_wav(np.zeros((400, 1)), 16_000), max_seconds=10, param="a").waveform.size == 400


@pytest.mark.filterwarnings("error::RuntimeWarning")  # the 64-bit overflow is no warning in the gateway's log
@pytest.mark.parametrize(("bits", "bad"), [(32, np.nan), (32, np.inf), (64, 1e300)])  # 1e300: inf as float32
def test_float_audio_that_is_not_finite_is_400(bits: int, bad: float) -> None:
    x = np.full(800, 0.25, np.float32 if bits == 32 else np.float64)
    x[400] = bad
    with pytest.raises(PipelineError, match="NaN or infinite") as e:
        wav_to_audio_part(riff(3, 1, 16_000, bits, x.astype("<f4" if bits == 32 else "<f8").tobytes()),
                          max_seconds=10, param="input_audio")
    assert e.value.http_status == 400 and e.value.param == "input_audio"


def test_too_long_audio_is_413_before_decoding() -> None:
    with pytest.raises(PipelineError, match=r"2\.0 s long; the limit is 1 s") as e:
        decode_wav(pcm16_wav(np.zeros((32_000, 1)), 16_000), max_seconds=1.0)
    assert e.value.http_status == 413


# ------------------------------------------------------------------------------------ resampling
@pytest.mark.parametrize(("src", "dst"), [(44_100, 16_000), (48_000, 16_000), (22_050, 16_000), (8_000, 16_000),
                                          (16_000, 24_000)])
def test_resampled_sine_matches_the_analytic_sine(src: int, dst: int) -> None:
    y = resample(sine(1000, src, 1.0).astype(np.float32), src, dst)
    assert y.shape == (dst,) and y.dtype == np.float32
    ref = sine(1000, dst, 1.0)
    edge = dst // 20  # the first / last 50 ms see the zero padding
    assert np.abs(y[edge:-edge] - ref[edge:-edge]).max() < 1e-4


def test_resampling_removes_what_would_alias_and_keeps_the_passband() -> None:
    def gain_db(freq: float) -> float:
        y = resample(sine(freq, 44_100, 1.0).astype(np.float32), 44_100, 16_000)[800:-800]
        return 20 * np.log10(np.sqrt(np.mean(y**2)) / (0.5 / np.sqrt(2)) + 1e-12)

    assert abs(gain_db(6000)) < 0.05  # flat passband
    assert gain_db(9000) < -80  # would alias to 7 kHz
    assert gain_db(15000) < -80  # would alias to 1 kHz


def test_resample_length_and_identity() -> None:
    x = np.arange(10, dtype=np.float32)
    np.testing.assert_array_equal(resample(x, 16_000, 16_000), x)
    assert resample(np.zeros(441, np.float32), 44_100, 16_000).shape == (160,)
    assert resample(np.zeros(1, np.float32), 44_100, 16_000).shape == (1,)
    with pytest.raises(ValueError, match="positive"):
        resample(x, 0, 16_000)


@pytest.mark.parametrize("rate", [2**30, 44_101, 1_000_003])
def test_a_rate_whose_filter_would_not_fit_is_400_not_gigabytes(rate: int) -> None:
    """A 2**31 Hz header asked for a 10**9-tap filter (~8 GB an array): the gateway was OOM-killed and took the
    mesh down. Rates whose ratio to 16 kHz has a term above MAX_RESAMPLE_TERM are refused before any filter."""
    with pytest.raises(PipelineError, match=rf"a sample rate of {rate} Hz is not supported") as e:
        wav_to_audio_part(riff(1, 1, rate, 16, bytes(3200)), max_seconds=10, param="input_audio")
    assert e.value.http_status == 400 and e.value.param == "input_audio"
    with pytest.raises(ValueError, match="terms above 16384 are not supported"):
        resample(np.zeros(1600, np.float32), rate, 16_000)
    for common in (5_512, 11_025, 37_800, 44_100, 88_200, 352_800, 768_000):
        assert max(resample_ratio(common, 16_000)) <= MAX_RESAMPLE_TERM


def test_a_large_down_sampling_gathers_its_windows_in_bounded_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """1/16384 needs ~10**6 taps per output: the blocks shrink so the gathered windows stay ~16 MB (whole
    blocks gathered ~490 MB here); the filter's own arrays are bounded by MAX_RESAMPLE_TERM. Another block size
    gives the same samples to float rounding (BLAS sums a long row in its own order per batch shape); the
    common rates' taps fit whole blocks, as before."""
    import tracemalloc

    import gateway.media as media

    x = np.random.default_rng(0).standard_normal(2_000_000).astype(np.float32)
    tracemalloc.start()
    y = resample(x, 16_000 * 16_384, 16_000)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert y.shape == (123,) and peak < 150 * 2**20, peak
    monkeypatch.setattr(media, "_RESAMPLE_TEMP", 2**24)  # 4x the block
    np.testing.assert_allclose(resample(x, 16_000 * 16_384, 16_000), y, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------- data URIs and images
def png(size: tuple[int, int], mode: str = "RGBA") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, 77).save(buf, format="PNG")
    return buf.getvalue()


def test_data_uri_round_trip_and_errors() -> None:
    mime, data = parse_data_uri("data:image/png;base64," + base64.b64encode(b"abc").decode(), "p")
    assert (mime, data) == ("image/png", b"abc")
    for uri, needle in [("data:image/png,abc", "base64-encoded"), ("image/png;base64,YWJj", "malformed"),
                        ("data:image/png;base64,@@@", "not valid base64")]:
        with pytest.raises(PipelineError, match=needle) as e:
            parse_data_uri(uri, "p")
        assert e.value.http_status == 400


def test_images_become_rgb_within_the_pixel_limit() -> None:
    for mode in ("RGBA", "L", "P"):
        part = decode_image(png((40, 30), mode), max_pixels=1200, param="img")
        assert part.image.mode == "RGB" and part.image.size == (40, 30)  # type: ignore[attr-defined]
    with pytest.raises(PipelineError, match="41x30 = 1230 pixels; the limit is 1200") as e:
        decode_image(png((41, 30)), max_pixels=1200, param="img")
    assert e.value.http_status == 413
    with pytest.raises(PipelineError, match="could not decode") as e:
        decode_image(b"\x89PNG not really", max_pixels=1200, param="img")
    assert e.value.http_status == 400
    assert "15 bytes in no image format" in str(e.value) and "BytesIO" not in str(e.value)


def test_limits_validate_themselves() -> None:
    with pytest.raises(ValueError, match="max_audio_seconds must be positive"):
        InputLimits(max_audio_seconds=0)


# ------------------------------------------------------------------------------ remote URL policy
class _Handler(http.server.BaseHTTPRequestHandler):
    routes: dict[str, tuple[int, dict[str, str], bytes]] = {}

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/slow":
            time.sleep(1.0)
        status, headers, body = self.routes.get(self.path, (404, {}, b"missing"))
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        if "Content-Length" not in headers and "Transfer-Encoding" not in headers:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if headers.get("Transfer-Encoding") == "chunked":
            for i in range(0, len(body), 1000):
                part = body[i:i + 1000]
                self.wfile.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
        else:
            self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def media_server() -> Iterator[str]:
    wav = pcm16_wav(sine(440, 22_050, 0.5)[:, None], 22_050)
    _Handler.routes = {
        "/a.wav": (200, {"Content-Type": "audio/wav"}, wav),
        "/a.png": (200, {"Content-Type": "image/png"}, png((20, 10))),
        "/big": (200, {}, b"x" * 5000),
        "/big-chunked": (200, {"Transfer-Encoding": "chunked"}, b"x" * 5000),
        "/moved": (302, {"Location": "http://127.0.0.1/elsewhere"}, b""),
        "/slow": (200, {}, b"late"),
    }
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(5)


def run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


def test_allowed_loopback_fetch_decodes_audio_and_images(media_server: str) -> None:
    loader = MediaLoader(InputLimits(), frozenset({"127.0.0.1"}))
    audio = run(loader.audio_from_url(f"{media_server}/a.wav", "audio_url.url"))
    assert audio.sample_rate == 16_000 and audio.waveform.shape == (8000,)  # type: ignore[attr-defined]
    image = run(loader.image_from_url(f"{media_server}/a.png", "image_url.url"))
    assert image.image.size == (20, 10) and image.image.mode == "RGB"  # type: ignore[attr-defined]


@pytest.mark.parametrize(("url", "domains", "status", "needle"), [
    ("file:///etc/passwd", {"127.0.0.1"}, 400, "scheme 'file:' is not allowed"),
    ("ftp://127.0.0.1/a.png", {"127.0.0.1"}, 400, "scheme 'ftp:' is not allowed"),
    ("/a.png", {"127.0.0.1"}, 400, "scheme (none) is not allowed"),
    ("{base}/a.png", set(), 400, "remote media URLs are disabled"),
    ("http://localhost:1/a.png", {"127.0.0.1"}, 400, "domain 'localhost' is not in this server's allowed"),
    ("{base}/missing", {"127.0.0.1"}, 400, "failed with HTTP 404"),
    ("{base}/moved", {"127.0.0.1"}, 400, "redirects are not followed"),
    ("{base}/big", {"127.0.0.1"}, 413, "5000 bytes; the limit is 4000"),
    ("{base}/big-chunked", {"127.0.0.1"}, 413, "larger than the limit of 4000 bytes"),
    ("{base}/slow", {"127.0.0.1"}, 400, "took longer than 0.3 s"),
])
def test_url_policy_refusals(media_server: str, url: str, domains: set[str], status: int, needle: str) -> None:
    # only /slow is about the timeout: the others get time to spare on a loaded host (CI saw 0.3 s run out
    # while the 5000 chunked bytes were still arriving)
    limits = InputLimits(max_fetch_bytes=4000, fetch_timeout_s=0.3 if url.endswith("/slow") else 30.0)
    with pytest.raises(PipelineError, match=re.escape(needle)) as e:
        run(fetch_url(url.format(base=media_server), allowed_domains=frozenset(domains), limits=limits,
                      param="image_url.url"))
    assert e.value.http_status == status and e.value.param == "image_url.url"


@pytest.mark.parametrize(("tag", "encode"), [(7, "linear_to_ulaw"), (6, "linear_to_alaw")])
def test_a_telephony_wav_is_decoded_by_ffmpeg(tag: int, encode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mu-law or A-law WAV sent as "wav" is not parsed here: it goes to FFmpeg as any other file, so it equals
    the same bytes sent as another format; without PyAV the encoding's own 400 stands."""
    import gateway.media as media
    from gateway import realtime_audio

    pcm = np.rint(sine(440, 8_000, 0.5) * 32767).astype(np.int16)
    codes = getattr(realtime_audio, encode)(pcm).astype(np.uint8).tobytes()
    fmt = struct.pack("<HHIIHHH", tag, 1, 8_000, 8_000, 1, 8, 0)  # non-PCM: cbSize 0
    chunks = b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(codes)) + codes
    data = b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks
    b64 = base64.b64encode(data).decode()
    loader = MediaLoader(InputLimits())
    as_wav = run(loader.audio_from_base64(b64, "wav", "input_audio"))
    as_file = run(loader.audio_from_base64(b64, "mp3", "input_audio"))
    assert as_wav.sample_rate == 16_000 and as_wav.waveform.shape == (8_000,)  # type: ignore[attr-defined]
    np.testing.assert_array_equal(as_wav.waveform, as_file.waveform)  # type: ignore[attr-defined]
    y = as_wav.waveform[800:-800]  # type: ignore[attr-defined]
    assert np.abs(y - sine(440, 16_000, 0.5)[800:-800]).max() < 0.02  # G.711's step, not noise
    monkeypatch.setattr(media, "_av_missing", lambda: ImportError("No module named 'av'"))
    with pytest.raises(PipelineError, match=f"unsupported WAV encoding \\(format tag {tag}, 8 bits\\)") as e:
        run(loader.audio_from_base64(b64, "wav", "input_audio"))
    assert e.value.http_status == 400


def test_an_adpcm_wav_is_decoded_by_ffmpeg() -> None:
    """ADPCM's block_align is a block of many samples: the PCM header check refused it as "inconsistent" before
    it could reach FFmpeg; it now goes there as every encoding this module does not parse."""
    av = pytest.importorskip("av")
    buf = io.BytesIO()
    with av.open(buf, "w", format="wav") as out:
        stream = out.add_stream("adpcm_ms", rate=16_000, layout="mono")
        frame = av.AudioFrame.from_ndarray(sine(440, 16_000, 0.5).astype(np.float32)[None], format="flt",
                                           layout="mono")
        frame.sample_rate = 16_000
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            out.mux(packet)
    data = buf.getvalue()
    assert struct.unpack_from("<H", data, 20)[0] == 2  # WAVE_FORMAT_ADPCM
    part = run(MediaLoader(InputLimits()).audio_from_base64(base64.b64encode(data).decode(), "wav", "input_audio"))
    y = part.waveform[800:7000]  # type: ignore[attr-defined]
    assert part.sample_rate == 16_000 and np.abs(y - sine(440, 16_000, 0.5)[800:7000]).max() < 0.05


def test_loader_refuses_unsupported_input_audio_format() -> None:
    with pytest.raises(PipelineError, match="'amr' is not supported; supported: wav, mp3, flac") as e:
        run(MediaLoader(InputLimits()).audio_from_base64("AAAA", "amr", "input_audio"))
    assert e.value.http_status == 400 and e.value.param == "input_audio.format"


def test_loader_totals() -> None:
    loader = MediaLoader(InputLimits(max_audio_seconds=10, max_media_items=2))
    loader.check_audio_seconds(10.0)
    with pytest.raises(PipelineError, match="12.0 s of audio") as e:
        loader.check_audio_seconds(12.0)
    assert e.value.http_status == 413
    loader.check_counts(["audio", "video"])
    with pytest.raises(PipelineError, match="3 audio/image/video parts; the limit is 2") as e:
        loader.check_counts(["audio", "image", "image"])
    assert e.value.http_status == 400


def test_loader_counts_per_modality() -> None:
    """--limit-mm-per-prompt: a count per modality, 0 = the modality is refused, others bounded only in all."""
    loader = MediaLoader(InputLimits(limit_mm_per_prompt={"image": 2, "video": 0}))
    loader.check_counts(["image", "image", "audio", "audio", "audio"])
    with pytest.raises(PipelineError) as e:
        loader.check_counts(["audio", "image", "image", "image"])
    assert e.value.http_status == 400 and e.value.param == "messages"
    assert str(e.value) == "request has 3 image parts; at most 2 may be given in one request (--limit-mm-per-prompt)"
    with pytest.raises(PipelineError) as e:
        loader.check_counts(["video"])
    assert str(e.value) == "this server takes no video input (--limit-mm-per-prompt video=0)"


def test_video_without_pyav_is_a_501_naming_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    """A gateway installed without PyAV still serves everything else; a video part says what is missing."""
    import sys

    monkeypatch.setitem(sys.modules, "gateway.media_video", None)  # `import` now raises ImportError
    with pytest.raises(PipelineError, match=r"cannot decode video: .*pip install av") as e:
        run(MediaLoader(InputLimits()).video_from_bytes(b"\x00" * 64, "messages[0].content[0].video"))
    assert e.value.http_status == 501 and e.value.grpc_code == 12 and e.value.param == "messages[0].content[0].video"
