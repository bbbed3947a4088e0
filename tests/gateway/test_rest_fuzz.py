"""Valid REST bodies (chat with audio, image and tools; streamed chat with logprobs and n; responses; speech)
with one to three fields replaced, removed or added, values of every JSON type: each is answered (2xx) or
refused with a 4xx naming the mistake, never a 5xx, and a stream never carries a `server_error` (a crash in the
gateway). Seeded, so a failure replays. Against a scripted pipeline, on a real uvicorn server."""

from __future__ import annotations

import base64
import copy
import json
import random
from typing import Any

import httpx
import pytest
from gateway_harness import RestServer, ScriptedPipeline
from test_rest import png_data_uri, wav_file

from gateway.rest import create_app

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                       "properties": {"a": {"type": "string"}}}}}
SEEDS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {
        "model": "tiny-omni", "max_tokens": 5, "modalities": ["text", "audio"],
        "audio": {"voice": "Ethan", "format": "wav"},
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": [
                         {"type": "text", "text": "hi"},
                         {"type": "input_audio",
                          "input_audio": {"data": base64.b64encode(wav_file(0.1)).decode(), "format": "wav"}},
                         {"type": "image_url", "image_url": {"url": png_data_uri(8, 8)}}]}]}),
    ("/v1/chat/completions", {
        "model": "tiny-omni", "messages": [{"role": "user", "content": "hi"}], "stream": True, "n": 2,
        "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2, "tools": [TOOL],
        "tool_choice": "auto"}),
    ("/v1/chat/completions", {
        "model": "tiny-omni", "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                         "schema": {"type": "object"}}},
        "messages": [{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": None,
                      "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}),
    ("/v1/responses", {"model": "tiny-omni", "instructions": "x", "max_output_tokens": 5, "stream": True,
                       "input": [{"role": "user",
                                  "content": [{"type": "input_text", "text": "hi"},
                                              {"type": "input_image", "image_url": png_data_uri(8, 8)}]}],
                       "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]}),
    ("/v1/audio/speech", {"model": "tiny-omni", "input": "hello", "voice": "Ethan", "response_format": "mp3",
                          "speed": 1.2, "stream_format": "sse"}),
]
VALUES: list[Any] = [None, 0, -1, 1.5, 10**12, -10**12, 1e308, True, "", "x", "auto", "none", "\x00", "data:,x",
                     [], [None], [{}], {}, {"type": None}, {"a": 1}, "A" * 5000]
KEYS = ["extra", "type", "role", "content", "url", "data", "format", "text", "name", "arguments"]


def _paths(value: Any, at: tuple = ()) -> list[tuple]:
    out = [at] if at else []
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        out += _paths(child, (*at, key))
    return out


def _mutate(body: dict[str, Any], rng: random.Random) -> None:
    path = rng.choice(_paths(body))
    parent: Any = body
    for key in path[:-1]:
        parent = parent[key]
    value = copy.deepcopy(rng.choice(VALUES))
    roll = rng.random()
    if roll < 0.15 and isinstance(parent, dict):
        del parent[path[-1]]
    elif roll < 0.25 and isinstance(parent, dict):
        parent[rng.choice(KEYS)] = value
    else:
        parent[path[-1]] = value


@pytest.mark.parametrize("seed", [1, 2])
def test_mutated_bodies_are_answered_or_refused_never_crash(pipeline: ScriptedPipeline, seed: int) -> None:
    rng = random.Random(seed)
    with RestServer(create_app(pipeline, served_model_names=("tiny-omni",))) as server:
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            for _ in range(150):
                path, seed_body = rng.choice(SEEDS)
                body = copy.deepcopy(seed_body)
                for _ in range(rng.randint(1, 3)):
                    _mutate(body, rng)
                r = client.post(path, json=body)
                assert r.status_code < 500 and '"server_error"' not in r.text, (path, json.dumps(body)[:2000], r.text)
                if r.status_code >= 400:
                    error = r.json()["error"]
                    assert error["message"] and error["type"] != "server_error", (path, body, error)
