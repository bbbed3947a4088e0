"""`POST /v1/completions` through the shared mesh, against `transformers` `generate` on the same folder and the
same prompt ids (no chat template): a text prompt's greedy text and its legacy logprobs (each token's value,
its top alternatives, their text offsets), a batch of token-id prompts answered in order (each equal to its own
`generate`), and a streamed echo equal to the whole answer. Bad bodies: tests/gateway/test_completions.py."""

from __future__ import annotations

import json

import httpx
import pytest

from gateway.events import ChatRequest
from services.llm.token_logprobs import TokenBytes

MODEL = "tiny-qwen3-omni"
MAX_TOKENS = 10
TOP = 3
TIMEOUT_S = 60.0
TOLERANCE = 2e-4  # the mesh's fused kernels vs transformers' modules, in nats


def _reference(reference, ids: list[int], max_tokens: int = MAX_TOKENS):
    req = ChatRequest(request_id="ref", model="m", messages=(), modalities=("text",), prompt_ids=tuple(ids))
    gen, logprobs = reference.text_logprobs(req, max_tokens=max_tokens)
    return gen, logprobs


def _text(reference, gen: list[int]) -> str:
    return reference.tokenizer.decode(gen, skip_special_tokens=True)


def _post(mesh, body: dict) -> dict:
    r = httpx.post(f"{mesh.rest}/v1/completions", json={"model": MODEL, "temperature": 0, **body}, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()


def test_text_prompt_and_logprobs_equal_generates(mesh, reference):
    prompt = "The sea is"
    ids = reference.tokenizer(prompt)["input_ids"]
    body = _post(mesh, {"prompt": prompt, "max_tokens": MAX_TOKENS, "logprobs": TOP})
    gen, rows = _reference(reference, ids)
    [choice] = body["choices"]
    assert choice["text"] == _text(reference, gen)
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == len(gen)
    stop_id = reference.tokenizer.convert_tokens_to_ids("<|im_end|>")
    spoken = gen[:-1] if gen[-1] == stop_id else gen  # a stop id adds no text: no entry
    assert len(spoken) >= 3, gen  # enough tokens for the checks below to mean something
    lp = choice["logprobs"]
    token_bytes = TokenBytes(reference.tokenizer)
    assert lp["tokens"] == [token_bytes(t).decode("utf-8", errors="replace") for t in spoken]
    assert lp["token_logprobs"] == pytest.approx([float(rows[i][t]) for i, t in enumerate(spoken)], abs=TOLERANCE)
    for i, (token, top) in enumerate(zip(lp["tokens"], lp["top_logprobs"], strict=True)):
        best = rows[i].topk(TOP)
        assert token in top and len(top) <= TOP + 1
        expected = {token_bytes(t).decode("utf-8", errors="replace"): v
                    for t, v in zip(best.indices.tolist(), best.values.tolist(), strict=True)}
        for text, value in expected.items():
            assert top[text] == pytest.approx(value, abs=TOLERANCE)
    special = {i for i, t in reference.tokenizer.added_tokens_decoder.items() if t.special}
    room = [0 if t in special else len(text) for t, text in zip(spoken, lp["tokens"], strict=True)]
    assert lp["text_offset"] == [sum(room[:i]) for i in range(len(room))]


def test_token_prompts_in_order_each_equal_to_generate(mesh, reference):
    prompts = [reference.tokenizer(p)["input_ids"] for p in ("Fish swim", "Birds fly over the", "A")]
    body = _post(mesh, {"prompt": prompts, "max_tokens": 6})
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert len({c["text"] for c in body["choices"]}) == 3  # three different answers, none empty
    assert all(c["text"] for c in body["choices"])
    for ids, choice in zip(prompts, body["choices"], strict=True):
        assert choice["text"] == _text(reference, _reference(reference, ids, 6)[0])
    assert body["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)


def test_streamed_echo_equals_the_whole_answer(mesh):
    body = {"prompt": "Once upon a time", "max_tokens": 8, "echo": True}
    whole = _post(mesh, body)["choices"][0]["text"]
    assert whole.startswith("Once upon a time")
    pieces, finish = [], None
    with httpx.stream("POST", f"{mesh.rest}/v1/completions", timeout=TIMEOUT_S,
                      json={"model": MODEL, "temperature": 0, "stream": True, **body}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[len("data: "):])["choices"]:
                    pieces.append(c["text"])
                    finish = c["finish_reason"] or finish
    assert "".join(pieces) == whole and finish in ("stop", "length")


def check_prompt_logprobs(got: list, ids: list[int], rows, k: int, tokenizer) -> None:
    """vLLM's shape: None, then per prompt token from the second {id: {logprob, rank, decoded_token}} holding
    the token and its k likeliest alternatives (ranks 1..k)."""
    assert got[0] is None and len(got) == len(ids)
    token_bytes = TokenBytes(tokenizer)
    for row, (position, token) in enumerate(zip(got[1:], ids[1:], strict=True)):
        mine = position[str(token)]
        assert mine["logprob"] == pytest.approx(float(rows[row][token]), abs=TOLERANCE)
        assert mine["decoded_token"] == token_bytes(token).decode("utf-8", errors="replace")
        assert mine["rank"] >= 1
        best = rows[row].topk(k)
        for rank, (i, value) in enumerate(zip(best.indices.tolist(), best.values.tolist(), strict=True), start=1):
            assert position[str(i)]["logprob"] == pytest.approx(value, abs=TOLERANCE)
            assert position[str(i)]["rank"] == (mine["rank"] if i == token else rank)
        assert len(position) in (k, k + 1)


def test_echo_with_logprobs_and_max_tokens_0_scores_the_prompt(mesh, reference):
    """lm-eval's loglikelihood request: the prompt alone, each token but the first scored."""
    ids = reference.tokenizer("The river runs to the sea")["input_ids"]
    body = _post(mesh, {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1, "prompt_logprobs": 2})
    req = ChatRequest(request_id="ref", model="m", messages=(), modalities=("text",), prompt_ids=tuple(ids))
    _, rows = reference.prompt_logprobs(req)
    [choice] = body["choices"]
    assert choice["text"] == reference.tokenizer.decode(ids) and body["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(ids)
    assert lp["token_logprobs"][1:] == pytest.approx([float(rows[i][t]) for i, t in enumerate(ids[1:])], abs=TOLERANCE)
    check_prompt_logprobs(choice["prompt_logprobs"], ids, rows, 2, reference.tokenizer)


def test_grpc_raw_prompts_equal_generate(mesh, reference):
    """gRPC's `prompt` / `prompt_token_ids`: the same tokens as REST's prompt, the same greedy text as `generate`."""
    import grpc

    from omnimesh.v1 import omni_pb2, omni_pb2_grpc, stage_pb2

    prompt = "The sea is"
    ids = list(reference.tokenizer(prompt)["input_ids"])
    gen, _ = _reference(reference, ids)
    sampling = stage_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    with grpc.insecure_channel(mesh.grpc) as ch:
        stub = omni_pb2_grpc.OmniStub(ch)
        for request in (omni_pb2.GenerateRequest(model=MODEL, prompt=prompt, sampling=sampling),
                        omni_pb2.GenerateRequest(model=MODEL, prompt_token_ids=ids, sampling=sampling)):
            out = list(stub.Generate(request, timeout=TIMEOUT_S))
            assert out[-1].WhichOneof("kind") == "done", out[-1]
            assert "".join(r.text_delta for r in out if r.WhichOneof("kind") == "text_delta") == _text(reference, gen)
            assert out[-1].done.usage.prompt_tokens == len(ids)
