"""The encoder cache through the shared mesh (on by default, --encoder-cache-memory): a chat's second turn
carries the first turn's picture again beside a new one; the encoder serves the known picture from its cache
(the gateway's /metrics: one more lookup per picture, one more hit only for the known one), and asking the
first question again gives the same greedy answer as the first time."""

from __future__ import annotations

import base64
import re

import httpx
from reference import png_bytes

MODEL = "tiny-qwen3-omni"
TIMEOUT_S = 120


def _image(png: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}


def _ask(mesh, messages: list) -> str:
    r = httpx.post(f"{mesh.rest}/v1/chat/completions", timeout=TIMEOUT_S, json={
        "model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0, "modalities": ["text"]})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def _counts(mesh) -> tuple[float, float]:
    text = httpx.get(f"{mesh.rest}/metrics", timeout=TIMEOUT_S).text

    def total(name: str) -> float:
        found = re.findall(rf'^{name}\{{[^}}]*stage="encoder"[^}}]*\}} ([\d.e+]+)$', text, re.M)
        assert found, f"no encoder series {name} in /metrics"
        return sum(float(v) for v in found)

    return total("omnimesh:encoder_cache_queries_total"), total("omnimesh:encoder_cache_hits_total")


def test_a_picture_sent_again_is_served_from_the_encoder_cache(mesh) -> None:
    first, second = png_bytes(48, seed=901), png_bytes(40, seed=902)  # seen by no other test
    turn1 = [{"role": "user", "content": [_image(first), {"type": "text", "text": "What is in the picture?"}]}]
    q0, h0 = _counts(mesh)
    answer = _ask(mesh, turn1)
    q1, h1 = _counts(mesh)
    assert (q1 - q0, h1 - h0) == (1, 0)
    turn2 = [*turn1, {"role": "assistant", "content": answer},
             {"role": "user", "content": [_image(second), {"type": "text", "text": "And this one?"}]}]
    _ask(mesh, turn2)
    q2, h2 = _counts(mesh)
    assert (q2 - q1, h2 - h1) == (2, 1)  # the history's picture from the cache, the new one through the tower
    assert _ask(mesh, turn1) == answer
    q3, h3 = _counts(mesh)
    assert (q3 - q2, h3 - h2) == (1, 1)
