"""Prefix caching in the thinker (`--enable-prefix-caching`): BlockAllocator's cache, LMScheduler taking cached
blocks, and LMEngine skipping their rows, in-process on the tiny model folder. What it proves:

- a prompt that starts with the blocks an earlier prompt computed runs only its remaining rows (the LMBatch
  has just those), its usage counts the cached tokens, and its tokens and logits equal its run on a stage
  without the cache; at least one row is always computed (a repeated prompt still yields its logits);
- without the gateway's media digests the cache stops at a prompt's first media row (the rows after it depend
  on the media), yet a media prompt's tokens stay exact; with them the same clip is served from the cache
  past its rows and another clip only up to it; a speech-out request gets the media rows' hidden states its
  talker reads from the cached blocks, equal to computing them, also when preempted, never from blocks that
  did not keep them (a text-out request's, or one whose captured rows did not come back);
- 16 concurrent requests sharing a prefix share its blocks (reference counts) while they run, every one
  equals its solo run, and every block is free again at the end (cached blocks count as free);
- a preemption with cached blocks keeps tokens exact; eviction reuses the least recently freed cached block,
  a request's last blocks before its first ones; a request that cannot start gives its matched blocks back;
- new tokens take a free block that holds no cached prefix before any cached one, the most recently freed
  first: 1,000 requests one after another use no more blocks in all than one of them holds (at e1042a7 they
  walked the whole pool, its pages resident one new block at a time);
- the stage reports prefix_cache_queries / prefix_cache_hits (tokens), as vLLM does; off by default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

from omnimesh.config.serve_args import ServeArgs
from omnimesh.engine.kv_blocks import BlockAllocator, prefix_hashes
from omnimesh.engine.lm_scheduler import LMScheduler
from omnimesh.transport.frames import StageChunk
from omnimesh.v1 import stage_pb2
from services.llm.talker_handler import build_handler as talker_handler
from services.llm.thinker_handler import build_handler as thinker_handler
from tests.services.test_lm_batching import (Driver, Recorder, assert_drained, assert_same_run, block_bytes,
                                             open_thinker, prompts, record_batches, solo, token_ids)

BLOCK = 4


def caching_thinker(model_dir: Path, **kw: Any) -> Any:
    args = dict(max_model_len=128, kv_cache_memory="1MiB", block_size=BLOCK, stream_interval=1,
                enable_prefix_caching=True)
    return thinker_handler(model_dir, ServeArgs(**{**args, **kw}))


@pytest.fixture(scope="module")
def plain(model_dir: Path) -> Any:
    """The same stage without the cache: every prompt computed whole (the reference)."""
    return thinker_handler(model_dir, ServeArgs(max_model_len=128, kv_cache_memory="1MiB", block_size=BLOCK,
                                                stream_interval=1))


def run_one(handler: Any, rid: str, ids: torch.Tensor, max_tokens: int = 8) -> tuple[Any, list[int], Any]:
    """-> (the finished task, its tokens, the Recorder of its logits); the task's blocks are freed."""
    rec = Recorder(handler.batcher.engine)
    try:
        d = Driver(handler)
        task = open_thinker(handler, rid, ids, max_tokens)
        d.add(task)
        return task, token_ids(d.run()[rid]), rec
    finally:
        rec.stop()


def test_a_shared_prefix_is_computed_once_and_tokens_stay_exact(model_dir: Path, plain: Any) -> None:
    handler = caching_thinker(model_dir)
    engine = handler.batcher.engine
    assert plain.batcher.engine.allocator.prefix_caching is False  # off unless asked for
    head, tail_a, tail_b = prompts([22, 5, 9], seed=11)
    a, b = torch.cat([head, tail_a]), torch.cat([head, tail_b])  # 27 and 31 tokens, 22 shared

    batches = record_batches(engine)
    first, _, _ = run_one(handler, "a", a)
    assert first.cached_tokens == 0 and batches[0].layout.num_tokens == 27
    batches.clear()
    second, got, rec = run_one(handler, "b", b)
    # 5 whole blocks of the shared 22 tokens (20 tokens) came from the cache: 11 rows ran in the prefill
    assert second.cached_tokens == 20 and batches[0].layout.num_tokens == 11
    assert batches[0].layout.prefills[0].past == 20  # attending to the 20 cached keys
    assert_same_run((got, rec.stacked("b")), solo(plain, b, 8), "after a cache hit")
    stats = handler.batcher.stats()
    assert stats["prefix_cache_queries"] == 27 + 31 and stats["prefix_cache_hits"] == 20

    batches.clear()
    again, got, rec = run_one(handler, "a2", a)  # the whole prompt is cached: its last row still runs
    assert again.cached_tokens == 24 and batches[0].layout.num_tokens == 3
    assert_same_run((got, rec.stacked("a2")), solo(plain, a, 8), "a repeated prompt")
    assert_drained(engine, engine.allocator.num_blocks)  # cached blocks count as free
    assert engine.allocator.num_cached >= 6


def test_the_cache_stops_at_the_first_media_row(model_dir: Path, plain: Any) -> None:
    handler = caching_thinker(model_dir)
    engine = handler.batcher.engine
    pad = AutoTokenizer.from_pretrained(model_dir).convert_tokens_to_ids("<|audio_pad|>")
    frames = torch.tensor([100])
    n_audio = int(_get_feat_extract_output_lengths(frames)[0])
    head, tail = prompts([10, 6], seed=12)
    ids = torch.cat([head, torch.full((n_audio,), pad), tail])
    hidden = handler.thinker.config.get_text_config().hidden_size
    audio = torch.randn(n_audio, hidden, generator=torch.Generator().manual_seed(0))

    def media_task(h: Any, rid: str) -> Any:
        task = h.open(stage_pb2.Open(request_id=rid, sampling=stage_pb2.SamplingParams(temperature=0, max_tokens=6)))
        task.feed(StageChunk(tensors={"input_ids": ids, "audio_embeds": audio, "audio_feature_lengths": frames},
                             final=True))
        return task

    def run(h: Any, rid: str) -> tuple[Any, list[int], torch.Tensor]:
        rec = Recorder(h.batcher.engine)
        d = Driver(h)
        task = media_task(h, rid)
        d.add(task)
        try:
            return task, token_ids(d.run()[rid]), rec.stacked(rid)
        finally:
            rec.stop()

    want = run(plain, "solo")
    first = run(handler, "m1")
    second = run(handler, "m2")  # the same prompt, the same audio: still only the text before it is cached
    assert first[0].cached_tokens == 0 and second[0].cached_tokens == 8  # the 2 whole blocks of the 10-token head
    for got in (first, second):
        assert_same_run(got[1:], want[1:], "media prompt")
    assert engine.allocator.num_cached == 2


class AudioPrompt:
    """A prompt with one audio clip between text (as the encoder stage would feed the thinker): its ids, the
    clip's frames, and clips of random rows by seed."""

    def __init__(self, model_dir: Path, handler: Any, lengths: tuple[int, ...] = (10, 14, 3), seed: int = 21):
        pad = AutoTokenizer.from_pretrained(model_dir).convert_tokens_to_ids("<|audio_pad|>")
        self.frames = torch.tensor([100])
        self.n_audio = int(_get_feat_extract_output_lengths(self.frames)[0])
        head, *rest = prompts(list(lengths), seed=seed)
        self.ids = torch.cat([head, torch.full((self.n_audio,), pad), *rest])
        self.hidden = handler.thinker.config.get_text_config().hidden_size

    def clip(self, seed: int) -> torch.Tensor:
        return torch.randn(self.n_audio, self.hidden, generator=torch.Generator().manual_seed(seed))

    def open(self, h: Any, rid: str, clip: int, digest: int | None, ids: torch.Tensor | None = None,
             max_tokens: int = 6, **options: str) -> Any:
        task = h.open(stage_pb2.Open(request_id=rid, options=options,
                                     sampling=stage_pb2.SamplingParams(temperature=0, max_tokens=max_tokens)))
        tensors = {"input_ids": self.ids if ids is None else ids, "audio_embeds": self.clip(clip),
                   "audio_feature_lengths": self.frames}
        if digest is not None:
            tensors["audio_hashes"] = torch.tensor([digest])
        task.feed(StageChunk(tensors=tensors, final=True))
        return task


def test_media_rows_are_cached_by_their_items_digests(model_dir: Path, plain: Any) -> None:
    """With the gateway's `audio_hashes` the rows after an audio clip are cached too, for the same clip only.
    A request whose media rows go to the talker (speech out) gets their hidden states from the cached blocks,
    exactly as computed; it never takes the blocks of a text-only request, which keep none."""
    handler = caching_thinker(model_dir)
    audio = AudioPrompt(model_dir, handler)
    ids, n_audio, hidden = audio.ids, audio.n_audio, audio.hidden

    def run(h: Any, rid: str, clip: int, digest: int | None, **options: str) -> tuple[Any, list[int], torch.Tensor,
                                                                                       dict[str, torch.Tensor]]:
        task = audio.open(h, rid, clip, digest, **options)
        rec = Recorder(h.batcher.engine)
        d = Driver(h)
        d.add(task)
        try:
            chunks = d.run()[rid]
            return task, token_ids(chunks), rec.stacked(rid), chunks[0].tensors
        finally:
            rec.stop()

    n = ids.numel()
    whole = (n - 1) // BLOCK * BLOCK  # every whole block but the one holding the last row
    first = run(handler, "a", 1, 111)
    again = run(handler, "b", 1, 111)
    other = run(handler, "c", 2, 222)  # another clip: only the blocks before it
    assert (first[0].cached_tokens, again[0].cached_tokens, other[0].cached_tokens) == (0, whole, 8)
    assert_same_run(again[1:3], run(plain, "solo-a", 1, None)[1:3], "media rows from the cache")
    assert_same_run(other[1:3], run(plain, "solo-c", 2, None)[1:3], "another clip")
    spoken = [run(handler, f"s{i}", 1, 111, talker_inputs="1") for i in range(3)]
    # the first takes only the text head (the blocks past the clip keep no hidden states), the next ones all
    assert [s[0].cached_tokens for s in spoken] == [8, whole, whole]
    want = run(plain, "solo-s", 1, None, talker_inputs="1")
    for s in spoken:
        assert_same_run(s[1:3], want[1:3], "speech-out request")
        assert s[3]["multimodal_hidden"].shape == (n_audio, hidden)  # what the talker reads: every audio row
        torch.testing.assert_close(s[3]["multimodal_hidden"], want[3]["multimodal_hidden"], atol=1e-5, rtol=0)
    assert run(handler, "t", 1, 111)[0].cached_tokens == whole  # text-only still finds its own blocks


def test_concurrent_requests_share_blocks_and_all_come_back(model_dir: Path, plain: Any) -> None:
    handler = caching_thinker(model_dir)
    engine = handler.batcher.engine
    head = prompts([17], seed=13)[0]
    ids = [torch.cat([head, t]) for t in prompts([1 + i % 5 for i in range(16)], seed=14)]
    run_one(handler, "warm", head)  # 4 blocks of the head are cached now
    alone = [solo(plain, p, 6) for p in ids]
    rec = Recorder(engine)
    d = Driver(handler)
    tasks = [open_thinker(handler, f"r{i}", p, 6) for i, p in enumerate(ids)]
    d.add(*tasks)
    d.step()
    # all 16 hold the same 4 head blocks: 16 x (the rest of their prompt) blocks plus 4, not 16 x 5
    held = engine.allocator.num_blocks - engine.allocator.num_free
    assert held == 4 + sum(engine.allocator.blocks_for(len(p)) - 4 for p in ids)
    d.run()
    assert all(t.cached_tokens == 16 for t in tasks)
    for i, want in enumerate(alone):
        assert_same_run((token_ids(d.chunks[f"r{i}"]), rec.stacked(f"r{i}")), want, f"r{i}")
    assert_drained(engine, engine.allocator.num_blocks)


def test_preemption_with_cached_blocks_keeps_tokens_exact(model_dir: Path, plain: Any) -> None:
    blocks = 12
    handler = caching_thinker(model_dir, max_model_len=32, max_num_batched_tokens=6,
                              kv_cache_memory=str(blocks * block_bytes(model_dir, BLOCK)))
    engine = handler.batcher.engine
    head = prompts([9], seed=15)[0]
    ids = [torch.cat([head, t]) for t in prompts([2, 5, 1, 4], seed=16)]
    alone = [solo(plain, p, 14) for p in ids]
    rec = Recorder(engine)
    d = Driver(handler)
    d.add(*(open_thinker(handler, f"r{i}", p, 14) for i, p in enumerate(ids)))
    d.run(max_steps=2000)
    assert engine.scheduler.preemptions > 0
    for i, want in enumerate(alone):
        assert_same_run((token_ids(d.chunks[f"r{i}"]), rec.stacked(f"r{i}")), want, f"r{i}")
    assert engine.stats()["prefix_cache_hits"] > 0
    assert_drained(engine, blocks)


def test_speech_requests_preempted_with_cached_media_rows_stay_exact(model_dir: Path, plain: Any) -> None:
    """Speech-out requests sharing a clip, in a cache small enough to preempt them: each one's tokens, logits and
    the media hidden states its talker gets equal its run without the cache, though some rows came from it."""
    blocks = 24
    handler = caching_thinker(model_dir, max_model_len=64, max_num_batched_tokens=12,
                              kv_cache_memory=str(blocks * block_bytes(model_dir, BLOCK)))
    engine = handler.batcher.engine
    audio = AudioPrompt(model_dir, handler, lengths=(6, 5))
    tails = prompts([1, 3, 2, 4, 5], seed=22)
    ids = [torch.cat([audio.ids, t]) for t in tails]
    want = []
    for i, p in enumerate(ids):
        d, rec = Driver(plain), Recorder(plain.batcher.engine)
        d.add(audio.open(plain, f"w{i}", 3, None, p, max_tokens=12, talker_inputs="1"))
        chunks = d.run()[f"w{i}"]
        rec.stop()
        want.append((token_ids(chunks), rec.stacked(f"w{i}"), chunks[0].tensors["multimodal_hidden"]))
    warm = Driver(handler)  # text out: its blocks past the clip keep no hidden states, the others cannot use them
    warm.add(audio.open(handler, "warm", 3, 7, ids[0]))
    warm.run()
    d, rec = Driver(handler), Recorder(engine)
    tasks = [audio.open(handler, f"r{i}", 3, 7, p, max_tokens=12, talker_inputs="1") for i, p in enumerate(ids)]
    d.add(tasks[0])
    d.step()  # the first prefill computes (and keeps) the clip's rows; the others come after it
    d.add(*tasks[1:])
    d.run(max_steps=3000)
    rec.stop()
    assert engine.scheduler.preemptions > 0 and any(t.cached_tokens > 8 for t in tasks[1:])
    for i, (tokens, logits, media) in enumerate(want):
        assert_same_run((token_ids(d.chunks[f"r{i}"]), rec.stacked(f"r{i}")), (tokens, logits), f"r{i}")
        torch.testing.assert_close(d.chunks[f"r{i}"][0].tensors["multimodal_hidden"], media, atol=1e-5, rtol=0)
    assert_drained(engine, blocks)


def test_blocks_whose_captured_rows_were_not_kept_are_not_offered(model_dir: Path) -> None:
    """A capturing request whose media rows' hidden states did not come back (as in a recompute after a
    preemption, which captures nothing) registers no block from its first media row on: a later speech
    request computes those rows itself instead of finding blocks without them."""
    handler = caching_thinker(model_dir)
    engine = handler.batcher.engine
    audio = AudioPrompt(model_dir, handler)
    layer, engine.capture_layer = engine.capture_layer, None  # the ranks return no captured rows
    try:
        d = Driver(handler)
        d.add(audio.open(handler, "lost", 4, 9, talker_inputs="1"))
        d.run()
    finally:
        engine.capture_layer = layer
    d = Driver(handler)
    task = audio.open(handler, "next", 4, 9, talker_inputs="1")
    d.add(task)
    chunks = d.run()["next"]
    assert task.cached_tokens == 8  # the text before the clip only
    assert chunks[0].tensors["multimodal_hidden"].shape == (audio.n_audio, audio.hidden)


# ------------------------------------------------------------------------------------ unit tests


def hashes(n_blocks: int, seed: int = 0) -> list[bytes]:
    keys = np.random.default_rng(seed).integers(0, 1000, size=(n_blocks * BLOCK, 5))
    return prefix_hashes(keys, BLOCK)


def test_prefix_hashes_chain_over_whole_blocks() -> None:
    keys = np.arange(50).reshape(10, 5)
    h = prefix_hashes(keys, BLOCK)
    assert len(h) == 2 and len(set(h)) == 2  # 10 rows: 2 whole blocks, the partial one never cached
    assert prefix_hashes(keys, BLOCK, limit=1) == h[:1]
    other = keys.copy()
    other[0, 0] += 1  # a different first token changes every later block's hash too
    assert all(x != y for x, y in zip(prefix_hashes(other, BLOCK), h))
    moved = keys.copy()
    moved[5, 1] += 1  # the same ids at other positions are other keys
    assert prefix_hashes(moved, BLOCK)[0] == h[0] and prefix_hashes(moved, BLOCK)[1] != h[1]


def test_allocator_reference_counts_and_evicts_least_recently_freed() -> None:
    alloc = BlockAllocator(6, BLOCK, prefix_caching=True)
    h = hashes(3)
    a: list[int] = []
    assert alloc.grow(a, 12)
    alloc.register(zip(a, h))
    blocks = list(a)
    b = alloc.match(h, 13)
    assert b == blocks and alloc.num_free == 3  # shared, not copied
    alloc.free(a)  # (empties the table)
    assert alloc.num_free == 3 and alloc.match(h[:1], 5) == blocks[:1]  # b still holds them; another match is fine
    alloc.free(blocks[:1])  # drop that extra hold
    alloc.free(b)
    assert alloc.num_free == 6 and alloc.num_cached == 3
    # the 3 never-used blocks go first, then the cached ones, the prefix's LAST block first
    c: list[int] = []
    assert alloc.grow(c, 4 * BLOCK)
    assert c[3] == blocks[2] and alloc.num_cached == 2
    assert alloc.match(h, 13) == blocks[:2]  # the chain stops at the evicted block
    assert alloc.queried_tokens == 13 + 5 + 13 and alloc.hit_tokens == 12 + 4 + 8


@pytest.mark.parametrize("caching", [False, True])
def test_freed_blocks_are_reused_before_untouched_ones(caching: bool) -> None:
    alloc = BlockAllocator(1000, BLOCK, prefix_caching=caching)
    used: set[int] = set()
    for i in range(1000):  # one request after another, 1 to 3 blocks each
        table: list[int] = []
        assert alloc.grow(table, BLOCK * (1 + i % 3))
        used.update(table)
        alloc.free(table)
    assert used == {0, 1, 2} and alloc.num_free == 1000


def test_blocks_without_a_cached_prefix_are_taken_before_cached_ones() -> None:
    alloc = BlockAllocator(4, BLOCK, prefix_caching=True)
    cached: list[int] = []
    plain: list[int] = []
    assert alloc.grow(cached, 2 * BLOCK) and alloc.grow(plain, 2 * BLOCK)
    alloc.register(zip(cached, hashes(2)))
    kept, spare = list(cached), list(plain)
    alloc.free(cached)
    alloc.free(plain)
    taken: list[int] = []
    assert alloc.grow(taken, 2 * BLOCK)
    assert sorted(taken) == spare and alloc.num_cached == 2  # the cached prefix survives
    assert alloc.match(hashes(2), 2 * BLOCK + 1) == kept
    alloc.free(taken)
    alloc.register([(spare[0], hashes(3)[2])])  # a free block is never registered (no request computed it)
    assert alloc.num_cached == 2


def test_kept_rows_are_counted_until_their_block_is_reused() -> None:
    """`payload_bytes` (the stage's omnimesh:prefix_cache_kept_bytes): what `attach` keeps, a row replaced counted
    once, all of a block's rows dropped when the block is handed out again."""
    alloc = BlockAllocator(2, BLOCK, prefix_caching=True)
    a: list[int] = []
    alloc.grow(a, 2 * BLOCK)
    row = torch.zeros(8)  # 32 bytes
    alloc.attach(a[0], 0, row)
    alloc.attach(a[0], 1, row)
    alloc.attach(a[0], 1, torch.zeros(4))  # replaced: 16 bytes instead of 32
    alloc.attach(a[1], 3, row)
    assert alloc.payload_bytes == 32 + 16 + 32
    blocks = list(a)
    alloc.free(a)
    assert alloc.payload_bytes == 80  # a free block keeps its rows (it may still be matched) ...
    b: list[int] = []
    alloc.grow(b, BLOCK)  # ... until it is reused: the table's last block first
    assert b == [blocks[1]] and alloc.payload(b[0]) == {} and alloc.payload_bytes == 48


def test_allocator_without_caching_never_matches_or_registers() -> None:
    alloc = BlockAllocator(4, BLOCK)
    a: list[int] = []
    alloc.grow(a, 8)
    alloc.register(zip(a, hashes(2)))
    assert alloc.num_cached == 0 and alloc.match(hashes(2), 8) == [] and alloc.queried_tokens == 0


def test_a_request_that_cannot_start_gives_its_matched_blocks_back() -> None:
    alloc = BlockAllocator(4, BLOCK, prefix_caching=True)
    sched = LMScheduler(alloc, max_num_seqs=8, max_num_batched_tokens=100)
    h = hashes(2)
    first = sched.add("first")
    first.pending, first.prefix = 9, h
    plan, _ = sched.schedule({"first"})
    assert plan == [(first, 9)] and first.first_hit == 0
    first.pending, first.cached = 0, 9
    alloc.register(zip(first.blocks, h))
    hog = sched.add("hog")
    hog.pending = 4
    assert sched.schedule({"hog"})[0] == [(hog, 4)]  # every block is held now
    again = sched.add("again")
    again.pending, again.prefix = 13, h
    assert sched.schedule({"again"})[0] == []  # its 2 cached blocks match, but its 2 new blocks do not fit
    assert again.blocks == [] and again.cached == 0 and again.pending == 13 and again.first_hit is None
    assert alloc.queried_tokens == 9 and alloc.hit_tokens == 0
    sched.remove(first)
    sched.remove(hog)
    plan, _ = sched.schedule({"again"})
    assert plan == [(again, 5)] and again.cached == 8 and again.first_hit == 8  # 8 tokens from the cache
    assert alloc.queried_tokens == 9 + 13 and alloc.hit_tokens == 8


def test_the_flag_reaches_the_thinker_only(model_dir: Path) -> None:
    args = ServeArgs(max_model_len=64, enable_prefix_caching=True)
    assert talker_handler(model_dir, args).batcher.engine.allocator.prefix_caching is False  # no ids to key by
    assert caching_thinker(model_dir).info().prefix_caching  # what the gateway reads: it hashes media only then
    assert not thinker_handler(model_dir, ServeArgs(max_model_len=64, kv_cache_memory="1MiB")).info().prefix_caching
    assert not ServeArgs().stage_configs()["thinker"].enable_prefix_caching
    with pytest.raises(ValueError, match="enable_prefix_caching must be true or false"):
        ServeArgs(stage_overrides='{"thinker": {"enable_prefix_caching": "yes"}}').stage_configs()
