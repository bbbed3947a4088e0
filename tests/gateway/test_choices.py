"""OpenAI's `n` (gateway/choices.py) on the scripted pipeline: each choice is its own run (`<id>-<i>`, seed + i
at every level), the runs interleave, the first error ends the request and closes every run, and the REST
answer has one choice per index (whole or streamed, each with its own end) and usage summed over them."""

from __future__ import annotations

import asyncio
import json

import httpx
from gateway_harness import RestServer, ScriptedPipeline, stage_down

from gateway.choices import choice_requests, fan_out
from gateway.events import ChatMessage, ChatRequest, Finished, SamplingOverrides, TextDelta


def _request(seed: int | None) -> ChatRequest:
    return ChatRequest(request_id="chatcmpl-x", model="m", messages=(ChatMessage("user", ()),), modalities=("text",),
                       sampling=SamplingOverrides(seed=seed, temperature=0.5),
                       stage_params={"talker": SamplingOverrides(seed=seed), "thinker": SamplingOverrides(top_k=3)})


def test_each_choice_is_a_seeded_run_of_its_own() -> None:
    one = _request(7)
    assert choice_requests(one, 1) == (one,)
    runs = choice_requests(one, 3)
    assert [r.request_id for r in runs] == ["chatcmpl-x", "chatcmpl-x-1", "chatcmpl-x-2"]
    assert [r.sampling.seed for r in runs] == [7, 8, 9] and {r.sampling.temperature for r in runs} == {0.5}
    assert [r.stage_params["talker"].seed for r in runs] == [7, 8, 9]
    assert {r.stage_params["thinker"].seed for r in runs} == {None}  # unseeded stays unseeded
    assert choice_requests(_request(2**63 - 1), 2)[1].sampling.seed == -(2**63)  # wraps inside int64


def test_the_runs_interleave_and_an_error_ends_them_all(pipeline: ScriptedPipeline) -> None:
    pipeline.event_delay_s = 0.01
    pipeline.script = lambda r: [TextDelta(r.request_id[-1]), TextDelta("."), Finished("stop", 3, 2)]

    async def collect(n: int) -> list[tuple[int, object]]:
        return [item async for item in fan_out(pipeline, choice_requests(_request(None), n))]

    got = asyncio.run(collect(3))
    assert sorted(i for i, ev in got if isinstance(ev, Finished)) == [0, 1, 2]
    assert [ev.text for i, ev in got if i == 1 and isinstance(ev, TextDelta)] == ["1", "."]
    assert [i for i, _ in got[:3]] != [0, 0, 0]  # not one run after the other
    assert sorted(pipeline.closed) == ["chatcmpl-x", "chatcmpl-x-1", "chatcmpl-x-2"]
    pipeline.reset()
    pipeline.event_delay_s = 0.01
    pipeline.script = lambda r: ([TextDelta("a"), stage_down("talker")] if r.request_id.endswith("-1")
                                 else [TextDelta("a")] * 50 + [Finished("stop", 3, 50)])
    try:
        asyncio.run(collect(3))
        raise AssertionError("the error did not end the request")
    except Exception as e:  # noqa: BLE001
        assert "talker" in str(e)
    assert sorted(pipeline.closed) == ["chatcmpl-x", "chatcmpl-x-1", "chatcmpl-x-2"]  # the others cancelled


def test_rest_answers_one_choice_per_index(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 3, "seed": 1}
    r = httpx.post(f"{rest_server.base_url}/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in out["choices"]] == [
        (i, "Hello world", "stop") for i in range(3)]
    assert out["usage"] == {"prompt_tokens": 7, "completion_tokens": 6, "total_tokens": 13, "prompt_tokens_details": None}
    assert sorted(q.sampling.seed for q in pipeline.requests) == [1, 2, 3]
    chunks = []
    with httpx.stream("POST", f"{rest_server.base_url}/v1/chat/completions", timeout=10,
                      json={**body, "n": 2, "stream": True, "stream_options": {"include_usage": True}}) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[len("data: "):]))
    per = {i: [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i] for i in (0, 1)}
    for i in (0, 1):
        assert per[i][0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content") or "" for c in per[i]) == "Hello world"
        assert [c.get("finish_reason") for c in per[i]][-1] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


def test_grpc_n_names_each_choice(grpc_server, pipeline: ScriptedPipeline) -> None:  # type: ignore[no-untyped-def]
    import grpc

    from omnimesh.v1 import omni_pb2, omni_pb2_grpc

    msg = omni_pb2.ChatMessage(role="user", content=[omni_pb2.ContentPart(text="hi")])
    with grpc.insecure_channel(grpc_server.target) as ch:
        stub = omni_pb2_grpc.OmniStub(ch)
        out = list(stub.Generate(omni_pb2.GenerateRequest(messages=[msg], n=2), timeout=10))
        (refused,) = list(stub.Generate(omni_pb2.GenerateRequest(messages=[msg], n=17), timeout=10))
    assert refused.error.code == 3 and refused.error.message == "n: must be in [1, 16] choices, got 17"
    for i in (0, 1):
        mine = [r for r in out if r.index == i]
        assert "".join(r.text_delta for r in mine if r.WhichOneof("kind") == "text_delta") == "Hello world"
        assert [r.audio.seq for r in mine if r.WhichOneof("kind") == "audio"] == [0, 1]  # numbered per choice
        assert [r.WhichOneof("kind") for r in mine][-1] == "done" and mine[-1].done.usage.completion_tokens == 2
    assert sorted(q.request_id.endswith("-1") for q in pipeline.requests) == [False, True]
