"""A spoken answer that starts a function call, through the real stages (a gateway with
--enable-auto-tool-choice --tool-call-parser hermes on the shared mesh's stages): the talker says the words
before `<tool_call>` and nothing after, and the answer's text is the text the model writes uninterrupted.

The tiny model's random weights never write `<tool_call>` on their own; a small logit_bias on its token makes it
come after a few words (the bias is searched for, greedy, on the text answer). Then, with the same bias:
- the spoken answer's text, usage and finish reason equal the text-only answer's (the second part, written
  text-only after `<tool_call>`, continues exactly where the uninterrupted answer goes);
- its audio and transcript equal a spoken answer asked to stop at `<tool_call>` (stop_token_ids): the words
  before the call, and only them; streamed, the transcript deltas are those words and the content deltas the
  text-only answer's text.
The parts and the REST shapes against a scripted pipeline: tests/gateway/test_spoken_calls.py."""

from __future__ import annotations

import base64
import io
import json
import wave

import httpx
import numpy as np
import pytest
from mesh_harness import start_gateway

from omnimesh.models.qwen3_omni.tiny_config import TOOL_TOKENS

MODEL = "tiny-qwen3-omni"
TIMEOUT_S = 120.0
PCM16_TOLERANCE = 4  # as test_api_e2e.py
CALL = "<tool_call>"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
BASE = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": TOOLS,
        "max_tokens": 12, "temperature": 0}
SPEECH = {"modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "wav"}}


def _post(url: str, **body) -> dict:
    r = httpx.post(f"{url}/v1/chat/completions", json={**BASE, **body}, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()


def _pcm(message: dict) -> np.ndarray:
    with wave.open(io.BytesIO(base64.b64decode(message["audio"]["data"]))) as w:
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.int32)


def test_the_talker_stops_where_the_call_starts(mesh, tiny_model_dir) -> None:
    token = str(TOOL_TOKENS[CALL])
    for bias in (0.3, 0.35, 0.25, 0.4, 0.2):  # greedy: words first, then the call
        raw = _post(mesh.rest, tool_choice="none", logit_bias={token: bias})["choices"][0]["message"]["content"]
        if raw.find(CALL) > 0:
            break
    else:
        pytest.fail(f"no bias made the tiny model write words and then {CALL}")
    words = raw[:raw.index(CALL)]
    gw, url = start_gateway(tiny_model_dir, mesh.stages, "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    try:
        text = _post(url, logit_bias={token: bias})
        spoken = _post(url, logit_bias={token: bias}, **SPEECH)
        with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=TIMEOUT_S,
                          json={**BASE, **SPEECH, "logit_bias": {token: bias}, "stream": True,
                                "audio": {"voice": "ethan", "format": "pcm16"}}) as r:
            deltas = [c["choices"][0]["delta"] for line in r.iter_lines() if line.startswith("data: {")
                      for c in [json.loads(line[6:])] if c["choices"]]
    finally:
        assert gw.stop() == 0
    streamed_said = "".join((d.get("audio") or {}).get("transcript") or "" for d in deltas)
    assert streamed_said == words and "".join(d.get("content") or "" for d in deltas) == text["choices"][0][
        "message"]["content"]
    said = _post(mesh.rest, tool_choice="none", logit_bias={token: bias}, stop_token_ids=[int(token)], **SPEECH)
    t, s, w = text["choices"][0], spoken["choices"][0], said["choices"][0]
    assert s["message"]["content"] == t["message"]["content"] and s["message"]["tool_calls"] == t["message"]["tool_calls"]
    assert s["finish_reason"] == t["finish_reason"] and spoken["usage"] == text["usage"]
    assert CALL in s["message"]["content"]  # the random weights write no JSON after it: the block stays text
    assert s["message"]["audio"]["transcript"] == w["message"]["content"] == words
    a, b = _pcm(s["message"]), _pcm(w["message"])
    assert a.shape == b.shape and a.size > 0 and np.abs(a - b).max() <= PCM16_TOLERANCE
