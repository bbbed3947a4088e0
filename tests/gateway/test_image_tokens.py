"""Images that alone reach max_model_len are refused from their headers, before their pixels are decoded
(gateway/prompt.py `ImageTokens`, used by REST chat / Responses / tokenize and the gRPC API): they would be
refused once the prompt is built anyway, after the decoding (32 flat 4096x4096 PNGs, 2.4 MB of body, took a
gateway to 4.2 GB and 17 s). The proof: the image that crosses the limit has a valid header and corrupt pixels,
and the answer is the token refusal naming it, not the corrupt-image one."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from gateway.events import PipelineError
from gateway.grpc_api import OmniServicer
from gateway.prompt import PromptBuilder
from gateway.rest import create_app
from gateway_harness import RestServer, ScriptedPipeline
from omnimesh.models.qwen3_omni.tiny import build_tiny_qwen3_omni
from omnimesh.v1 import omni_pb2


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> PromptBuilder:
    """The tiny model's processor (a 256x256 image is 64 tokens) under a max_model_len of 100."""
    folder = build_tiny_qwen3_omni(Path(tmp_path_factory.mktemp("tiny")) / "qwen3-omni")
    return PromptBuilder(folder, max_model_len=100)


def _png(size: int, cut: bool = False) -> bytes:
    out = io.BytesIO()
    noise = np.random.default_rng(0).integers(0, 256, (size, size, 3), np.uint8)
    Image.fromarray(noise).save(out, "PNG")
    data = out.getvalue()
    return data[:len(data) // 2] if cut else data  # cut: the header says 256x256, the pixels end halfway


def _blank_png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height)).save(out, "PNG")
    return out.getvalue()


def test_the_count_is_the_processors(small: PromptBuilder) -> None:
    tokens = small.image_tokens()
    assert tokens is not None
    for size in ((256, 256), (100, 40), (33, 250)):
        batch = small.processor.image_processor(images=[Image.new("RGB", size)], return_tensors="pt")
        assert tokens.count(*size) == int(batch["image_grid_thw"].prod()) // small.processor.image_processor.merge_size ** 2
    assert tokens.count(256, 256) == 64


def test_rest_refuses_the_image_that_crosses_max_model_len_before_decoding_it(small: PromptBuilder) -> None:
    def part(data: bytes) -> dict:
        return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}

    pipeline = ScriptedPipeline()
    with RestServer(create_app(pipeline, served_model_names=("tiny-omni",), prompts=small)) as server:
        def chat(*images: bytes) -> httpx.Response:
            return httpx.post(f"{server.base_url}/v1/chat/completions", timeout=30, json={
                "model": "tiny-omni", "messages": [{"role": "user", "content": [part(i) for i in images]}]})

        r = chat(_png(256), _png(256, cut=True))  # 64 + 64 tokens: over 100 at the second image's header
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "messages[0].content[1].image_url.url", r.text
        assert err["message"].startswith("the images alone are 128 tokens at this request's processor settings, "
                                         "but this model's maximum context length (max_model_len) is 100 tokens")
        assert not pipeline.requests
        r = chat(_blank_png(3000, 10))  # a shape the resize rule refuses: a 400 naming the image (was a 500)
        assert r.status_code == 400 and r.json()["error"]["message"] == (
            "messages[0].content[0].image_url.url: could not prepare the image for this model: absolute aspect ratio "
            "must be smaller than 200, got 300.0"), r.text
        r = chat(_png(256, cut=True))  # alone it fits: decoded, and refused as the corrupt file it is
        assert r.status_code == 400 and "could not decode the image" in r.json()["error"]["message"]
        assert chat(_png(256)).status_code == 200


async def test_grpc_refuses_it_the_same_way(small: PromptBuilder) -> None:
    pipeline = ScriptedPipeline()
    pipeline.prepare = small  # type: ignore[attr-defined]  # what StagePipeline calls its PromptBuilder
    msg = omni_pb2.ChatMessage(role="user", content=[omni_pb2.ContentPart(image=_png(256)),
                                                     omni_pb2.ContentPart(image=_png(256, cut=True))])
    with pytest.raises(PipelineError, match=r"^the images alone are 128 tokens") as e:
        await OmniServicer(pipeline).build(omni_pb2.GenerateRequest(messages=[msg], modalities=["text"]))
    assert e.value.param == "messages[0].content[1].image"


def test_a_realtime_conversation_counts_its_pictures(small: PromptBuilder) -> None:
    """A Realtime session keeps its pictures decoded for its life: a picture that would bring the conversation's
    to max_model_len is refused from its header (an error event naming it); the conversation stays as it was."""
    import json

    from websockets.sync.client import connect

    def create(conn, data: bytes) -> dict:  # type: ignore[no-untyped-def]
        conn.send(json.dumps({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64," + base64.b64encode(data).decode()}]}}))
        while (event := json.loads(conn.recv(timeout=30)))["type"] == "conversation.item.done":
            pass  # GA's second event for an item it added
        return event

    with RestServer(create_app(ScriptedPipeline(), served_model_names=("tiny-omni",), prompts=small)) as server, \
            connect(server.base_url.replace("http://", "ws://") + "/v1/realtime?model=tiny-omni",
                    open_timeout=30) as conn:
        assert json.loads(conn.recv(timeout=30))["type"] == "session.created"
        assert create(conn, _png(256))["type"] == "conversation.item.added"  # 64 tokens (GA's event name)
        error = create(conn, _png(256, cut=True))["error"]  # 128: refused before its (corrupt) pixels
        assert error["param"] == "item.content[0].image_url" and error["message"].startswith(
            "the images alone are 128 tokens"), error
        assert create(conn, _blank_png(32, 32))["type"] == "conversation.item.added"  # 65: still room


def _data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def test_the_header_size_reads_only_the_start() -> None:
    from gateway.media import HEADER_PEEK_BYTES, image_header_size

    big = _png(600)  # ~1 MB of noise: its size is read from the first HEADER_PEEK_BYTES
    assert len(big) > 4 * HEADER_PEEK_BYTES and image_header_size(big) == (600, 600)
    assert image_header_size(_data_uri(big)) == (600, 600)
    assert image_header_size(_data_uri(big)[:200]) == (600, 600)  # a cut payload still holds the header
    past_the_peek = len("data:image/png;base64,") + HEADER_PEEK_BYTES * 2
    assert image_header_size(_data_uri(big)[:past_the_peek] + "%%%%") == (600, 600)  # nothing decoded past it
    jpeg = io.BytesIO()
    Image.new("RGB", (320, 200)).save(jpeg, "JPEG", exif=Image.Exif())
    assert image_header_size(_data_uri(jpeg.getvalue(), "image/jpeg")) == (320, 200)
    for bad in (b"", b"not an image", "data:image/png,plain", "data:image/png;base64,%%%%", "https://x/a.png"):
        assert image_header_size(bad) is None


def test_rest_refuses_the_crossing_image_before_decoding_any_media(small: PromptBuilder) -> None:
    """The media ahead of the crossing image are not decoded first: a corrupt image and a corrupt clip before it
    were refused as corrupt (after decoding them); now the answer is the token refusal of the image that
    crosses. An image over the pixel limit ahead of them is still refused as that (413), as before."""
    from gateway.input_limits import InputLimits

    pipeline = ScriptedPipeline()
    limits = InputLimits(max_image_pixels=300 * 300)
    with RestServer(create_app(pipeline, served_model_names=("tiny-omni",), prompts=small, limits=limits)) as server:
        def chat(*parts: dict) -> httpx.Response:
            return httpx.post(f"{server.base_url}/v1/chat/completions", timeout=30, json={
                "model": "tiny-omni", "messages": [{"role": "user", "content": list(parts)}]})

        def image(data: bytes) -> dict:
            return {"type": "image_url", "image_url": {"url": _data_uri(data)}}

        clip = {"type": "input_audio", "input_audio": {"data": base64.b64encode(b"RIFF....WAVEjunk").decode(),
                                                       "format": "wav"}}
        r = chat(image(_png(256, cut=True)), clip, image(_png(256)))
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "messages[0].content[2].image_url.url", r.text
        assert err["message"].startswith("the images alone are 128 tokens")
        r = chat(image(_png(400)), image(_png(256)), image(_png(256)))  # over max_image_pixels first: as before
        assert r.status_code == 413 and r.json()["error"]["param"] == "messages[0].content[0].image_url.url", r.text
        assert not pipeline.requests


async def test_grpc_refuses_the_crossing_image_before_decoding_any(small: PromptBuilder) -> None:
    pipeline = ScriptedPipeline()
    pipeline.prepare = small  # type: ignore[attr-defined]
    msg = omni_pb2.ChatMessage(role="user", content=[omni_pb2.ContentPart(image=_png(256, cut=True)),
                                                     omni_pb2.ContentPart(image=_png(256))])
    with pytest.raises(PipelineError, match=r"^the images alone are 128 tokens") as e:
        await OmniServicer(pipeline).build(omni_pb2.GenerateRequest(messages=[msg], modalities=["text"]))
    assert e.value.param == "messages[0].content[1].image"
