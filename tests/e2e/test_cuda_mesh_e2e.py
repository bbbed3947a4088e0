"""The Qwen3-Omni mesh on a GPU (gpu-marked: the prepared GPU run, `scripts/gpu_check.sh`).

`omnimesh serve --device cuda` with the default layout: all four stages on GPU 0, the thinker and talker
sizing their KV caches from their shares of --gpu-memory-utilization (per instance), the ranks' layers and
code2wav's conv stack on the GPU. Three spoken requests at once each come back with text and audio (bf16: no
parity with the float32 reference), and every stage says it runs on CUDA.
"""

from __future__ import annotations

import base64
import io
import wave
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from mesh_harness import start_mesh

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
    finally:
        assert m.proc.stop() == 0, m.proc.output()
