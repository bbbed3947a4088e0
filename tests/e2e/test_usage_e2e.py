"""vLLM's `stream_options.continuous_usage_stats` through the shared mesh: the gateway counts the thinker's
tokens from the `token_ids` frames it relays (never reading them), so every chunk's completion count rises
with the text and the last equals the final usage chunk's, which equals the non-streamed answer's usage."""

from __future__ import annotations

import json

import httpx

BODY = {"model": "tiny-qwen3-omni", "messages": [{"role": "user", "content": "Count the waves."}], "max_tokens": 12,
        "temperature": 0}


def test_usage_rises_chunk_by_chunk_to_the_final_count(mesh) -> None:
    whole = httpx.post(f"{mesh.rest}/v1/chat/completions", json=BODY, timeout=120).json()["usage"]
    body = {**BODY, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", f"{mesh.rest}/v1/chat/completions", json=body, timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"] and c.get("usage")]
    assert len(counts) >= 3 and counts == sorted(counts) and counts[0] >= 1
    keys = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert chunks[-1]["choices"] == [] and [chunks[-1]["usage"][k] for k in keys] == [whole[k] for k in keys]
    assert counts[-1] == whole["completion_tokens"]
    assert all(c["usage"]["prompt_tokens"] == whole["prompt_tokens"] for c in chunks if c.get("usage"))
