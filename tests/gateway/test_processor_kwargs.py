"""`--mm-processor-kwargs` (gateway/processor_kwargs.py): parsed with errors naming the flag; applied by
`load_processor`, an image is resized and patched exactly as transformers' image processor given the same
`max_pixels`, video frames take the same area bound, and the video sampling (what the gateway decodes and
the prompt's `video_second_per_grid`) follows `fps` / `max_frames`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen2VLImageProcessorPil

from gateway.events import ChatMessage, ChatRequest, ImagePart, TextPart, VideoPart
from gateway.processor_kwargs import parse_mm_processor_kwargs
from gateway.prompt import PromptBuilder
from omnimesh.models.qwen3_omni import tiny


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.build_tiny_qwen3_omni(Path(tmp_path_factory.mktemp("tiny")) / "qwen3-omni")


def ask(*parts: object) -> ChatRequest:
    return ChatRequest(request_id="r", model="m", messages=(ChatMessage("user", (*parts, TextPart("?"))),))  # type: ignore[arg-type]


def test_the_flag_is_parsed_and_checked() -> None:
    assert parse_mm_processor_kwargs(None) == {}
    assert parse_mm_processor_kwargs('{"max_pixels": 4096, "fps": 1, "max_frames": 8}') == {
        "max_pixels": 4096, "fps": 1.0, "max_frames": 8}
    for text, message in [('{"max_pixel": 1}', "unknown setting 'max_pixel'; settings: min_pixels, max_pixels"),
                          ('{"max_pixels": 1.5}', r"\['max_pixels'\]: 1.5 is not a whole number"),
                          ('{"fps": 0}', r"\['fps'\] must be positive, got 0"),
                          ('{"fps": 1e-300}', r"\['fps'\] must be at least 0.001 \(a frame every 1000 s\)"),
                          ('{"fps": Infinity}', r"\['fps'\]: inf is not a finite number"),
                          ('{"max_pixels": Infinity}', r"\['max_pixels'\]: inf is not a finite number"),
                          ('{"min_frames": NaN}', r"\['min_frames'\]: nan is not a finite number"),
                          ('{"min_pixels": 9000, "max_pixels": 4096}', "min_pixels 9000 is above max_pixels 4096"),
                          ("[]", "--mm-processor-kwargs must be a JSON object")]:
        with pytest.raises(ValueError, match=message):
            parse_mm_processor_kwargs(text)


def test_images_are_resized_as_transformers_would(folder: Path) -> None:
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (96, 128, 3), dtype=np.uint8))
    small = PromptBuilder(folder, max_model_len=512, processor_kwargs={"max_pixels": 4096})
    default = PromptBuilder(folder, max_model_len=512)
    got = small(ask(ImagePart(image)))
    want = Qwen2VLImageProcessorPil.from_pretrained(folder, local_files_only=True, max_pixels=4096)(
        images=[image], return_tensors="pt")
    assert torch.equal(got.image_grid_thw, want["image_grid_thw"])
    assert torch.equal(got.pixel_values, want["pixel_values"])
    _, h, w = got.image_grid_thw[0].tolist()
    assert h * w * 16 * 16 <= 4096  # 16-pixel patches: the resized image is within max_pixels
    assert got.input_ids.numel() < default(ask(ImagePart(image))).input_ids.numel()  # fewer vision tokens


def test_video_frames_and_sampling_follow_the_settings(folder: Path) -> None:
    builder = PromptBuilder(folder, max_model_len=4096, processor_kwargs={"max_pixels": 4096, "fps": 1.0,
                                                                          "max_frames": 4})
    video = builder.processor.video_processor
    assert (video.sampling.fps, video.sampling.max_frames) == (1.0, 4)
    assert video.sampling.count(40, 4.0) == 4  # 10 s at 1 fps, capped at 4 frames
    frames = np.zeros((4, 96, 128, 3), np.uint8)
    got = builder(ask(VideoPart(frames=frames, fps=1.0)))
    assert got.video_second_per_grid is not None and float(got.video_second_per_grid[0]) == 2.0  # tps / fps
    t, h, w = got.video_grid_thw[0].tolist()
    assert h * w * 16 * 16 <= 4096 and t == 2


def test_a_requests_own_settings_equal_the_servers(folder: Path) -> None:
    """mm_processor_kwargs per request: the same prompt as a server started with those settings; the few
    processors built for such settings are kept and reused."""
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (96, 128, 3), dtype=np.uint8))
    server = PromptBuilder(folder, max_model_len=512, processor_kwargs={"max_pixels": 4096})(ask(ImagePart(image)))
    builder = PromptBuilder(folder, max_model_len=512)
    own = ChatRequest(request_id="r", model="m", messages=ask(ImagePart(image)).messages,
                      processor_kwargs=(("max_pixels", 4096),))
    got = builder(own)
    assert torch.equal(got.input_ids, server.input_ids) and torch.equal(got.pixel_values, server.pixel_values)
    assert builder.processor_for(own) is builder.processor_for(own) is not builder.processor
    assert builder(ask(ImagePart(image))).input_ids.numel() > got.input_ids.numel()  # others keep the server's
    from gateway.events import PipelineError

    with pytest.raises(PipelineError, match="this server's processor takes no per-request settings") as e:
        PromptBuilder(builder.processor, max_model_len=512)(own)  # built from a processor, not a folder
    assert e.value.http_status == 400


def test_rest_mm_processor_kwargs_reach_the_prompt_and_the_sampling(rest_server, pipeline) -> None:  # type: ignore[no-untyped-def]
    import base64

    import httpx

    from omnimesh.models.qwen3_omni.video_sampling import VideoSampling
    from test_media_video import make_video

    url = "data:video/mp4;base64," + base64.b64encode(make_video(12, 4)).decode()  # 3 s at 4 fps
    body = {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}}]}],
            "mm_processor_kwargs": {"fps": 1, "min_frames": 2, "max_pixels": 4096}}
    r = httpx.post(f"{rest_server.base_url}/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 200, r.text
    req = pipeline.requests[-1]
    assert req.processor_kwargs == (("fps", 1.0), ("max_pixels", 4096), ("min_frames", 2))
    (video,) = req.messages[0].content
    assert video.fps == 1.0 and video.frames.shape[0] == VideoSampling(fps=1, min_frames=2).count(12, 4) == 2


def test_grpc_mm_processor_kwargs(grpc_server, pipeline) -> None:  # type: ignore[no-untyped-def]
    import grpc

    from omnimesh.v1 import omni_pb2, omni_pb2_grpc
    from test_media_video import make_video

    msg = omni_pb2.ChatMessage(role="user", content=[omni_pb2.ContentPart(video=make_video(12, 4))])
    with grpc.insecure_channel(grpc_server.target) as ch:
        stub = omni_pb2_grpc.OmniStub(ch)
        out = list(stub.Generate(omni_pb2.GenerateRequest(
            messages=[msg], modalities=["text"], mm_processor_kwargs={"fps": 1, "min_frames": 2, "max_pixels": 4096}),
            timeout=10))
        (bad,) = list(stub.Generate(omni_pb2.GenerateRequest(messages=[msg], mm_processor_kwargs={"max_pixels": 1.5}),
                                    timeout=10))
        (endless,) = list(stub.Generate(omni_pb2.GenerateRequest(  # was UNKNOWN: OverflowError from int(inf)
            messages=[msg], mm_processor_kwargs={"max_pixels": float("inf")}), timeout=10))
    assert out[-1].WhichOneof("kind") == "done", out
    req = pipeline.requests[-1]
    assert req.processor_kwargs == (("fps", 1.0), ("max_pixels", 4096), ("min_frames", 2))
    assert req.messages[0].content[0].frames.shape[0] == 2  # type: ignore[union-attr]
    assert bad.error.code == 3 and "mm_processor_kwargs['max_pixels']: 1.5 is not a whole number" in bad.error.message
    assert endless.error.code == 3 and "['max_pixels']: inf is not a finite number" in endless.error.message
