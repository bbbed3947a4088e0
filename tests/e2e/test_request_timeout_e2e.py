"""`--request-timeout` in a real gateway process (a second `omnimesh gateway` on the shared mesh's stages): a
request that runs past it ends with 504 naming the flag, the stages drop it (the thinker runs nothing after),
and requests within it are answered as the open gateway answers them."""

from __future__ import annotations

import re
import time

import httpx
from mesh_harness import start_gateway

BODY = {"model": "tiny-qwen3-omni", "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "temperature": 0}


def _running(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(m) for m in re.findall(r'^omnimesh:num_requests_running\{[^}]*stage="thinker"[^}]*\} (\S+)$',
                                             text, re.MULTILINE))


def test_a_request_past_the_timeout_is_a_504_naming_the_flag(mesh, tiny_model_dir):
    proc, url = start_gateway(tiny_model_dir, mesh.stages, "--request-timeout", "1")
    try:
        started = time.monotonic()
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                       json={**BODY, "max_tokens": 3000, "ignore_eos": True})  # ~8 s of decoding here
        took = time.monotonic() - started
        assert r.status_code == 504, r.text
        assert "--request-timeout is 1 s" in r.json()["error"]["message"] and took < 5
        deadline = time.monotonic() + 10
        while _running(url) and time.monotonic() < deadline:  # the thinker dropped it
            time.sleep(0.1)
        assert _running(url) == 0
        short = httpx.post(f"{url}/v1/chat/completions", json={**BODY, "max_tokens": 8}, timeout=60)
        open_answer = httpx.post(f"{mesh.rest}/v1/chat/completions", json={**BODY, "max_tokens": 8}, timeout=60)
        assert short.status_code == 200 and short.json()["choices"][0]["message"]["content"] == \
            open_answer.json()["choices"][0]["message"]["content"]
    finally:
        assert proc.stop() == 0, proc.output()
