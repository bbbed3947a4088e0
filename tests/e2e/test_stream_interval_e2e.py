"""`--stream-interval` through the shared mesh, at its default (4): the thinker sends its tokens in groups (after
the ones the talker's first audio needs, which come out of one engine step after the first token:
first_output_rounds), and the answer is still exactly `generate`'s — text, and audio
within pcm16 rounding — non-streaming and streaming; the text a streaming client sees arrives in fewer
deltas.
"""

from __future__ import annotations

import json

import httpx
from reference import png_bytes, sine_wav
from test_handoff_e2e import PROMPT, _deltas, _metrics, _request_matches_reference
from test_parity import _rest_body

from omnimesh.config.serve_args import ServeArgs
from omnimesh.config.stage_config import StageConfig


INTERVAL = ServeArgs().stream_interval  # the mesh below starts without the flag
EAGER = 6  # the vocoder's first window (5 codes) + 1: the tokens the talker's first audio reads
# the eager tokens, the first one included, come out of calls of up to this many rounds each
ROUNDS = StageConfig().effective_first_output_rounds("thinker")


def test_grouped_thinker_output_equals_generate(mesh, reference):
    assert INTERVAL > 1  # else this test would not see any grouping
    _request_matches_reference(mesh.rest, reference)
    before = _metrics(mesh.rest)
    r = httpx.post(f"{mesh.rest}/v1/chat/completions", json=_rest_body(PROMPT, sine_wav(), png_bytes(), False),
                   timeout=120).json()
    after = _metrics(mesh.rest)
    plain, tokens = r["choices"][0]["message"]["content"], r["usage"]["completion_tokens"]
    outputs = _deltas(before, after, "omnimesh:inter_token_latency_seconds_count")["thinker"] + 1
    assert tokens > EAGER
    assert outputs == -(-EAGER // ROUNDS) + -(-(tokens - EAGER) // INTERVAL), (tokens, outputs)

    deltas, text = 0, ""
    body = _rest_body(PROMPT, sine_wav(), png_bytes(), True)
    with httpx.stream("POST", f"{mesh.rest}/v1/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                if delta.get("content"):
                    deltas += 1
                    text += delta["content"]
    assert text == plain and 0 < deltas <= outputs
