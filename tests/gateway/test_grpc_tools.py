"""OpenAI function calling over gRPC (`GenerateRequest.tools` / `tool_choice`, gateway/grpc_api.py), against a
scripted pipeline: the tools reach the pipeline as REST sends them; with --enable-auto-tool-choice the Hermes
blocks leave the text as `tool_calls` responses and the choice ends "tool_calls"; "required" and a named
function hold the thinker to the calls' JSON (a structured output) and answer the calls only; earlier calls
and tool answers travel in the messages; a spoken answer asks for spoken calls; every mistake is one
INVALID_ARGUMENT naming its field."""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from gateway_harness import GrpcServer, ScriptedPipeline
from test_tool_calls import ANSWER, TIME, WEATHER

from gateway.events import AudioDelta, Finished, TextDelta, ToolCall
from omnimesh.v1 import omni_pb2, omni_pb2_grpc

USER = omni_pb2.ChatMessage(role="user", content=[omni_pb2.ContentPart(text="Weather and time in Oslo?")])


def _tool(spec: dict) -> omni_pb2.Tool:
    f = spec["function"]
    return omni_pb2.Tool(name=f["name"], description=f.get("description", ""),
                         parameters=json.dumps(f["parameters"]) if "parameters" in f else "")


TOOLS = [_tool(WEATHER), _tool(TIME)]


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[GrpcServer, ScriptedPipeline]]:
    pipeline = ScriptedPipeline()
    with GrpcServer(pipeline, auto_tool_choice=True) as server:
        yield server, pipeline


def generate(server: GrpcServer, **fields: object) -> list[omni_pb2.GenerateResponse]:
    request = omni_pb2.GenerateRequest(model="tiny-omni", messages=[USER], **{"modalities": ["text"], **fields})
    with grpc.insecure_channel(server.target) as ch:
        return list(omni_pb2_grpc.OmniStub(ch).Generate(request, timeout=10))


def _calls(out: list[omni_pb2.GenerateResponse]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for r in out if r.HasField("tool_calls") for c in r.tool_calls.calls]


def test_auto_tool_calls_come_as_tool_calls_responses(served) -> None:
    server, pipeline = served
    pipeline.script = lambda request: [TextDelta(ANSWER[:20]), TextDelta(ANSWER[20:70]), TextDelta(ANSWER[70:]),
                                       Finished(finish_reason="stop", prompt_tokens=40, completion_tokens=30)]
    out = generate(server, tools=TOOLS)
    assert pipeline.requests[-1].tools == (WEATHER, TIME)  # as REST renders them
    assert "".join(r.text_delta for r in out) == "Let me check.\n\n"
    assert _calls(out) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    ids = [c.id for r in out if r.HasField("tool_calls") for c in r.tool_calls.calls]
    assert len(set(ids)) == 2 and all(i.startswith("chatcmpl-tool-") for i in ids)
    assert out[-1].done.finish_reason == "tool_calls"
    none = generate(server, tools=TOOLS, tool_choice="none")  # the tools render, nothing is parsed
    assert "".join(r.text_delta for r in none) == ANSWER and none[-1].done.finish_reason == "stop"


def test_forced_calls_and_the_next_turn(served) -> None:
    server, pipeline = served
    answers = {"named": '{"city": "Oslo"}', "required": '[{"name": "get_time", "parameters": {}}]'}
    pipeline.script = lambda request: [TextDelta(answers["required" if "array" in request.structured[1] else "named"]),
                                       Finished(finish_reason="stop", prompt_tokens=9, completion_tokens=5)]
    named = generate(server, tools=TOOLS, tool_choice="get_weather")
    assert _calls(named) == [("get_weather", {"city": "Oslo"})] and not any(r.text_delta for r in named)
    assert pipeline.requests[-1].structured is not None  # held to the function's arguments schema
    one = generate(server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert _calls(one) == [("get_time", {})]
    assert '"maxItems": 1' in pipeline.requests[-1].structured[1]
    call = next(c for r in named if r.HasField("tool_calls") for c in r.tool_calls.calls)
    turn = [USER, omni_pb2.ChatMessage(role="assistant", tool_calls=[call]),
            omni_pb2.ChatMessage(role="tool", tool_call_id=call.id, content=[omni_pb2.ContentPart(text="rain")])]
    request = omni_pb2.GenerateRequest(model="tiny-omni", modalities=["text"], messages=turn, tools=TOOLS,
                                       tool_choice="none")
    with grpc.insecure_channel(server.target) as ch:
        list(omni_pb2_grpc.OmniStub(ch).Generate(request, timeout=10))
    sent = pipeline.requests[-1].messages
    assert sent[1].tool_calls == (ToolCall(call.id, "get_weather", '{"city": "Oslo"}'),)
    assert sent[2].role == "tool" and sent[2].tool_call_id == call.id


@pytest.mark.parametrize(("fields", "needle"), [
    ({"tools": [omni_pb2.Tool(name="")]}, "tools[0].name: a function needs a name"),
    ({"tools": [omni_pb2.Tool(name="f", parameters="{oops")]}, "tools[0].parameters: not JSON"),
    ({"tools": [omni_pb2.Tool(name="f", parameters="[1]")]}, "tools[0].parameters: must be a JSON schema object"),
    ({"tools": [omni_pb2.Tool(name="f", parameters="[" * 5000 + "]" * 5000)]},  # was UNKNOWN (RecursionError)
     "tools[0].parameters: not JSON: its arrays / objects nest too deeply"),
    ({"tools": [omni_pb2.Tool(name="f", parameters='{"description": "\\ud800"}')]},  # was INTERNAL (the tokenizer)
     "tools[0].parameters: not JSON: a string has an unpaired UTF-16 surrogate"),
    ({"chat_template_kwargs": '{"x": ' + "[" * 5000 + "]" * 5000 + "}"}, "chat_template_kwargs: not JSON: its arrays"),
    ({"structured_output": omni_pb2.StructuredOutput(kind="json", spec="[" * 5000 + "]" * 5000)},
     "structured_output: invalid json: its arrays / objects nest too deeply"),
    ({"tools": TOOLS, "tool_choice": "get_nothing"}, "tool_choice: function 'get_nothing' is not among the tools"),
    ({"tool_choice": "required"}, "tool_choice: forcing a call needs tools"),
    ({"tools": TOOLS, "tool_choice": "required", "modalities": ["text", "audio"]}, "tool_choice: a forced call is the whole answer"),
    ({"tools": TOOLS, "structured_output": omni_pb2.StructuredOutput(kind="regex", spec="a+")},
     "structured_output: a structured output and tool calls cannot both shape one answer"),
    ({"messages": [omni_pb2.ChatMessage(role="tool", content=[omni_pb2.ContentPart(text="x")])]},
     "messages[0]: a 'tool' message needs the tool_call_id"),
    ({"messages": [omni_pb2.ChatMessage(role="user", tool_calls=[omni_pb2.ToolCall(id="c", name="f")])]},
     "messages[0].tool_calls: only assistant messages make calls"),
])
def test_mistakes_are_invalid_argument(served, fields, needle) -> None:
    server, pipeline = served
    pipeline.requests.clear()
    request = omni_pb2.GenerateRequest(model="tiny-omni", modalities=["text"], messages=[USER])
    for name, value in fields.items():
        if isinstance(value, list):  # replaces the field's list
            del getattr(request, name)[:]
            getattr(request, name).extend(value)
        elif isinstance(value, str):
            setattr(request, name, value)
        else:
            getattr(request, name).CopyFrom(value)
    with grpc.insecure_channel(server.target) as ch:
        out = list(omni_pb2_grpc.OmniStub(ch).Generate(request, timeout=10))
    assert len(out) == 1 and out[0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], out
    assert needle in out[0].error.message, out[0].error.message
    assert pipeline.requests == []


def test_auto_needs_the_flag(grpc_server: GrpcServer) -> None:
    out = generate(grpc_server, tools=TOOLS)
    assert out[0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "--enable-auto-tool-choice" in out[0].error.message


def test_a_spoken_answer_calls_tools(served) -> None:
    """Audio out with "auto": the request asks for spoken calls (gateway/spoken_calls.py: the talker stops at
    the call); the audio and the words come as usual, the call as a `tool_calls` response."""
    server, pipeline = served
    pipeline.script = lambda request: [TextDelta("Let me check."), AudioDelta(np.full(480, 0.1, np.float32), 24_000),
                                       TextDelta("<tool_call>", spoken=False), TextDelta(ANSWER[ANSWER.index("\n{"):],
                                                                                           spoken=False),
                                       Finished(finish_reason="stop", prompt_tokens=40, completion_tokens=30)]
    out = generate(server, tools=TOOLS, modalities=["text", "audio"], voice="ethan")
    assert pipeline.requests[-1].spoken_calls and pipeline.requests[-1].modalities == ("text", "audio")
    assert "".join(r.text_delta for r in out).startswith("Let me check.") and any(r.HasField("audio") for r in out)
    assert [name for name, _ in _calls(out)][:1] == ["get_weather"] and out[-1].done.finish_reason == "tool_calls"
