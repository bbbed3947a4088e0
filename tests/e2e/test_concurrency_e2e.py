"""Concurrency on a real mesh (the shared `mesh`): requests running together give exactly what each gives
alone (greedy text and audio samples), and a short request is not stuck behind a long one."""

from __future__ import annotations

import base64
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np

MODEL = "tiny-qwen3-omni"
TIMEOUT_S = 120.0
# The vocoder decodes aligned windows whatever the timing, but batched with other requests' windows its conv
# kernels round differently (<= 2e-7 on the waveform), which can move a pcm16 sample by one step.
PCM16_TOLERANCE = 1
PROMPTS = [
    ("Tell me about the sea.", "ethan"),
    ("What is 2+2?", "aiden"),
    ("Count to ten.", "chelsie"),
    ("Describe a forest.", "ethan"),
    ("Why is the sky blue?", "aiden"),
    ("Explain gravity.", "chelsie"),
    ("Read me a poem.", "ethan"),
    ("Who are you?", "aiden"),
]


def _body(prompt: str, voice: str, *, talker_max: int, max_tokens: int = 10, stream: bool = False) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "modalities": ["text", "audio"],
        "audio": {"voice": voice, "format": "pcm16"},
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
        "stage_params": {"talker": {"max_tokens": talker_max}},
    }


def _complete(mesh, body: dict) -> tuple[str, np.ndarray]:
    r = httpx.post(f"{mesh.rest}/v1/chat/completions", json=body, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    return msg["content"], np.frombuffer(base64.b64decode(msg["audio"]["data"]), dtype="<i2")


def test_concurrent_requests_equal_each_request_alone(mesh):
    bodies = [_body(p, v, talker_max=60) for p, v in PROMPTS]
    alone = [_complete(mesh, b) for b in bodies]
    assert len({text for text, _ in alone}) > 1, "the prompts should give different answers"
    assert all(pcm.size > 0 for _, pcm in alone)

    barrier = threading.Barrier(len(bodies))

    def together(body: dict) -> tuple[str, np.ndarray]:
        barrier.wait(timeout=30)  # all eight in flight at once
        return _complete(mesh, body)

    with ThreadPoolExecutor(len(bodies)) as pool:
        concurrent = list(pool.map(together, bodies, timeout=TIMEOUT_S))

    for (prompt, voice), (text_a, pcm_a), (text_c, pcm_c) in zip(PROMPTS, alone, concurrent):
        assert text_c == text_a, f"{prompt!r}: text differs when run concurrently"
        assert pcm_c.shape == pcm_a.shape, f"{prompt!r} ({voice}): audio length differs when run concurrently"
        diff = np.abs(pcm_c.astype(np.int32) - pcm_a.astype(np.int32))
        assert diff.max(initial=0) <= PCM16_TOLERANCE, f"{prompt!r} ({voice}): audio differs by {diff.max()} LSB"


def test_short_request_is_not_stuck_behind_a_long_one(mesh):
    """A long streaming request (300 talker steps) is under way; a short one started after its first chunk
    must finish first (the stages interleave requests, they do not run them one after another)."""
    long_body = _body("Who are you?", "aiden", talker_max=300, stream=True)  # greedy: runs the full 300 steps
    short_body = _body("Hello there", "ethan", talker_max=10, max_tokens=4)
    first_chunk = threading.Event()
    result: dict = {}

    def long_request() -> None:
        audio_samples = 0
        try:
            with httpx.stream("POST", f"{mesh.rest}/v1/chat/completions", json=long_body, timeout=TIMEOUT_S) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    first_chunk.set()
                    if line == "data: [DONE]":
                        result["long_done"] = time.monotonic()
                        break
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    if event["choices"] and (event["choices"][0]["delta"].get("audio") or {}).get("data"):
                        audio_samples += len(base64.b64decode(event["choices"][0]["delta"]["audio"]["data"])) // 2
            result["long_audio_samples"] = audio_samples
        except BaseException as e:  # noqa: BLE001 (reported by the main thread)
            result["long_error"] = e
        finally:
            first_chunk.set()

    t = threading.Thread(target=long_request, daemon=True)
    t.start()
    assert first_chunk.wait(TIMEOUT_S), "the long request produced no chunk"
    started = time.monotonic()
    text, pcm = _complete(mesh, short_body)
    short_done = time.monotonic()
    t.join(TIMEOUT_S)
    assert not t.is_alive(), "the long request did not finish"
    assert "long_error" not in result, result.get("long_error")
    assert text and pcm.size > 0
    # 300 talker steps against at most 10: the long request really was much longer
    assert result["long_audio_samples"] > 10 * pcm.size, (result["long_audio_samples"], pcm.size)
    assert short_done < result["long_done"], (
        f"the short request ({short_done - started:.2f} s) finished after the long one "
        f"({result['long_done'] - started:.2f} s after the short one started)")
