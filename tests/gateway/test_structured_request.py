"""Structured outputs at the gateway (gateway/structured_request.py): OpenAI's `response_format` (json_object,
json_schema), vLLM's `structured_outputs` (json, regex, choice, grammar, json_object) and its older `guided_*`
fields become one (kind, spec) on the ChatRequest, through a real REST server and the gRPC API; a bad schema,
regex or grammar, two specs at once, a json_schema without its schema, and a structured output beside
auto tool calls are 400s naming the field; `text` asks for nothing."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
from gateway_harness import GrpcServer, RestServer, ScriptedPipeline

from gateway.events import PipelineError
from gateway.openai_schema import parse_chat_request
from gateway.structured_request import structured_spec
from omnimesh.v1 import omni_pb2, omni_pb2_grpc

USER = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def spec(**body: object) -> tuple[str, str] | None:
    return structured_spec(parse_chat_request(json.dumps({"messages": USER, **body}).encode()))


def test_each_field_names_one_spec() -> None:
    assert spec() is None and spec(response_format={"type": "text"}) is None
    assert spec(response_format={"type": "json_object"}) == ("json", '{"type": "object"}')
    got = spec(response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA, "strict": True}})
    assert got is not None and got[0] == "json" and json.loads(got[1]) == SCHEMA
    assert spec(structured_outputs={"regex": "[0-9]+"}) == ("regex", "[0-9]+")
    assert spec(structured_outputs={"choice": ["a", "b"]}) == ("choice", '["a", "b"]')
    assert spec(structured_outputs={"json": SCHEMA}) == ("json", json.dumps(SCHEMA))
    assert spec(structured_outputs={"json_object": True}) == ("json", '{"type": "object"}')
    assert spec(structured_outputs={"grammar": 'start: "x"'}) == ("grammar", 'start: "x"')
    assert spec(guided_json=json.dumps(SCHEMA)) == ("json", json.dumps(SCHEMA))
    assert spec(guided_regex="a|b") == ("regex", "a|b") and spec(guided_choice=["x"]) == ("choice", '["x"]')
    assert spec(guided_grammar='start: "y"') == ("grammar", 'start: "y"')


@pytest.mark.parametrize(("body", "param", "needle"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r"}}}, "response_format.json_schema.schema",
     "needs its schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}}, "response_format",
     "invalid json"),
    ({"structured_outputs": {"regex": "(open"}}, "structured_outputs.regex", "invalid regex"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty list"),
    ({"guided_grammar": "start: nothing_here"}, "guided_grammar", "invalid grammar"),
    ({"guided_regex": "a", "structured_outputs": {"choice": ["b"]}}, "guided_regex",
     "one structured output per request, got structured_outputs.choice, guided_regex"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "'json_schema'"),
])
def test_bad_specs_are_400s_naming_the_field(body: dict, param: str, needle: str) -> None:
    with pytest.raises(PipelineError) as e:
        spec(**body)
    assert e.value.http_status == 400 and e.value.param == param and needle in e.value.message


def test_rest_and_grpc_carry_the_spec(rest_server: RestServer, grpc_server: GrpcServer,
                                      pipeline: ScriptedPipeline) -> None:
    r = httpx.post(f"{rest_server.base_url}/v1/chat/completions",
                   json={"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
                   timeout=10)
    assert r.status_code == 200, r.text
    assert pipeline.requests[-1].structured == ("json", json.dumps(SCHEMA))
    r = httpx.post(f"{rest_server.base_url}/v1/chat/completions",
                   json={"messages": USER, "structured_outputs": {"regex": "(x"}}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs.regex"
    request = omni_pb2.GenerateRequest(
        messages=[omni_pb2.ChatMessage(role="user", content=[omni_pb2.ContentPart(text="hi")])], modalities=["text"],
        structured_output=omni_pb2.StructuredOutput(kind="choice", spec='["up", "down"]'))
    with grpc.insecure_channel(grpc_server.target) as channel:
        out = list(omni_pb2_grpc.OmniStub(channel).Generate(request, timeout=10))
        assert out[-1].WhichOneof("kind") == "done"
        assert pipeline.requests[-1].structured == ("choice", '["up", "down"]')
        request.structured_output.kind = "yaml"
        out = list(omni_pb2_grpc.OmniStub(channel).Generate(request, timeout=10))
    assert [r.WhichOneof("kind") for r in out] == ["error"] and "structured_output: " in out[0].error.message
    assert out[0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]


def test_a_structured_output_beside_auto_tool_calls_is_refused() -> None:
    from gateway.rest import create_app

    pipeline = ScriptedPipeline()
    tools = [{"type": "function", "function": {"name": "f"}}]
    with RestServer(create_app(pipeline, served_model_names=("tiny-omni",), auto_tool_choice=True)) as server:
        r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=10, json={
            "messages": USER, "tools": tools, "response_format": {"type": "json_object"}})
        assert r.status_code == 400 and "cannot both shape one answer" in r.json()["error"]["message"]
        r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=10, json={
            "messages": USER, "tools": tools, "tool_choice": "none", "response_format": {"type": "json_object"}})
        assert r.status_code == 200 and pipeline.requests[-1].structured == ("json", '{"type": "object"}')


def test_a_server_without_llguidance_says_so(rest_server: RestServer, pipeline: ScriptedPipeline,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llguidance" else real(name, *a))
    r = httpx.post(f"{rest_server.base_url}/v1/chat/completions",
                   json={"messages": USER, "response_format": {"type": "json_object"}}, timeout=10)
    assert r.status_code == 501 and "pip install llguidance" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "response_format"
    assert httpx.post(f"{rest_server.base_url}/v1/chat/completions", json={"messages": USER},
                      timeout=10).status_code == 200  # everything else still works
