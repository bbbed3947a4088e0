"""Video decoding in a child process (gateway/video_process.py): the same frames, soundtrack and refusals as
decoding in the gateway, and the failures that must not reach the gateway: a decoder that segfaults, one
stuck past the deadline (killed) and one that raises a bug are each a 400 naming what happened, and the
next video decodes normally. No child outlives its request."""

from __future__ import annotations

import asyncio
import multiprocessing

import numpy as np
import pytest
import video_decoders

pytest.importorskip("av", reason="PyAV (the av package) decodes video; pip install av")

from gateway import video_process  # noqa: E402
from gateway.events import PipelineError  # noqa: E402
from gateway.input_limits import InputLimits  # noqa: E402
from gateway.media import MediaLoader  # noqa: E402
from gateway.media_video import decode_video  # noqa: E402
from omnimesh.models.qwen3_omni.video_sampling import VideoSampling  # noqa: E402
from test_media_video import make_video  # noqa: E402

SAMPLING = VideoSampling()


def in_child(data: bytes, limits: InputLimits | None = None, **kw: object):  # type: ignore[no-untyped-def]
    return video_process.decode_in_child(data, sampling=SAMPLING, limits=limits or InputLimits(), param="v", **kw)


def test_the_child_decodes_what_the_gateway_would() -> None:
    data = make_video(12, 4, tone_hz=440.0)
    here = decode_video(data, sampling=SAMPLING, limits=InputLimits(), param="v", with_audio=True)
    there = in_child(data, with_audio=True)
    assert there.fps == here.fps and np.array_equal(there.frames, here.frames)
    assert there.audio is not None and here.audio is not None
    assert np.array_equal(there.audio.waveform, here.audio.waveform)
    assert not multiprocessing.active_children()


def test_refusals_come_back_as_they_are() -> None:
    data = make_video(12, 4)
    limits = InputLimits(max_video_seconds=2.0)
    with pytest.raises(PipelineError) as here:
        decode_video(data, sampling=SAMPLING, limits=limits, param="v")
    with pytest.raises(PipelineError) as there:
        in_child(data, limits)
    assert (there.value.message, there.value.http_status, there.value.param) == (
        here.value.message, here.value.http_status, here.value.param) and here.value.http_status == 413


@pytest.mark.parametrize(("decoder", "needle"), [
    (video_decoders.crash, "v: the video decoder failed on this file (it was killed by SIGSEGV); send an intact"),
    (video_decoders.raise_bug, "v: the video decoder failed on this file (RuntimeError); send an intact video"),
])
def test_a_broken_decoder_is_a_400_and_the_next_video_decodes(decoder, needle: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(PipelineError) as e:
        in_child(make_video(4, 4), decoder=decoder)
    assert e.value.http_status == 400 and e.value.param == "v" and needle in e.value.message
    assert in_child(make_video(4, 4)).frames.shape[0] == 4
    assert not multiprocessing.active_children()


def test_a_stuck_decoder_is_killed_at_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    monkeypatch.setattr(video_process, "GRACE_S", 0.3)
    started = time.monotonic()
    with pytest.raises(PipelineError, match=r"v: decoding the video took longer than 0.2 s; send a shorter") as e:
        in_child(make_video(4, 4), InputLimits(video_decode_timeout_s=0.2), decoder=video_decoders.hang)
    assert e.value.http_status == 400 and time.monotonic() - started < 5.0
    assert not multiprocessing.active_children()  # killed, not left running


def test_the_loader_decodes_in_a_child(monkeypatch: pytest.MonkeyPatch) -> None:
    """MediaLoader.video_from_bytes goes through the child process (a crash there is a 400, not the gateway's)."""
    calls: list[str] = []
    real = video_process.decode_in_child

    def spy(data: bytes, **kw: object):  # type: ignore[no-untyped-def]
        calls.append(str(kw["param"]))
        return real(data, decoder=video_decoders.crash, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(video_process, "decode_in_child", spy)
    with pytest.raises(PipelineError, match="killed by SIGSEGV"):
        asyncio.run(MediaLoader(InputLimits()).video_from_bytes(make_video(4, 4), "messages[0].content[0].video"))
    assert calls == ["messages[0].content[0].video"]


def test_every_decode_is_counted_by_outcome(rest_server, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """omnimesh:video_decodes{outcome} and omnimesh:video_decode_seconds on the gateway's /metrics."""
    import httpx

    def counts() -> dict[str, float]:
        text = httpx.get(f"{rest_server.base_url}/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line.startswith("omnimesh:video_decodes_total{"):
                out[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
            elif line.startswith("omnimesh:video_decode_seconds_count"):
                out["count"] = float(line.rsplit(" ", 1)[1])
        return out

    before = counts()
    assert set(before) == {"ok", "refused", "timeout", "crashed", "cancelled", "bug", "count"}
    in_child(make_video(4, 4))
    with pytest.raises(PipelineError, match=r"decoding the video took longer than 1e-09 s \(after 0 of"):
        in_child(make_video(4, 4), InputLimits(video_decode_timeout_s=1e-9))  # the decoder's own deadline
    monkeypatch.setattr(video_process, "GRACE_S", 0.2)
    for decoder, limits in ((video_decoders.crash, None), (video_decoders.raise_bug, None),
                            (video_decoders.hang, InputLimits(video_decode_timeout_s=0.1))):
        with pytest.raises(PipelineError):
            in_child(make_video(4, 4), limits, decoder=decoder)
    with pytest.raises(PipelineError):
        in_child(make_video(12, 4), InputLimits(max_video_seconds=1.0))  # refused: over a limit
    after = counts()
    assert {k: after[k] - before[k] for k in after} == {"ok": 1, "refused": 1, "timeout": 2, "crashed": 1,
                                                        "cancelled": 0, "bug": 1, "count": 6}
