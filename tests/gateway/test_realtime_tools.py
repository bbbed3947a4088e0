"""Function calling on the Realtime API (gateway/realtime_tools.py) against a scripted pipeline, over a real
WebSocket to a gateway with --enable-auto-tool-choice:

- the session's flat function tools reach the chat template in the chat's form and are echoed;
- a text response: the words as `response.text.delta`, each call as its `function_call` item (added, created in
  the conversation, arguments delta and done, done) after the message, `response.done` listing both;
- the client's `function_call_output` item and the next `response.create`: the chat sees the user turn, the
  assistant's words with the call, and the tool turn;
- a spoken response: the talker's words alone as the transcript (gateway/spoken_calls.py), the call as its
  item, the request marked `spoken_calls`.
Mistakes (a hosted tool, "auto" without the flag, an output for no call): tests/gateway/test_realtime.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from gateway_harness import ScriptedPipeline
from test_realtime import BETA
from websockets.sync.client import ClientConnection, connect

from gateway.events import AudioDelta, ChatRequest, Event, Finished, TextDelta, TextPart, ToolCall

TIMEOUT_S = 10.0
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


@pytest.fixture()
def ws(auto_tools_server) -> Iterator[tuple[ClientConnection, ScriptedPipeline]]:
    s, pipeline = auto_tools_server
    pipeline.reset()
    with connect(s.base_url.replace("http://", "ws://") + "/v1/realtime?model=tiny-omni", additional_headers=BETA,
                 open_timeout=TIMEOUT_S) as c:
        assert recv(c)["type"] == "session.created"
        yield c, pipeline


def recv(conn: ClientConnection) -> dict[str, Any]:
    return json.loads(conn.recv(timeout=TIMEOUT_S))


def send(conn: ClientConnection, **event: Any) -> None:
    conn.send(json.dumps(event))


def until(conn: ClientConnection, kind: str) -> list[dict[str, Any]]:
    out = [recv(conn)]
    while out[-1]["type"] != kind:
        assert out[-1]["type"] != "error", out[-1]
        out.append(recv(conn))
    return out


def ask(conn: ClientConnection, text: str) -> None:
    send(conn, type="conversation.item.create", item={"type": "message", "role": "user",
                                                     "content": [{"type": "input_text", "text": text}]})
    assert recv(conn)["type"] == "conversation.item.created"


def test_a_text_response_calls_and_hears_the_result(ws) -> None:
    conn, pipeline = ws
    pipeline.script = lambda request: [TextDelta("Let me check.\n"), TextDelta(CALL[:30]), TextDelta(CALL[30:]),
                                       Finished("stop", 20, 12)]
    send(conn, type="session.update", session={"modalities": ["text"], "tools": [WEATHER]})
    session = recv(conn)["session"]
    assert session["tools"] == [WEATHER] and session["tool_choice"] == "auto"
    ask(conn, "Weather in Oslo?")
    send(conn, type="response.create")
    events = until(conn, "response.done")
    assert pipeline.requests[-1].tools == ({"type": "function", "function": {k: v for k, v in WEATHER.items()
                                                                             if k != "type"}},)
    assert "".join(e["delta"] for e in events if e["type"] == "response.text.delta") == "Let me check.\n"
    at = [i for i, e in enumerate(events) if e["type"] == "response.output_item.added"][1]
    assert [e["type"] for e in events[at:at + 5]] == [
        "response.output_item.added", "conversation.item.created", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"]
    item = events[at + 4]["item"]
    assert item["type"] == "function_call" and item["name"] == "get_weather" and events[at]["output_index"] == 1
    assert json.loads(item["arguments"]) == {"city": "Oslo"} and events[at + 3]["call_id"] == item["call_id"]
    done = events[-1]["response"]
    assert done["status"] == "completed" and [o["type"] for o in done["output"]] == ["message", "function_call"]
    assert done["output"][1] == item
    # the result, then the next response: the chat has the words with the call, and the tool's answer
    pipeline.script = lambda request: [TextDelta("Rain."), Finished("stop", 40, 2)]
    send(conn, type="conversation.item.create", item={"type": "function_call_output", "call_id": item["call_id"],
                                                     "output": "rain"})
    created = recv(conn)
    assert created["item"]["type"] == "function_call_output" and created["previous_item_id"] == item["id"]
    send(conn, type="response.create")
    assert "".join(e["delta"] for e in until(conn, "response.done") if e["type"] == "response.text.delta") == "Rain."
    user, assistant, tool = pipeline.requests[-1].messages
    assert user.content == (TextPart("Weather in Oslo?"),) and assistant.content == (TextPart("Let me check.\n"),)
    assert assistant.tool_calls == (ToolCall(item["call_id"], "get_weather", item["arguments"]),)
    assert tool.role == "tool" and tool.tool_call_id == item["call_id"] and tool.content == (TextPart("rain"),)


def test_a_spoken_response_says_only_the_words(ws) -> None:
    conn, pipeline = ws

    def script(request: ChatRequest) -> list[Event]:  # what gateway/spoken_calls.py hands the front
        return [TextDelta("Let me check."), AudioDelta(np.full(480, 0.1, np.float32), 24_000),
                TextDelta("<tool_call>", spoken=False), TextDelta(CALL[len("<tool_call>"):], spoken=False),
                Finished("stop", 20, 12)]

    pipeline.script = script
    send(conn, type="session.update", session={"tools": [WEATHER], "tool_choice": "auto"})
    recv(conn)
    ask(conn, "Weather in Oslo?")
    send(conn, type="response.create")
    events = until(conn, "response.done")
    assert pipeline.requests[-1].spoken_calls and pipeline.requests[-1].modalities == ("text", "audio")
    assert "".join(e["delta"] for e in events if e["type"] == "response.audio_transcript.delta") == "Let me check."
    assert [e["transcript"] for e in events if e["type"] == "response.audio_transcript.done"] == ["Let me check."]
    calls = [e["item"] for e in events if e["type"] == "response.output_item.done" and e["item"]["type"] == "function_call"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Oslo"})]
    # the conversation keeps what was said, then the call
    pipeline.script = lambda request: [TextDelta("Rain."), Finished("stop", 40, 2)]
    send(conn, type="conversation.item.create", item={"type": "function_call_output", "call_id": calls[0]["call_id"],
                                                     "output": {"rain": True}})
    recv(conn)
    send(conn, type="response.create", response={"modalities": ["text"]})
    until(conn, "response.done")
    _, assistant, tool = pipeline.requests[-1].messages
    assert assistant.content == (TextPart("Let me check."),) and tool.content == (TextPart('{"rain": true}'),)


def test_a_call_id_the_conversation_already_has_is_refused() -> None:
    """Two function_call items with one call_id: an output could not say which it answers (both were kept)."""
    from gateway.realtime_settings import RealtimeError
    from gateway.realtime_tools import parse_call_item

    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    items: list[Any] = [parse_call_item(call, [])]
    with pytest.raises(RealtimeError, match="already has a function_call with call_id 'c1'") as e:
        parse_call_item(call, items)
    assert e.value.param == "item.call_id"
    assert parse_call_item({**call, "call_id": "c2"}, items).call.id == "c2"


def test_a_forced_calls_schema_that_does_not_compile_is_refused_before_the_response(ws) -> None:
    """It failed after response.created (at the thinker), with no param; now an error event up front, as REST's
    400, and no response starts."""
    conn, pipeline = ws
    ask(conn, "Weather?")
    bad = {"type": "function", "name": "f",
           "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}
    send(conn, type="response.create", response={"modalities": ["text"], "tools": [bad], "tool_choice": "required"})
    error = recv(conn)
    assert error["type"] == "error" and error["error"]["param"] == "response.tools", error
    assert "does not compile" in error["error"]["message"] and "nonsense" in error["error"]["message"]
    assert pipeline.requests == []
