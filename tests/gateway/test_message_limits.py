"""`--input-limits` max_messages / max_content_parts: a body's messages (or Responses input items) and their
content parts are counted on the parsed JSON before any validation, so a huge list is a 413 in a fraction of
the seconds validating it would hold the gateway for; the chat body is parsed off the event loop. gRPC, the
same bounds as INVALID_ARGUMENT (/tokenize: tests/gateway/test_tokenize.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest
from gateway_harness import GrpcServer, RestServer, ScriptedPipeline
from test_grpc_api import INVALID_ARGUMENT, generate

from gateway.input_limits import InputLimits, limits_from_flags
from gateway.openai_schema import ChatCompletionRequest, validate_body
from gateway.rest import create_app
from omnimesh.v1 import omni_pb2

HI = {"role": "user", "content": "hi"}


@pytest.fixture(scope="module")
def server(shared_pipeline: ScriptedPipeline) -> Iterator[RestServer]:
    with RestServer(create_app(shared_pipeline, served_model_names=("tiny-omni",))) as s:  # the default limits
        yield s


def post(server: RestServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", content=json.dumps(body), timeout=60,
                      headers={"content-type": "application/json"})


@pytest.mark.parametrize(("path", "body", "param", "needle"), [
    ("/v1/chat/completions", {"messages": [HI] * 4097}, "messages", "4097 of them; at most 4096"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 16385}]},
     "messages", "16385 content parts in all; at most 16384"),
    ("/v1/responses", {"input": [HI] * 4097}, "input", "at most 4096"),
])
def test_too_many_messages_or_parts_are_413s(server: RestServer, pipeline: ScriptedPipeline, path: str, body: dict,
                                             param: str, needle: str) -> None:
    r = post(server, path, {"model": "tiny-omni", **body})
    assert r.status_code == 413 and r.json()["error"]["param"] == param, r.text[:300]
    assert needle in r.json()["error"]["message"] and "--input-limits" in r.json()["error"]["message"]
    assert not pipeline.requests


def test_a_huge_list_is_refused_before_it_is_validated(server: RestServer, pipeline: ScriptedPipeline) -> None:
    """200k messages (7 MB) would take seconds to validate; counted first, the 413 comes in a fraction of that
    (0.7 s unloaded, sending and parsing included), and the gateway keeps answering meanwhile. The bound is the
    validation itself, timed on this host right after (20k messages, x10): a loaded host slows both alike."""
    raw = json.dumps({"messages": [HI] * 200_000})  # encoded before the clock starts: the gateway's time is timed
    started = time.monotonic()
    r = httpx.post(f"{server.base_url}/v1/chat/completions", content=raw, timeout=60,
                   headers={"content-type": "application/json"})
    refused_s = time.monotonic() - started
    assert r.status_code == 413
    assert post(server, "/v1/chat/completions", {"messages": [HI]}).status_code == 200
    started = time.monotonic()
    validate_body(ChatCompletionRequest, {"messages": [HI] * 20_000})  # a tenth of what the count spares it
    validate_s = 10 * (time.monotonic() - started)
    assert refused_s < validate_s, (refused_s, validate_s)


def test_the_bounds_are_input_limits_keys() -> None:
    limits = limits_from_flags(None, '{"max_messages": 8, "max_content_parts": 20}')
    assert (limits.max_messages, limits.max_content_parts) == (8, 20)
    with pytest.raises(ValueError, match="max_messages must be positive"):
        InputLimits(max_messages=0)


def test_grpc_takes_the_same_bounds(grpc_server: GrpcServer, pipeline: ScriptedPipeline) -> None:
    msg = omni_pb2.ChatMessage(role="user", content=[omni_pb2.ContentPart(text="hi")])
    err = generate(grpc_server, omni_pb2.GenerateRequest(model="tiny-omni", messages=[msg] * 4097))[-1].error
    assert err.code == INVALID_ARGUMENT and "at most 4096" in err.message and not pipeline.requests
