"""OpenAI's `logit_bias` and vLLM's `allowed_token_ids` and `bad_words` at the gateway: the top level (the
thinker's) and `stage_params` reach the stages' sampling params (REST and gRPC); keys that are no token ids,
biases outside [-100, 100], negative ids, blank bad words and bad words for the talker are 400s naming the
field."""

from __future__ import annotations

import json

import grpc
import pytest
from gateway_harness import GrpcServer, ScriptedPipeline

from gateway.events import PipelineError
from gateway.openai_schema import check_sampling, parse_chat_request
from gateway.stage_sampling import talker_sampling, thinker_sampling
from omnimesh.v1 import omni_pb2, omni_pb2_grpc, stage_pb2

USER = [{"role": "user", "content": "hi"}]


def body(**fields: object):  # type: ignore[no-untyped-def]
    return parse_chat_request(json.dumps({"messages": USER, **fields}).encode())


def test_the_fields_reach_the_stages() -> None:
    b = body(logit_bias={"17": 5, "3": -100}, allowed_token_ids=[1, 2],
             stage_params={"talker": {"logit_bias": {"9": 1.5}}})
    s = b.sampling()
    assert s.logit_bias == ((3, -100.0), (17, 5.0)) and s.allowed_token_ids == (1, 2)
    from gateway.events import ChatRequest, ChatMessage, TextPart

    req = ChatRequest(request_id="r", model="m", messages=(ChatMessage("user", (TextPart("hi"),)),), sampling=s,
                      stage_params=b.stage_overrides())
    thinker = thinker_sampling(req)
    assert dict(thinker.logit_bias) == {3: -100.0, 17: 5.0} and list(thinker.allowed_token_ids) == [1, 2]
    assert dict(talker_sampling(req).logit_bias) == {9: 1.5}
    words = body(bad_words=["storm", "rain cloud"]).sampling()
    assert words.bad_words == ("storm", "rain cloud")
    req = ChatRequest(request_id="r", model="m", messages=(ChatMessage("user", (TextPart("hi"),)),), sampling=words)
    assert list(thinker_sampling(req).bad_words) == ["storm", "rain cloud"]


@pytest.mark.parametrize(("fields", "param", "needle"), [
    ({"logit_bias": {"cat": 1}}, "logit_bias", "keys are token ids"),
    ({"logit_bias": {"5": 150}}, "logit_bias", "biases in [-100, 100]"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids[0]", "token id >= 0"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "must name at least one token id"),  # was ignored
    ({"logit_bias": {"5": "x"}}, "logit_bias.5", "number"),
    ({"bad_words": ["ok", "  "]}, "bad_words", "must not be empty"),
    ({"bad_words": [f"w{i}" for i in range(1025)]}, "bad_words", "at most 1024 bad words, got 1025"),
])
def test_bad_values_are_400s(fields: dict, param: str, needle: str) -> None:
    with pytest.raises(PipelineError) as e:
        check_sampling(body(**fields).sampling(), "")
    assert e.value.http_status == 400 and e.value.param == param and needle in e.value.message


def test_bad_words_are_the_thinkers() -> None:
    with pytest.raises(PipelineError) as e:
        check_sampling(body(stage_params={"talker": {"bad_words": ["x"]}}).stage_overrides()["talker"],
                       "stage_params.talker")
    assert e.value.param == "stage_params.talker.bad_words" and "thinker's text only" in e.value.message


def test_grpc_carries_them(grpc_server: GrpcServer, pipeline: ScriptedPipeline) -> None:
    request = omni_pb2.GenerateRequest(
        messages=[omni_pb2.ChatMessage(role="user", content=[omni_pb2.ContentPart(text="hi")])], modalities=["text"],
        sampling=stage_pb2.SamplingParams(logit_bias={4: 2.5}, allowed_token_ids=[4, 5]))
    with grpc.insecure_channel(grpc_server.target) as channel:
        out = list(omni_pb2_grpc.OmniStub(channel).Generate(request, timeout=10))
        assert out[-1].WhichOneof("kind") == "done"
        s = pipeline.requests[-1].sampling
        assert s.logit_bias == ((4, 2.5),) and s.allowed_token_ids == (4, 5)
        request.sampling.logit_bias[4] = 500.0
        out = list(omni_pb2_grpc.OmniStub(channel).Generate(request, timeout=10))
    assert out[0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "logit_bias" in out[0].error.message
