"""Function calling on `POST /v1/responses` (gateway/responses_tools.py) against a scripted pipeline:

- flat function tools reach the chat template in the chat's form; the thinker's Hermes blocks come back as
  `function_call` items after the message (no message when the answer is only calls), the tools and the tool
  choice echoed in the Responses shape;
- streamed: each call is its own item (added, arguments delta and done, done) at its output index, the
  message opening only at the answer's first text that is not blank; `response.completed` carries the items
  as streamed;
- the official `openai` client's loop: the calls sent back as `function_call` items with their
  `function_call_output`, which become the chat's assistant calls and tool turn;
- a forced call (named, or "required") without --enable-auto-tool-choice: the thinker held to its JSON;
- a reasoning model: the reasoning item first, then the call; sent back, its text is the reasoning of the
  assistant turn after it.
The 400s: tests/gateway/test_responses.py::test_bad_bodies. Through a real mesh: tests/e2e/test_responses_e2e.py."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from gateway_harness import RestServer, ScriptedPipeline

from gateway.events import Finished, TextDelta, ToolCall
from gateway.reasoning import ReasoningParser
from gateway.rest import create_app

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
TIME = {"type": "function", "name": "get_time"}
CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def _script(*pieces: str):
    return lambda request: [*(TextDelta(p) for p in pieces), Finished("stop", prompt_tokens=40, completion_tokens=30)]


@pytest.fixture()
def scripted(auto_tools_server) -> Iterator[tuple[RestServer, ScriptedPipeline]]:
    s, pipeline = auto_tools_server
    pipeline.reset()
    yield s, pipeline


def _post(server: RestServer, **body) -> dict:
    r = httpx.post(f"{server.base_url}/v1/responses", json={"model": "tiny-omni", "input": "Weather in Oslo?", **body},
                   timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def _events(server: RestServer, **body) -> list[dict]:
    with httpx.stream("POST", f"{server.base_url}/v1/responses", timeout=10,
                      json={"model": "tiny-omni", "input": "Weather in Oslo?", "stream": True, **body}) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def _calls(output: list[dict]) -> list[tuple[str, dict]]:
    return [(o["name"], json.loads(o["arguments"])) for o in output if o["type"] == "function_call"]


def test_calls_come_back_as_function_call_items(scripted) -> None:
    server, pipeline = scripted
    pipeline.script = _script("Let me check.\n", CALLS[:30], CALLS[30:])
    out = _post(server, tools=[WEATHER, TIME])
    assert [o["type"] for o in out["output"]] == ["message", "function_call", "function_call"]
    assert out["output"][0]["content"][0]["text"] == "Let me check.\n\n"
    assert _calls(out["output"]) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    fc = out["output"][1]
    assert fc["id"].startswith("fc_") and fc["call_id"] and fc["status"] == "completed"
    assert out["status"] == "completed" and out["tool_choice"] == "auto" and out["tools"] == [WEATHER, TIME]
    # the chat template gets the chat's form
    assert pipeline.requests[-1].tools == ({"type": "function", "function": {k: v for k, v in WEATHER.items()
                                                                             if k != "type"}},
                                           {"type": "function", "function": {"name": "get_time"}})
    # only calls: no message item
    pipeline.script = _script("\n", CALLS)
    only = _post(server, tools=[WEATHER, TIME])
    assert [o["type"] for o in only["output"]] == ["function_call", "function_call"]
    # tool_choice "none": the tools are in the prompt, the blocks stay text
    none = _post(server, tools=[WEATHER, TIME], tool_choice="none")
    assert [o["type"] for o in none["output"]] == ["message"] and none["output"][0]["content"][0]["text"] == "\n" + CALLS
    assert pipeline.requests[-1].tools and none["tool_choice"] == "none"


def test_streamed_calls_are_items_of_their_own(scripted) -> None:
    server, pipeline = scripted
    pipeline.script = _script("\n", CALLS[:25], CALLS[25:60], CALLS[60:], " Done.")
    events = _events(server, tools=[WEATHER, TIME])
    kinds = [e["type"] for e in events]
    call = ["response.output_item.added", "response.function_call_arguments.delta",
            "response.function_call_arguments.done", "response.output_item.done"]
    assert kinds == ["response.created", "response.in_progress", *call, *call,
                     "response.output_item.added", "response.content_part.added", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [(e["output_index"], e["item"]["type"]) for e in added] == [(0, "function_call"), (1, "function_call"),
                                                                     (2, "message")]
    assert added[0]["item"]["arguments"] == "" and added[0]["item"]["status"] == "in_progress"
    args = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [(e["output_index"], json.loads(e["arguments"])) for e in args] == [(0, {"city": "Oslo"}), (1, {})]
    assert args[0]["item_id"] == added[0]["item"]["id"]
    # the blank text before the calls joins the message's text that comes after them
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "\n\n Done."
    done = events[-1]["response"]["output"]
    assert [o["type"] for o in done] == ["function_call", "function_call", "message"]
    assert done[0] == events[5]["item"] and _calls(done) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert done[2]["content"][0]["text"] == "\n\n Done."
    # only calls: no message item at all
    pipeline.script = _script("\n", CALLS)
    only = _events(server, tools=[WEATHER, TIME])
    assert "response.content_part.added" not in [e["type"] for e in only]
    assert [o["type"] for o in only[-1]["response"]["output"]] == ["function_call", "function_call"]


def test_the_openai_client_runs_the_tool_loop(scripted) -> None:
    server, pipeline = scripted
    pipeline.script = _script("Let me check.", CALLS)
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x")
    asked: list = [{"role": "user", "content": "Weather in Oslo?"}]
    first = client.responses.create(model="tiny-omni", input=asked, tools=[WEATHER, TIME])  # type: ignore[arg-type,list-item]
    calls = [o for o in first.output if o.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    pipeline.script = _script("Rain at noon.")
    follow = [*asked, *(o.model_dump(exclude_none=True) for o in first.output),
              *({"type": "function_call_output", "call_id": c.call_id, "output": out}
                for c, out in zip(calls, ("rain", [{"type": "input_text", "text": "12:00"}]), strict=True))]
    second = client.responses.create(model="tiny-omni", input=follow, tools=[WEATHER, TIME])  # type: ignore[arg-type]
    assert second.output_text == "Rain at noon."
    user, assistant, *tools = pipeline.requests[-1].messages
    assert assistant.role == "assistant" and assistant.content[0].text == "Let me check.\n"  # type: ignore[union-attr]
    assert assistant.tool_calls == tuple(ToolCall(c.call_id, c.name, c.arguments) for c in calls)
    assert [(t.role, t.tool_call_id, t.content[0].text) for t in tools] == [  # type: ignore[union-attr]
        ("tool", calls[0].call_id, "rain"), ("tool", calls[1].call_id, "12:00")]
    # streamed through the client: the same calls
    pipeline.script = _script(CALLS)
    stream = client.responses.create(model="tiny-omni", input=asked, tools=[WEATHER, TIME], stream=True)  # type: ignore[arg-type,list-item]
    assert [e.item.name for e in stream if e.type == "response.output_item.done"] == ["get_weather", "get_time"]


def test_forced_calls_need_no_flag() -> None:
    pipeline = ScriptedPipeline()
    answers = {"named": '{"city": "Oslo"}', "required": '[{"name": "get_time", "parameters": {}}]'}
    pipeline.script = lambda request: [TextDelta(answers["required" if "array" in request.structured[1] else "named"]),
                                       Finished("stop", prompt_tokens=9, completion_tokens=5)]
    with RestServer(create_app(pipeline, served_model_names=("tiny-omni",))) as server:  # no --enable-auto-tool-choice
        for choice, want in (({"type": "function", "name": "get_weather"}, [("get_weather", {"city": "Oslo"})]),
                             ("required", [("get_time", {})])):
            out = _post(server, tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=False)
            assert [o["type"] for o in out["output"]] == ["function_call"] and _calls(out["output"]) == want
            assert out["tool_choice"] == choice and out["parallel_tool_calls"] is False
            structured = pipeline.requests[-1].structured
            assert structured is not None and ('"maxItems": 1' in structured[1]) == (choice == "required")
            events = _events(server, tools=[WEATHER, TIME], tool_choice=choice)
            assert not [e for e in events if e["type"] == "response.output_text.delta"]  # the JSON never shows as text
            assert _calls(events[-1]["response"]["output"]) == want


def test_a_reasoning_model_reasons_then_calls() -> None:
    pipeline = ScriptedPipeline()
    pipeline.script = _script("<think>\nAsk the tool.\n</think>\n\n", CALLS)
    with RestServer(create_app(pipeline, served_model_names=("tiny-omni",), auto_tool_choice=True,
                               reasoning=ReasoningParser("qwen3"))) as server:
        out = _post(server, tools=[WEATHER, TIME])
        assert [o["type"] for o in out["output"]] == ["reasoning", "function_call", "function_call"]
        events = _events(server, tools=[WEATHER, TIME])
    added = [(e["output_index"], e["item"]["type"]) for e in events if e["type"] == "response.output_item.added"]
    assert added == [(0, "reasoning"), (1, "function_call"), (2, "function_call")]
    kinds = [e["type"] for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.function_call_arguments.delta")
    assert [o["type"] for o in events[-1]["response"]["output"]] == ["reasoning", "function_call", "function_call"]
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == out["output"][0]["content"][0]["text"]
    # the SDKs send the reasoning item back with the calls: accepted, and left out of the next prompt
    follow = [{"role": "user", "content": "Weather in Oslo?"}, *out["output"],
              {"type": "function_call_output", "call_id": out["output"][1]["call_id"], "output": "rain"}]
    pipeline.script = _script("<think>\nIt rains.\n</think>\n\nRain.")
    with RestServer(create_app(pipeline, served_model_names=("tiny-omni",), auto_tool_choice=True,
                               reasoning=ReasoningParser("qwen3"))) as server:
        again = _post(server, input=follow, tools=[WEATHER, TIME])
    assert again["output"][-1]["content"][0]["text"] == "\n\nRain."
    assert [m.role for m in pipeline.requests[-1].messages] == ["user", "assistant", "tool"]
    assert len(pipeline.requests[-1].messages[1].tool_calls) == 2
    # its thought goes with that assistant turn, for the template (`reasoning_content`)
    assert pipeline.requests[-1].messages[1].reasoning == out["output"][0]["content"][0]["text"] != ""
