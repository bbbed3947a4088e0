"""The stages' periodic load line in the shared mesh's log (`omnimesh serve`, default 10 s interval): after
audio requests the thinker and talker report generation throughput and KV-cache usage, the vocoder its
throughput without a KV cache, in vLLM's words."""

from __future__ import annotations

import httpx

BODY = {"model": "tiny-qwen3-omni", "messages": [{"role": "user", "content": "Sing to me."}],
        "modalities": ["text", "audio"], "max_tokens": 8, "temperature": 0}
RATE = r"Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: [1-9][\d.]* tokens/s"


def test_stages_log_their_load(mesh) -> None:
    for _ in range(2):
        r = httpx.post(f"{mesh.rest}/v1/chat/completions", json=BODY, timeout=120)
        assert r.status_code == 200, r.text
    for stage in ("thinker", "talker"):
        mesh.proc.wait_for_line(rf"stat_logger: {stage}: {RATE}, Running: \d+ reqs, Waiting: \d+ reqs, "
                                rf"KV cache usage: [\d.]+%, Finished: [1-9]\d* reqs", timeout_s=30)
    line = mesh.proc.wait_for_line(rf"stat_logger: vocoder: {RATE}, Running: \d+ reqs", timeout_s=30)
    assert "KV cache" not in line.string
