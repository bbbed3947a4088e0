"""Sampling parameters per stage through both front ends (REST on uvicorn, gRPC Omni): each field reaches
the right stage's wire `SamplingParams` (top level = thinker, `stage_params` per stage, stop ids / strings /
min_tokens / include_stop_str_in_output / the frequency and presence penalties never inherited by the talker), and bad values are a 400 /
INVALID_ARGUMENT naming the parameter (min_tokens also against the thinker's max_tokens across levels)."""

from __future__ import annotations

import grpc
import httpx
import openai
import pytest
from gateway_harness import GrpcServer, RestServer, ScriptedPipeline

from gateway.events import ChatRequest, SamplingOverrides
from gateway.stage_sampling import talker_sampling, thinker_sampling
from omnimesh.v1 import omni_pb2, omni_pb2_grpc, stage_pb2

USER_HI = [{"role": "user", "content": "hi"}]
INVALID_ARGUMENT = 3


def post(server: RestServer, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/chat/completions", json={"messages": USER_HI, **body}, timeout=10)


def generate(server: GrpcServer, **kw: object) -> list[omni_pb2.GenerateResponse]:
    msg = omni_pb2.ChatMessage(role="user", content=[omni_pb2.ContentPart(text="hi")])
    req = omni_pb2.GenerateRequest(model="tiny-omni", messages=[msg], modalities=["text"], **kw)  # type: ignore[arg-type]
    with grpc.insecure_channel(server.target) as ch:
        return list(omni_pb2_grpc.OmniStub(ch).Generate(req, timeout=10))


def wire(req: ChatRequest) -> tuple[stage_pb2.SamplingParams, stage_pb2.SamplingParams]:
    return thinker_sampling(req), talker_sampling(req)


def test_rest_fields_reach_each_stage(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    r = post(rest_server, {
        "temperature": 0, "top_p": 0.9, "top_k": 20, "seed": 11, "max_tokens": 30, "repetition_penalty": 1.1,
        "stop": ["\n\n", "END"], "stop_token_ids": [5, 6],
        "stage_params": {"talker": {"top_k": 10, "stop_token_ids": [1000], "max_tokens": 300}}})
    assert r.status_code == 200, r.text
    req = pipeline.requests[-1]
    assert req.sampling == SamplingOverrides(temperature=0.0, top_p=0.9, top_k=20, seed=11, max_tokens=30,
                                             repetition_penalty=1.1, stop_token_ids=(5, 6), stop=("\n\n", "END"))
    thinker, talker = wire(req)
    assert (thinker.temperature, thinker.top_k, thinker.seed, thinker.max_tokens) == (0.0, 20, 11, 30)
    assert list(thinker.stop) == ["\n\n", "END"] and list(thinker.stop_token_ids) == [5, 6]
    # the talker: greedy and the seed inherited, its own ids; the thinker's ids / strings / top_k are not
    assert (talker.temperature, talker.seed, talker.top_k, talker.max_tokens) == (0.0, 11, 10, 300)
    assert list(talker.stop_token_ids) == [1000] and list(talker.stop) == []
    assert not talker.HasField("top_p") and not talker.HasField("repetition_penalty")


def test_vllms_top_k_minus_one_turns_top_k_off(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    """vLLM's clients send -1 (LangChain's VLLMOpenAI by default) or 0 for "every token": a 400 here before; now
    the stages' 0 (off), also over a stage's own default (the talker's generation config samples top-50)."""
    r = post(rest_server, {"top_k": -1, "stage_params": {"talker": {"top_k": 0}}})
    assert r.status_code == 200, r.text
    thinker, talker = wire(pipeline.requests[-1])
    assert thinker.HasField("top_k") and thinker.top_k == 0 and talker.HasField("top_k") and talker.top_k == 0
    r = post(rest_server, {"top_k": 2**31})  # past the wire's int32: was a 500
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_k", r.text


def test_rest_stage_params_override_the_top_level(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    r = post(rest_server, {"stop": "A", "stop_token_ids": [1],
                           "stage_params": {"thinker": {"stop": "B", "stop_token_ids": [2, 3], "temperature": 0.5}}})
    assert r.status_code == 200, r.text
    thinker, talker = wire(pipeline.requests[-1])
    assert list(thinker.stop) == ["B"] and list(thinker.stop_token_ids) == [2, 3] and thinker.temperature == 0.5
    assert list(talker.stop_token_ids) == [] and not talker.HasField("temperature")
    # a lone string is a list of one; an empty list means "none"
    assert post(rest_server, {"stop": "\n"}).status_code == 200
    assert thinker_sampling(pipeline.requests[-1]).stop == ["\n"]
    assert post(rest_server, {"stop": [], "stop_token_ids": []}).status_code == 200
    plain = thinker_sampling(pipeline.requests[-1])
    assert list(plain.stop) == [] and list(plain.stop_token_ids) == []


def test_rest_min_tokens_and_include_stop_str(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    r = post(rest_server, {"min_tokens": 3, "max_tokens": 3, "include_stop_str_in_output": True, "stop": "x",
                           "stage_params": {"talker": {"min_tokens": 7}}})
    assert r.status_code == 200, r.text
    thinker, talker = wire(pipeline.requests[-1])
    assert (thinker.min_tokens, thinker.include_stop_str_in_output, list(thinker.stop)) == (3, True, ["x"])
    assert talker.min_tokens == 7 and not talker.HasField("include_stop_str_in_output")
    # stage_params.thinker wins field by field; unset stays unset (the stage's default: 0 / false)
    r = post(rest_server, {"min_tokens": 3, "include_stop_str_in_output": True,
                           "stage_params": {"thinker": {"include_stop_str_in_output": False, "min_tokens": 0}}})
    assert r.status_code == 200, r.text
    thinker, talker = wire(pipeline.requests[-1])
    assert thinker.HasField("include_stop_str_in_output") and not thinker.include_stop_str_in_output
    assert thinker.HasField("min_tokens") and thinker.min_tokens == 0 and not talker.HasField("min_tokens")
    assert post(rest_server, {}).status_code == 200
    plain = thinker_sampling(pipeline.requests[-1])
    assert not plain.HasField("min_tokens") and not plain.HasField("include_stop_str_in_output")


def test_penalties_reach_each_stage_rest_and_grpc(rest_server: RestServer, grpc_server: GrpcServer,
                                                  pipeline: ScriptedPipeline) -> None:
    r = post(rest_server, {"presence_penalty": 0.5, "frequency_penalty": -1.5,
                           "stage_params": {"talker": {"frequency_penalty": 0.25}}})
    assert r.status_code == 200, r.text
    thinker, talker = wire(pipeline.requests[-1])
    assert (thinker.presence_penalty, thinker.frequency_penalty) == (0.5, -1.5)
    assert talker.frequency_penalty == 0.25 and not talker.HasField("presence_penalty")
    out = generate(grpc_server, sampling=stage_pb2.SamplingParams(presence_penalty=1.0),
                   stage_params={"talker": stage_pb2.SamplingParams(presence_penalty=-0.5)})
    assert out[-1].WhichOneof("kind") == "done", out
    thinker, talker = wire(pipeline.requests[-1])
    assert thinker.presence_penalty == 1.0 and not thinker.HasField("frequency_penalty")
    assert talker.presence_penalty == -0.5
    bad = generate(grpc_server, sampling=stage_pb2.SamplingParams(frequency_penalty=2.5))
    assert bad[0].error.code == INVALID_ARGUMENT and "sampling.frequency_penalty: must be in [-2, 2]" in bad[0].error.message


def test_openai_client_extra_body(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    client = openai.OpenAI(base_url=f"{rest_server.base_url}/v1", api_key="x", max_retries=0)
    client.chat.completions.create(
        model="tiny-omni", messages=USER_HI, stop=["###"],  # type: ignore[arg-type]
        extra_body={"stop_token_ids": [9], "stage_params": {"talker": {"temperature": 0.7, "stop_token_ids": [4]}}})
    thinker, talker = wire(pipeline.requests[-1])
    assert list(thinker.stop) == ["###"] and list(thinker.stop_token_ids) == [9]
    assert list(talker.stop_token_ids) == [4] and talker.temperature == pytest.approx(0.7)


def test_as_many_stop_strings_as_vllm_clients_send(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    """64 stop strings (OpenAI takes 4; vLLM any number, and its clients send more than 4) reach the thinker."""
    stops = [f"<stop {i}>" for i in range(64)]
    r = httpx.post(f"{rest_server.base_url}/v1/chat/completions", timeout=10,
                   json={"model": "tiny-omni", "messages": USER_HI, "stop": stops})
    assert r.status_code == 200, r.text
    assert list(wire(pipeline.requests[-1])[0].stop) == stops


@pytest.mark.parametrize(("body", "param", "needle"), [
    ({"stop": [str(i) for i in range(65)]}, "stop", "at most 64"),
    ({"stop": 5}, "stop", "valid list"),
    ({"stop": ["a", 1]}, "stop[1]", "string"),
    ({"stop": ["a", ""]}, "stop", "empty"),
    ({"stop_token_ids": ["1"]}, "stop_token_ids[0]", "integer"),
    ({"stop_token_ids": [1.5]}, "stop_token_ids[0]", "integer"),
    ({"stop_token_ids": [True]}, "stop_token_ids[0]", "integer"),
    ({"stop_token_ids": 3}, "stop_token_ids", "list"),
    ({"stop_token_ids": [4, -1]}, "stop_token_ids[1]", ">= 0"),
    ({"stop_token_ids": [2**63]}, "stop_token_ids[0]", ">= 0"),
    ({"stage_params": {"thinker": {"stop_token_ids": [-2]}}}, "stage_params.thinker.stop_token_ids[0]", ">= 0"),
    ({"stage_params": {"thinker": {"stop": ["x"] * 65}}}, "stage_params.thinker.stop", "at most 64"),
    ({"stage_params": {"talker": {"stop": ["x"]}}}, "stage_params.talker.stop", "thinker's text only"),
    ({"stage_params": {"talker": {"stop_token_ids": ["x"]}}}, "stage_params.talker.stop_token_ids[0]", "integer"),
    ({"min_tokens": -1}, "min_tokens", "must be in [0,"),
    ({"min_tokens": 2**31}, "min_tokens", "must be in [0,"),
    ({"min_tokens": "3"}, "min_tokens", "integer"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens", "<= max_tokens (4)"),
    ({"min_tokens": 5, "max_tokens": 9, "max_completion_tokens": 4}, "min_tokens", "<= max_tokens (4)"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", ">= 1, got 0"),
    ({"stage_params": {"talker": {"min_tokens": 9, "max_tokens": 8}}}, "stage_params.talker.min_tokens",
     "<= max_tokens"),
    ({"max_tokens": 5, "stage_params": {"thinker": {"min_tokens": 6}}}, "stage_params.thinker.min_tokens",
     "thinker's max_tokens (5)"),
    ({"min_tokens": 6, "stage_params": {"thinker": {"max_tokens": 5}}}, "min_tokens", "thinker's max_tokens (5)"),
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output", "boolean"),
    ({"stage_params": {"talker": {"include_stop_str_in_output": True}}},
     "stage_params.talker.include_stop_str_in_output", "thinker's text only"),
])
def test_rest_bad_values_name_the_param(rest_server: RestServer, pipeline: ScriptedPipeline, body: dict,
                                        param: str, needle: str) -> None:
    r = post(rest_server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"] and err["type"] == "invalid_request_error"
    assert pipeline.requests == []


def test_grpc_fields_reach_each_stage(grpc_server: GrpcServer, pipeline: ScriptedPipeline) -> None:
    out = generate(grpc_server,
                   sampling=stage_pb2.SamplingParams(seed=3, top_k=7, stop=["END"], stop_token_ids=[5]),
                   stage_params={"talker": stage_pb2.SamplingParams(stop_token_ids=[1000], repetition_penalty=1.2)})
    assert out[-1].WhichOneof("kind") == "done", out
    req = pipeline.requests[-1]
    assert req.sampling == SamplingOverrides(seed=3, top_k=7, stop=("END",), stop_token_ids=(5,))
    assert set(req.stage_params) == {"talker"} and req.stage_params["talker"].stop_token_ids == (1000,)
    assert req.stage_params["talker"].repetition_penalty == pytest.approx(1.2)  # a proto float32
    thinker, talker = wire(req)
    assert list(thinker.stop) == ["END"] and list(thinker.stop_token_ids) == [5] and thinker.top_k == 7
    assert list(talker.stop_token_ids) == [1000] and list(talker.stop) == [] and talker.seed == 3


def test_grpc_min_tokens_and_include_stop_str(grpc_server: GrpcServer, pipeline: ScriptedPipeline) -> None:
    out = generate(grpc_server, sampling=stage_pb2.SamplingParams(min_tokens=4, include_stop_str_in_output=True),
                   stage_params={"talker": stage_pb2.SamplingParams(min_tokens=9)})
    assert out[-1].WhichOneof("kind") == "done", out
    req = pipeline.requests[-1]
    assert (req.sampling.min_tokens, req.sampling.include_stop_str_in_output) == (4, True)
    thinker, talker = wire(req)
    assert (thinker.min_tokens, thinker.include_stop_str_in_output) == (4, True)
    assert talker.min_tokens == 9 and not talker.HasField("include_stop_str_in_output")


@pytest.mark.parametrize(("kw", "needle"), [
    ({"sampling": stage_pb2.SamplingParams(min_tokens=-1)}, "sampling.min_tokens: must be in [0,"),
    ({"sampling": stage_pb2.SamplingParams(min_tokens=5, max_tokens=4)}, "sampling.min_tokens: must be <= max_tokens"),
    ({"sampling": stage_pb2.SamplingParams(max_tokens=4), "stage_params": {"thinker": stage_pb2.SamplingParams(
        min_tokens=5)}}, "stage_params.thinker.min_tokens: must be <= the thinker's max_tokens (4)"),
    ({"stage_params": {"talker": stage_pb2.SamplingParams(include_stop_str_in_output=True)}},
     "stage_params.talker.include_stop_str_in_output"),
    ({"sampling": stage_pb2.SamplingParams(stop=[str(i) for i in range(65)])}, "sampling.stop: at most 64"),
    ({"sampling": stage_pb2.SamplingParams(stop=[""])}, "sampling.stop: stop strings must not be empty"),
    ({"sampling": stage_pb2.SamplingParams(stop_token_ids=[-1])}, "sampling.stop_token_ids[0]: must be"),
    ({"stage_params": {"talker": stage_pb2.SamplingParams(stop=["x"])}}, "stage_params.talker.stop"),
    ({"stage_params": {"thinker": stage_pb2.SamplingParams(stop_token_ids=[3, -7])}},
     "stage_params.thinker.stop_token_ids[1]"),
])
def test_grpc_bad_values_name_the_param(grpc_server: GrpcServer, pipeline: ScriptedPipeline, kw: dict,
                                        needle: str) -> None:
    out = generate(grpc_server, **kw)
    assert [r.WhichOneof("kind") for r in out] == ["error"]
    assert out[0].error.code == INVALID_ARGUMENT and needle in out[0].error.message, out[0].error.message
    assert pipeline.requests == []


def test_min_p_ignore_eos_and_logprobs_reach_their_stages(rest_server: RestServer, grpc_server: GrpcServer,
                                                          pipeline: ScriptedPipeline) -> None:
    """vLLM's min_p / ignore_eos (top level: the thinker; stage_params: that stage) and OpenAI's logprobs
    (the thinker only) on the wire, from REST and from gRPC alike."""
    r = post(rest_server, {"min_p": 0.1, "ignore_eos": True, "logprobs": True, "top_logprobs": 3,
                           "stage_params": {"talker": {"min_p": 0.05, "ignore_eos": True}}})
    assert r.status_code == 200, r.text
    thinker, talker = wire(pipeline.requests[-1])
    assert (round(thinker.min_p, 6), thinker.ignore_eos, thinker.logprobs) == (0.1, True, 3)
    assert (round(talker.min_p, 6), talker.ignore_eos, talker.HasField("logprobs")) == (0.05, True, False)
    out = generate(grpc_server, sampling=stage_pb2.SamplingParams(min_p=0.2, ignore_eos=True, logprobs=0))
    assert out[-1].WhichOneof("kind") == "done", out
    thinker, talker = wire(pipeline.requests[-1])
    assert (round(thinker.min_p, 6), thinker.ignore_eos, thinker.logprobs) == (0.2, True, 0)
    assert not talker.HasField("min_p") and not talker.ignore_eos  # the thinker's own, not inherited


def test_priority_reaches_the_request(rest_server: RestServer, grpc_server: GrpcServer,
                                      pipeline: ScriptedPipeline) -> None:
    """vLLM's request `priority` (REST field, gRPC GenerateRequest.priority) -> ChatRequest.priority, which the
    pipeline hands the thinker and talker as their `priority` option (gateway/pipeline.py)."""
    from gateway.pipeline import _priority

    assert post(rest_server, {"priority": -3}).status_code == 200
    assert pipeline.requests[-1].priority == -3 and _priority(pipeline.requests[-1]) == {"priority": "-3"}
    assert post(rest_server, {}).status_code == 200 and _priority(pipeline.requests[-1]) == {}
    r = post(rest_server, {"priority": 2**31})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
    out = generate(grpc_server, priority=4)
    assert out[-1].WhichOneof("kind") == "done" and pipeline.requests[-1].priority == 4


def test_skip_special_tokens_and_prompt_logprobs_reach_the_thinker(rest_server: RestServer, grpc_server: GrpcServer,
                                                                   pipeline: ScriptedPipeline) -> None:
    """vLLM's skip_special_tokens and prompt_logprobs: the thinker's, from REST and gRPC; the talker refuses them."""
    assert post(rest_server, {"skip_special_tokens": False, "prompt_logprobs": 2}).status_code == 200
    thinker, talker = wire(pipeline.requests[-1])
    assert thinker.HasField("skip_special_tokens") and not thinker.skip_special_tokens and thinker.prompt_logprobs == 2
    assert not talker.HasField("skip_special_tokens") and not talker.HasField("prompt_logprobs")
    post(rest_server, {})
    assert not wire(pipeline.requests[-1])[0].HasField("skip_special_tokens")  # unset: the stage's default (true)
    out = generate(grpc_server, sampling=stage_pb2.SamplingParams(skip_special_tokens=False))
    assert out[-1].WhichOneof("kind") == "done", out
    assert not wire(pipeline.requests[-1])[0].skip_special_tokens
    out = generate(grpc_server, stage_params={"talker": stage_pb2.SamplingParams(skip_special_tokens=False)})
    assert "stage_params.talker.skip_special_tokens: applies to the thinker's text only" in out[0].error.message
