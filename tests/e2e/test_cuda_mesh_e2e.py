"""The Qwen3-Omni mesh on a GPU (gpu-marked: the prepared GPU run, `scripts/gpu_check.sh`).

`omnimesh serve --device cuda` with the default layout: all four stages on GPU 0, the thinker and talker
sizing their KV caches from their shares of --gpu-memory-utilization (per instance), the ranks' layers and
code2wav's conv stack on the GPU. Three spoken requests at once each come back with text and audio (bf16: no
parity with the float32 reference), a sampled spoken request too (the code predictor draws from CUDA logits),
and every stage says it runs on CUDA. The encoder cache works on a CUDA encoder: a picture asked about again is a
hit, gives the same greedy answer, and the cache's usage gauge counts its bytes (the ranks hand their outputs
back to the stage's host memory, which is where the cache keeps them and what the edges carry).
"""

from __future__ import annotations

import base64
import io
import re
import wave
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from mesh_harness import start_mesh
from reference import png_bytes
from test_encoder_cache_e2e import _ask, _counts, _image

from omnimesh.v1 import stage_pb2, stage_pb2_grpc

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_the_default_mesh_speaks_on_one_gpu(tiny_model_dir: Path) -> None:
    m = start_mesh(tiny_model_dir, "--device", "cuda")
    try:
        for stage, address in m.stages.items():
            with grpc.insecure_channel(address) as ch:
                assert stage_pb2_grpc.StageStub(ch).Info(stage_pb2.InfoRequest(), timeout=30).device == "cuda", stage
        body = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 8, "temperature": 0,
                "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "wav"}}
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda _: httpx.post(f"{m.rest}/v1/chat/completions", json=body, timeout=180),
                                    range(3)))
        for got in answers:
            assert got.status_code == 200, got.text
            message = got.json()["choices"][0]["message"]
            with wave.open(io.BytesIO(base64.b64decode(message["audio"]["data"]))) as w:
                assert w.getframerate() == 24000 and w.getnframes() > 0
            assert message["content"]
        sampled = {**body, "temperature": 0.9, "top_p": 0.95, "seed": 11}  # the talker samples too (its defaults)
        got = httpx.post(f"{m.rest}/v1/chat/completions", json=sampled, timeout=180)
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["message"]["audio"]["data"]
        picture = [{"role": "user", "content": [_image(png_bytes(48, seed=903)), {"type": "text", "text": "What?"}]}]
        q0, h0 = _counts(m)
        answer = _ask(m, picture)
        assert _ask(m, picture) == answer
        q1, h1 = _counts(m)
        assert (q1 - q0, h1 - h0) == (2, 1)
        usage = httpx.get(f"{m.rest}/metrics", timeout=30).text
        assert re.search(r'^omnimesh:encoder_cache_usage_bytes\{[^}]*stage="encoder"[^}]*\} [1-9]', usage, re.M)
    finally:
        assert m.proc.stop() == 0, m.proc.output()
