"""OpenAI's /v1/audio/transcriptions and /translations (gateway/transcription_api.py) on the scripted
pipeline: the form becomes one text-only user message [the audio, the instruction with its hints],
greedy by default; json and text answers; streamed as OpenAI's transcript.text.delta / .done events
(the openai SDK's stream reads them; a reasoning model's thought stays out; an error midway is an error
event, one before the first event a 4xx/5xx); the openai SDK's `audio.transcriptions.create` works; bad
forms, a language that is no ISO-639-1 code, formats that need timestamps, a missing or non-WAV file, an unknown model and oversized bodies or
audio are 4xx naming the field; the key is needed under --api-key."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from gateway_harness import RestServer, ScriptedPipeline
from test_rest import wav_file

from gateway.events import AudioPart, Finished, PipelineError, TextDelta, TextPart
from gateway.input_limits import InputLimits
from gateway.rest import create_app


def post(server: RestServer, path: str = "/v1/audio/transcriptions", *, wav: bytes | None = None,
         **fields: str) -> httpx.Response:
    files = {"file": ("speech.wav", wav if wav is not None else wav_file(0.5), "audio/wav")}
    return httpx.post(f"{server.base_url}{path}", data={"model": "tiny-omni", **fields}, files=files, timeout=30)


def test_transcription_is_one_text_only_chat(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    r = post(rest_server, language="en", prompt="Omnimesh")
    assert r.status_code == 200, r.text
    assert r.json() == {"text": "Hello world", "usage": {"type": "tokens", "input_tokens": 7, "output_tokens": 2,
                                                         "total_tokens": 9}}
    req = pipeline.requests[-1]
    assert req.modalities == ("text",) and req.sampling.temperature == 0.0 and req.request_id.startswith("trsc-")
    assert req.media_param == "file"  # an error about the clip (too loud to analyse) names the upload's field
    (msg,) = req.messages
    audio, ask = msg.content
    assert msg.role == "user" and isinstance(audio, AudioPart) and audio.sample_rate == 16_000
    assert audio.waveform.size == 8000
    assert isinstance(ask, TextPart) and ask.text == ("The audio is in English. Transcribe the audio into text. "
                                                      "Context (names and spellings to follow): Omnimesh")
    post(rest_server, language="YUE")
    assert pipeline.requests[-1].messages[0].content[1].text.startswith("The audio is in Cantonese. ")  # type: ignore[union-attr]


def test_translation_text_format_and_temperature(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    r = post(rest_server, "/v1/audio/translations", response_format="text", temperature="0.4",
             max_completion_tokens="12")
    assert r.status_code == 200 and r.text == "Hello world" and r.headers["content-type"].startswith("text/plain")
    req = pipeline.requests[-1]
    assert req.messages[0].content[1].text == "Translate the audio into English text."  # type: ignore[union-attr]
    assert req.sampling.temperature == 0.4 and req.sampling.max_tokens == 12


def test_the_openai_sdk(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    client = openai.OpenAI(base_url=f"{rest_server.base_url}/v1", api_key="unused", max_retries=0)
    out = client.audio.transcriptions.create(model="tiny-omni", file=("a.wav", wav_file(0.5)))
    assert out.text == "Hello world"


@pytest.mark.parametrize(("fields", "status", "needle"), [
    ({"response_format": "srt"}, 400, "needs timestamps"),
    ({"response_format": "yaml"}, 400, "is not one of json, text"),
    ({"stream": "maybe"}, 400, "stream: must be true or false"),
    ({"timestamp_granularities[]": "word"}, 400, "timestamp_granularities[]"),
    ({"include[]": "segments"}, 400, "include: 'segments' is not something a transcription can include"),
    ({"include[]": "logprobs", "response_format": "text"}, 400, "logprobs come with response_format json"),
    ({"temperature": "hot"}, 400, "is not a number"),
    ({"language": "klingon"}, 400, "language: 'klingon' is not an ISO-639-1 language code"),
    ({"language": "english"}, 400, "(e.g. 'en', 'zh', 'de'"),
    ({"temperature": "1.5"}, 400, "in [0, 1]"),
    ({"model": "whisper-1"}, 404, "whisper-1"),
    ({"max_completion_tokens": "0"}, 400, "max_completion_tokens: must be a whole number >= 1"),
    ({"max_completion_tokens": "many"}, 400, "max_completion_tokens"),
])
def test_bad_fields(rest_server: RestServer, pipeline: ScriptedPipeline, fields: dict, status: int, needle: str) -> None:
    r = post(rest_server, **fields)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]
    assert not pipeline.requests  # refused before the pipeline


def test_bad_files_and_bodies(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    url = f"{rest_server.base_url}/v1/audio/transcriptions"
    r = post(rest_server, wav=b"ID3 not a wav")
    assert r.status_code == 400 and r.json()["error"]["param"] == "file", r.text
    r = httpx.post(url, data={"model": "tiny-omni"}, files={"other": ("x", b"1")}, timeout=10)
    assert r.status_code == 400 and "file: the audio file (WAV, MP3, FLAC, ...) is required" in r.json()["error"]["message"]
    r = httpx.post(url, json={"file": "x"}, timeout=10)
    assert r.status_code == 400 and "multipart/form-data" in r.json()["error"]["message"]
    r = httpx.post(url, content=b"--x\r\nnonsense", headers={"content-type": "multipart/form-data; boundary=x"},
                   timeout=10)
    assert r.status_code == 400, r.text
    assert post(rest_server, wav=wav_file(6.0)).status_code == 413  # over the 5 s of the test limits
    assert post(rest_server, wav=b"\0" * 1_100_000).status_code == 413  # over the body limit
    assert not pipeline.requests


def test_needs_the_key(shared_pipeline: ScriptedPipeline) -> None:
    with RestServer(create_app(shared_pipeline, served_model_names=("tiny-omni",), api_keys=("k",))) as s:
        assert post(s).status_code == 401


def test_audio_refused_by_limit_mm_per_prompt(pipeline: ScriptedPipeline) -> None:
    """--limit-mm-per-prompt '{"audio": 0}' refuses these routes too: they are audio input."""
    limits = InputLimits(limit_mm_per_prompt={"audio": 0})
    with RestServer(create_app(pipeline, served_model_names=("tiny-omni",), limits=limits)) as s:
        r = post(s)
        assert r.status_code == 400 and r.json()["error"]["message"] == ("this server takes no audio input "
                                                                         "(--limit-mm-per-prompt audio=0)")
        assert r.json()["error"]["param"] == "file"  # the field that carries it (not a chat's messages)
    assert not pipeline.requests


def test_a_reasoning_models_thought_is_left_out(pipeline: ScriptedPipeline) -> None:
    """--reasoning-parser: the transcript is the answer after `</think>`, never the thought."""
    from gateway.events import Finished, TextDelta
    from gateway.reasoning import ReasoningParser

    pipeline.script = lambda request: [TextDelta("<think>\nSomeone gree"), TextDelta("ts.</think>\n\nHello"),
                                       TextDelta(" world"), Finished("stop", 7, 9)]
    with RestServer(create_app(pipeline, served_model_names=("tiny-omni",), reasoning=ReasoningParser("qwen3"))) as s:
        r = post(s)
        assert r.status_code == 200 and r.json()["text"] == "\n\nHello world", r.text
        assert pipeline.requests[-1].reasoning_end == "</think>"
        assert post(s, response_format="text").text == "\n\nHello world"


def events(r: httpx.Response) -> list:
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    lines = [line.removeprefix("data: ") for line in r.text.split("\n\n") if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_streamed_as_openai_transcript_events(pipeline: ScriptedPipeline) -> None:
    with RestServer(create_app(pipeline, served_model_names=("tiny-omni",))) as server:  # its own metrics
        r = httpx.post(f"{server.base_url}/v1/audio/transcriptions", data={"model": "tiny-omni", "stream": "true"},
                       files={"file": ("a.wav", wav_file(0.5), "audio/wav")}, headers={"X-Request-Id": "mine"},
                       timeout=30)
        assert events(r) == [{"type": "transcript.text.delta", "delta": "Hello"},
                             {"type": "transcript.text.delta", "delta": " world"},
                             {"type": "transcript.text.done", "text": "Hello world",
                              "usage": {"type": "tokens", "input_tokens": 7, "output_tokens": 2, "total_tokens": 9}}]
        assert r.headers["x-request-id"] == "trsc-mine" == pipeline.requests[-1].request_id
        assert pipeline.closed == ["trsc-mine"]
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        stream = client.audio.transcriptions.create(model="tiny-omni", file=("a.wav", wav_file(0.5)), stream=True)
        got = list(stream)
        assert [e.type for e in got] == ["transcript.text.delta", "transcript.text.delta", "transcript.text.done"]
        assert "".join(e.delta for e in got[:-1]) == got[-1].text == "Hello world"
        assert got[-1].usage.output_tokens == 2  # type: ignore[union-attr]
        translated = httpx.post(f"{server.base_url}/v1/audio/translations", timeout=30,
                                data={"model": "tiny-omni", "stream": "true"}, files={"file": ("a.wav", wav_file(0.5))})
        assert events(translated)[-1]["text"] == "Hello world"
        deadline = time.monotonic() + 5  # each stream settled once, as a 200 (after its last bytes went out)
        while "omnimesh:requests_running 0.0" not in (metrics := httpx.get(f"{server.base_url}/metrics").text):
            assert time.monotonic() < deadline, metrics
            time.sleep(0.05)
        assert 'omnimesh:requests_total{endpoint="transcriptions",status="200"} 2.0' in metrics
        assert 'omnimesh:requests_total{endpoint="translations",status="200"} 1.0' in metrics


def test_a_streamed_thought_is_left_out_and_errors_are_events(pipeline: ScriptedPipeline) -> None:
    from gateway.reasoning import ReasoningParser

    pipeline.script = lambda request: [TextDelta("<think>\nhm"), TextDelta("m</think>\n\nHel"), TextDelta("lo"),
                                       Finished("stop", 7, 3)]
    with RestServer(create_app(pipeline, served_model_names=("tiny-omni",), reasoning=ReasoningParser("qwen3"))) as s:
        got = events(post(s, stream="true"))
        assert "".join(e.get("delta", "") for e in got) == got[-1]["text"] == "\n\nHello"
        died = PipelineError("thinker died", http_status=503, grpc_code=14, kind="server_error")
        pipeline.script = lambda request: [TextDelta("<think>x</think>Hel"), died]
        got = events(post(s, stream="true"))
        assert got[0] == {"type": "transcript.text.delta", "delta": "Hel"}
        assert got[1]["error"]["message"] == "thinker died" and len(got) == 2
        pipeline.script = lambda request: [died]
        r = post(s, stream="true")  # nothing sent yet: the error keeps its status
        assert r.status_code == 503 and r.json()["error"]["message"] == "thinker died"


def test_include_logprobs(pipeline: ScriptedPipeline) -> None:
    """OpenAI's include[]=logprobs: each answer token's {token, logprob, bytes} in the json answer, on each
    streamed delta and in the done event; a reasoning model's thought tokens stay out."""
    from gateway.reasoning import ReasoningParser
    from omnimesh.v1 import stage_pb2

    def lp(token: bytes, logprob: float) -> stage_pb2.TokenLogprob:
        return stage_pb2.TokenLogprob(token_id=1, token=token, logprob=logprob)

    pipeline.script = lambda request: [
        TextDelta("<think>hm</think>", logprobs=(lp(b"<think>", -0.1), lp(b"hm", -0.2), lp(b"</think>", -0.3))),
        TextDelta("Hi", logprobs=(lp(b"Hi", -0.5),)), TextDelta(" you", logprobs=(lp(b" you", -1.5),)),
        Finished("stop", 7, 5)]
    with RestServer(create_app(pipeline, served_model_names=("tiny-omni",), reasoning=ReasoningParser("qwen3"))) as s:
        want = [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105]},
                {"token": " you", "logprob": -1.5, "bytes": [32, 121, 111, 117]}]
        r = post(s, **{"include[]": "logprobs"})
        assert r.status_code == 200 and r.json()["text"] == "Hi you" and r.json()["logprobs"] == want, r.text
        assert pipeline.requests[-1].sampling.logprobs == 0
        got = events(post(s, **{"include[]": "logprobs", "stream": "true"}))
        assert [e["logprobs"] for e in got[:-1]] == [want[:1], want[1:]] and got[-1]["logprobs"] == want
        assert "logprobs" not in post(s).json() and pipeline.requests[-1].sampling.logprobs is None
        client = openai.OpenAI(base_url=f"{s.base_url}/v1", api_key="unused", max_retries=0)
        out = client.audio.transcriptions.create(model="tiny-omni", file=("a.wav", wav_file(0.5)), include=["logprobs"])
        assert [(t.token, t.logprob) for t in out.logprobs or []] == [("Hi", -0.5), (" you", -1.5)]
