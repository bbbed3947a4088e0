"""Function calls in spoken answers (gateway/spoken_calls.py):

- the two parts against a scripted run: the speech part asks the thinker to stop at `<tool_call>` as well; when
  it does, the calls part continues the same conversation text-only (the words so far and `<tool_call>` as the
  open assistant message, the rest of max_tokens, the thinker's own sampling kept); the client gets one
  answer: the spoken deltas, `<tool_call>` and the calls' deltas marked unspoken, one `Finished` counting both
  parts (the prompt once); no call, a client's own stop id, max_tokens used up: no second part;
- the REST front over such a stream: `message.audio.transcript` and the streamed transcript deltas are only
  what was said, the calls come as `tool_calls` (finish_reason "tool_calls"), the content keeps the words;
- the `<tool_call>` token: one token in the tiny (Qwen-style) vocabulary; a pipeline whose tokenizer lacks it
  refuses spoken calls with a 400 naming `tools`.
Through the real mesh, equal to the uninterrupted text answer: tests/e2e/test_spoken_calls_e2e.py."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from gateway_harness import RestServer, ScriptedPipeline

from gateway.events import (
    AudioDelta,
    ChatMessage,
    ChatRequest,
    Event,
    Finished,
    PipelineError,
    SamplingOverrides,
    TemplateOptions,
    TextDelta,
    TextPart,
)
from gateway.pipeline import StagePipeline
from gateway.rest import create_app
from gateway.spoken_calls import call_token, spoken_with_calls
from omnimesh.models.qwen3_omni.tiny import tiny_tokenizer_spec
from omnimesh.models.tokenizer_build import build_tokenizer

TOKEN = 418
CALL = '\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
USER = (ChatMessage(role="user", content=(TextPart("Weather in Oslo?"),)),)


def _request(**sampling) -> ChatRequest:
    return ChatRequest(request_id="r1", model="m", messages=USER, modalities=("text", "audio"), voice="ethan",
                       sampling=SamplingOverrides(temperature=0.0, **sampling), tools=(WEATHER,), spoken_calls=True,
                       stage_params={"thinker": SamplingOverrides(top_k=5), "talker": SamplingOverrides(top_k=9)})


class Runs:
    """A scripted `run`: the speech part's events, then the calls part's; records each request."""

    def __init__(self, speech: list[Event], calls: list[Event]) -> None:
        self.scripts, self.requests = [speech, calls], []  # type: ignore[var-annotated]

    async def __call__(self, request: ChatRequest) -> AsyncIterator[Event]:
        self.requests.append(request)
        for ev in self.scripts[len(self.requests) - 1]:
            yield ev


async def _collect(runs: Runs, request: ChatRequest) -> list[Event]:
    return [ev async for ev in spoken_with_calls(runs, request, TOKEN)]


async def test_a_call_ends_the_speech_and_is_written_text_only() -> None:
    pcm = np.ones(240, np.float32)
    runs = Runs([TextDelta("Let me ", usage=(30, 2)), AudioDelta(pcm, 24_000), TextDelta("check.", usage=(30, 3)),
                 AudioDelta(pcm, 24_000), Finished("stop", 30, 4, cached_tokens=16, stop_reason=TOKEN)],
                [TextDelta(CALL[:20], usage=(36, 1)), TextDelta(CALL[20:], usage=(36, 14)),
                 Finished("stop", 36, 15)])
    events = await _collect(runs, _request(max_tokens=50, stop_token_ids=(7,)))
    speech, calls = runs.requests
    assert speech.sampling.stop_token_ids == (7, TOKEN) and speech.modalities == ("text", "audio")
    assert speech.request_id == "r1" and not speech.spoken_calls
    assert calls.request_id == "r1-calls" and calls.modalities == ("text",) and calls.voice is None
    assert calls.messages == (*USER, ChatMessage(role="assistant", content=(TextPart("Let me check.<tool_call>"),)))
    assert calls.template == TemplateOptions(add_generation_prompt=False, continue_final_message=True)
    assert calls.sampling.max_tokens == 46 and calls.sampling.stop_token_ids == (7,)  # the client's own stops only
    assert calls.stage_params == {"thinker": SamplingOverrides(top_k=5)} and calls.tools == (WEATHER,)
    texts = [(e.text, e.spoken, e.usage) for e in events if isinstance(e, TextDelta)]
    assert texts == [("Let me ", True, (30, 2)), ("check.", True, (30, 3)), ("<tool_call>", False, (30, 4)),
                     (CALL[:20], False, (30, 5)), (CALL[20:], False, (30, 18))]
    assert sum(isinstance(e, AudioDelta) for e in events) == 2
    assert events[-1] == Finished("stop", 30, 19, cached_tokens=16)


async def test_no_call_means_one_part() -> None:
    for last, request in ((Finished("stop", 30, 4), _request()),  # the model's own end
                          (Finished("stop", 30, 4, stop_reason=TOKEN), _request(stop_token_ids=(TOKEN,))),  # the client's
                          (Finished("length", 30, 4), _request(max_tokens=4))):
        runs = Runs([TextDelta("Hello."), last], [])
        events = await _collect(runs, request)
        assert len(runs.requests) == 1 and events == [TextDelta("Hello."), last]
    runs = Runs([TextDelta("Hi."), Finished("stop", 30, 4, stop_reason=TOKEN)], [])  # the call token was the last one
    events = await _collect(runs, _request(max_tokens=4))
    assert len(runs.requests) == 1 and events[-2] == TextDelta("<tool_call>", usage=(30, 4), spoken=False)
    assert events[-1] == Finished("length", 30, 4)


class ByteTokenizer:
    """A vocabulary of bytes: `<tool_call>` is eleven tokens."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())


def test_the_call_token() -> None:
    assert call_token(build_tokenizer(tiny_tokenizer_spec())) == TOKEN
    assert call_token(ByteTokenizer()) is None and call_token(object()) is None


def _spoken_script(request: ChatRequest) -> list[Event]:
    """What `spoken_with_calls` hands the front: the words spoken, the call not."""
    tone = (np.sin(np.arange(2400) / 5) * 0.3).astype(np.float32)
    return [TextDelta("Let me ", usage=(30, 2)), AudioDelta(tone, 24_000), TextDelta("check.", usage=(30, 3)),
            TextDelta("<tool_call>", usage=(30, 4), spoken=False), TextDelta(CALL, usage=(30, 18), spoken=False),
            Finished("stop", 30, 18)]


def test_rest_says_the_words_and_calls_the_tool() -> None:
    pipeline = ScriptedPipeline()
    pipeline.script = _spoken_script
    body = {"model": "tiny-omni", "messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [WEATHER],
            "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "pcm16"}}
    with RestServer(create_app(pipeline, served_model_names=("tiny-omni",), auto_tool_choice=True)) as server:
        r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=10)
        assert r.status_code == 200, r.text
        assert pipeline.requests[-1].spoken_calls and pipeline.requests[-1].tools == (WEATHER,)
        choice = r.json()["choices"][0]
        message = choice["message"]
        assert choice["finish_reason"] == "tool_calls" and message["content"] == "Let me check."
        assert message["audio"]["transcript"] == "Let me check." and base64.b64decode(message["audio"]["data"])
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
            ("get_weather", {"city": "Oslo"})]
        with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json={**body, "stream": True},
                          timeout=10) as s:
            deltas = [c["choices"][0]["delta"] for line in s.iter_lines() if line.startswith("data: {")
                      for c in [json.loads(line[6:])] if c["choices"]]
        transcript = "".join((d.get("audio") or {}).get("transcript") or "" for d in deltas)
        assert transcript == "Let me check." and "".join(d.get("content") or "" for d in deltas) == "Let me check."
        calls = [t for d in deltas for t in d.get("tool_calls") or []]
        assert [t["function"]["name"] for t in calls] == ["get_weather"]
        assert any((d.get("audio") or {}).get("data") for d in deltas)
        # a forced call has nothing to say: a 400
        forced = httpx.post(f"{server.base_url}/v1/chat/completions", json={**body, "tool_choice": "required"},
                            timeout=10)
        assert forced.status_code == 400 and forced.json()["error"]["param"] == "tool_choice"
        # without tools (or with tool_choice "none") nothing is split
        httpx.post(f"{server.base_url}/v1/chat/completions", json={**body, "tool_choice": "none"}, timeout=10)
        assert not pipeline.requests[-1].spoken_calls


def test_a_pipeline_whose_tokenizer_cannot_stop_at_a_call_refuses_spoken_calls() -> None:
    """`StagePipeline.run` finds `<tool_call>` in its prompt builder's tokenizer; a vocabulary without it as one token
    cannot keep the call out of the speech: a 400 naming `tools`, before any stage is asked."""
    prepare = SimpleNamespace(processor=SimpleNamespace(tokenizer=ByteTokenizer()))
    pipe = StagePipeline({"thinker": []}, prepare, served_models=("m",))  # type: ignore[arg-type]
    with pytest.raises(PipelineError, match="no single <tool_call> token") as e:
        pipe.run(_request())
    assert e.value.http_status == 400 and e.value.param == "tools"
    prepare.processor.tokenizer = build_tokenizer(tiny_tokenizer_spec())
    assert pipe._call_token("m") == TOKEN
