"""Prefix caching through a running mesh (`omnimesh serve --enable-prefix-caching
--enable-prompt-tokens-details`): requests that share a long system prompt. The second one's usage says the
thinker's cache served part of its prompt (REST `prompt_tokens_details.cached_tokens`, gRPC
`usage.cached_tokens`), the gateway's /metrics shows the thinker's prefix_cache_queries / hits, and every
answer — text, and speech (the talker reads the thinker's prompt embeddings) — equals the same request on the
shared mesh, which computes every prompt whole.
"""

from __future__ import annotations

import base64
import io
import re
import wave

import grpc
import httpx
import numpy as np
import pytest
from mesh_harness import start_mesh
from reference import sine_wav

from omnimesh.v1 import omni_pb2, omni_pb2_grpc, stage_pb2

MODEL = "tiny-qwen3-omni"
TIMEOUT_S = 120
SYSTEM = ("You are a careful assistant for sailors. Answer in short plain sentences, name the sources you use, "
          "and say so when you do not know. Never guess a tide table or a weather report.")
HIDDEN = 64  # the tiny thinker's hidden size (omnimesh/models/qwen3_omni/tiny_config.py)
PCM16_TOLERANCE = 4  # as test_api_e2e.py: the vocoder's chunking may round the last bits differently


@pytest.fixture(scope="module")
def cached(tiny_model_dir):
    m = start_mesh(tiny_model_dir, "--enable-prefix-caching", "--enable-prompt-tokens-details")
    yield m
    assert m.proc.stop() == 0, m.proc.output()


def _body(question: str, audio: bool = False) -> dict:
    return {"model": MODEL, "temperature": 0, "max_tokens": 8,
            "modalities": ["text", "audio"] if audio else ["text"],
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}


def _post(mesh, body: dict) -> dict:
    r = httpx.post(f"{mesh.rest}/v1/chat/completions", json=body, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()


def _pcm(reply: dict) -> np.ndarray:
    with wave.open(io.BytesIO(base64.b64decode(reply["choices"][0]["message"]["audio"]["data"]))) as w:
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.int32)


def _metric(mesh, name: str) -> float:
    text = httpx.get(f"{mesh.rest}/metrics", timeout=TIMEOUT_S).text
    found = re.search(rf'^{re.escape(name)}\{{[^}}]*stage="thinker"[^}}]*\}} ([\d.e+]+)$', text, re.M)
    assert found, f"no thinker series {name} in /metrics"
    return float(found.group(1))


def test_a_shared_system_prompt_is_served_from_the_cache_with_the_same_answers(cached, mesh):
    first = _post(cached, _body("What is a knot?"))
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    second = _post(cached, _body("Where do rivers end?"))
    cached_tokens = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    prompt_tokens = second["usage"]["prompt_tokens"]
    assert 16 <= cached_tokens < prompt_tokens and cached_tokens % 16 == 0  # whole blocks of 16 (--block-size)
    plain = _post(mesh, _body("Where do rivers end?"))
    assert plain["usage"].get("prompt_tokens_details") is None  # without --enable-prompt-tokens-details
    assert second["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    assert second["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]

    spoken = _post(cached, _body("Where do rivers end?", audio=True))
    assert spoken["usage"]["prompt_tokens_details"]["cached_tokens"] >= cached_tokens
    want = _pcm(_post(mesh, _body("Where do rivers end?", audio=True)))
    got = _pcm(spoken)
    assert got.shape == want.shape and got.size > 0
    assert np.abs(got - want).max() <= PCM16_TOLERANCE

    assert _metric(cached, "omnimesh:prefix_cache_hits_total") >= 2 * cached_tokens
    assert _metric(cached, "omnimesh:prefix_cache_queries_total") >= 3 * prompt_tokens - 20


def test_a_repeated_clip_is_served_from_the_cache_past_its_rows(cached, mesh):
    """The gateway names each media item by its content (gateway/media_digest.py): a chat that sends the same
    clip again reuses the blocks after it, another clip only those before it, text or speech out; answers equal
    the shared mesh's."""
    def body(wav: bytes) -> dict:
        clip = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}
        return {**_body("What do you hear?"), "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": [clip, {"type": "text", "text": "What do you hear? Answer briefly."}]}]}

    first = _post(cached, body(sine_wav(1.0, freq=440.0)))
    again = _post(cached, body(sine_wav(1.0, freq=440.0)))
    other = _post(cached, body(sine_wav(1.0, freq=660.0)))
    prompt = again["usage"]["prompt_tokens"]
    hits = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (first, again, other)]
    assert hits[1] == (prompt - 1) // 16 * 16 > hits[2] > 0  # the repeat: all but the last block; the other: the system prompt
    for got, wav in ((again, sine_wav(1.0, freq=440.0)), (other, sine_wav(1.0, freq=660.0))):
        want = _post(mesh, body(wav))
        assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    # speech out: the talker reads the clip's hidden states, which the cached blocks keep once a speech request
    # computed them (the text-only requests' blocks keep none: the first spoken one computes the clip)
    spoken = [_post(cached, {**body(sine_wav(1.0, freq=440.0)), "modalities": ["text", "audio"]}) for _ in range(2)]
    assert spoken[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == hits[1]
    assert spoken[0]["usage"]["prompt_tokens_details"]["cached_tokens"] < hits[1]
    want = _post(mesh, {**body(sine_wav(1.0, freq=440.0)), "modalities": ["text", "audio"]})
    for got in spoken:
        assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
        assert _pcm(got).shape == _pcm(want).shape and np.abs(_pcm(got) - _pcm(want)).max() <= PCM16_TOLERANCE
    # those kept rows are host memory the thinker reports: whole rows of the thinker's hidden size (float32)
    kept = _metric(cached, "omnimesh:prefix_cache_kept_bytes")
    assert kept > 0 and kept % (4 * HIDDEN) == 0


def test_grpc_usage_counts_the_cached_tokens(cached):
    request = omni_pb2.GenerateRequest(
        model=MODEL, modalities=["text"],
        messages=[omni_pb2.ChatMessage(role="system", content=[omni_pb2.ContentPart(text=SYSTEM)]),
                  omni_pb2.ChatMessage(role="user", content=[omni_pb2.ContentPart(text="Is the sea salty?")])],
        sampling=stage_pb2.SamplingParams(temperature=0.0, max_tokens=4))
    with grpc.insecure_channel(cached.grpc) as ch:
        stub = omni_pb2_grpc.OmniStub(ch)
        for _ in range(2):  # the second time, its whole prompt but the last token's block is cached
            done = [r.done for r in stub.Generate(request, timeout=TIMEOUT_S) if r.HasField("done")]
    assert len(done) == 1 and done[0].usage.prompt_tokens > done[0].usage.cached_tokens >= 16
    assert done[0].usage.cached_tokens == (done[0].usage.prompt_tokens - 1) // 16 * 16
