"""The Realtime session's `truncation` (gateway/realtime_truncation.py), on the tiny model's real prompt builder
(its chat template and processor) with a small max_model_len: `fit` leaves out the fewest oldest messages that
make the prompt fit (the instructions stay; a retention ratio cuts deeper; a last message too long alone is no
fit); through a WebSocket session whose pipeline checks the prompt's length as the real one does, a conversation
grown past the context is still answered (the response's prompt fits, the items stay in the conversation),
"disabled" fails the response as before, and the GA session shows and takes the setting."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from gateway_harness import RestServer, ScriptedPipeline, tone
from test_realtime import BETA
from websockets.sync.client import ClientConnection, connect

from gateway.events import AudioPart, ChatMessage, ChatRequest, Finished, SamplingOverrides, TextDelta, TextPart
from gateway.prompt import PromptBuilder
from gateway.realtime_settings import RealtimeError, parse_truncation, truncation_json
from gateway.realtime_truncation import fit
from gateway.rest import create_app

MAX_LEN = 160
TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def builder(tmp_path_factory: pytest.TempPathFactory) -> PromptBuilder:
    from omnimesh.models.qwen3_omni.tiny import build_tiny_qwen3_omni

    return PromptBuilder(build_tiny_qwen3_omni(Path(tmp_path_factory.mktemp("tiny")) / "m"), max_model_len=MAX_LEN)


def _chat(n: int, max_tokens: int | None = None) -> ChatRequest:
    """Instructions, then `n` alternating user / assistant turns (a user turn with audio among them)."""
    messages = [ChatMessage("system", (TextPart("Be brief."),))]
    for i in range(n):
        role = "user" if i % 2 == 0 else "assistant"
        parts: tuple[Any, ...] = (TextPart(f"turn {i}: the weather was fine and the sea was calm all day"),)
        if i == 2:
            parts += (AudioPart(tone(0.5), 16_000),)
        messages.append(ChatMessage(role, parts))
    return ChatRequest(request_id="r", model="m", messages=tuple(messages), sampling=SamplingOverrides(max_tokens=max_tokens))


def _tokens(builder: PromptBuilder, chat: ChatRequest) -> int:
    return int(builder.encode(chat).numel())


@pytest.mark.parametrize("ratio,max_tokens", [(1.0, None), (0.5, None), (1.0, 40)])
def test_fit_leaves_out_the_fewest_oldest_messages(builder: PromptBuilder, ratio: float, max_tokens: int | None) -> None:
    chat = _chat(13, max_tokens)
    assert _tokens(builder, chat) > MAX_LEN  # over the context as it is
    shorter, k = fit(builder, chat, ratio)  # type: ignore[misc]
    budget = MAX_LEN - (max_tokens or 1)
    assert shorter.messages == chat.messages[:1] + chat.messages[1 + k:]  # the instructions stay
    assert _tokens(builder, shorter) <= int(budget * ratio)
    one_less = replace(chat, messages=chat.messages[:1] + chat.messages[k:])
    assert _tokens(builder, one_less) > int(budget * ratio)  # the fewest: one message more would not fit
    builder.check_length(_tokens(builder, shorter), max_tokens)  # what the pipeline checks passes


def test_nothing_fits_or_nothing_to_leave_out(builder: PromptBuilder) -> None:
    long_last = _chat(3)
    long_last = replace(long_last, messages=long_last.messages + (ChatMessage("user", (TextPart("word " * 400),)),))
    assert fit(builder, long_last, 1.0) is None  # the last message alone is over the context
    alone = replace(long_last, messages=long_last.messages[-1:])
    assert fit(builder, alone, 1.0) is None
    chat = _chat(13)
    tight = fit(builder, chat, 0.0)  # nothing fits 0 tokens: the most left out that fits the context itself
    assert tight is not None and tight[1] == 12 and tight[0].messages == chat.messages[:1] + chat.messages[-1:]


def test_the_setting() -> None:
    assert parse_truncation("auto", "s") == 1.0 and parse_truncation(None, "s") == 1.0
    assert parse_truncation("disabled", "s") is None
    assert parse_truncation({"type": "retention_ratio", "retention_ratio": 0.8}, "s") == 0.8
    for ratio in (1.0, None, 0.8):
        assert parse_truncation(truncation_json(ratio), "s") == ratio
    for bad in ("x", 1, {"type": "retention_ratio"}, {"type": "retention_ratio", "retention_ratio": 1.5},
                {"type": "retention_ratio", "retention_ratio": True}, {"type": "x", "retention_ratio": 0.5},
                {"type": "retention_ratio", "retention_ratio": 0.5, "extra": 1}):
        with pytest.raises(RealtimeError, match="truncation must be"):
            parse_truncation(bad, "session.truncation")


# ---------------------------------------------------------------------------------------- through a session
@pytest.fixture(scope="module")
def counted(builder: PromptBuilder) -> Iterator[tuple[RestServer, ScriptedPipeline]]:
    """A session server whose pipeline builds each prompt with the real builder (its length check included) and
    answers with the prompt's size as its usage."""
    pipeline = ScriptedPipeline()
    pipeline.prepare = builder  # type: ignore[attr-defined]

    def script(request: ChatRequest) -> list[Any]:
        n = builder.build(request).prompt_tokens  # a prompt over the context: the pipeline's 400, before any output
        return [TextDelta("Fine."), Finished(finish_reason="stop", prompt_tokens=n, completion_tokens=1)]

    pipeline.script = script
    with RestServer(create_app(pipeline, served_model_names=("tiny-omni",), prompts=builder)) as server:
        yield server, pipeline


def _events_until(ws: ClientConnection, *kinds: str) -> list[dict[str, Any]]:
    out = []
    while not out or out[-1]["type"] not in kinds:
        out.append(json.loads(ws.recv(timeout=TIMEOUT_S)))
    return out


@contextlib.contextmanager
def _session(server: RestServer, ga: bool = False) -> Iterator[ClientConnection]:
    with connect(server.base_url.replace("http://", "ws://") + "/v1/realtime?model=tiny-omni",
                 additional_headers=None if ga else BETA, open_timeout=TIMEOUT_S) as ws:
        assert json.loads(ws.recv(timeout=TIMEOUT_S))["type"] == "session.created"
        session = ({"type": "realtime", "output_modalities": ["text"], "instructions": "Be brief."} if ga
                   else {"modalities": ["text"], "instructions": "Be brief."})
        ws.send(json.dumps({"type": "session.update", "session": session}))
        assert json.loads(ws.recv(timeout=TIMEOUT_S))["type"] == "session.updated"
        yield ws


def _say(ws: ClientConnection, n: int) -> list[str]:
    ids = []
    for i in range(n):
        role = "user" if i % 2 == 0 else "assistant"
        kind = "input_text" if role == "user" else "text"
        ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": role, "content": [{"type": kind, "text": f"turn {i}: " + "the sea was calm " * 3}]}}))
        ids.append(_events_until(ws, "conversation.item.created", "conversation.item.added")[-1]["item"]["id"])
    return ids


def test_a_long_conversation_is_still_answered(counted: tuple[RestServer, ScriptedPipeline], builder: PromptBuilder) -> None:
    server, pipeline = counted
    before = len(pipeline.requests)  # the server (and its pipeline) is the module's
    with _session(server) as ws:
        ids = _say(ws, 15)
        ws.send(json.dumps({"type": "response.create"}))
        done = _events_until(ws, "response.done")[-1]["response"]
        assert done["status"] == "completed", done
        assert done["usage"]["input_tokens"] < MAX_LEN  # the prompt that ran fits
        ran = pipeline.requests[-1]
        assert ran.messages[0].content[0].text == "Be brief."  # the instructions kept
        assert ran.messages[-1].content[0].text.startswith("turn 14:")  # the latest turns kept
        assert len(pipeline.requests) == before + 2  # the whole one ran first, then the cut one
        assert len(pipeline.requests[before].messages) == 16
        ws.send(json.dumps({"type": "conversation.item.retrieve", "item_id": ids[0]}))  # the oldest is still there
        assert _events_until(ws, "conversation.item.retrieved")[-1]["item"]["id"] == ids[0]

        ws.send(json.dumps({"type": "session.update", "session": {"truncation": "disabled"}}))
        assert json.loads(ws.recv(timeout=TIMEOUT_S))["session"]["truncation"] == "disabled"
        ws.send(json.dumps({"type": "response.create"}))
        events = _events_until(ws, "response.done")
        assert events[-1]["response"]["status"] == "failed"
        assert any(e["type"] == "error" and "maximum context length" in e["error"]["message"] for e in events)


def test_the_ga_session_shows_and_takes_the_setting(counted: tuple[RestServer, ScriptedPipeline]) -> None:
    server, pipeline = counted
    with _session(server, ga=True) as ws:
        ratio = {"type": "retention_ratio", "retention_ratio": 0.5}
        ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime", "truncation": ratio}}))
        assert json.loads(ws.recv(timeout=TIMEOUT_S))["session"]["truncation"] == ratio
        _say(ws, 15)
        ws.send(json.dumps({"type": "response.create"}))
        done = _events_until(ws, "response.done")[-1]["response"]
        assert done["status"] == "completed" and done["usage"]["input_tokens"] <= (MAX_LEN - 1) // 2
        ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime", "truncation": "sometimes"}}))
        error = json.loads(ws.recv(timeout=TIMEOUT_S))
        assert error["type"] == "error" and error["error"]["param"] == "session.truncation"


def test_audio_counts_too(builder: PromptBuilder) -> None:
    """A user turn's audio is part of what is counted (its placeholder tokens): leaving it out frees them."""
    chat = _chat(3)
    with_audio = _tokens(builder, chat)
    without = replace(chat, messages=tuple(replace(m, content=m.content[:1]) for m in chat.messages))
    assert with_audio - _tokens(builder, without) > 5
