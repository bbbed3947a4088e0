"""OpenAI's `POST /v1/audio/speech` (gateway/speech_api.py) against a scripted pipeline: the chat it runs (the
input as the user turn, the thinker held to exactly it by a one-string choice, audio out in the voice), every
response format with its content type (mp3 by default, `pcm` raw and streamed as the samples come), the
`sse` stream's delta and done events with the usage, the official `openai` client, and each bad body as a
400 naming its field. Through a real mesh: tests/e2e/test_speech_e2e.py."""

from __future__ import annotations

import base64
import io
import json
import wave

import grpc
import httpx
import numpy as np
import openai
import pytest
from gateway_harness import SAMPLE_RATE, GrpcServer, RestServer, ScriptedPipeline, tone

from gateway.audio_encoding import pcm16_bytes
from gateway.rest import create_app
from omnimesh.v1 import omni_pb2, omni_pb2_grpc


def post(server: RestServer, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/audio/speech", json=body, timeout=10)


def test_the_chat_it_runs(rest_server, pipeline) -> None:
    r = post(rest_server, {"model": "tiny-omni", "input": 'Say "hi" — twice.', "voice": "chelsie",
                           "instructions": "Cheerfully.", "response_format": "wav"})
    assert r.status_code == 200, r.text
    [req] = pipeline.requests
    assert req.modalities == ("text", "audio") and req.voice == "Chelsie" and req.sampling.temperature == 0
    assert req.sampling.max_tokens == len('Say "hi" — twice.'.encode()) + 1  # no prompt builder: the bytes bound
    assert req.structured == ("choice", json.dumps(['Say "hi" — twice.']))
    system, user = req.messages
    assert system.role == "system" and "word for word" in system.content[0].text
    assert system.content[0].text.endswith("How to speak: Cheerfully.")
    assert user.role == "user" and user.content[0].text == 'Say "hi" — twice.'
    assert r.headers["content-type"] == "audio/wav" and r.headers["x-request-id"] == req.request_id
    with wave.open(io.BytesIO(r.content)) as w:  # the scripted 0.2 s tone, whole
        assert w.getframerate() == SAMPLE_RATE and w.getnframes() == int(0.2 * SAMPLE_RATE)
    assert req.request_id.startswith("speech-")


@pytest.mark.parametrize(("fmt", "media_type", "magic"), [
    ("mp3", "audio/mpeg", None), ("opus", "audio/ogg", b"OggS"), ("aac", "audio/aac", b"\xff"),
    ("flac", "audio/flac", b"fLaC"), ("wav", "audio/wav", b"RIFF")])
def test_each_format(rest_server, pipeline, fmt, media_type, magic) -> None:
    body = {"input": "hello", "response_format": fmt} if fmt != "mp3" else {"input": "hello"}  # mp3: the default
    r = post(rest_server, body)
    assert r.status_code == 200 and r.headers["content-type"] == media_type
    assert len(r.content) > 100 and (magic is None or r.content.startswith(magic))


def test_pcm_streams_the_samples_as_they_come(rest_server, pipeline) -> None:
    with httpx.stream("POST", f"{rest_server.base_url}/v1/audio/speech", json={"input": "hello",
                      "response_format": "pcm"}, timeout=10) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "audio/pcm"
        data = b"".join(r.iter_bytes())
    assert data == pcm16_bytes(tone(0.2))  # the two scripted chunks, raw 16-bit


def test_sse_deltas_and_done(rest_server, pipeline) -> None:
    for fmt in ("pcm", "wav"):
        with httpx.stream("POST", f"{rest_server.base_url}/v1/audio/speech", timeout=10,
                          json={"input": "hello", "response_format": fmt, "stream_format": "sse"}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        events = [json.loads(line[6:]) for line in lines[:-1]]
        deltas = [base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta"]
        assert len(deltas) == (2 if fmt == "pcm" else 1)  # pcm as it comes; a file whole at the end
        assert events[-1] == {"type": "speech.audio.done",
                              "usage": {"input_tokens": 7, "output_tokens": 2, "total_tokens": 9}}
        if fmt == "pcm":
            assert b"".join(deltas) == pcm16_bytes(tone(0.2))
        else:
            assert deltas[0].startswith(b"RIFF")


def test_speed_plays_the_audio_faster_and_streams_the_same(rest_server, pipeline) -> None:
    """speed 2: half as long at the same pitch (gateway/audio_tempo.py); the raw pcm stream is the wav's samples."""
    from gateway.audio_tempo import Tempo

    r = post(rest_server, {"input": "hello", "response_format": "wav", "speed": 2.0})
    with wave.open(io.BytesIO(r.content)) as w:
        samples = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    assert abs(samples.size - 0.1 * SAMPLE_RATE) < 0.02 * SAMPLE_RATE
    assert samples.tobytes() == pcm16_bytes(Tempo(2.0, SAMPLE_RATE).whole(tone(0.2)))
    with httpx.stream("POST", f"{rest_server.base_url}/v1/audio/speech", timeout=10,
                      json={"input": "hello", "response_format": "pcm", "speed": 2.0}) as s:
        assert b"".join(s.iter_bytes()) == samples.tobytes()


def test_mp3_aac_and_opus_stream_as_they_are_encoded(rest_server, pipeline) -> None:
    """Written front to back, they go out delta by delta (sse: one delta per audio chunk and the encoder's tail,
    not one file at the end), and the raw body is the same file (gateway/audio_file_stream.py)."""
    from test_audio_file_stream import decode

    for fmt in ("mp3", "aac", "opus"):
        with httpx.stream("POST", f"{rest_server.base_url}/v1/audio/speech", timeout=10,
                          json={"input": "hello", "response_format": fmt, "stream_format": "sse"}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        deltas = [base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta"]
        assert len(deltas) >= 2 and events[-1]["type"] == "speech.audio.done"
        audio, rate = decode(b"".join(deltas))
        assert abs(audio.size / rate - 0.2) < 0.1
        raw = post(rest_server, {"input": "hello", "response_format": fmt})
        assert raw.status_code == 200 and raw.headers["content-type"] == MEDIA[fmt]
        assert abs(decode(raw.content)[0].size / rate - 0.2) < 0.1


MEDIA = {"mp3": "audio/mpeg", "aac": "audio/aac", "opus": "audio/ogg"}


def test_the_openai_client(rest_server, pipeline) -> None:
    client = openai.OpenAI(base_url=f"{rest_server.base_url}/v1", api_key="none")
    audio = client.audio.speech.create(model="tiny-omni", voice="ethan", input="Hello there.",  # type: ignore[arg-type]
                                       response_format="wav")
    with wave.open(io.BytesIO(audio.content)) as w:
        samples = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    assert samples.size == int(0.2 * SAMPLE_RATE)


@pytest.mark.parametrize(("body", "param", "needle"), [
    ({}, "input", "Field required"),
    ({"input": "  "}, "input", "no text to speak"),
    ({"input": "a" * 4097}, "input", "at most 4096 characters"),
    ({"input": "a", "speed": 4.5}, "speed", "must be in [0.25, 4.0]"),
    ({"input": "a", "speed": 0.1}, "speed", "must be in [0.25, 4.0]"),
    ({"input": "a", "voice": "alloy"}, "voice", "unknown voice 'alloy'"),
    ({"input": "a", "response_format": "ogg"}, "response_format", "'mp3'"),
    ({"input": "a", "stream_format": "chunks"}, "stream_format", "'audio'"),
    ({"input": "a", "model": "tts-1"}, "model", "tts-1"),
])
def test_bad_bodies(rest_server, pipeline, body, param, needle) -> None:
    r = post(rest_server, body)
    assert r.status_code == (404 if param == "model" else 400), r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err
    assert pipeline.requests == []


def test_max_tokens_leave_room_for_the_whole_input(shared_pipeline, pipeline, tmp_path) -> None:
    """The thinker's default (1024 tokens) would cut a long input: the route asks for the input's bytes + 1
    (a token is at least a byte), within max_model_len after the prompt; an input whose own tokens cannot fit
    is a 400 before anything runs."""
    from gateway.prompt import PromptBuilder
    from gateway.rest import create_app
    from omnimesh.models.qwen3_omni.tiny import build_tiny_qwen3_omni

    builder = PromptBuilder(build_tiny_qwen3_omni(tmp_path / "tiny"), max_model_len=256)
    with RestServer(create_app(shared_pipeline, served_model_names=("tiny-omni",), prompts=builder)) as server:
        assert post(server, {"input": "héllo", "response_format": "wav"}).status_code == 200
        assert pipeline.requests[-1].sampling.max_tokens == len("héllo".encode()) + 1
        text = "the sea " * 20  # more bytes than the room after the prompt, yet its tokens fit
        assert post(server, {"input": text, "response_format": "wav"}).status_code == 200
        prompt = int(builder.encode(pipeline.requests[-1]).numel())
        assert pipeline.requests[-1].sampling.max_tokens == min(len(text) + 1, 256 - prompt)
        r = post(server, {"input": "the sea " * 200})
        assert r.status_code == 400 and "do not fit" in r.json()["error"]["message"], r.text
        # the model's control tokens cannot be said as text: the thinker's grammar would refuse them mid-answer
        asked = len(pipeline.requests)
        for text, mark in [("done <|im_end|> now", "<|im_end|>"), ("<tool_call>{}</tool_call>", "<tool_call>")]:
            r = post(server, {"input": text})
            assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
            assert f"{mark}" in r.json()["error"]["message"] and "control token" in r.json()["error"]["message"]
        assert len(pipeline.requests) == asked


def test_a_failure_midstream(rest_server, pipeline) -> None:
    """sse: an error event then [DONE]; raw pcm: the stream just ends short (it has no room for an error)."""
    from gateway.events import AudioDelta, PipelineError

    pipeline.script = lambda request: [AudioDelta(tone(0.1), SAMPLE_RATE),
                                       PipelineError("vocoder died", http_status=503, grpc_code=14,
                                                     kind="service_unavailable")]
    with httpx.stream("POST", f"{rest_server.base_url}/v1/audio/speech", timeout=10,
                      json={"input": "hi", "response_format": "pcm", "stream_format": "sse"}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["error"]["message"] == "vocoder died"
    with httpx.stream("POST", f"{rest_server.base_url}/v1/audio/speech", timeout=10,
                      json={"input": "hi", "response_format": "pcm"}) as r:
        assert b"".join(r.iter_bytes()) == pcm16_bytes(tone(0.1))
    assert post(rest_server, {"input": "hi", "response_format": "wav"}).status_code == 503  # whole: its status


def test_the_voices_it_speaks(rest_server, pipeline) -> None:
    """GET /v1/audio/voices (and gRPC ListVoices): what `voice` may name and the default; none, with the reason,
    without speech."""
    r = httpx.get(f"{rest_server.base_url}/v1/audio/voices", timeout=10)
    assert r.status_code == 200 and r.json() == {"voices": ["Ethan", "Chelsie"], "default": "Ethan"}
    silent = ScriptedPipeline()
    silent.voices, silent.default_voice, silent.no_audio = (), "", "the model m has no audio output"
    with RestServer(create_app(silent, served_model_names=("tiny-omni",), api_keys=("k",))) as server:
        url = f"{server.base_url}/v1/audio/voices"
        assert httpx.get(url, timeout=10).status_code == 401  # under /v1: the key is needed
        body = httpx.get(url, headers={"Authorization": "Bearer k"}, timeout=10).json()
    assert body == {"voices": [], "default": None, "reason": "the model m has no audio output"}
    with GrpcServer(silent) as g, grpc.insecure_channel(f"127.0.0.1:{g.port}") as ch:
        listed = omni_pb2_grpc.OmniStub(ch).ListVoices(omni_pb2.ListVoicesRequest(), timeout=10)
    assert (list(listed.voices), listed.default_voice, listed.reason) == ([], "", "the model m has no audio output")
    with GrpcServer(pipeline) as g, grpc.insecure_channel(f"127.0.0.1:{g.port}") as ch:
        listed = omni_pb2_grpc.OmniStub(ch).ListVoices(omni_pb2.ListVoicesRequest(), timeout=10)
    assert (list(listed.voices), listed.default_voice, listed.reason) == (["Ethan", "Chelsie"], "Ethan", "")
