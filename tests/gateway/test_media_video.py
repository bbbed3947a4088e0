"""Video input at the gateway: `decode_video` keeps exactly the frames `VideoSampling` picks (MP4 with
mpeg4 / H.264, WebM with VP9 where the container stores no frame count), its refusals (not a video, a
still image, a WAV, too long, frames too large, truncated), the soundtrack decoded only with
use_audio_in_video, and `video_url` / gRPC `video` parts reaching the pipeline as `VideoPart`s. Every clip is made here with PyAV: frame i is a constant gray level, so the
frames kept can be told apart after lossy coding."""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import threading
import wave
from pathlib import Path
from types import SimpleNamespace

import grpc
import httpx
import numpy as np
import pytest
from gateway_harness import GrpcServer, RestServer, ScriptedPipeline
from PIL import Image

av = pytest.importorskip("av", reason="PyAV (the av package) decodes video; pip install av")

from gateway.events import PipelineError, TextPart, VideoPart  # noqa: E402
from gateway.grpc_api import OmniServicer  # noqa: E402
from gateway.input_limits import InputLimits  # noqa: E402
from gateway.media import MediaLoader, video_sampling_of  # noqa: E402
from gateway.media_video import _native_fps, decode_video  # noqa: E402
from gateway.rest import create_app  # noqa: E402
from omnimesh.models.qwen3_omni.video_sampling import VideoSampling  # noqa: E402
from omnimesh.v1 import omni_pb2, omni_pb2_grpc  # noqa: E402

W, H = 64, 48
GRAY_STEP = 14  # gray level of frame i: 10 + GRAY_STEP * i (clips of up to 16 frames)
TOLERANCE = 6  # the codecs' error on a flat frame, in gray levels
SAMPLING = VideoSampling()  # 2 fps, at least 4 frames, pairs


def gray(i: int) -> int:
    return 10 + GRAY_STEP * i


def make_video(n: int = 12, rate: int = 4, *, fmt: str = "mp4", codec: str = "mpeg4", w: int = W, h: int = H,
               path: Path | None = None, options: dict[str, str] | None = None, tone_hz: float | None = None) -> bytes:
    """A clip of `n` flat frames (frame i at gray level `gray(i)`), `rate` frames per second; with `tone_hz`
    a stereo AAC soundtrack at 44.1 kHz: that tone on both channels for the clip's whole length."""
    target: io.BytesIO | str = io.BytesIO() if path is None else str(path)
    with av.open(target, mode="w", format=fmt, options=options or {}) as c:
        s = c.add_stream(codec, rate=rate)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        sound = c.add_stream("aac", rate=44100, layout="stereo") if tone_hz else None  # before any packet
        for i in range(n):
            rgb = np.full((h, w, 3), gray(i), np.uint8)  # (H, W, 3)
            for packet in s.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                c.mux(packet)
        for packet in s.encode():
            c.mux(packet)
        if sound is not None and tone_hz:
            t = np.arange(int(44100 * n / rate)) / 44100
            pcm = np.repeat((0.3 * np.sin(2 * np.pi * tone_hz * t)).astype(np.float32)[None], 2, axis=0)  # (2, n)
            for start in range(0, t.size, 1024):
                frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm[:, start:start + 1024]), format="fltp",
                                                   layout="stereo")
                frame.sample_rate, frame.pts = 44100, start
                for packet in sound.encode(frame):
                    c.mux(packet)
            for packet in sound.encode():
                c.mux(packet)
    return target.getvalue() if isinstance(target, io.BytesIO) else Path(target).read_bytes()


def data_uri(data: bytes, mime: str = "video/mp4") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def png_bytes() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (W, H), (1, 2, 3)).save(buf, format="PNG")
    return buf.getvalue()


def wav_bytes() -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16_000)
        w.writeframes(np.zeros(8000, "<i2").tobytes())
    return buf.getvalue()


def frame_levels(frames: np.ndarray) -> list[int]:
    """(T, H, W, 3) -> each frame's mean gray level."""
    return [round(float(f.mean())) for f in frames]


def assert_kept(part: VideoPart, indices: list[int]) -> None:
    assert part.frames.dtype == np.uint8 and part.frames.shape == (len(indices), H, W, 3)
    got = frame_levels(part.frames)
    assert all(abs(g - gray(i)) <= TOLERANCE for g, i in zip(got, indices, strict=True)), (got, indices)


def decode(data: bytes, limits: InputLimits | None = None, sampling: VideoSampling = SAMPLING) -> VideoPart:
    return decode_video(data, sampling=sampling, limits=limits or InputLimits(), param="v")


# -------------------------------------------------------------------------------------------- decoding
@pytest.mark.parametrize(("fmt", "codec", "n", "rate"), [
    ("mp4", "mpeg4", 12, 4),  # 3 s -> 6 frames at 2 fps
    ("mp4", "libx264", 16, 8),  # 2 s -> 4 frames (min_frames)
    ("webm", "libvpx-vp9", 12, 4),  # no frame count in the container: counted from its packets
    ("matroska", "mpeg4", 9, 4),  # 2.25 s -> 4 frames
])
def test_the_sampled_frames_are_kept(fmt: str, codec: str, n: int, rate: int) -> None:
    data = make_video(n, rate, fmt=fmt, codec=codec)
    part = decode(data)
    assert part.fps == SAMPLING.fps
    assert_kept(part, SAMPLING.indices(n, rate))


def test_webm_has_no_stored_frame_count() -> None:
    """So the WebM case above runs the packet-counting pass."""
    with av.open(io.BytesIO(make_video(fmt="webm", codec="libvpx-vp9"))) as c:
        assert c.streams.video[0].frames == 0


def test_the_loader_uses_its_sampling() -> None:
    sampling = VideoSampling(fps=1.0, min_frames=2, max_frames=8)
    loader = MediaLoader(InputLimits(), video_sampling=sampling)
    part = asyncio.run(loader.video_from_url(data_uri(make_video(16, 4)), "v"))  # 4 s at 1 fps -> 4 frames
    assert part.fps == 1.0
    assert_kept(part, sampling.indices(16, 4))
    assert MediaLoader(InputLimits()).video_sampling == VideoSampling()  # the default, built lazily


def test_a_truncated_upload_keeps_the_frames_before_the_cut(tmp_path: Path) -> None:
    """moov first (faststart): the header counts 12 frames, the bytes end after a few of them."""
    full = make_video(12, 4, path=tmp_path / "clip.mp4", options={"movflags": "faststart"})
    indices = SAMPLING.indices(12, 4)  # 0, 2, 4, 6, 8, 10
    part = decode(full[:int(len(full) * 0.7)])  # the cut falls a few frames in
    assert 2 <= len(part.frames) < len(indices) and part.frames.shape[1:] == (H, W, 3)
    levels = frame_levels(part.frames)[:-1]  # the last one may be half decoded (its packet is cut)
    assert all(abs(g - gray(i)) <= TOLERANCE for g, i in zip(levels, indices)), levels
    with pytest.raises(PipelineError, match="no frame of the video could be decoded") as e:
        decode(full[:int(len(full) * 0.5)])  # header intact, no frame data
    assert e.value.http_status == 400


# --------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(("data", "needle"), [
    (np.random.default_rng(0).bytes(4000), "no container format"),
    (b"", "no container format"),
    (wav_bytes(), "no video stream"),
    (png_bytes(), "still image"),
])
def test_what_is_not_a_video_is_a_400(data: bytes, needle: str) -> None:
    with pytest.raises(PipelineError, match=needle) as e:
        decode(data)
    assert e.value.http_status == 400 and e.value.param == "v" and e.value.message.startswith("v: ")


def test_corrupt_bytes_never_escape_as_av_errors() -> None:
    src = make_video(12, 4, codec="libx264")
    rng = np.random.default_rng(1)
    for k in range(60):
        data = bytearray(src)
        for pos in rng.integers(0, len(data), 1 + k % 30):
            data[pos] = int(rng.integers(0, 256))
        try:
            part = decode(bytes(data))
        except PipelineError as e:
            assert e.http_status in (400, 413) and e.param == "v"
        else:
            assert part.frames.ndim == 4 and part.frames.dtype == np.uint8


def test_too_long_too_large_and_too_slow() -> None:
    with pytest.raises(PipelineError, match=r"3.0 s long .*the limit is 2 s") as e:
        decode(make_video(12, 4), InputLimits(max_video_seconds=2.0))
    assert e.value.http_status == 413
    with pytest.raises(PipelineError, match=f"{W}x{H} = {W * H} pixels; the limit is {W * H - 1}") as e:
        decode(make_video(4, 4), InputLimits(max_image_pixels=W * H - 1))
    assert e.value.http_status == 413
    n = len(SAMPLING.indices(4, 4.0))  # the sampled frames as RGB, against max_video_pixels
    with pytest.raises(PipelineError, match=f"{n} sampled frames of {W}x{H} are {n * W * H} pixels") as e:
        decode(make_video(4, 4), InputLimits(max_video_pixels=n * W * H - 1))
    assert e.value.http_status == 413
    assert decode(make_video(4, 4), InputLimits(max_video_pixels=n * W * H)).frames.shape[0] == n
    with pytest.raises(PipelineError, match=r"decoding the video took longer than 1e-09 s \(after 0 of the 11 frames") as e:
        decode(make_video(12, 4), InputLimits(video_decode_timeout_s=1e-9))
    assert e.value.http_status == 400


def test_the_soundtrack_is_decoded_only_when_asked() -> None:
    """use_audio_in_video: the AAC track becomes a 16 kHz mono AudioPart of the clip's length with its tone;
    without the flag it is not read; a silent clip with the flag is a 400."""
    clip = make_video(8, 4, tone_hz=440.0)  # 2 s
    assert decode(clip).audio is None
    part = decode_video(clip, sampling=SAMPLING, limits=InputLimits(), param="v", with_audio=True)
    assert_kept(part, SAMPLING.indices(8, 4))
    audio = part.audio
    assert audio is not None and audio.sample_rate == 16_000 and audio.waveform.dtype == np.float32
    assert abs(audio.waveform.size / 16_000 - 2.0) < 0.1  # AAC adds its priming and padding samples
    spectrum = np.abs(np.fft.rfft(audio.waveform))
    assert abs(float(np.argmax(spectrum)) * 16_000 / audio.waveform.size - 440.0) < 5
    assert 0.25 < float(np.abs(audio.waveform).max()) < 0.35  # both channels averaged: the tone's 0.3
    with pytest.raises(PipelineError, match="no audio track") as e:
        decode_video(make_video(8, 4), sampling=SAMPLING, limits=InputLimits(), param="v", with_audio=True)
    assert e.value.http_status == 400 and e.value.param == "v"
    with pytest.raises(PipelineError, match="audio is longer than 1 s") as e:
        decode_video(clip, sampling=SAMPLING, limits=InputLimits(max_audio_seconds=1.0), param="v", with_audio=True)
    assert e.value.http_status == 413


def test_a_broken_soundtrack_is_a_400_only_when_heard() -> None:
    """A clip whose AAC configuration is garbage, and one whose audio track holds no packet: their frames
    decode as always, and use_audio_in_video on them is a 400 saying what to send instead."""
    clip = make_video(8, 4, fmt="matroska", tone_hz=440.0)
    with av.open(io.BytesIO(clip)) as c:
        config = bytes(c.streams.audio[0].codec_context.extradata)  # AAC's AudioSpecificConfig
    assert clip.count(config) == 1
    garbled = clip.replace(config, b"\xff" * len(config))
    empty = io.BytesIO()
    with av.open(empty, mode="w", format="matroska") as c:
        s = c.add_stream("mpeg4", rate=4)
        s.width, s.height, s.pix_fmt = W, H, "yuv420p"
        c.add_stream("aac", rate=44100, layout="stereo")  # declared, never written to
        for i in range(8):
            for packet in s.encode(av.VideoFrame.from_ndarray(np.full((H, W, 3), gray(i), np.uint8), format="rgb24")):
                c.mux(packet)
        for packet in s.encode():
            c.mux(packet)
    for data, needle in [(garbled, "v: could not decode the video's audio track (Invalid data found when processing "
                                   "input); send an intact video file, or its audio as an input_audio part"),
                         (empty.getvalue(), "v: the video's audio track holds no samples; leave use_audio_in_video "
                                            "off for this request")]:
        assert_kept(decode(data), SAMPLING.indices(8, 4))
        with pytest.raises(PipelineError) as e:
            decode_video(data, sampling=SAMPLING, limits=InputLimits(), param="v", with_audio=True)
        assert e.value.http_status == 400 and e.value.param == "v" and e.value.message == needle


def test_an_unknown_frame_rate_is_a_400() -> None:
    stream = SimpleNamespace(average_rate=None, guessed_rate=None)
    with pytest.raises(PipelineError, match="frame rate is unknown") as e:
        _native_fps(stream, "v")  # type: ignore[arg-type]
    assert e.value.http_status == 400


def test_an_allowed_loopback_url_is_fetched_and_decoded() -> None:
    """`video_url` with an http URL on an operator-allowed domain (here 127.0.0.1): fetched, then decoded
    like inline bytes; a domain not allowed is refused before any connection."""
    clip = make_video(12, 4)

    class Clip(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            self.send_response(200)
            self.send_header("Content-Type", "video/mp4")
            self.send_header("Content-Length", str(len(clip)))
            self.end_headers()
            self.wfile.write(clip)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Clip)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/clip.mp4"
        part = asyncio.run(MediaLoader(InputLimits(), frozenset({"127.0.0.1"})).video_from_url(url, "v"))
        assert_kept(part, SAMPLING.indices(12, 4))
        with pytest.raises(PipelineError, match="remote media URLs are disabled") as e:
            asyncio.run(MediaLoader(InputLimits()).video_from_url(url, "v"))
        assert e.value.http_status == 400
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_a_non_video_data_uri_is_a_400() -> None:
    with pytest.raises(PipelineError, match="'image/png', expected a video/\\* type") as e:
        asyncio.run(MediaLoader(InputLimits()).video_from_url(data_uri(png_bytes(), "image/png"), "v"))
    assert e.value.http_status == 400 and e.value.param == "v"


def test_limits_and_sampling_plumbing() -> None:
    with pytest.raises(ValueError, match="max_video_seconds"):
        InputLimits(max_video_seconds=0)
    with pytest.raises(ValueError, match="max_video_pixels"):
        InputLimits(max_video_pixels=0)
    with pytest.raises(ValueError, match="video_decode_timeout_s"):
        InputLimits(video_decode_timeout_s=0)
    sampling = VideoSampling(fps=1.0)
    builder = SimpleNamespace(processor=SimpleNamespace(video_processor=SimpleNamespace(sampling=sampling)))
    assert video_sampling_of(builder) is sampling
    assert video_sampling_of(SimpleNamespace(processor=object())) is None and video_sampling_of(None) is None
    pipeline = ScriptedPipeline()
    pipeline.prepare = builder  # type: ignore[attr-defined]  # what StagePipeline calls its PromptBuilder
    assert create_app(pipeline).state.gateway.loader.video_sampling is sampling
    assert OmniServicer(pipeline).loader.video_sampling is sampling


# ------------------------------------------------------------------------------------------ front ends
def post(server: RestServer, messages: list[dict]) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/chat/completions", json={"messages": messages}, timeout=10)


def video_part(data: bytes, mime: str = "video/mp4") -> dict:
    return {"type": "video_url", "video_url": {"url": data_uri(data, mime)}}


def test_rest_video_url_reaches_the_pipeline(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    r = post(rest_server, [{"role": "user", "content": [{"type": "text", "text": "what happens?"},
                                                        video_part(make_video(12, 4))]}])
    assert r.status_code == 200, r.text
    text, video = pipeline.requests[-1].messages[0].content
    assert text == TextPart("what happens?")
    assert isinstance(video, VideoPart) and video.fps == SAMPLING.fps
    assert_kept(video, SAMPLING.indices(12, 4))


@pytest.mark.parametrize(("messages", "status", "param", "needle"), [
    ([{"role": "assistant", "content": [video_part(make_video(4, 4))]}], 400, "messages[0].content[0]",
     "only user messages may carry audio, images or video"),
    ([{"role": "user", "content": [{"type": "video_url"}]}], 400, "messages[0].content[0]",
     "needs a 'video_url' field"),
    ([{"role": "user", "content": [{"type": "video_url", "video_url": {"url": 3}}]}], 400,
     "messages[0].content[0].video_url.url", "string"),
    ([{"role": "user", "content": [video_part(png_bytes(), "image/png")]}], 400,
     "messages[0].content[0].video_url.url", "video/*"),
    ([{"role": "user", "content": [video_part(b"not a video at all")]}], 400,
     "messages[0].content[0].video_url.url", "no container format"),
    ([{"role": "user", "content": [video_part(make_video(4, 4, w=320, h=240))]}], 413,
     "messages[0].content[0].video_url.url", "76800 pixels"),
    ([{"role": "user", "content": [video_part(make_video(4, 4))] * 5}], 400, "messages", "limit is 4"),
])
def test_rest_video_errors(rest_server: RestServer, pipeline: ScriptedPipeline, messages: list[dict], status: int,
                           param: str, needle: str) -> None:
    r = post(rest_server, messages)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err
    assert pipeline.requests == []


def test_rest_use_audio_in_video(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    """vLLM-Omni's `mm_processor_kwargs: {"use_audio_in_video": true}` brings each video's soundtrack along."""
    content = [video_part(make_video(8, 4, tone_hz=440.0))]
    body = {"messages": [{"role": "user", "content": content}]}
    for flag in (True, False):
        r = httpx.post(f"{rest_server.base_url}/v1/chat/completions", timeout=10,
                       json={**body, "mm_processor_kwargs": {"use_audio_in_video": flag}})
        assert r.status_code == 200, r.text
        (video,) = pipeline.requests[-1].messages[0].content
        assert isinstance(video, VideoPart) and (video.audio is not None) == flag
    for kwargs, status, param, needle in [
        ({"use_audio_in_video": "yes"}, 400, "mm_processor_kwargs.use_audio_in_video", "bool"),
        ({"do_resize": False}, 400, "mm_processor_kwargs.do_resize", "unknown field"),
        ({"fps": 0}, 400, "mm_processor_kwargs", "mm_processor_kwargs['fps'] must be positive, got 0"),
        ({"max_frames": 1}, 400, "mm_processor_kwargs", "temporal_patch_size <= max_frames"),
    ]:
        r = httpx.post(f"{rest_server.base_url}/v1/chat/completions", timeout=10,
                       json={**body, "mm_processor_kwargs": kwargs})
        assert r.status_code == status and r.json()["error"]["param"] == param, r.text
        assert needle in r.json()["error"]["message"]
    silent = {"messages": [{"role": "user", "content": [video_part(make_video(8, 4))]}],
              "mm_processor_kwargs": {"use_audio_in_video": True}}
    r = httpx.post(f"{rest_server.base_url}/v1/chat/completions", json=silent, timeout=10)
    assert r.status_code == 400 and "no audio track" in r.json()["error"]["message"], r.text
    long_clip = {"messages": [{"role": "user", "content": [video_part(make_video(12, 2, tone_hz=440.0))]}],
                 "mm_processor_kwargs": {"use_audio_in_video": True}}  # 6 s of soundtrack, the harness allows 5
    r = httpx.post(f"{rest_server.base_url}/v1/chat/completions", json=long_clip, timeout=10)
    assert r.status_code == 413, r.text


def test_grpc_video_part_reaches_the_pipeline(grpc_server: GrpcServer, pipeline: ScriptedPipeline) -> None:
    msg = omni_pb2.ChatMessage(role="user", content=[omni_pb2.ContentPart(text="what happens?"),
                                                     omni_pb2.ContentPart(video=make_video(12, 4))])
    with grpc.insecure_channel(grpc_server.target) as ch:
        out = list(omni_pb2_grpc.OmniStub(ch).Generate(
            omni_pb2.GenerateRequest(messages=[msg], modalities=["text"]), timeout=10))
    assert out[-1].WhichOneof("kind") == "done", out
    _, video = pipeline.requests[-1].messages[0].content
    assert isinstance(video, VideoPart) and video.audio is None
    assert_kept(video, SAMPLING.indices(12, 4))
    heard = omni_pb2.ChatMessage(role="user", content=[omni_pb2.ContentPart(video=make_video(8, 4, tone_hz=440.0))])
    with grpc.insecure_channel(grpc_server.target) as ch:
        out = list(omni_pb2_grpc.OmniStub(ch).Generate(
            omni_pb2.GenerateRequest(messages=[heard], modalities=["text"], use_audio_in_video=True), timeout=10))
    assert out[-1].WhichOneof("kind") == "done", out
    (video,) = pipeline.requests[-1].messages[0].content
    assert isinstance(video, VideoPart) and video.audio is not None and video.audio.sample_rate == 16_000
    with grpc.insecure_channel(grpc_server.target) as ch:
        bad = omni_pb2.ChatMessage(role="user", content=[omni_pb2.ContentPart(video=b"nope")])
        out = list(omni_pb2_grpc.OmniStub(ch).Generate(omni_pb2.GenerateRequest(messages=[bad]), timeout=10))
    assert [r.WhichOneof("kind") for r in out] == ["error"]
    assert out[0].error.code == 3 and "messages[0].content[0].video" in out[0].error.message
