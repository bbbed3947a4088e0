"""vLLM's `min_tokens` and `include_stop_str_in_output` through a real `omnimesh serve` (the shared `mesh`),
as a REST client sees them, non-streaming and streaming (greedy, text only):

- a `stop` string ends the text before itself by default and right after itself with
  include_stop_str_in_output, with finish_reason "stop", in both response modes;
- a stop string that the text starts with ends the request at once; with `min_tokens` the request runs on
  to at least that many tokens, the text still the plain greedy text (stop strings never change tokens);
- vLLM's `stop_reason` names the stop string or the request's stop token id that ended an answer (None for
  max_tokens or the model's own EOS), on chat, completions and gRPC;
- min_tokens above max_tokens is a 400 naming min_tokens, from the gateway when max_tokens is given and from
  the thinker stage when it is left to the stage's default (1024).
"""

from __future__ import annotations

import json

import grpc
import httpx

from omnimesh.v1 import omni_pb2, omni_pb2_grpc, stage_pb2

MODEL = "tiny-qwen3-omni"
PROMPT = "Tell me about the sea."
MAX_TOKENS = 16
TIMEOUT_S = 60.0


def _body(**over: object) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "modalities": ["text"],
            "max_tokens": MAX_TOKENS, "temperature": 0, **over}


def complete(mesh, **over: object) -> tuple[str, str, int]:
    """Non-streaming: (content, finish_reason, completion_tokens)."""
    r = httpx.post(f"{mesh.rest}/v1/chat/completions", json=_body(**over), timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    out = r.json()
    choice = out["choices"][0]
    return choice["message"]["content"], choice["finish_reason"], out["usage"]["completion_tokens"]


def stream(mesh, **over: object) -> tuple[str, str]:
    """Streaming: (the joined deltas, the final finish_reason)."""
    text, finish = [], None
    with httpx.stream("POST", f"{mesh.rest}/v1/chat/completions", json=_body(stream=True, **over),
                      timeout=TIMEOUT_S) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                text.append(choice["delta"].get("content") or "")
                finish = choice["finish_reason"] or finish
    assert finish is not None
    return "".join(text), finish


def _stop_in_the_middle(text: str) -> str:
    """Two characters from the middle of `text` (no U+FFFD: the detokenizer holds those back)."""
    for i in range(len(text) // 2, len(text) - 1):
        if "\ufffd" not in text[i:i + 2]:
            return text[i:i + 2]
    raise AssertionError(f"the greedy text is too short for a stop string: {text!r}")


def test_include_stop_str_in_output_streaming_and_not(mesh):
    plain, _, _ = complete(mesh)
    stop = _stop_in_the_middle(plain)
    at = plain.index(stop)
    for include in (False, True):
        want = plain[:at + len(stop)] if include else plain[:at]
        over = {"stop": [stop], "include_stop_str_in_output": include}
        text, finish, _ = complete(mesh, **over)
        assert (text, finish) == (want, "stop"), (include, text, want)
        assert stream(mesh, **over) == (want, "stop"), include
    assert complete(mesh, stop=[stop])[0] == plain[:at]  # the default excludes it, as before


def test_min_tokens_runs_past_an_early_stop_string(mesh):
    plain, plain_finish, plain_tokens = complete(mesh)
    stop = next(c for c in plain if c != "\ufffd")
    early, finish, early_tokens = complete(mesh, stop=[stop])
    assert finish == "stop" and early == plain[:plain.index(stop)]
    want = min(early_tokens + 3, MAX_TOKENS)
    text, finish, tokens = complete(mesh, stop=[stop], min_tokens=want)
    assert tokens >= want > early_tokens
    assert text == plain[:len(text)] and len(text) > len(early)  # same tokens, cut later (or not at all)
    if finish == "stop":
        assert plain[len(text):].startswith(stop)
    else:
        assert (finish, text, tokens) == ("length", plain, plain_tokens)
    assert stream(mesh, stop=[stop], min_tokens=want) == (text, finish)


def test_min_tokens_above_max_tokens_is_400(mesh):
    r = httpx.post(f"{mesh.rest}/v1/chat/completions", json=_body(min_tokens=MAX_TOKENS + 1), timeout=TIMEOUT_S)
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text
    body = _body(min_tokens=2000)
    del body["max_tokens"]  # the thinker's default max_tokens (1024) applies: the stage refuses it
    r = httpx.post(f"{mesh.rest}/v1/chat/completions", json=body, timeout=TIMEOUT_S)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "min_tokens" in message and "2000" in message and "1024" in message, message


def test_stop_reason_names_what_stopped_the_answer(mesh):
    """vLLM's `stop_reason`: the stop string matched, or the request's stop token id generated; None otherwise.
    On chat (whole and on the streamed finish chunk), completions and gRPC alike."""
    plain, _, _ = complete(mesh)
    stop = _stop_in_the_middle(plain)
    whole = httpx.post(f"{mesh.rest}/v1/chat/completions", json=_body(stop=[stop]), timeout=TIMEOUT_S).json()
    assert whole["choices"][0]["stop_reason"] == stop
    finish_chunks = []
    with httpx.stream("POST", f"{mesh.rest}/v1/chat/completions", json=_body(stop=[stop], stream=True),
                      timeout=TIMEOUT_S) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                finish_chunks += [c for c in json.loads(line[6:])["choices"] if c.get("finish_reason")]
    assert [c.get("stop_reason") for c in finish_chunks] == [stop]
    # a request's stop id: a +100 bias makes the model say it first
    [x] = httpx.post(f"{mesh.rest}/tokenize", json={"prompt": "x"}, timeout=TIMEOUT_S).json()["tokens"]
    by_id = httpx.post(f"{mesh.rest}/v1/completions", timeout=TIMEOUT_S, json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stop_token_ids": [x],
        "logit_bias": {str(x): 100}}).json()
    assert by_id["choices"][0]["stop_reason"] == x and by_id["choices"][0]["finish_reason"] == "stop"
    plain_completion = httpx.post(f"{mesh.rest}/v1/completions", timeout=TIMEOUT_S, json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}).json()
    assert plain_completion["choices"][0]["stop_reason"] is None  # max_tokens or the model's own EOS
    request = omni_pb2.GenerateRequest(
        model=MODEL, modalities=["text"],
        messages=[omni_pb2.ChatMessage(role="user", content=[omni_pb2.ContentPart(text=PROMPT)])],
        sampling=stage_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[stop]))
    with grpc.insecure_channel(mesh.grpc) as ch:
        done = [r.done for r in omni_pb2_grpc.OmniStub(ch).Generate(request, timeout=TIMEOUT_S) if r.HasField("done")]
    assert done[0].WhichOneof("stop_reason") == "stop_string" and done[0].stop_string == stop
