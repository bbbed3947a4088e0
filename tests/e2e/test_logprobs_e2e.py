"""OpenAI's `logprobs` / `top_logprobs` through the shared mesh, against `generate` on the same folder: each
text token's entry is the sampled id's log-probability under the thinker's raw logits, its alternatives are
the top ids best first, and its bytes join into the answer's text. Non-streaming, streaming (the chunks'
entries together are the same) and gRPC (`sampling.logprobs`) agree. Bad values: tests/gateway/test_rest.py and test_grpc_api.py.
"""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
from reference import chat_request, openai_content, png_bytes, sine_wav

from omnimesh.v1 import omni_pb2, omni_pb2_grpc, stage_pb2
from services.llm.token_logprobs import TokenBytes

MODEL = "tiny-qwen3-omni"
MAX_TOKENS = 12
TOP = 5
TIMEOUT_S = 60.0
TOLERANCE = 2e-4  # the mesh's fused kernels vs transformers' modules, in nats


def _body(text: str, wav: bytes | None, png: bytes | None, **over: object) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": openai_content(text, wav, png)}],
            "modalities": ["text"], "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": True,
            "top_logprobs": TOP, **over}


def _check_against_reference(content: list[dict], text: str, ref_ids: list[int], ref_logprobs, tokenizer) -> None:
    stop_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = ref_ids[:-1] if ref_ids and ref_ids[-1] == stop_id else ref_ids  # a stop id adds no text: no entry
    assert len(content) == len(ids) > 0
    token_bytes = TokenBytes(tokenizer)
    for entry, token, row in zip(content, ids, ref_logprobs, strict=False):
        assert bytes(entry["bytes"]) == token_bytes(token)
        assert entry["logprob"] == pytest.approx(float(row[token]), abs=TOLERANCE)
        best = row.topk(TOP)
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(best.values.tolist(), abs=TOLERANCE)
        assert entry["top_logprobs"][0]["logprob"] >= entry["logprob"] - TOLERANCE  # greedy picked the best
        assert entry["token"] == bytes(entry["bytes"]).decode("utf-8", errors="replace")
    # special tokens have entries but no text (the text skips them, as vLLM's)
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    spoken = [bytes(e["bytes"]) for e, i in zip(content, ids, strict=True) if i not in special]
    assert b"".join(spoken).decode("utf-8", errors="replace") == text


@pytest.mark.parametrize("media", [False, True], ids=["text", "audio+image"])
def test_rest_logprobs_equal_generates(mesh, tiny_model_dir, reference, media):
    wav, png = (sine_wav(), png_bytes()) if media else (None, None)
    r = httpx.post(f"{mesh.rest}/v1/chat/completions", json=_body("Tell me about the sea.", wav, png), timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    req = chat_request("Tell me about the sea.", wav, png, max_tokens=MAX_TOKENS, talker_max=1, modalities=("text",))
    ref_ids, ref_logprobs = reference.text_logprobs(req, max_tokens=MAX_TOKENS)
    _check_against_reference(choice["logprobs"]["content"], choice["message"]["content"], ref_ids, ref_logprobs,
                             reference.tokenizer)


def test_streaming_and_grpc_give_the_same_entries(mesh):
    body = _body("Name three fish.", None, None)
    whole = httpx.post(f"{mesh.rest}/v1/chat/completions", json=body, timeout=TIMEOUT_S).json()["choices"][0]
    streamed: list[dict] = []
    with httpx.stream("POST", f"{mesh.rest}/v1/chat/completions", json={**body, "stream": True}, timeout=TIMEOUT_S) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[len("data: "):])["choices"]
                if choices and choices[0].get("logprobs"):
                    streamed.extend(choices[0]["logprobs"]["content"])
    assert streamed == whole["logprobs"]["content"]
    request = omni_pb2.GenerateRequest(
        model=MODEL, modalities=["text"],
        messages=[omni_pb2.ChatMessage(role="user", content=[omni_pb2.ContentPart(text="Name three fish.")])],
        sampling=stage_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP))
    with grpc.insecure_channel(mesh.grpc) as ch:
        out = list(omni_pb2_grpc.OmniStub(ch).Generate(request, timeout=TIMEOUT_S))
    entries = [e for r in out for e in r.logprobs]
    assert [(e.token_id and e.token, round(e.logprob, 5)) for e in entries] == [
        (bytes(w["bytes"]), round(w["logprob"], 5)) for w in whole["logprobs"]["content"]]
    assert all(len(e.top) == TOP for e in entries)


def test_without_logprobs_there_are_none(mesh):
    r = httpx.post(f"{mesh.rest}/v1/chat/completions", json=_body("Hi", None, None, logprobs=False, top_logprobs=None),
                   timeout=TIMEOUT_S)
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None, r.text
    r = httpx.post(f"{mesh.rest}/v1/chat/completions", json=_body("Hi", None, None, top_logprobs=0), timeout=TIMEOUT_S)
    assert all(e["top_logprobs"] == [] for e in r.json()["choices"][0]["logprobs"]["content"]), r.text


@pytest.mark.parametrize("media", [False, True], ids=["text", "audio+image"])
def test_chat_prompt_logprobs_equal_the_thinkers_forward(mesh, reference, media):
    """vLLM's `prompt_logprobs` on a chat (the templated prompt, media rows included), REST and gRPC."""
    from test_completions_e2e import check_prompt_logprobs

    wav, png = (sine_wav(), png_bytes()) if media else (None, None)
    body = {**_body("Tell me about the sea.", wav, png), "logprobs": False, "top_logprobs": None, "prompt_logprobs": 2}
    r = httpx.post(f"{mesh.rest}/v1/chat/completions", json=body, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    req = chat_request("Tell me about the sea.", wav, png, max_tokens=MAX_TOKENS, talker_max=1, modalities=("text",))
    ids, rows = reference.prompt_logprobs(req)
    got = r.json()["prompt_logprobs"]
    check_prompt_logprobs(got, ids, rows, 2, reference.tokenizer)
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    if media:
        return
    request = omni_pb2.GenerateRequest(
        model=MODEL, modalities=["text"],
        messages=[omni_pb2.ChatMessage(role="user", content=[omni_pb2.ContentPart(text="Tell me about the sea.")])],
        sampling=stage_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, prompt_logprobs=2))
    with grpc.insecure_channel(mesh.grpc) as ch:
        out = list(omni_pb2_grpc.OmniStub(ch).Generate(request, timeout=TIMEOUT_S))
    entries = [e for resp in out for e in resp.prompt_logprobs]
    assert [e.token_id for e in entries] == ids[1:]
    assert [e.logprob for e in entries] == pytest.approx([p[str(t)]["logprob"] for p, t in zip(got[1:], ids[1:])],
                                                         abs=1e-6)
    assert out[0].prompt_logprobs  # on the first response
