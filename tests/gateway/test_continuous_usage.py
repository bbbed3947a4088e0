"""vLLM's `stream_options.continuous_usage_stats` on the REST stream (scripted pipeline, real server): with
`include_usage` every chunk carries the usage so far -- the prompt tokens and the tokens generated up to that
chunk, from the pipeline's text deltas, exact from the Finished event on -- and the final usage chunk still
comes; without it (or without include_usage) only the final one does."""

from __future__ import annotations

import json

import httpx
from gateway_harness import RestServer, ScriptedPipeline

from gateway.events import Finished, TextDelta

USER = [{"role": "user", "content": "hi"}]


def stream(server: RestServer, **options: bool) -> list[dict]:
    body = {"model": "tiny-omni", "messages": USER, "stream": True, "stream_options": options}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=10) as r:
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_every_chunk_says_the_usage_so_far(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    pipeline.script = lambda request: [TextDelta("Hel", usage=(7, 1)), TextDelta("lo", usage=(7, 2)),
                                       TextDelta(" there", usage=(7, 4)),
                                       Finished(finish_reason="stop", prompt_tokens=7, completion_tokens=5)]
    chunks = stream(rest_server, include_usage=True, continuous_usage_stats=True)
    seen = [(c["choices"][0]["delta"].get("content"), c["usage"]["completion_tokens"]) for c in chunks if c["choices"]]
    assert seen == [("", 1), ("Hel", 1), ("lo", 2), (" there", 4), (None, 5)]  # the finish chunk: Finished's count
    assert all(c["usage"]["prompt_tokens"] == 7 and c["usage"]["total_tokens"] == 7 + c["usage"]["completion_tokens"]
               for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5  # the final usage chunk
    plain = stream(rest_server, include_usage=True)
    assert all("usage" not in c for c in plain[:-1]) and plain[-1]["usage"]["completion_tokens"] == 5
    assert all("usage" not in c for c in stream(rest_server, continuous_usage_stats=True))  # needs include_usage
