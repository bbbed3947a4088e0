"""vLLM's own /v1/realtime dialect (gateway/realtime_vllm.py) on the scripted pipeline: a client that names the
model at the top level of session.update speaks it; commit, 16 kHz pcm16 appends and the final commit give
`transcription.delta` events and `transcription.done` with the text and the usage, the stream transcribed as
/v1/audio/transcriptions transcribes (one text-only chat: the clip and the instruction); a pause in the
speech cuts the stream into clips transcribed in order, none of the audio heard twice or dropped; audio waiting
for its text is bounded by max_audio_seconds; a clip the pipeline fails is an error event before the done; mistakes
are vLLM-shaped error events and the connection goes on."""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
from gateway_harness import RestServer, ScriptedPipeline
from test_realtime import recv, speech, url
from websockets.sync.client import ClientConnection, connect

from gateway.audio_encoding import pcm16_bytes
from gateway.events import AudioPart, TextPart
from gateway.media import resample


def send(ws: ClientConnection, **event: Any) -> None:
    ws.send(json.dumps(event))


def append(ws: ClientConnection, samples: np.ndarray, chunk: int = 3200) -> None:
    pcm = pcm16_bytes(samples)
    for at in range(0, len(pcm), chunk):
        send(ws, type="input_audio_buffer.append", audio=base64.b64encode(pcm[at:at + chunk]).decode())


def until_done(ws: ClientConnection) -> list[dict[str, Any]]:
    out = [recv(ws)]
    while out[-1]["type"] != "transcription.done":
        assert out[-1]["type"] != "error", out[-1]
        out.append(recv(ws))
    return out


def test_a_stream_is_transcribed_as_the_transcriptions_endpoint(rest_server: RestServer,
                                                                pipeline: ScriptedPipeline) -> None:
    tone = (0.3 * np.sin(np.arange(8000) / 5)).astype(np.float32)  # 0.5 s at 16 kHz, no speech: one clip
    with connect(url(rest_server).split("?")[0], open_timeout=10) as ws:  # vLLM's clients name no model here
        assert recv(ws)["type"] == "session.created"
        send(ws, type="session.update", model="tiny-omni")
        send(ws, type="input_audio_buffer.commit")
        append(ws, tone)
        send(ws, type="input_audio_buffer.commit", final=True)
        events = until_done(ws)
    assert [e["delta"] for e in events[:-1]] == ["Hello", " world"]
    assert events[-1] == {"type": "transcription.done", "text": "Hello world",
                          "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}}
    [req] = pipeline.requests
    clip, ask = req.messages[0].content
    assert isinstance(clip, AudioPart) and clip.sample_rate == 16_000 and clip.waveform.size == tone.size
    assert np.abs(clip.waveform - tone).max() <= 1 / 32768 and ask == TextPart("Transcribe the audio into text.")
    assert req.modalities == ("text",) and req.sampling.temperature == 0


def test_a_pause_cuts_the_stream_into_clips(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    said = resample(speech(), 24_000, 16_000)
    stream = np.concatenate([said, np.zeros(16_000, np.float32), said, np.zeros(4000, np.float32)])
    with connect(url(rest_server).split("?")[0], open_timeout=10) as ws:
        recv(ws)
        send(ws, type="session.update", model="tiny-omni")
        send(ws, type="input_audio_buffer.commit")
        append(ws, stream)
        send(ws, type="input_audio_buffer.commit", final=True)
        events = until_done(ws)
    assert len(pipeline.requests) >= 2  # cut at the pause (and maybe after the second sentence)
    clips = [r.messages[0].content[0] for r in pipeline.requests]
    assert sum(c.waveform.size for c in clips) == stream.size  # type: ignore[union-attr]  # all of it, once
    assert events[-1]["text"] == " ".join(["Hello world"] * len(clips))
    assert "".join(e["delta"] for e in events[:-1]) == events[-1]["text"]


def test_mistakes_are_vllm_error_events(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    with connect(url(rest_server).split("?")[0], open_timeout=10) as ws:
        recv(ws)
        send(ws, type="session.update", model="tiny-omni")  # the dialect from here on
        for event, code in (({"type": "input_audio_buffer.commit", "final": True}, "input_audio_buffer_commit_empty"),
                            ({"type": "input_audio_buffer.append", "audio": "@@"}, "invalid_audio"),
                            ({"type": "input_audio_buffer.append", "audio": "AA=="}, "invalid_audio"),
                            ({"type": "session.update", "model": "whisper-1"}, "model_not_found"),
                            ({"type": "response.create"}, "unknown_event")):
            send(ws, **event)
            error = recv(ws)
            assert error["type"] == "error" and error["code"] == code and isinstance(error["error"], str), error
        ws.send("{")
        assert recv(ws)["code"] == "invalid_json"
        send(ws, type="input_audio_buffer.commit")  # the connection goes on
        append(ws, np.zeros(1600, np.float32))
        send(ws, type="input_audio_buffer.commit", final=True)
        assert until_done(ws)[-1]["text"] == "Hello world"


def test_audio_waiting_for_its_text_is_bounded(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    """A client faster than the transcription: clips wait in turn, but not beyond max_audio_seconds (5 s in the
    test limits) of audio not transcribed yet; the refused chunk is an error event and the stream goes on."""
    pipeline.event_delay_s = 1.0  # each clip's text takes ~3 s (three events)
    said = resample(speech(), 24_000, 16_000)
    turn = np.concatenate([said, np.zeros(16_000, np.float32)])  # ~2.25 s: a sentence, then a pause
    with connect(url(rest_server).split("?")[0], open_timeout=10) as ws:
        recv(ws)
        send(ws, type="session.update", model="tiny-omni")
        send(ws, type="input_audio_buffer.commit")
        for _ in range(3):
            append(ws, turn, chunk=len(pcm16_bytes(turn)))  # one append a turn: cut at its pause, then queued
        error = recv(ws)
        assert error["type"] == "error" and error["code"] == "audio_too_long", error
        send(ws, type="input_audio_buffer.commit", final=True)
        events = until_done(ws)
    assert events[-1]["text"] == "Hello world Hello world"  # the two turns that fit


def test_a_failed_clip_and_an_unnamed_model(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    """A clip the pipeline fails is a processing_error event and the stream still ends with transcription.done
    (its text without that clip); a commit before a served model was named is model_not_validated."""
    from gateway.events import PipelineError

    with connect(url(rest_server).split("?")[0], open_timeout=10) as ws:
        recv(ws)
        send(ws, type="session.update", model="whisper-1")  # vLLM's dialect, but no served model yet
        assert recv(ws)["code"] == "model_not_found"
        send(ws, type="input_audio_buffer.commit")
        assert recv(ws)["code"] == "model_not_validated"
        send(ws, type="session.update", model="tiny-omni")
        pipeline.script = lambda request: [PipelineError("thinker is full", http_status=429, grpc_code=8,
                                                         kind="rate_limit_error")]
        send(ws, type="input_audio_buffer.commit")
        append(ws, np.zeros(1600, np.float32))
        send(ws, type="input_audio_buffer.commit", final=True)
        error = recv(ws)
        assert error == {"type": "error", "error": "thinker is full", "code": "processing_error"}
        assert recv(ws) == {"type": "transcription.done", "text": "",
                            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}
