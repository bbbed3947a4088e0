"""A request's audio in all (max_audio_seconds, every clip and soundtrack together) is checked as each part is
decoded (gateway/media.py `AudioTotal`): the parts after the one that crosses the limit are never decoded. The
proof: a corrupt clip after the crossing one; checked only once all were decoded, the answer was that clip's 400."""

from __future__ import annotations

import base64
import io
import wave

import httpx
import numpy as np
import pytest

from gateway.events import PipelineError
from gateway.grpc_api import OmniServicer
from gateway.input_limits import InputLimits
from gateway.rest import create_app
from gateway_harness import RestServer, ScriptedPipeline
from omnimesh.v1 import omni_pb2

LIMITS = InputLimits(max_audio_seconds=1.0)
CORRUPT = b"RIFF\x24\x00\x00\x00WAVEjunk"


def _wav(seconds: float) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16_000)
        w.writeframes((np.sin(np.arange(int(16_000 * seconds)) / 5) * 8000).astype("<i2").tobytes())
    return out.getvalue()


def test_rest_refuses_at_the_clip_that_crosses_the_limit() -> None:
    def clip(data: bytes) -> dict:
        return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}}

    pipeline = ScriptedPipeline()
    with RestServer(create_app(pipeline, served_model_names=("tiny-omni",), limits=LIMITS)) as server:
        def chat(*parts: dict) -> httpx.Response:
            return httpx.post(f"{server.base_url}/v1/chat/completions", timeout=30, json={
                "model": "tiny-omni", "messages": [{"role": "user", "content": list(parts)}]})

        r = chat(clip(_wav(0.6)), clip(_wav(0.6)), clip(CORRUPT))
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert (err["message"], err["param"]) == ("request has 1.2 s of audio in all; the limit is 1 s", "messages")
        assert not pipeline.requests  # refused before anything ran
        assert chat(clip(_wav(0.5)), clip(_wav(0.5))).status_code == 200  # 1 s in all: at the limit, served
        assert len(pipeline.requests) == 1


async def test_grpc_refuses_it_the_same_way() -> None:
    pipeline = ScriptedPipeline()
    servicer = OmniServicer(pipeline, limits=LIMITS)
    msg = omni_pb2.ChatMessage(role="user", content=[omni_pb2.ContentPart(audio_wav=_wav(0.6)),
                                                     omni_pb2.ContentPart(audio_wav=_wav(0.6)),
                                                     omni_pb2.ContentPart(audio_wav=CORRUPT)])
    with pytest.raises(PipelineError, match=r"^request has 1\.2 s of audio in all; the limit is 1 s$") as e:
        await servicer.build(omni_pb2.GenerateRequest(messages=[msg], modalities=["text"]))
    assert e.value.http_status == 413 and e.value.param == "messages"
