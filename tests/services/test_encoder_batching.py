"""The encoder stage's continuous batching on the tiny model folder: a batch of requests with different
audio lengths, image sizes and videos (audio-only, image-only, video-only, mixed) gives every request what
it gets alone, in ONE audio-tower call and ONE vision-tower call (images and videos together); a request with bad media fails alone; and the same through
a real gRPC stage server on 127.0.0.1 (EngineLoop + StageServicer + the handler's batcher)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import grpc
import pytest
import torch

from omnimesh.config.serve_args import ServeArgs
from omnimesh.engine.loop import EngineLoop
from omnimesh.models.qwen3_omni.tiny import build_tiny_qwen3_omni
from omnimesh.transport.frames import StageChunk
from omnimesh.transport.stage_client import StageCallError
from omnimesh.v1 import stage_pb2
from tests.stage_harness import served_stage
from services.encoder.handler import EncoderHandler, build_handler

N_MEL, PATCH_DIM = 128, 3 * 2 * 16 * 16  # the tiny model's num_mel_bins and C * temporal_patch * patch^2


@pytest.fixture(scope="module")
def handler(tmp_path_factory: pytest.TempPathFactory) -> EncoderHandler:
    # the encoder cache off: every step here must run the towers (tests/services/test_encoder_cache.py has it on)
    return build_handler(build_tiny_qwen3_omni(tmp_path_factory.mktemp("tiny") / "m"), ServeArgs(encoder_cache_memory="0"))


def audio(gen: torch.Generator, valid: list[int], padded: int) -> dict[str, torch.Tensor]:
    """Clips of `valid` real frames each, padded with noise to `padded` frames (mask 0 there)."""
    mask = (torch.arange(padded) < torch.tensor(valid)[:, None]).long()  # (B, T)
    return {"input_features": torch.randn(len(valid), N_MEL, padded, generator=gen), "feature_attention_mask": mask}


def images(gen: torch.Generator, grids: list[list[int]]) -> dict[str, torch.Tensor]:
    grid = torch.tensor(grids)
    return {"pixel_values": torch.randn(int(grid.prod(-1).sum()), PATCH_DIM, generator=gen), "image_grid_thw": grid}


def videos(gen: torch.Generator, grids: list[list[int]]) -> dict[str, torch.Tensor]:
    grid = torch.tensor(grids)
    return {"pixel_values_videos": torch.randn(int(grid.prod(-1).sum()), PATCH_DIM, generator=gen),
            "video_grid_thw": grid}


def requests() -> dict[str, dict[str, torch.Tensor]]:
    """Audio-only, image-only, video-only and mixed; short clips (under one 100-frame chunk), long ones
    (several attention windows of 104 tokens), several clips / images / videos per request, a 2-frame image
    grid, videos of 2 and 3 temporal patches."""
    g = torch.Generator().manual_seed(7)
    return {
        "both": {**audio(g, [300], 320), **images(g, [[1, 4, 4]])},
        "two-clips": audio(g, [150, 57], 160),
        "short-clip": audio(g, [80], 80),
        "long-clip": audio(g, [900], 1000),
        "two-images": images(g, [[1, 4, 4], [1, 6, 4]]),
        "video+clip": {**audio(g, [230], 230), **images(g, [[2, 4, 6]])},
        "big-image": images(g, [[1, 8, 10]]),
        "video": videos(g, [[3, 4, 4]]),
        "image+videos+clip": {**audio(g, [120], 130), **images(g, [[1, 4, 6]]), **videos(g, [[2, 4, 4], [2, 6, 4]])},
    }


def media_counts(media: dict[str, dict[str, torch.Tensor]]) -> tuple[int, int]:
    """(audio clips, images + videos) over all requests."""
    n_audios = sum(t["feature_attention_mask"].shape[0] for t in media.values() if "input_features" in t)
    n_visual = sum(t[grid].shape[0] for t in media.values() for grid in ("image_grid_thw", "video_grid_thw")
                   if grid in t)
    return n_audios, n_visual


BAD = {  # per request: media the towers would refuse, and the message it fails with
    "rows-off": ({"pixel_values": torch.randn(15, PATCH_DIM), "image_grid_thw": torch.tensor([[1, 4, 4]])},
                 "pixel_values must be"),
    "odd-grid": ({"pixel_values": torch.randn(12, PATCH_DIM), "image_grid_thw": torch.tensor([[1, 3, 4]])},
                 "divide by spatial_merge_size"),
    "video-rows-off": ({"pixel_values_videos": torch.randn(31, PATCH_DIM), "video_grid_thw": torch.tensor([[2, 4, 4]])},
                       "pixel_values_videos must be"),
    "mask-off": ({"input_features": torch.randn(1, N_MEL, 100), "feature_attention_mask": torch.ones(1, 90)},
                 "feature_attention_mask must be"),
    "no-frames": ({"input_features": torch.randn(2, N_MEL, 50),
                   "feature_attention_mask": torch.tensor([[1] * 50, [0] * 50])}, "at least one valid frame"),
    "wrong-mel": ({"input_features": torch.randn(1, 80, 100), "feature_attention_mask": torch.ones(1, 100)},
                  "n_mel=128"),
}


class CountingTower:
    """Wraps a tower: counts calls and the items (audios / images) in each; everything else passes through.
    Each call first waits for `gate` (set: no wait)."""

    def __init__(self, inner: Any, items_arg: str):
        self.inner, self.items_arg = inner, items_arg
        self.calls: list[int] = []
        self.gate = threading.Event()
        self.gate.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(len(kwargs[self.items_arg]))
        assert self.gate.wait(timeout=60)
        return self.inner(*args, **kwargs)


@pytest.fixture
def counted(handler: EncoderHandler, monkeypatch: pytest.MonkeyPatch) -> tuple[CountingTower, CountingTower]:
    audio_tower = CountingTower(handler.encoder.audio_tower, "feature_lens")
    vision_tower = CountingTower(handler.encoder.visual, "grid_thw")
    monkeypatch.setattr(handler.encoder, "audio_tower", audio_tower)
    monkeypatch.setattr(handler.encoder, "visual", vision_tower)
    return audio_tower, vision_tower


def open_task(handler: EncoderHandler, rid: str, tensors: dict[str, torch.Tensor]) -> Any:
    task = handler.open(stage_pb2.Open(request_id=rid))
    task.feed(StageChunk(tensors=tensors, final=True))
    return task


def solo(handler: EncoderHandler, media: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for rid, tensors in media.items():
        task = open_task(handler, rid, tensors)
        (chunk,) = task.step()
        assert task.finished
        out[rid] = chunk.tensors
    return out


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rid: str) -> None:
    assert sorted(got) == sorted(want), rid
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=0, msg=lambda m: f"{rid} {name}: {m}")
        assert torch.equal(got[name], want[name]), f"{rid} {name}: close but not bit-identical"


def test_solo_step_matches_the_towers_called_directly(handler: EncoderHandler) -> None:
    media = requests()
    alone = solo(handler, media)
    enc = handler.encoder
    for rid, t in media.items():
        if "input_features" in t:
            torch.testing.assert_close(alone[rid]["audio_embeds"],
                                       enc.encode_audio(t["input_features"], t["feature_attention_mask"]),
                                       atol=0, rtol=0)
            assert alone[rid]["audio_feature_lengths"].tolist() == t["feature_attention_mask"].sum(-1).tolist()
            n = int(enc.audio_output_lengths(t["feature_attention_mask"].sum(-1)).sum())
            assert alone[rid]["audio_embeds"].shape == (n, 64)
        if "pixel_values" in t:
            image, deep = enc.encode_image(t["pixel_values"], t["image_grid_thw"])
            torch.testing.assert_close(alone[rid]["image_embeds"], image, atol=0, rtol=0)
            torch.testing.assert_close(alone[rid]["deepstack_embeds"], torch.stack(deep), atol=0, rtol=0)
            assert image.shape[0] == int(t["image_grid_thw"].prod(-1).sum()) // 4
        if "pixel_values_videos" in t:
            video, deep = enc.encode_image(t["pixel_values_videos"], t["video_grid_thw"])
            torch.testing.assert_close(alone[rid]["video_embeds"], video, atol=0, rtol=0)
            torch.testing.assert_close(alone[rid]["video_deepstack_embeds"], torch.stack(deep), atol=0, rtol=0)
            assert video.shape[0] == int(t["video_grid_thw"].prod(-1).sum()) // 4


def test_a_batch_equals_each_request_alone_in_one_call_per_tower(handler: EncoderHandler, counted) -> None:
    media = requests()
    alone = solo(handler, media)
    audio_tower, vision_tower = counted
    audio_tower.calls.clear()
    vision_tower.calls.clear()
    tasks = [open_task(handler, rid, t) for rid, t in media.items()]
    results = handler.batcher.step_batch(tasks)
    n_audios, n_visual = media_counts(media)
    assert audio_tower.calls == [n_audios] and vision_tower.calls == [n_visual]  # ONE call each, all items
    assert sorted(results) == sorted(media)
    for task in tasks:
        chunks = results[task.request_id]
        assert isinstance(chunks, list) and len(chunks) == 1 and task.finished
        assert_same(chunks[0].tensors, alone[task.request_id], task.request_id)


def test_bad_requests_fail_alone(handler: EncoderHandler, counted) -> None:
    media = requests()
    alone = solo(handler, media)
    audio_tower, vision_tower = counted
    audio_tower.calls.clear()
    vision_tower.calls.clear()
    order = ["rows-off", "both", "no-frames", "short-clip", "mask-off", "two-images", "odd-grid", "wrong-mel"]
    mixed = {rid: BAD[rid][0] if rid in BAD else media[rid] for rid in order}
    tasks = [open_task(handler, rid, t) for rid, t in mixed.items()]
    results = handler.batcher.step_batch(tasks)
    assert len(audio_tower.calls) == 1 and len(vision_tower.calls) == 1
    for task in tasks:
        rid, result = task.request_id, results[task.request_id]
        if rid in BAD:
            assert isinstance(result, ValueError) and BAD[rid][1] in str(result), (rid, result)
            assert not task.finished
        else:
            assert isinstance(result, list) and task.finished
            assert_same(result[0].tensors, alone[rid], rid)
    # a batch whose every request is bad calls no tower at all
    only_bad = handler.batcher.step_batch([open_task(handler, rid, t) for rid, (t, _) in BAD.items()])
    assert all(isinstance(r, ValueError) for r in only_bad.values()) and len(only_bad) == len(BAD)
    assert len(audio_tower.calls) == 1 and len(vision_tower.calls) == 1


async def collect(stream: Any) -> list[StageChunk]:
    return [c async for c in stream]


async def test_batched_through_a_grpc_stage_server(handler: EncoderHandler, counted) -> None:
    media = requests()
    alone = solo(handler, media)
    audio_tower, vision_tower = counted
    audio_tower.calls.clear()
    vision_tower.calls.clear()
    audio_tower.gate.clear()  # a step that starts before every request is in waits in the audio tower
    engine = EngineLoop("encoder", batcher=handler.batcher)
    async with served_stage(handler, engine) as served:
        try:
            client = served.client
            rids = [*media, "rows-off"]
            streams = [await client.open(rid) for rid in rids]
            for rid, s in zip(rids, streams):
                await s.send(StageChunk(tensors=media[rid] if rid in media else BAD[rid][0], final=True))
            await asyncio.sleep(0.2)  # the last inputs reach the engine
            audio_tower.gate.set()
            results = await asyncio.gather(*(collect(s) for s in streams), return_exceptions=True)
            bad = results[-1]
            assert isinstance(bad, StageCallError) and bad.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "pixel_values must be" in bad.message
            for rid, chunks in zip(rids[:-1], results[:-1]):
                assert isinstance(chunks, list) and len(chunks) == 1 and chunks[0].final, rid
                assert_same(chunks[0].tensors, alone[rid], rid)
            # at most the first request stepped alone; every other one shared the next step's tower calls
            assert len(audio_tower.calls) <= 2 and len(vision_tower.calls) <= 2, (audio_tower.calls, vision_tower.calls)
            assert sum(audio_tower.calls) == media_counts(media)[0] and sum(vision_tower.calls) == media_counts(media)[1]
            assert engine.num_requests == 0
        finally:
            audio_tower.gate.set()  # before the engine stops: a step waiting in the tower ends
