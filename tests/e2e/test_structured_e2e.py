"""Structured outputs (and logit_bias / allowed_token_ids) through the shared mesh: the tiny model's random weights never write JSON on their own,
yet with OpenAI's `response_format` json_schema the answer is JSON of that schema, with vLLM's
`structured_outputs.choice` one of the choices and with `regex` a match; streamed the same text arrives; a
bad schema is a 400 from the gateway, before any stage runs; gRPC's `structured_output` works alike."""

from __future__ import annotations

import json
import re

import grpc
import httpx

from omnimesh.v1 import omni_pb2, omni_pb2_grpc, stage_pb2

MODEL = "tiny-qwen3-omni"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["S", "M", "L"]}},
          "required": ["ok", "size"], "additionalProperties": False}


def _chat(mesh, **extra) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Describe the sea."}], "max_tokens": 48,
            "temperature": 0, **extra}
    return httpx.post(f"{mesh.rest}/v1/chat/completions", json=body, timeout=120)


def test_answers_follow_the_schema_choice_and_regex(mesh) -> None:
    plain = _chat(mesh).json()["choices"][0]["message"]["content"]
    r = _chat(mesh, response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    value = json.loads(text)
    assert set(value) == {"ok", "size"} and isinstance(value["ok"], bool) and value["size"] in "SML"
    assert text != plain and r.json()["choices"][0]["finish_reason"] == "stop"
    streamed = []
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Describe the sea."}], "max_tokens": 48,
            "temperature": 0, "stream": True, "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}
    with httpx.stream("POST", f"{mesh.rest}/v1/chat/completions", json=body, timeout=120) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                streamed += [c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"]]
    assert "".join(streamed) == text
    choice = _chat(mesh, structured_outputs={"choice": ["calm", "rough", "frozen over"]}).json()
    assert choice["choices"][0]["message"]["content"] in ("calm", "rough", "frozen over")
    regex = _chat(mesh, guided_regex="[A-Z][a-z]{2,6}!").json()["choices"][0]["message"]["content"]
    assert re.fullmatch("[A-Z][a-z]{2,6}!", regex)
    bad = _chat(mesh, response_format={"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"


def test_grpc_structured_output(mesh) -> None:
    request = omni_pb2.GenerateRequest(
        model=MODEL, modalities=["text"],
        messages=[omni_pb2.ChatMessage(role="user", content=[omni_pb2.ContentPart(text="Describe the sea.")])],
        sampling=stage_pb2.SamplingParams(temperature=0.0, max_tokens=48),
        structured_output=omni_pb2.StructuredOutput(kind="json", spec=json.dumps(SCHEMA)))
    with grpc.insecure_channel(mesh.grpc) as ch:
        out = list(omni_pb2_grpc.OmniStub(ch).Generate(request, timeout=120))
    value = json.loads("".join(r.text_delta for r in out))
    assert set(value) == {"ok", "size"} and out[-1].done.finish_reason == "stop"


def test_logit_bias_and_allowed_token_ids(mesh, tiny_model_dir) -> None:
    """A +100 bias on one id makes the greedy answer that token, repeated; allowed_token_ids bound the answer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok.encode("sea", add_special_tokens=False)
    forced = _chat(mesh, max_tokens=6, ignore_eos=True, logit_bias={str(ids[0]): 100})
    assert forced.status_code == 200, forced.text
    assert forced.json()["choices"][0]["message"]["content"] == tok.decode([ids[0]] * 6)
    allowed = _chat(mesh, max_tokens=8, allowed_token_ids=ids).json()
    text = allowed["choices"][0]["message"]["content"]
    assert tok.encode(text, add_special_tokens=False) and set(tok.encode(text, add_special_tokens=False)) <= set(ids)
    assert allowed["usage"]["completion_tokens"] == 8  # the stop id is not among them: only max_tokens ends it
    # a grammar and allowed_token_ids that leave no token: the request's settings, a 400 (was a 500 blaming the
    # model's logits, which the grammar's mask had set to -inf)
    shut = _chat(mesh, allowed_token_ids=ids, structured_outputs={"choice": ["hello"]})
    assert shut.status_code == 400, shut.text
    assert "no token can be picked" in shut.json()["error"]["message"]
