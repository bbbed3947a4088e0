"""`omnimesh serve --load-format dummy` on a model folder that holds every file but the weights: each stage says it
reads no weights, the thinker's second tp rank (a process of its own) fills its shard with random values too,
and a chat request with speech comes back whole: as many text tokens as asked for (with `ignore_eos`), and the
waveform of whole codes (n codes decode to n * 1920 - 555 samples), up to the talker's max_tokens. The loader's side: tests/models/test_load_format.py."""

from __future__ import annotations

import base64
import io
import json
import shutil
import wave
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from mesh_harness import Mesh, start_mesh

from omnimesh.models.qwen3_omni.tiny import build_tiny_qwen3_omni

TOKENS, CODES = 6, 5
SAMPLES_PER_CODE, HELD_BACK = 1920, 555  # the tiny code2wav's upsampling; samples the last code leaves out


@pytest.fixture(scope="module")
def dummy_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    root = tmp_path_factory.mktemp("dummy")
    full = build_tiny_qwen3_omni(root / "full")
    bare = shutil.copytree(full, root / "bare", ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    m = start_mesh(Path(bare), "--load-format", "dummy", "--served-model-name", "tiny-dummy",
                   "--stage-overrides", json.dumps({"thinker": {"tp": 2}}))
    yield m
    assert m.proc.stop() == 0, m.proc.output()


def test_a_folder_without_weights_serves_text_and_speech(dummy_mesh: Mesh) -> None:
    out = dummy_mesh.proc.output()
    for stage in ("encoder", "thinker", "talker", "vocoder"):
        assert f"stage {stage}: --load-format dummy: no weight file is read" in out, stage
    body = {"model": "tiny-dummy", "messages": [{"role": "user", "content": "Tell me about the sea."}],
            "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "wav"},
            "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
            "stage_params": {"talker": {"max_tokens": CODES, "ignore_eos": True}}}
    r = httpx.post(f"{dummy_mesh.rest}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert r.json()["usage"]["completion_tokens"] == TOKENS and choice["finish_reason"] == "length"
    with wave.open(io.BytesIO(base64.b64decode(choice["message"]["audio"]["data"]))) as w:
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    codes, rest = divmod(len(pcm) + HELD_BACK, SAMPLES_PER_CODE)
    assert rest == 0 and 1 <= codes <= CODES, len(pcm)
