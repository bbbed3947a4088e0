"""OpenAI's `logprobs` at the gateway (scripted pipeline): the thinker's entries become
`choices[0].logprobs.content` (token text, logprob, exact bytes, alternatives), whole or per streamed chunk
(a token that holds part of a character comes with its chunk though the text waits); without the request's
`logprobs` there are none; `--max-logprobs` bounds `top_logprobs` on REST and gRPC and
`--return-tokens-as-token-ids` names tokens by id, as vLLM's flags do. Parity with `generate`:
tests/e2e/test_logprobs_e2e.py."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
from gateway_harness import GrpcServer, RestServer, ScriptedPipeline

from gateway.events import Finished, TextDelta
from gateway.rest import create_app
from omnimesh.v1 import omni_pb2, omni_pb2_grpc, stage_pb2

WORLD = "世"  # 3 UTF-8 bytes, split over two tokens below


def entry(token_id: int, token: bytes, logprob: float, *top: tuple[int, bytes, float]) -> stage_pb2.TokenLogprob:
    return stage_pb2.TokenLogprob(token_id=token_id, token=token, logprob=logprob,
                                  top=[stage_pb2.TopLogprob(token_id=i, token=t, logprob=p) for i, t, p in top])


FIRST = entry(11, b"Hi", -0.25, (11, b"Hi", -0.25), (12, b"Yo", -1.5))
HEAD = entry(21, WORLD.encode()[:2], -0.5, (21, WORLD.encode()[:2], -0.5), (12, b"Yo", -3.0))
TAIL = entry(22, WORLD.encode()[2:], -9999.0, (23, b"!", -0.01), (22, WORLD.encode()[2:], -9999.0))


def script(request):  # type: ignore[no-untyped-def]
    return [TextDelta("Hi", (FIRST,)), TextDelta("", (HEAD,)), TextDelta(WORLD, (TAIL,)),
            Finished(finish_reason="length", prompt_tokens=3, completion_tokens=3)]


def post(server: RestServer, **body: object) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/chat/completions", timeout=10,
                      json={"messages": [{"role": "user", "content": "hi"}], **body})


def test_entries_take_openais_shape(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    pipeline.script = script
    r = post(rest_server, logprobs=True, top_logprobs=2)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "Hi" + WORLD
    assert pipeline.requests[-1].sampling.logprobs == 2
    content = choice["logprobs"]["content"]
    assert content[0] == {"token": "Hi", "logprob": -0.25, "bytes": list(b"Hi"),
                          "top_logprobs": [{"token": "Hi", "logprob": -0.25, "bytes": list(b"Hi")},
                                           {"token": "Yo", "logprob": -1.5, "bytes": list(b"Yo")}]}
    assert [e["token"] for e in content[1:]] == ["\ufffd", "\ufffd"]  # part of a character: its bytes say which
    assert bytes(content[1]["bytes"] + content[2]["bytes"]).decode() == WORLD
    assert content[2]["logprob"] == -9999.0 and content[2]["top_logprobs"][0]["token"] == "!"
    pipeline.script = script  # asked for nothing: null, as OpenAI
    assert post(rest_server).json()["choices"][0]["logprobs"] is None


def test_each_streamed_chunk_carries_its_tokens(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    pipeline.script = script
    chunks = []
    with httpx.stream("POST", f"{rest_server.base_url}/v1/chat/completions", timeout=10,
                      json={"messages": [{"role": "user", "content": "hi"}], "stream": True, "logprobs": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[len("data: "):])["choices"][0])
    with_entries = [(c["delta"].get("content"), [e["bytes"] for e in c["logprobs"]["content"]])
                    for c in chunks if c.get("logprobs")]
    assert with_entries == [("Hi", [list(b"Hi")]), ("", [list(WORLD.encode()[:2])]), (WORLD, [list(WORLD.encode()[2:])])]


def test_the_operators_flags(pipeline: ScriptedPipeline) -> None:
    """--max-logprobs 1 and --return-tokens-as-token-ids."""
    pipeline.script = script
    app = create_app(pipeline, served_model_names=("tiny-omni",), max_logprobs=1, return_tokens_as_token_ids=True)
    with RestServer(app) as server:
        r = post(server, logprobs=True, top_logprobs=2)
        assert r.status_code == 400 and r.json()["error"] == {
            "message": "top_logprobs: must be in [0, 1] (--max-logprobs), got 2", "type": "invalid_request_error",
            "param": "top_logprobs", "code": "invalid_request"}
        content = post(server, logprobs=True, top_logprobs=1).json()["choices"][0]["logprobs"]["content"]
        assert [e["token"] for e in content] == ["token_id:11", "token_id:21", "token_id:22"]
        assert content[0]["top_logprobs"][1]["token"] == "token_id:12" and content[0]["bytes"] == list(b"Hi")
    unbounded = create_app(pipeline, served_model_names=("tiny-omni",), max_logprobs=-1)
    with RestServer(unbounded) as server:  # -1: only the thinker's vocabulary bounds them
        assert post(server, logprobs=True, top_logprobs=500).status_code == 200
    assert pipeline.requests[-1].sampling.logprobs == 500
    with GrpcServer(pipeline, max_logprobs=1) as grpc_server, grpc.insecure_channel(grpc_server.target) as ch:
        req = omni_pb2.GenerateRequest(messages=[omni_pb2.ChatMessage(role="user", content=[
            omni_pb2.ContentPart(text="hi")])], modalities=["text"], sampling=stage_pb2.SamplingParams(logprobs=2))
        (answer,) = list(omni_pb2_grpc.OmniStub(ch).Generate(req, timeout=10))
        assert answer.error.code == 3 and answer.error.message == (
            "sampling.logprobs: must be in [0, 1] alternatives per token (--max-logprobs), got 2")
        out = list(omni_pb2_grpc.OmniStub(ch).Generate(
            omni_pb2.GenerateRequest(messages=req.messages, modalities=["text"],
                                     sampling=stage_pb2.SamplingParams(logprobs=1)), timeout=10))
        assert [list(r.logprobs) for r in out if r.WhichOneof("kind") == "text_delta"] == [[FIRST], [HEAD], [TAIL]]


@pytest.mark.parametrize("bad", [-2])
def test_max_logprobs_flag_is_checked(bad: int) -> None:
    from omnimesh.config.serve_args import ServeArgs

    with pytest.raises(ValueError, match=r"--max-logprobs must be >= 0 \(or -1: up to the vocabulary\), got -2"):
        ServeArgs(max_logprobs=bad)


def test_chat_prompt_logprobs_are_vllms_top_level_field(rest_server, pipeline) -> None:  # type: ignore[no-untyped-def]
    """The thinker's prompt entries (on the first delta) -> `prompt_logprobs`: None for the first prompt token,
    then {id: {logprob, rank, decoded_token}} with the prompt token first and k alternatives."""
    scored = entry(12, b"Yo", -1.5, (11, b"Hi", -0.25), (12, b"Yo", -1.5))
    scored.rank = 2
    pipeline.script = lambda request: [TextDelta("Hi", (), prompt_logprobs=(scored,)),
                                       Finished(finish_reason="stop", prompt_tokens=2, completion_tokens=1)]
    r = post(rest_server, prompt_logprobs=1)
    assert r.status_code == 200, r.text
    assert pipeline.requests[0].sampling.prompt_logprobs == 1
    assert r.json()["prompt_logprobs"] == [None, {"12": {"logprob": -1.5, "rank": 2, "decoded_token": "Yo"},
                                                  "11": {"logprob": -0.25, "rank": 1, "decoded_token": "Hi"}}]
    assert "prompt_logprobs" not in post(rest_server).json()  # only when asked
