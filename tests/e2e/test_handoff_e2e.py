"""Hand-off transports end to end, through real meshes on loopback.

- The session mesh (all stages on this host, `--transport auto`) hands stage-to-stage tensors over shared
  memory: /metrics says so per stage; tensors under the default --shm-min-tensor-size come inline and the
  large pcm by reference; the output still equals `transformers` `generate`, and every stage's arena is
  whole again after a finished and a client-cancelled request.
- With `--shm-min-tensor-size 0` every tensor goes by reference: the gateway receives none of their bytes
  inline (it relays headers only).
- A mesh started with `--transport grpc` sends the same tensors inline through the gateway and gives the
  same output.
"""

from __future__ import annotations

import base64
import io
import time
import wave

import httpx
import numpy as np
from mesh_harness import start_mesh
from reference import chat_request, png_bytes, sine_wav
from test_parity import MAX_TOKENS, TALKER_MAX, _pcm16, _rest_body

from omnimesh.engine.metrics import parse_exposition

STAGES = ("encoder", "thinker", "talker", "vocoder")
PROMPT = "What do you hear and see?"


def _metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in parse_exposition(text) for s in fam.samples}


def _per_stage(samples: dict, name: str, **extra: str) -> dict[str, float]:
    out = {}
    for (series, labels), value in samples.items():
        d = dict(labels)
        if series == name and all(d.get(k) == v for k, v in extra.items()):
            out[d["stage"]] = value
    return out


def _transports(samples: dict) -> dict[str, str]:
    return {dict(labels)["stage"]: dict(labels)["transport"] for (series, labels), v in samples.items()
            if series == "omnimesh:stage_output_transport" and v == 1}


def _request_matches_reference(url: str, reference) -> None:
    wav, png = sine_wav(), png_bytes()
    ref = reference.generate(chat_request(PROMPT, wav, png, max_tokens=MAX_TOKENS, talker_max=TALKER_MAX),
                             max_tokens=MAX_TOKENS, talker_max=TALKER_MAX)
    r = httpx.post(f"{url}/v1/chat/completions", json=_rest_body(PROMPT, wav, png, False), timeout=120)
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert msg["content"] == ref.text
    with wave.open(io.BytesIO(base64.b64decode(msg["audio"]["data"]))) as w:
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    assert pcm.shape == ref.audio.shape
    assert np.abs(pcm.astype(np.int32) - _pcm16(ref.audio)).max() <= 4


def _deltas(before: dict, after: dict, name: str) -> dict[str, float]:
    b, a = _per_stage(before, name), _per_stage(after, name)
    return {stage: a.get(stage, 0.0) - b.get(stage, 0.0) for stage in STAGES}


def _one_request(url: str, reference, transport: str) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Check every stage edge uses `transport`, run one request that must equal `generate` -> per stage the
    tensor bytes its frames described, those that came inline, and the bytes the gateway received."""
    before = _metrics(url)
    assert _transports(before) == dict.fromkeys(STAGES, transport)
    _request_matches_reference(url, reference)
    after = _metrics(url)
    return (_deltas(before, after, "omnimesh:gateway_stage_tensor_bytes_total"),
            _deltas(before, after, "omnimesh:gateway_stage_inline_tensor_bytes_total"),
            _deltas(before, after, "omnimesh:gateway_stage_received_bytes_total"))


def test_colocated_stages_pass_large_tensors_by_reference_and_small_ones_inline(mesh, reference):
    """The default --shm-min-tensor-size (16 KiB): the tiny model's features, hidden states and codes are all
    smaller and come inline; the vocoder's pcm (~200 kB) goes by reference, so only its header is read."""
    described, inline, wire = _one_request(mesh.rest, reference, "shm")
    for stage in ("encoder", "thinker", "talker"):
        assert inline[stage] == described[stage] > 0, (stage, described, inline)
    assert described["vocoder"] > 16 * 2**10 and inline["vocoder"] == 0, (described, inline)
    assert wire["vocoder"] < described["vocoder"] / 100, (wire, described)


def test_with_no_minimum_colocated_stages_pass_only_headers_through_the_gateway(tiny_model_dir, reference):
    m = start_mesh(tiny_model_dir, "--shm-min-tensor-size", "0")
    try:
        described, inline, wire = _one_request(m.rest, reference, "shm")
        for stage in STAGES:
            assert described[stage] > 0, stage
            assert inline[stage] == 0, f"{stage}: {inline[stage]} tensor bytes came through the gateway"
        # what the gateway read from the encoder (features for the thinker) is headers only
        assert wire["encoder"] < described["encoder"] / 10, (wire, described)
    finally:
        assert m.proc.stop() == 0, m.proc.output()


def _arenas_whole(url: str, timeout_s: float = 20.0) -> dict[str, tuple[float, float]]:
    deadline = time.monotonic() + timeout_s
    while True:
        samples = _metrics(url)
        size = _per_stage(samples, "omnimesh:shm_arena_size_bytes")
        free = _per_stage(samples, "omnimesh:shm_arena_free_bytes")
        state = {stage: (free.get(stage, -1.0), size.get(stage, 0.0)) for stage in STAGES}
        if all(f == s > 0 for f, s in state.values()) or time.monotonic() > deadline:
            return state
        time.sleep(0.3)


def test_finished_and_cancelled_requests_leave_every_arena_whole(mesh):
    wav, png = sine_wav(), png_bytes()
    r = httpx.post(f"{mesh.rest}/v1/chat/completions", json=_rest_body(PROMPT, wav, png, False), timeout=120)
    assert r.status_code == 200, r.text
    for _ in range(3):  # streaming requests the client walks away from mid-stream
        with httpx.stream("POST", f"{mesh.rest}/v1/chat/completions", json=_rest_body(PROMPT, wav, png, True),
                          timeout=120) as resp:
            assert resp.status_code == 200
            for i, _line in enumerate(resp.iter_lines()):
                if i >= 3:
                    break
    state = _arenas_whole(mesh.rest)
    assert all(free == size > 0 for free, size in state.values()), state


def test_grpc_transport_sends_the_same_tensors_inline(tiny_model_dir, reference):
    m = start_mesh(tiny_model_dir, "--transport", "grpc", "--shm-arena-size", "0")
    try:
        described, inline, wire = _one_request(m.rest, reference, "grpc")
        for stage in STAGES:
            assert inline[stage] == described[stage] > 0, stage
            assert wire[stage] > inline[stage], stage
    finally:
        assert m.proc.stop() == 0, m.proc.output()


def test_the_talker_sends_each_vocoder_window_as_one_chunk(mesh):
    """The vocoder announces its windows (5 codes, then 25) and the gateway opens the talker with them: the
    talker's codes cross the gateway in a few window-sized chunks, not one message per code group."""
    before = _metrics(mesh.rest)
    body = {**_rest_body("Tell me about the sea.", None, None, False), "stage_params": {"talker": {"max_tokens": 64}}}
    r = httpx.post(f"{mesh.rest}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    with wave.open(io.BytesIO(base64.b64decode(r.json()["choices"][0]["message"]["audio"]["data"]))) as w:
        n_codes = (w.getnframes() + 555) // 1920  # n codes decode to n * 1920 - 555 samples
    after = _metrics(mesh.rest)
    itl = "omnimesh:inter_token_latency_seconds_count"
    talker_chunks = _deltas(before, after, itl)["talker"] + 1  # one gap between each two outputs
    want = 1 + -(-max(n_codes - 5, 0) // 25)
    assert n_codes > 30 and talker_chunks == want, (n_codes, talker_chunks)
