"""The encoder cache (services/encoder/encoder_cache.py, --encoder-cache-memory) on the tiny model folder:
media sent again skip the towers and give bit-identical outputs; a step mixing known and new items runs
only the new ones (in one call per tower) and still gives each request what it gets alone (to the rounding
batching has), also when a request's known and new items interleave; an item twice in one step runs once; keys are the gateway's
digests when it sends them, else follow content, shape and dtype; least recently used entries go first past the capacity; the counters reach the stage's
Metrics RPC; the flag is checked, reaches the encoder stage and 0 turns the cache off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_encoder_batching import CountingTower, assert_same, audio, images, open_task, requests, solo, videos

from omnimesh.config.serve_args import ServeArgs
from omnimesh.engine.loop import EngineLoop
from omnimesh.engine.metrics import EngineMetrics
from omnimesh.launcher import MeshLauncher
from omnimesh.models.qwen3_omni.tiny import build_tiny_qwen3_omni
from omnimesh.transport.frames import StageChunk
from services.encoder.encoder_cache import EncoderCache, key
from services.encoder.handler import EncoderHandler, build_handler
from tests.stage_harness import served_stage


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen3_omni(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture
def handler(folder: Path, monkeypatch: pytest.MonkeyPatch) -> EncoderHandler:
    """A fresh handler (an empty cache) whose towers count their calls and items."""
    h = build_handler(folder, ServeArgs(encoder_cache_memory="64MiB"))
    monkeypatch.setattr(h.encoder, "audio_tower", CountingTower(h.encoder.audio_tower, "feature_lens"))
    monkeypatch.setattr(h.encoder, "visual", CountingTower(h.encoder.visual, "grid_thw"))
    return h


def calls(h: EncoderHandler) -> tuple[list[int], list[int]]:
    return h.encoder.audio_tower.calls, h.encoder.visual.calls  # type: ignore[union-attr]


def step(h: EncoderHandler, media: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
    results = h.batcher.step_batch([open_task(h, rid, t) for rid, t in media.items()])
    out = {}
    for rid, chunks in results.items():
        assert isinstance(chunks, list), (rid, chunks)
        out[rid] = chunks[0].tensors
    return out


def test_media_sent_again_skip_the_towers(handler: EncoderHandler) -> None:
    media = requests()
    alone = solo(handler, media)  # the solo path runs the towers itself, past the cache
    audio_calls, vision_calls = calls(handler)
    audio_calls.clear()
    vision_calls.clear()
    first = step(handler, media)
    assert len(audio_calls) == 1 and len(vision_calls) == 1
    again = step(handler, media)
    assert len(audio_calls) == 1 and len(vision_calls) == 1  # nothing new: no tower ran
    for rid in media:
        assert_same(first[rid], alone[rid], rid)
        assert_same(again[rid], alone[rid], rid)
    stats = handler.batcher.stats()
    n = stats["encoder_cache_queries"] // 2
    assert stats["encoder_cache_hits"] == n and 0 < stats["encoder_cache_usage_bytes"] <= 64 * 2**20
    assert len(handler.batcher.cache or ()) == n  # type: ignore[arg-type]


def test_known_and_new_items_mix_in_one_step(handler: EncoderHandler, folder: Path) -> None:
    g = torch.Generator().manual_seed(11)
    clip_a, clip_b = audio(g, [150], 150), audio(g, [90], 90)
    img_a, img_b, img_c = images(g, [[1, 4, 4]]), images(g, [[1, 6, 4]]), images(g, [[1, 4, 6]])
    vid = videos(g, [[2, 4, 4]])

    def together(*parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Several clips / images in one request, in the given order (clips padded to the longest)."""
        out: dict[str, torch.Tensor] = {}
        clips = [p for p in parts if "input_features" in p]
        if clips:
            t = max(c["input_features"].shape[-1] for c in clips)
            pad = torch.nn.functional.pad
            out["input_features"] = torch.cat([pad(c["input_features"], (0, t - c["input_features"].shape[-1]))
                                               for c in clips])
            out["feature_attention_mask"] = torch.cat([pad(c["feature_attention_mask"],
                                                           (0, t - c["feature_attention_mask"].shape[-1]))
                                                       for c in clips])
        pics = [p for p in parts if "pixel_values" in p]
        if pics:
            out["pixel_values"] = torch.cat([p["pixel_values"] for p in pics])
            out["image_grid_thw"] = torch.cat([p["image_grid_thw"] for p in pics])
        for p in parts:
            if "pixel_values_videos" in p:
                out.update(p)
        return out

    step(handler, {"warm": together(clip_a, img_b)})  # clip_a and img_b are known from here on
    audio_calls, vision_calls = calls(handler)
    audio_calls.clear()
    vision_calls.clear()
    media = {"mixed": together(clip_b, clip_a, img_a, img_b, img_c, vid),  # known items between new ones
             "twin": together(img_a),  # the same new image as "mixed": computed once in this step
             "known": together(clip_a, img_b)}
    got = step(handler, media)
    assert audio_calls == [1] and vision_calls == [3]  # clip_b; img_a (once), img_c and the video
    fresh = build_handler(folder, ServeArgs(encoder_cache_memory="0"))
    for rid, t in media.items():  # a known item's rows came from another batch: its rounding, as batching has
        (want,) = solo(fresh, {rid: t}).values()
        assert sorted(got[rid]) == sorted(want), rid
        for name in want:
            torch.testing.assert_close(got[rid][name], want[name], atol=1e-5, rtol=0, msg=lambda m: f"{rid} {name}: {m}")


def test_the_gateways_digests_are_the_keys(handler: EncoderHandler) -> None:
    """With the gateway's `image_hashes` the stage keys by them (it does not hash the patches again): the
    same digest is a hit, another digest for the same pixels a miss; a digest count off is the request's
    error."""
    g = torch.Generator().manual_seed(5)
    media = images(g, [[1, 4, 4], [1, 6, 4]])
    step(handler, {"a": {**media, "image_hashes": torch.tensor([11, 12])}})
    _, vision_calls = calls(handler)
    vision_calls.clear()
    step(handler, {"b": {**media, "image_hashes": torch.tensor([11, 12])}})
    assert vision_calls == []
    step(handler, {"c": {**media, "image_hashes": torch.tensor([11, 13])}})
    assert vision_calls == [1]  # the second picture under a new name
    results = handler.batcher.step_batch([open_task(handler, "d", {**media, "image_hashes": torch.tensor([11])})])
    assert isinstance(results["d"], ValueError) and "image_hashes must hold one digest per image (2)" in str(results["d"])


def test_keys_follow_content_shape_and_dtype() -> None:
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    g = torch.tensor([[1, 3, 4]])
    assert key("image", x, g) == key("image", x.clone(), g.clone())
    assert key("image", x, g) != key("video", x, g)
    assert key("image", x, g) != key("image", x.reshape(4, 3), g)
    assert key("image", x, g) != key("image", x.double(), g)
    y = x.clone()
    y[2, 3] += 1e-6
    assert key("image", x, g) != key("image", y, g)
    assert key("image", x.t().contiguous().t(), g) == key("image", x, g)  # the same values, another layout


def test_least_recently_used_out_past_the_capacity() -> None:
    row = (torch.zeros(16, 16),)  # 1 KiB
    cache = EncoderCache(3 * 1024)
    for k in (b"a", b"b", b"c"):
        cache.put(k, row)
    assert cache.get(b"a") is not None  # "a" is now the most recently used
    cache.put(b"d", row)
    assert cache.get(b"b") is None and cache.get(b"a") is not None and len(cache) == 3
    cache.put(b"huge", (torch.zeros(64, 64),))  # larger than the whole cache: not kept, nothing dropped
    assert cache.get(b"huge") is None and len(cache) == 3
    assert cache.stats() == {"encoder_cache_queries": 4, "encoder_cache_hits": 2, "encoder_cache_usage_bytes": 3072}
    base = torch.ones(100, 16)
    cache.put(b"view", (base[:16],))  # an entry owns its rows: not a view into the batch's output
    stored = cache.get(b"view")
    assert stored is not None and stored[0].untyped_storage().nbytes() == 1024
    with pytest.raises(ValueError, match="positive capacity"):
        EncoderCache(0)


async def test_counters_reach_the_stage_metrics(handler: EncoderHandler) -> None:
    media = {k: v for k, v in requests().items() if k in ("both", "two-images")}
    metrics = EngineMetrics("encoder")
    engine = EngineLoop("encoder", batcher=handler.batcher, metrics=metrics)
    async with served_stage(handler, engine, metrics=metrics) as served:
        for round_ in range(2):
            for rid, t in media.items():
                s = await served.client.open(f"{rid}-{round_}")
                await s.send(StageChunk(tensors=t, final=True))
                assert [c async for c in s][0].final
        text = await served.client.metrics()
    # 4 items a round (a clip and an image; two images), the second round's all known
    assert 'omnimesh:encoder_cache_queries_total{stage="encoder"} 8.0' in text
    assert 'omnimesh:encoder_cache_hits_total{stage="encoder"} 4.0' in text
    assert "omnimesh:encoder_cache_usage_bytes" in text


def test_the_flag(folder: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--encoder-cache-memory"):
        ServeArgs(encoder_cache_memory="lots")
    assert build_handler(folder, ServeArgs(encoder_cache_memory="0")).batcher.cache is None
    assert build_handler(folder, ServeArgs()).batcher.cache.capacity == 512 * 2**20  # type: ignore[union-attr]
    launcher = MeshLauncher(ServeArgs(encoder_cache_memory="1GiB"), tmp_path)
    argv = launcher._stage_argv("encoder", 1)
    assert argv[argv.index("--encoder-cache-memory") + 1] == "1GiB"
    assert "--encoder-cache-memory" not in launcher._stage_argv("thinker", 2)
