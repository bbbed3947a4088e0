"""`POST /v1/completions` (gateway/completions_api.py) against a scripted pipeline and the tiny model's real
tokenizer: what reaches the pipeline (the prompt's ids exactly, no template; one run per prompt and choice,
their ids and seeds), the response's shape (choice order, echo, the legacy logprobs with text offsets, usage
counting each prompt once), the stream (echo first, a finish chunk per choice, usage, [DONE]), the official
`openai` client, and every bad body as a 400 / 404 naming its field. vLLM's /invocations routes a body to
this route or the chat's by its fields and answers as they do. Real tokens through a mesh:
tests/e2e/test_completions_e2e.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from gateway_harness import RestServer, ScriptedPipeline

from gateway.events import ChatRequest, Event, Finished, PipelineError, TextDelta
from gateway.prompt import PromptBuilder
from gateway.rest import create_app
from omnimesh.models.qwen3_omni.tiny import build_tiny_qwen3_omni
from omnimesh.v1 import stage_pb2


@pytest.fixture(scope="module")
def builder(tmp_path_factory: pytest.TempPathFactory) -> PromptBuilder:
    return PromptBuilder(build_tiny_qwen3_omni(Path(tmp_path_factory.mktemp("tiny")) / "qwen3-omni"), max_model_len=64)


@pytest.fixture(scope="module")
def server(shared_pipeline: ScriptedPipeline, builder: PromptBuilder) -> Iterator[RestServer]:
    with RestServer(create_app(shared_pipeline, served_model_names=("tiny-omni",), prompts=builder)) as s:
        yield s


def post(server: RestServer, body: object) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)


def _entry(token: bytes, token_id: int, logprob: float, top: list[tuple[bytes, int, float]]) -> stage_pb2.TokenLogprob:
    e = stage_pb2.TokenLogprob(token_id=token_id, token=token, logprob=logprob)
    for t, i, lp in top:
        e.top.add(token_id=i, token=t, logprob=lp)
    return e


def scripted(request: ChatRequest) -> list[Event | BaseException]:
    """The prompt's first id in the text, so each choice shows which prompt it answers."""
    assert request.prompt_ids is not None
    first = _entry(b" ab", 5, -0.5, [(b" ab", 5, -0.5), (b"x", 9, -1.0)])
    second = _entry(b"c", 7, -0.25, [(b"d", 8, -0.125)])
    return [TextDelta(f"<{request.prompt_ids[0]}> ab", logprobs=(first,)), TextDelta("c", logprobs=(second,)),
            Finished("length", prompt_tokens=len(request.prompt_ids), completion_tokens=2, cached_tokens=1)]


def test_a_text_prompt_reaches_the_thinker_as_its_tokens(server, pipeline, builder):
    r = post(server, {"model": "tiny-omni", "prompt": "The sea is", "temperature": 0, "stop": ["\n"]})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = builder.processor.tokenizer("The sea is")["input_ids"]
    [req] = pipeline.requests
    assert req.prompt_ids == tuple(ids) and req.messages == () and req.modalities == ("text",)
    assert req.sampling.max_tokens == 16 and req.sampling.temperature == 0 and req.sampling.stop == ("\n",)  # OpenAI's default
    assert body["id"] == req.request_id and body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["choices"] == [{"index": 0, "text": "Hello world", "logprobs": None, "finish_reason": "stop",
                               "stop_reason": None}]
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9,
                             "prompt_tokens_details": None}
    assert r.headers["x-request-id"] == body["id"]
    assert post(server, {"prompt": "x", "max_tokens": None}).status_code == 200
    assert pipeline.requests[-1].sampling.max_tokens is None  # null: up to max_model_len, as vLLM


def test_prompts_and_choices_in_vllm_order_with_legacy_logprobs(server, pipeline):
    pipeline.script = scripted
    r = post(server, {"prompt": [[11, 12], [13]], "n": 2, "seed": 5, "logprobs": 1, "echo": False})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = [req.request_id for req in pipeline.requests]
    rid = body["id"]
    assert sorted(ids) == sorted([rid, f"{rid}-1", f"{rid}-p1", f"{rid}-p1-1"])
    seeds = {req.request_id: req.sampling.seed for req in pipeline.requests}
    assert seeds[rid] == seeds[f"{rid}-p1"] == 5 and seeds[f"{rid}-1"] == seeds[f"{rid}-p1-1"] == 6
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == ["<11> abc", "<11> abc", "<13> abc", "<13> abc"]
    assert body["choices"][0]["logprobs"] == {"tokens": [" ab", "c"], "token_logprobs": [-0.5, -0.25],
                                              "text_offset": [0, 3],
                                              "top_logprobs": [{" ab": -0.5}, {"d": -0.125, "c": -0.25}]}  # k = 1
    # each prompt counted once, every choice's completion tokens
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 8
    assert body["usage"]["total_tokens"] == 11


def test_echo_puts_the_prompt_first_and_ids_are_decoded(server, pipeline, builder):
    text = post(server, {"prompt": "Once upon", "echo": True}).json()["choices"][0]["text"]
    assert text == "Once uponHello world"
    ids = builder.processor.tokenizer(" a time")["input_ids"]
    assert post(server, {"prompt": ids, "echo": True}).json()["choices"][0]["text"] == " a timeHello world"


def with_prompt(request: ChatRequest) -> list[Event | BaseException]:
    """`scripted`, its first delta carrying an entry per prompt token from the second (ids + 100, rank 2)."""
    assert request.prompt_ids is not None
    prompt = tuple(_entry(f"p{t}".encode(), t, -1.5, [(b"best", 1, -0.75), (f"p{t}".encode(), t, -1.5)])
                   for t in request.prompt_ids[1:])
    for e in prompt:
        e.rank = 2
    events = scripted(request)
    first = events[0]
    assert isinstance(first, TextDelta)
    return [TextDelta(first.text, first.logprobs, prompt_logprobs=prompt), *events[1:]]


def test_prompt_logprobs_in_vllms_shape(server, pipeline):
    pipeline.script = with_prompt
    r = post(server, {"prompt": [5, 6, 7], "prompt_logprobs": 1, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert pipeline.requests[0].sampling.prompt_logprobs == 1
    choice = r.json()["choices"][0]
    assert choice["prompt_logprobs"] == [
        None, {"6": {"logprob": -1.5, "rank": 2, "decoded_token": "p6"},
               "1": {"logprob": -0.75, "rank": 1, "decoded_token": "best"}},
        {"7": {"logprob": -1.5, "rank": 2, "decoded_token": "p7"},
         "1": {"logprob": -0.75, "rank": 1, "decoded_token": "best"}}]
    assert choice["logprobs"] is None
    assert "prompt_logprobs" not in post(server, {"prompt": [5]}).json()["choices"][0]  # only when asked


def test_echo_with_logprobs_scores_the_prompt_and_max_tokens_0_answers_it_alone(server, pipeline, builder):
    pipeline.script = with_prompt
    ids = [5, 6, 7]
    r = post(server, {"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert pipeline.requests[-1].sampling.prompt_logprobs == 1  # asked for by echo + logprobs
    choice = r.json()["choices"][0]
    first = builder.processor.tokenizer.convert_ids_to_tokens(5)
    prompt_text = builder.processor.tokenizer.decode(ids)
    assert choice["text"] == prompt_text + "<5> abc"
    lp = choice["logprobs"]
    assert lp["tokens"] == [first, "p6", "p7", " ab", "c"] and lp["token_logprobs"] == [None, -1.5, -1.5, -0.5, -0.25]
    assert lp["top_logprobs"][:2] == [None, {"best": -0.75, "p6": -1.5}]
    assert lp["text_offset"] == [0, len(first), len(first) + 2, len(prompt_text), len(prompt_text) + 3]
    assert "prompt_logprobs" not in choice  # not asked for itself
    # lm-eval's loglikelihood request: the prompt alone, scored
    alone = post(server, {"prompt": ids, "echo": True, "logprobs": 0, "max_tokens": 0}).json()
    assert pipeline.requests[-1].sampling.max_tokens == 1  # one token generated, and dropped
    assert alone["choices"][0]["text"] == prompt_text and alone["choices"][0]["finish_reason"] == "length"
    assert alone["choices"][0]["logprobs"]["token_logprobs"] == [None, -1.5, -1.5]
    assert alone["choices"][0]["logprobs"]["top_logprobs"][1] == {"p6": -1.5}  # k = 0: the prompt token alone
    assert alone["usage"]["completion_tokens"] == 0


def test_streamed_echo_with_logprobs_waits_for_the_prompts_entries(server, pipeline):
    pipeline.script = with_prompt
    body = {"prompt": [[5, 6], [8, 9]], "echo": True, "logprobs": 0, "max_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=30) as r:
        events = _events(r)
    firsts = {}
    for e in events:
        for c in e["choices"]:
            firsts.setdefault(c["index"], c)
    assert firsts[0]["logprobs"]["token_logprobs"] == [None, -1.5] and firsts[1]["logprobs"]["tokens"][1] == "p9"
    assert all("prompt_logprobs" not in c for e in events for c in e["choices"])


def _events(r: httpx.Response) -> list[dict]:
    lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def test_stream_echo_first_then_text_finish_and_usage(server, pipeline):
    pipeline.script = scripted
    body = {"prompt": [[3, 4]], "echo": True, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _events(r)
    assert all(e["object"] == "text_completion" for e in events)
    texts = [c["text"] for e in events for c in e["choices"]]
    assert "".join(texts).endswith("<3> abc") and len(texts) == 4  # echo, two deltas, the finish chunk
    assert [c["finish_reason"] for e in events for c in e["choices"]] == [None, None, None, "length"]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["total_tokens"] == 4
    assert "usage" not in events[0]


def test_stream_continuous_usage_and_logprob_offsets_after_echo(server, pipeline):
    pipeline.script = scripted
    body = {"prompt": "ab", "echo": False, "logprobs": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=30) as r:
        events = _events(r)
    lps = [c["logprobs"] for e in events for c in e["choices"] if c["logprobs"]]
    assert [lp["text_offset"] for lp in lps] == [[0], [3]]
    assert lps[0]["top_logprobs"] == [{" ab": -0.5}]  # k = 0: the sampled one alone
    assert events[-2]["usage"]["completion_tokens"] == 2  # the finish chunk knows the whole count


def test_a_failure_midstream_is_an_error_event(server, pipeline):
    pipeline.script = lambda req: [TextDelta("a"), PipelineError("thinker died", http_status=503, grpc_code=14,
                                                                  kind="service_unavailable")]
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json={"prompt": "x", "stream": True},
                      timeout=30) as r:
        events = _events(r)
    assert events[-1]["error"]["message"] == "thinker died"


def test_the_openai_client(server, pipeline):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    out = client.completions.create(model="tiny-omni", prompt="Say", max_tokens=5, logprobs=2, n=2)
    assert [c.text for c in out.choices] == ["Hello world"] * 2 and out.usage.completion_tokens == 4
    pieces = [c.choices[0].text for c in client.completions.create(model="tiny-omni", prompt="Say", stream=True)]
    assert "".join(pieces) == "Hello world"


@pytest.mark.parametrize(("body", "status", "param", "needle"), [
    ({}, 400, "prompt", "Field required"),
    ({"prompt": []}, 400, "prompt", "non-empty list"),
    ({"prompt": ""}, 400, "prompt", "the prompt is empty"),
    ({"prompt": ["a", ""]}, 400, "prompt[1]", "the prompt is empty"),
    ({"prompt": [1, 10**9]}, 400, "prompt[1]", "is not a token id"),
    ({"prompt": [[1], [2, -1]]}, 400, "prompt[1][1]", "is not a token id"),
    ({"prompt": [[-5, 3]]}, 400, "prompt[0][0]", "is not a token id"),  # a list of one prompt: still indexed
    ({"prompt": [""]}, 400, "prompt[0]", "the prompt is empty"),
    ({"prompt": "a" * 10**6}, 400, "prompt", "characters, more than the"),  # refused before it is tokenized
    ({"prompt": ["x", "a" * 10**6]}, 400, "prompt[1]", "shorten the prompt[1]"),
    ({"prompt": 5}, 400, "prompt", "one kind per request"),
    ({"prompt": ["a", [1]]}, 400, "prompt", "one kind per request"),
    ({"prompt": [True]}, 400, "prompt", "one kind per request"),
    ({"prompt": "a", "suffix": "z"}, 400, "suffix", "not supported"),
    ({"prompt": "a", "best_of": 3}, 400, "best_of", "not supported"),
    ({"prompt": "a", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs", "not available with stream"),
    ({"prompt": "a", "prompt_logprobs": 21}, 400, "prompt_logprobs", "--max-logprobs"),
    ({"prompt": "a", "prompt_logprobs": -1}, 400, "prompt_logprobs", "must be in [0, 20]"),
    ({"prompt": "a", "logprobs": 21}, 400, "logprobs", "--max-logprobs"),
    ({"prompt": "a", "max_tokens": 0}, 400, "max_tokens", "only for echo"),
    ({"prompt": "a", "max_tokens": -1, "echo": True}, 400, "max_tokens", ">= 1"),
    ({"prompt": "a", "n": 17}, 400, "n", "[1, 16]"),
    ({"prompt": ["a"] * 20, "n": 4}, 400, "prompt", "80 runs"),
    ({"prompt": "a", "temperature": 3}, 400, "temperature", "[0, 2]"),
    ({"prompt": "a", "guided_regex": "("}, 400, "guided_regex", "guided_regex"),
    ({"prompt": "a", "model": "gpt-4"}, 404, "model", "gpt-4"),
])
def test_bad_bodies(server, pipeline, body, status, param, needle):
    r = post(server, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err
    assert pipeline.requests == []  # nothing ran


def test_route_needs_the_prompt_builder(shared_pipeline: ScriptedPipeline):
    with RestServer(create_app(shared_pipeline, served_model_names=("tiny-omni",))) as s:
        assert post(s, {"prompt": "a"}).status_code == 404  # no tokenizer, no completions (as /tokenize)


def test_prompt_length_is_checked_by_the_builder(builder):
    ok = ChatRequest(request_id="r", model="m", messages=(), prompt_ids=tuple(range(60)))
    assert builder.build(ok).input_ids.tolist() == list(range(60))
    with pytest.raises(PipelineError, match="max_model_len.*shorten the prompt") as e:
        builder.build(ChatRequest(request_id="r", model="m", messages=(), prompt_ids=tuple(range(64))))
    assert e.value.param == "prompt"
    from dataclasses import replace

    from gateway.events import SamplingOverrides
    with pytest.raises(PipelineError, match="lower max_tokens to at most 4"):
        builder.build(replace(ok, sampling=SamplingOverrides(max_tokens=5)))


def test_truncate_prompt_tokens_keeps_the_last_ones(server, pipeline, builder):
    ids = list(range(20, 40))
    r = post(server, {"prompt": ids, "truncate_prompt_tokens": 5, "echo": True})
    assert r.status_code == 200, r.text
    assert pipeline.requests[-1].prompt_ids == tuple(ids[-5:])
    assert r.json()["choices"][0]["text"] == builder.processor.tokenizer.decode(ids[-5:]) + "Hello world"  # what ran
    assert post(server, {"prompt": ids, "truncate_prompt_tokens": -1}).status_code == 200  # max_model_len
    assert pipeline.requests[-1].prompt_ids == tuple(ids)
    for bad in (0, 65, -2):
        r = post(server, {"prompt": ids, "truncate_prompt_tokens": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text
    r = post(server, {"prompt": "ab " * 10**5, "truncate_prompt_tokens": 5})  # past the text bound, but cut
    assert r.status_code == 200 and len(pipeline.requests[-1].prompt_ids) == 5, r.text


def test_truncating_a_chat_never_cuts_its_media(builder):
    import numpy as np

    from gateway.events import AudioPart, ChatMessage, TextPart

    clip = AudioPart(np.zeros(16000, dtype=np.float32), 16000)
    chat = ChatRequest(request_id="r", model="m", messages=(
        ChatMessage("user", (TextPart("a long question " * 3), clip, TextPart("and more"))),))
    whole = PromptBuilder(builder.processor, max_model_len=512).build(chat).input_ids
    roomy = PromptBuilder(builder.processor, max_model_len=512)
    from dataclasses import replace

    pad = builder.processor.tokenizer.convert_tokens_to_ids("<|audio_pad|>")
    keep = int(whole.numel()) - whole.tolist().index(pad)  # from the clip's first row on: the text before it goes
    inputs = roomy.build(replace(chat, truncate_prompt_tokens=keep))
    assert inputs.input_ids.tolist() == whole[-keep:].tolist() and inputs.input_features is not None
    with pytest.raises(PipelineError, match="would cut into the prompt's audio") as e:
        roomy.build(replace(chat, truncate_prompt_tokens=keep - 1))
    assert e.value.param == "truncate_prompt_tokens"


def test_force_include_usage_ends_completion_streams_with_usage(shared_pipeline: ScriptedPipeline,
                                                                builder: PromptBuilder) -> None:
    """--enable-force-include-usage: a streamed completion ends with its usage chunk, unasked."""
    app = create_app(shared_pipeline, served_model_names=("tiny-omni",), prompts=builder, force_include_usage=True)
    with RestServer(app) as s:
        r = httpx.post(f"{s.base_url}/v1/completions", json={"prompt": [[3, 4]], "stream": True}, timeout=30)
        events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
        usage = json.loads(events[-2])
        assert events[-1] == "[DONE]" and usage["choices"] == [] and usage["usage"]["total_tokens"] > 0


def test_invocations_answers_as_the_route_its_body_belongs_to(server, pipeline):
    url = f"{server.base_url}/invocations"
    completion = httpx.post(url, json={"prompt": "The sea is", "max_tokens": 3}, timeout=30)
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion", completion.text
    assert pipeline.requests[-1].prompt_ids is not None and pipeline.requests[-1].messages == ()
    chat = httpx.post(url, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}, timeout=30)
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion", chat.text
    assert pipeline.requests[-1].messages and pipeline.requests[-1].request_id.startswith("chatcmpl-")
    with httpx.stream("POST", url, json={"prompt": "x", "stream": True}, timeout=30) as streamed:
        lines = [line for line in streamed.iter_lines() if line.startswith("data: ")]
    assert streamed.headers["content-type"].startswith("text/event-stream") and lines[-1] == "data: [DONE]"
    # the route's own errors, as the route gives them
    wrong = httpx.post(url, json={"prompt": "x", "max_tokens": -1}, timeout=30)
    assert wrong.status_code == 400 and wrong.json() == httpx.post(
        f"{server.base_url}/v1/completions", json={"prompt": "x", "max_tokens": -1}, timeout=30).json()
    seen = len(pipeline.requests)
    for body, needle in (({"input": "hi"}, "takes the body of a chat completion (with `messages`) or a completion "
                                           "(with `prompt`); this one has input"),
                         ({}, "this one has no fields"), ([1], "must be a JSON object, got list")):
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    r = httpx.post(url, content=b"{nope", headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "the body is not JSON" in r.json()["error"]["message"]
    assert len(pipeline.requests) == seen  # nothing reached the pipeline
