"""The REST front end through a real uvicorn server on 127.0.0.1: shapes, streaming, the openai client,
every error path. The pipeline is the scripted double from `gateway_harness`."""

from __future__ import annotations

import base64
import io
import json
import re
import socket
import time
import wave

import grpc
import httpx
import numpy as np
import openai
import pytest
from gateway_harness import SAMPLE_RATE, RestServer, ScriptedPipeline, stage_down, tone
from PIL import Image

from gateway.events import AudioPart, Finished, ImagePart, SamplingOverrides, TextDelta, TextPart
from gateway.pipeline import stage_error
from omnimesh.transport.stage_client import StageCallError

USER_HI = [{"role": "user", "content": "hi"}]


def wav_file(seconds: float, rate: int = 16_000, channels: int = 1) -> bytes:
    pcm = (tone(seconds, 440.0, rate) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.repeat(pcm, channels).tobytes())
    return buf.getvalue()


def png_data_uri(w: int = 32, h: int = 24) -> str:
    buf = io.BytesIO()
    Image.new("RGBA", (w, h), (10, 200, 30, 128)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def post(server: RestServer, body: dict | bytes, **kw: object) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(f"{server.base_url}/v1/chat/completions", content=body,
                          headers={"content-type": "application/json"}, timeout=10, **kw)  # type: ignore[arg-type]
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=10, **kw)  # type: ignore[arg-type]


def sse_events(server: RestServer, body: dict) -> tuple[httpx.Response, list[str]]:
    """The `data:` payloads of a streamed response, in order."""
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=10) as r:
        lines = [line for line in r.iter_lines()]
    return r, [line[len("data: "):] for line in lines if line.startswith("data: ")]


def assert_error_shape(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


# ------------------------------------------------------------------------------------ non-streaming
def test_text_only_completion_shape(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    r = post(rest_server, {"model": "tiny-omni", "messages": USER_HI})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == "tiny-omni" and isinstance(body["created"], int)
    choice = body["choices"][0]
    assert choice["index"] == 0 and choice["finish_reason"] == "stop"
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"] == "Hello world"
    assert choice["message"]["audio"] is None
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9, "prompt_tokens_details": None}
    req = pipeline.requests[-1]
    assert req.modalities == ("text",) and req.voice is None  # OpenAI's default: text only
    assert req.request_id == body["id"]
    assert req.messages[0].content == (TextPart("hi"),)


def test_audio_completion_is_a_wav_of_the_streamed_samples(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    r = post(rest_server, {"model": "tiny-omni", "messages": USER_HI, "modalities": ["text", "audio"],
                           "audio": {"voice": "chelsie", "format": "wav"}})
    assert r.status_code == 200, r.text
    audio = r.json()["choices"][0]["message"]["audio"]
    assert audio["id"].startswith("audio_") and audio["transcript"] == "Hello world"
    assert isinstance(audio["expires_at"], int)
    with wave.open(io.BytesIO(base64.b64decode(audio["data"]))) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, SAMPLE_RATE)
        samples = np.frombuffer(w.readframes(w.getnframes()), "<i2") / 32767.0
    np.testing.assert_allclose(samples, tone(0.2), atol=1.0 / 32767)
    assert pipeline.requests[-1].voice == "Chelsie"  # matched case-insensitively, pipeline's spelling


def test_pcm16_format_is_raw_samples(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    r = post(rest_server, {"messages": USER_HI, "modalities": ["text", "audio"], "audio": {"format": "pcm16"}})
    assert r.status_code == 200, r.text
    raw = base64.b64decode(r.json()["choices"][0]["message"]["audio"]["data"])
    assert len(raw) == int(0.2 * SAMPLE_RATE) * 2 and raw[:4] != b"RIFF"
    assert pipeline.requests[-1].voice == "Ethan"  # default voice; model defaulted to the first name


def test_flac_format_is_a_flac_file_of_the_samples(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    import av

    r = post(rest_server, {"messages": USER_HI, "modalities": ["text", "audio"], "audio": {"format": "flac"}})
    assert r.status_code == 200, r.text
    data = base64.b64decode(r.json()["choices"][0]["message"]["audio"]["data"])
    assert data[:4] == b"fLaC"
    with av.open(io.BytesIO(data)) as f:
        samples = np.concatenate([fr.to_ndarray().reshape(-1) for fr in f.decode(audio=0)]) / 32767.0
    np.testing.assert_allclose(samples, tone(0.2), atol=1.0 / 32767)  # lossless: the streamed samples


def test_alias_name_runs_the_pipeline_model(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    r = post(rest_server, {"model": "omni-alias", "messages": USER_HI})
    assert r.status_code == 200 and r.json()["model"] == "omni-alias"
    assert pipeline.requests[-1].model == "tiny-omni"


def test_sampling_stage_params_and_media_reach_the_pipeline(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    body = {
        "model": "tiny-omni", "temperature": 0, "top_p": 0.9, "seed": 3, "max_tokens": 10,
        "max_completion_tokens": 50, "frequency_penalty": 0, "user": "u1", "n": 1, "stop": None,
        "stage_params": {"talker": {"max_tokens": 200, "temperature": 0, "top_k": 10, "repetition_penalty": 1.05}},
        "messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": png_data_uri()}},
                {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav_file(0.5, 44_100, 2)).decode(),
                                                        "format": "wav"}}]}]}
    r = post(rest_server, body)
    assert r.status_code == 200, r.text
    req = pipeline.requests[-1]
    assert req.sampling == SamplingOverrides(temperature=0.0, top_p=0.9, seed=3, max_tokens=50, frequency_penalty=0.0)
    assert req.stage_params == {"talker": SamplingOverrides(temperature=0.0, top_k=10, max_tokens=200,
                                                            repetition_penalty=1.05)}
    system, user = req.messages
    assert system.role == "system" and system.content == (TextPart("be brief"),)
    text, image, audio = user.content
    assert text == TextPart("what is this?")
    assert isinstance(image, ImagePart) and image.image.mode == "RGB" and image.image.size == (32, 24)
    assert isinstance(audio, AudioPart) and audio.sample_rate == 16_000 and audio.waveform.shape == (8000,)


# ---------------------------------------------------------------------------------------- streaming
def test_sse_stream_chunks_usage_and_done(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    r, events = sse_events(rest_server, {"messages": USER_HI, "stream": True, "modalities": ["text", "audio"],
                                         "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "Hello world"
    audio = [c["choices"][0]["delta"]["audio"] for c in chunks if c["choices"] and "audio" in c["choices"][0]["delta"]]
    assert len({a["id"] for a in audio}) == 1 and "".join(a.get("transcript", "") for a in audio) == "Hello world"
    samples = [a for a in audio if "data" in a]
    assert len(samples) == 2
    pcm = np.concatenate([np.frombuffer(base64.b64decode(a["data"]), "<i2") for a in samples]) / 32767.0
    np.testing.assert_allclose(pcm, tone(0.2), atol=1.0 / 32767)
    final, usage = chunks[-2], chunks[-1]
    assert final["choices"][0]["finish_reason"] == "stop" and final["choices"][0]["delta"] == {}
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 9
    assert pipeline.closed == [pipeline.requests[-1].request_id]


def test_force_include_usage(pipeline: ScriptedPipeline, tmp_path) -> None:
    """--enable-force-include-usage: streamed chats and completions end with their usage chunk unasked (vLLM's
    flag); without it an unasked stream has none; the flag reaches the gateway."""
    from gateway.rest import create_app
    from omnimesh.config.serve_args import ServeArgs
    from omnimesh.launcher import MeshLauncher

    def last_chunk(server: RestServer, path: str, body: dict) -> dict:
        r = httpx.post(f"{server.base_url}{path}", json={**body, "stream": True}, timeout=30)
        events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
        assert events[-1] == "[DONE]", r.text
        return json.loads(events[-2])

    chat = {"messages": USER_HI, "modalities": ["text"]}
    with RestServer(create_app(pipeline, served_model_names=("tiny-omni",), force_include_usage=True)) as forced, \
            RestServer(create_app(pipeline, served_model_names=("tiny-omni",))) as plain:
        usage = last_chunk(forced, "/v1/chat/completions", chat)
        assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 9
        assert last_chunk(plain, "/v1/chat/completions", chat)["choices"][0]["finish_reason"] == "stop"
    assert "--enable-force-include-usage" in MeshLauncher(ServeArgs(enable_force_include_usage=True),
                                                          tmp_path)._gateway_argv({})


def test_error_after_stream_started_is_an_sse_error_then_done(rest_server: RestServer,
                                                              pipeline: ScriptedPipeline) -> None:
    pipeline.script = lambda req: [TextDelta("Hel"), stage_down("vocoder")]
    r, events = sse_events(rest_server, {"messages": USER_HI, "stream": True})
    assert r.status_code == 200
    assert json.loads(events[1])["choices"][0]["delta"]["content"] == "Hel"
    err = json.loads(events[-2])
    assert set(err) == {"error"} and "vocoder" in err["error"]["message"]
    assert err["error"]["type"] == "service_unavailable" and err["error"]["code"] == "service_unavailable"
    assert events[-1] == "[DONE]" and len(events) == 4


def test_stream_without_finished_reports_an_internal_error(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    pipeline.script = lambda req: [TextDelta("a")]
    _, events = sse_events(rest_server, {"messages": USER_HI, "stream": True})
    assert json.loads(events[-2])["error"]["code"] == "internal_error" and events[-1] == "[DONE]"
    r = post(rest_server, {"messages": USER_HI})
    assert "without a Finished" in assert_error_shape(r, 500)["message"]


def test_bug_in_pipeline_is_a_500_not_a_crash(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    pipeline.script = lambda req: [TextDelta("a"), RuntimeError("boom")]
    assert "boom" in assert_error_shape(post(rest_server, {"messages": USER_HI}), 500)["message"]
    _, events = sse_events(rest_server, {"messages": USER_HI, "stream": True})
    assert "boom" in json.loads(events[-2])["error"]["message"]


def test_error_before_first_event_keeps_its_status_even_when_streaming(rest_server: RestServer,
                                                                       pipeline: ScriptedPipeline) -> None:
    pipeline.script = lambda req: [stage_down("thinker")]
    for stream in (False, True):
        err = assert_error_shape(post(rest_server, {"messages": USER_HI, "stream": stream}), 503)
        assert "thinker" in err["message"] and err["type"] == "service_unavailable"


def test_a_full_stage_queue_is_429_with_retry_after(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    """A stage refusing at `open` (--max-waiting-requests reached) -> RESOURCE_EXHAUSTED -> 429 with Retry-After,
    streaming or not (the refusal comes before the first event); the openai client sees a RateLimitError."""
    message = "256 requests already waiting in thinker (--max-waiting-requests 256); retry later or raise it"
    full = stage_error(StageCallError("thinker", grpc.StatusCode.RESOURCE_EXHAUSTED, message))
    pipeline.script = lambda req: [full]
    for stream in (False, True):
        r = post(rest_server, {"messages": USER_HI, "stream": stream})
        err = assert_error_shape(r, 429)
        assert r.headers["retry-after"] == "1"
        assert err["message"] == message and (err["type"], err["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    with pytest.raises(openai.RateLimitError, match="--max-waiting-requests"):
        _client(rest_server).chat.completions.create(model="tiny-omni", messages=USER_HI)
    pipeline.script = lambda req: [stage_down("thinker")]
    assert "retry-after" not in post(rest_server, {"messages": USER_HI}).headers  # only a 429 says it


def test_client_disconnect_closes_the_pipeline_request(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    pipeline.script = lambda req: [TextDelta("x")] * 200 + [Finished("stop", 1, 200)]
    pipeline.event_delay_s = 0.02
    with httpx.stream("POST", f"{rest_server.base_url}/v1/chat/completions",
                      json={"messages": USER_HI, "stream": True}, timeout=10) as r:
        for line in r.iter_lines():
            if '"content":"x"' in line:
                break
    deadline = time.monotonic() + 5
    while not pipeline.closed and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pipeline.closed == [pipeline.requests[-1].request_id]


# ----------------------------------------------------------------------------- the official client
def _client(server: RestServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=10)


def test_openai_client_non_streaming_audio(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    resp = _client(rest_server).chat.completions.create(
        model="tiny-omni", messages=USER_HI, modalities=["text", "audio"], audio={"voice": "Ethan", "format": "wav"})
    msg = resp.choices[0].message
    assert msg.content == "Hello world" and msg.audio is not None and msg.audio.transcript == "Hello world"
    with wave.open(io.BytesIO(base64.b64decode(msg.audio.data))) as w:
        assert w.getframerate() == SAMPLE_RATE and w.getnframes() == int(0.2 * SAMPLE_RATE)
    assert resp.usage is not None and resp.usage.total_tokens == 9


def test_openai_client_streaming_audio(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    stream = _client(rest_server).chat.completions.create(
        model="tiny-omni", messages=USER_HI, modalities=["text", "audio"], audio={"voice": "Ethan", "format": "wav"},
        stream=True, stream_options={"include_usage": True},
        extra_body={"stage_params": {"thinker": {"temperature": 0.5}}})
    text, pcm, finish, usage = "", b"", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            audio = getattr(c.delta, "audio", None) or (c.delta.model_extra or {}).get("audio")
            data = audio.get("data") if isinstance(audio, dict) else getattr(audio, "data", None)
            if data:
                pcm += base64.b64decode(data)
            finish = c.finish_reason or finish
    assert text == "Hello world" and finish == "stop" and usage is not None and usage.completion_tokens == 2
    assert len(pcm) == int(0.2 * SAMPLE_RATE) * 2
    assert pipeline.requests[-1].stage_params == {"thinker": SamplingOverrides(temperature=0.5)}


def test_openai_client_sees_mid_stream_error(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    pipeline.script = lambda req: [TextDelta("Hel"), stage_down("talker")]
    stream = _client(rest_server).chat.completions.create(model="tiny-omni", messages=USER_HI, stream=True)
    seen = ""
    with pytest.raises(openai.APIError, match="talker"):
        for chunk in stream:
            seen += chunk.choices[0].delta.content or "" if chunk.choices else ""
    assert seen == "Hel"


def test_openai_client_error_status(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    with pytest.raises(openai.NotFoundError, match="nope"):
        _client(rest_server).chat.completions.create(model="nope", messages=USER_HI)
    with pytest.raises(openai.BadRequestError, match="voice"):
        _client(rest_server).chat.completions.create(model="tiny-omni", messages=USER_HI, modalities=["text", "audio"],
                                                     audio={"voice": "alloy", "format": "wav"})


# ------------------------------------------------------------------------------------- error paths
BIG_AUDIO = base64.b64encode(wav_file(6.0)).decode()  # over TEST_LIMITS.max_audio_seconds (5 s)


def _user(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


@pytest.mark.parametrize(("body", "status", "param", "needle"), [
    (b'{"messages": [', 400, None, "not valid JSON"),
    (b'[1, 2]', 400, None, "JSON object"),
    (b'{"messages": ' + b'[' * 100000 + b']' * 100000 + b'}', 400, None, "nest too deeply"),
    (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', 400, None, "unpaired UTF-16 surrogate"),
    ({"model": "tiny-omni"}, 400, "messages", "Field required"),
    ({"messages": []}, 400, "messages", "at least 1"),
    ({"messages": "hi"}, 400, "messages", "list"),
    ({"messages": USER_HI, "temperature": "hot"}, 400, "temperature", "number"),
    ({"messages": USER_HI, "max_tokens": "10"}, 400, "max_tokens", "integer"),
    ({"messages": USER_HI, "stream": "yes"}, 400, "stream", "boolean"),
    ({"messages": [{"role": "function", "content": "x"}]}, 400, "messages[0].role", "'tool'"),
    ({"messages": USER_HI, "temperature": 3}, 400, "temperature", "[0, 2]"),
    ({"messages": USER_HI, "top_p": 0}, 400, "top_p", "(0, 1]"),
    # values the stages' float32 fields would turn into 0 or inf (the stage refused them, naming no param)
    ({"messages": USER_HI, "top_p": 1e-300}, 400, "top_p", "at least 1.17549e-38 (a float32)"),
    ({"messages": USER_HI, "repetition_penalty": 1e300}, 400, "repetition_penalty", "within float32's range"),
    ({"messages": USER_HI, "repetition_penalty": 1e-300}, 400, "repetition_penalty", "within float32's range"),
    ({"messages": USER_HI, "repetition_penalty": 0}, 400, "repetition_penalty", "must be > 0"),
    ({"messages": USER_HI, "n": 17}, 400, "n", "must be in [1, 16] choices, got 17"),
    ({"messages": USER_HI, "n": 0}, 400, "n", "must be in [1, 16] choices, got 0"),
    ({"messages": USER_HI, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "must be in [0, 20] (--max-logprobs), got 21"),
    ({"messages": USER_HI, "top_logprobs": 2}, 400, "top_logprobs", "needs logprobs: true"),
    ({"messages": USER_HI, "prompt_logprobs": 21}, 400, "prompt_logprobs", "must be in [0, 20] alternatives"),
    ({"messages": USER_HI, "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs", "not available with stream"),
    ({"messages": USER_HI, "stage_params": {"talker": {"prompt_logprobs": 1}}}, 400,
     "stage_params.talker.prompt_logprobs", "unknown field"),
    ({"messages": USER_HI, "min_p": 1.5}, 400, "min_p", "must be in [0, 1]"),
    ({"messages": USER_HI, "stage_params": {"talker": {"min_p": -0.1}}}, 400, "stage_params.talker.min_p",
     "must be in [0, 1]"),
    ({"messages": USER_HI, "stage_params": {"talker": {"logprobs": 2}}}, 400, "stage_params.talker.logprobs",
     "unknown field"),
    ({"messages": USER_HI, "response_format": {"type": "json_schema"}}, 400, "response_format.json_schema.schema",
     "needs its schema"),
    ({"messages": USER_HI, "frequency_penalty": 2.5}, 400, "frequency_penalty", "[-2, 2]"),
    ({"messages": USER_HI, "stage_params": {"talker": {"presence_penalty": -3}}}, 400,
     "stage_params.talker.presence_penalty", "[-2, 2]"),
    ({"messages": USER_HI, "modalities": ["image"]}, 400, "modalities[0]", "'text' or 'audio'"),
    ({"messages": USER_HI, "model": "gpt-4o"}, 404, "model", "gpt-4o"),
    ({"messages": USER_HI, "modalities": ["text", "audio"], "audio": {"voice": "alloy"}}, 400, "audio.voice", "Chelsie"),
    ({"messages": USER_HI, "modalities": ["text", "audio"], "audio": {"format": "ogg"}}, 400, "audio.format", "wav, pcm16, mp3, flac, opus, aac"),
    ({"messages": USER_HI, "stage_params": {"vocoder": {}}}, 400, "stage_params.vocoder", "unknown field"),
    ({"messages": USER_HI, "stage_params": {"talker": {"top_kk": 3}}}, 400, "stage_params.talker.top_kk", "unknown"),
    ({"messages": USER_HI, "stage_params": {"talker": {"top_k": -2}}}, 400, "stage_params.talker.top_k",
     "must be -1 or 0 (off"),  # vLLM's -1 and 0 are top-k off
    ({"messages": _user({"type": "file", "file": {"file_id": "x"}})}, 400, "messages[0].content[0]", "supported"),
    ({"messages": _user({"type": "image_url"})}, 400, "messages[0].content[0]", "needs a 'image_url'"),
    ({"messages": _user({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "amr"}})}, 400,
     "messages[0].content[0].input_audio.format", "supported: wav"),
    ({"messages": _user({"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}})}, 400,
     "messages[0].content[0].input_audio", "base64"),
    ({"messages": _user({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}})}, 400,
     "messages[0].content[0].input_audio", "not a WAV"),
    ({"messages": _user({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}})}, 400,
     "messages[0].content[0].image_url.url", "scheme 'file:'"),
    ({"messages": _user({"type": "image_url", "image_url": {"url": "http://example.com/a.png"}})}, 400,
     "messages[0].content[0].image_url.url", "disabled"),
    ({"messages": _user({"type": "image_url", "image_url": {"url": "data:text/plain;base64,AAAA"}})}, 400,
     "messages[0].content[0].image_url.url", "image/*"),
    ({"messages": [{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": png_data_uri()}}]}]},
     400, "messages[0].content[0]", "only user messages"),
    ({"messages": _user({"type": "input_audio", "input_audio": {"data": BIG_AUDIO, "format": "wav"}})}, 413,
     "messages[0].content[0].input_audio", "limit is 5 s"),
    ({"messages": _user({"type": "image_url", "image_url": {"url": png_data_uri(300, 300)}})}, 413,
     "messages[0].content[0].image_url.url", "90000 pixels"),
    ({"messages": _user(*[{"type": "image_url", "image_url": {"url": png_data_uri()}}] * 5)}, 400, "messages",
     "limit is 4"),
    # the counts are checked before anything is decoded: undecodable parts get the count's answer
    ({"messages": _user(*[{"type": "image_url", "image_url": {"url": "data:image/png;base64,%%"}}] * 5)}, 400,
     "messages", "5 audio/image/video parts; the limit is 4"),
    ({"messages": _user(*[{"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}}] * 3)}, 400,
     "messages", "request has 3 audio parts; at most 2 may be given in one request (--limit-mm-per-prompt)"),
    ({"messages": _user(*[{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}] * 2)}, 400,
     "messages", "request has 2 video parts; at most 1 may be given"),
    ({"messages": USER_HI, "padding": "x" * 1_100_000}, 413, None, "limit is 1000000"),
])
def test_error_status_and_shape(rest_server: RestServer, pipeline: ScriptedPipeline, body: dict | bytes, status: int,
                                param: str | None, needle: str) -> None:
    err = assert_error_shape(post(rest_server, body), status)
    assert err["param"] == param
    assert needle in err["message"]
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert pipeline.requests == []  # refused before the pipeline saw it


def test_oversize_chunked_body_is_cut_off_at_the_limit(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    def body():  # no content-length: the limit must hold while reading
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(20):
            yield b"x" * 100_000
        yield b'"}]}'

    r = httpx.post(f"{rest_server.base_url}/v1/chat/completions", content=body(), timeout=10)
    assert "larger than the limit of 1000000 bytes" in assert_error_shape(r, 413)["message"]
    assert pipeline.requests == []


def _raw_post(server: RestServer, declared: int, sent: bytes) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (declared, sent))
    return conn


def test_a_body_shorter_than_its_length_times_out_and_one_cut_off_counts_as_the_clients(
        rest_server: RestServer, pipeline: ScriptedPipeline, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A body that stops arriving is a 408 after the idle timeout (it waited for ever); a client that hangs up
    mid-body is counted as 499 (the client's), not logged and counted as a 500."""
    from gateway import http_errors

    monkeypatch.setattr(http_errors, "BODY_IDLE_TIMEOUT_S", 0.5)
    with _raw_post(rest_server, 1000, b"{}") as conn:
        t0 = time.monotonic()
        head = conn.recv(65536).decode()
        assert head.startswith("HTTP/1.1 408") and "the request body stopped arriving" in head, head
        assert time.monotonic() - t0 < 5
    def count(status: int) -> float:
        text = httpx.get(f"{rest_server.base_url}/metrics", timeout=10).text
        found = re.search(rf'requests_total{{endpoint="chat",status="{status}"}} (\S+)', text)
        return float(found.group(1)) if found else 0.0

    gone, failed = count(499), count(500)
    with caplog.at_level("ERROR"), _raw_post(rest_server, 1000, b'{"messages": [') as conn:
        time.sleep(0.1)
    deadline = time.monotonic() + 5
    while count(499) == gone:
        assert time.monotonic() < deadline, "the cut-off body was not counted as the client's"
        time.sleep(0.05)
    assert count(500) == failed
    assert not [r for r in caplog.records if "request failed" in r.getMessage()]
    assert pipeline.requests == []


def test_unknown_route_and_method_use_the_error_shape(rest_server: RestServer) -> None:
    assert_error_shape(httpx.get(f"{rest_server.base_url}/v1/nothing", timeout=10), 404)
    assert_error_shape(httpx.get(f"{rest_server.base_url}/v1/chat/completions", timeout=10), 405)


# ------------------------------------------------------------------------------ models, health, metrics
def test_models_list(rest_server: RestServer) -> None:
    body = httpx.get(f"{rest_server.base_url}/v1/models", timeout=10).json()
    assert body["object"] == "list"
    assert [(m["id"], m["object"], m["owned_by"]) for m in body["data"]] == [
        ("tiny-omni", "model", "omnimesh"), ("omni-alias", "model", "omnimesh")]
    assert [m.id for m in _client(rest_server).models.list()] == ["tiny-omni", "omni-alias"]


def test_models_retrieve_one(rest_server: RestServer) -> None:
    """OpenAI's `GET /v1/models/{model}`: the served card, or its 404 naming what is served."""
    client = _client(rest_server)
    assert (client.models.retrieve("omni-alias").id, client.models.retrieve("omni-alias").owned_by) == (
        "omni-alias", "omnimesh")
    with pytest.raises(openai.NotFoundError, match="served models: tiny-omni, omni-alias"):
        client.models.retrieve("gpt-4o")
    for path in ("/v1/models/org/tiny-omni", "/v1/models/"):
        r = httpx.get(f"{rest_server.base_url}{path}", timeout=10)
        assert_error_shape(r, 404)


def test_health_names_the_stage_that_is_down(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    r = httpx.get(f"{rest_server.base_url}/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    pipeline.stages["vocoder"] = False
    r = httpx.get(f"{rest_server.base_url}/health", timeout=10)
    assert r.status_code == 503
    assert r.json()["down"] == ["vocoder"] and "vocoder" in r.json()["message"]
    # vLLM's /ping (GET and POST, SageMaker's name) answers as /health
    assert [httpx.request(m, f"{rest_server.base_url}/ping", timeout=10).status_code for m in ("GET", "POST")] == [503] * 2
    pipeline.stages["vocoder"] = True
    assert httpx.post(f"{rest_server.base_url}/ping", timeout=10).status_code == 200


def test_load_counts_the_requests_in_flight(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    """vLLM's /load: a streamed request holds its place until its stream ends."""
    assert httpx.get(f"{rest_server.base_url}/load", timeout=10).json() == {"server_load": 0}
    pipeline.event_delay_s = 0.3
    with httpx.stream("POST", f"{rest_server.base_url}/v1/chat/completions", timeout=10,
                      json={"messages": USER_HI, "stream": True}) as r:
        assert httpx.get(f"{rest_server.base_url}/load", timeout=10).json() == {"server_load": 1}
        r.read()
    deadline = time.monotonic() + 5.0  # the stream settles just after its last byte
    while httpx.get(f"{rest_server.base_url}/load", timeout=10).json() != {"server_load": 0}:
        assert time.monotonic() < deadline, "the stream never settled"
        time.sleep(0.02)


def test_metrics_count_requests_by_status(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    def count(text: str, status: str) -> float:
        key = f'omnimesh:requests_total{{endpoint="chat",status="{status}"}} '
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(key))

    before = httpx.get(f"{rest_server.base_url}/metrics", timeout=10).text
    post(rest_server, {"messages": USER_HI})
    post(rest_server, {"messages": USER_HI, "model": "nope"})
    r = httpx.get(f"{rest_server.base_url}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert count(r.text, "200") == count(before, "200") + 1
    assert count(r.text, "404") == count(before, "404") + 1
    assert 'omnimesh:e2e_request_latency_seconds_bucket{endpoint="chat",le="+Inf"}' in r.text
    assert "omnimesh:time_to_first_token_seconds_count" in r.text
    assert "omnimesh:requests_running 0.0" in r.text  # every request, streamed or not, settled its gauge
