"""Continuous batching of the thinker and talker stages (LMScheduler + LMEngine + the batchers), in-process on
the tiny model folder. What it proves:

- batched == solo: 16 thinker requests of different prompt lengths stepped together give exactly the tokens
  each gives alone, and they really ran in shared steps (one engine step for all 16 at once);
- two steps at once in one process (the first-output lane): disjoint requests stepped by two threads through
  one engine give their solo tokens, with overlapping forwards;
- chunked prefill: with a token budget of 8 a 40-token prompt is prefilled over several steps (no LMBatch
  above 8 tokens) and gives the same tokens as unchunked; a request already decoding gets a token
  on every one of those steps;
- preemption: a KV cache of a few blocks forces newest-first preemption with recompute, yet every request's
  tokens equal its solo run, and all blocks come back; a request preempted in the middle of a prefill with
  capture rows hands each captured row to its task exactly once;
- cancellation: 200 requests holding blocks, closed the way a cancel does, give every block back and leave the
  scheduler empty; a prompt whose preparation raises (any error) fails alone, its step's others exact (the
  thinker's and the talker's); a cache that cannot hold max_model_len refuses to start, naming --kv-cache-memory;
- talker batched == solo: 4 requests fed from real thinker output give the same codes together as alone, with
  ONE code-predictor call per step for the batch;
- both batchers' stats() report running / waiting / kv_cache_usage / preemptions while requests run;
- LMScheduler unit tests (no model): the budget split between decodes and a chunked prefill, FCFS admission,
  max_num_seqs, newest-first preemption, `busy` requests never preempted; the "priority" policy: lower
  priority values first, a waiting request preempting a lower-priority running one for its seat or blocks
  (never an equal or higher one, never a busy one), priorities ignored under fcfs; the thinker refusing a
  priority under fcfs and ordering requests by it under "priority".
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from omnimesh.config.serve_args import ServeArgs
from omnimesh.engine.kv_blocks import BlockAllocator
from omnimesh.engine.lm_scheduler import LMScheduler, ScheduledSeq
from omnimesh.models.qwen3_omni import paged_kv
from omnimesh.models.qwen3_omni.lm_engine import InputRun
from omnimesh.models.qwen3_omni.lm_shard import LMBatch
from omnimesh.models.model_config import load_config
from omnimesh.models.qwen3_omni.tiny_config import ORDINARY_VOCAB_LIMIT
from omnimesh.transport.frames import StageChunk
from omnimesh.v1 import stage_pb2
from services.llm.talker_handler import build_handler as talker_handler
from services.llm.thinker_handler import build_handler as thinker_handler

LOGIT_ATOL = 1e-4
ORDINARY = ORDINARY_VOCAB_LIMIT  # tiny ids below this are plain text (above: specials, media placeholders)


# ---------------------------------------------------------------------------------------------- helpers


def prompts(lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, ORDINARY, (n,), generator=g) for n in lengths]


def open_thinker(handler: Any, rid: str, ids: torch.Tensor, max_tokens: int, **options: str) -> Any:
    task = handler.open(stage_pb2.Open(request_id=rid, options=options,
                                       sampling=stage_pb2.SamplingParams(temperature=0, max_tokens=max_tokens)))
    task.feed(StageChunk(tensors={"input_ids": ids}, final=True))
    return task


class Driver:
    """Steps a stage's batcher the way the engine loop does: every ready task in one `step_batch` per step;
    finished tasks are closed (their blocks freed) and leave the batch."""

    def __init__(self, handler: Any):
        self.handler = handler
        self.live: list[Any] = []
        self.chunks: dict[str, list[StageChunk]] = {}
        self.steps = 0

    def add(self, *tasks: Any) -> None:
        for task in tasks:
            self.live.append(task)
            self.chunks.setdefault(task.request_id, [])

    def step(self) -> dict[str, list[StageChunk]]:
        ready = [t for t in self.live if t.ready()]
        assert ready, f"no request is ready: {[t.request_id for t in self.live]}"
        got: dict[str, list[StageChunk]] = {}
        for rid, value in self.handler.batcher.step_batch(ready).items():
            if isinstance(value, BaseException):
                raise value
            got[rid] = value
            self.chunks[rid] += value
        for task in [t for t in self.live if t.finished]:
            task.close()
            self.live.remove(task)
        self.steps += 1
        return got

    def run(self, max_steps: int = 5000) -> dict[str, list[StageChunk]]:
        while self.live:
            assert self.steps < max_steps, "the batch does not finish"
            self.step()
        return self.chunks


def token_ids(chunks: list[StageChunk]) -> list[int]:
    return [int(t) for c in chunks for t in c.tensors.get("token_ids", torch.zeros(0)).tolist()]


class Recorder:
    """Wraps `engine.step`: the number of requests in each step, and every logits row each request got."""

    def __init__(self, engine: Any):
        self.engine, self.inner = engine, engine.step
        self.sizes: list[int] = []
        self.logits: dict[str, list[torch.Tensor]] = {}
        engine.step = self.step

    def step(self, ready: list[str]) -> Any:
        out = self.inner(ready)
        self.sizes.append(len(out))
        for key, result in out.items():
            if result.logits is not None:  # the engine knows a task by its key, `request_id~serial`
                self.logits.setdefault(key.rsplit("~", 1)[0], []).append(result.logits.clone())
        return out

    def stop(self) -> None:
        self.engine.step = self.inner

    def stacked(self, rid: str) -> torch.Tensor:
        return torch.stack(self.logits[rid])


def solo(handler: Any, ids: torch.Tensor, max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """The request alone on `handler`: its tokens and the logits (n, V) they were sampled from."""
    rec = Recorder(handler.batcher.engine)
    try:
        d = Driver(handler)
        d.add(open_thinker(handler, "solo", ids, max_tokens))
        return token_ids(d.run()["solo"]), rec.stacked("solo")
    finally:
        rec.stop()


def assert_same_run(got: tuple[list[int], torch.Tensor], want: tuple[list[int], torch.Tensor], what: str) -> None:
    """Token ids exactly equal, logits equal up to float32 rounding (batched GEMMs round differently)."""
    assert got[0] == want[0], what
    torch.testing.assert_close(got[1], want[1], atol=LOGIT_ATOL, rtol=0, msg=what)


def record_batches(engine: Any) -> list[LMBatch]:
    """Wrap the backend's submit and run: the returned list gets every LMBatch command the engine sends."""
    batches: list[LMBatch] = []

    def wrap(inner: Any) -> Any:
        def call(command: Any) -> Any:
            if isinstance(command, LMBatch):
                batches.append(command)
            return inner(command)
        return call

    engine.backend.submit, engine.backend.run = wrap(engine.backend.submit), wrap(engine.backend.run)
    return batches


def block_bytes(model_dir: Path, block_size: int) -> int:
    text = load_config(model_dir).thinker_config.text_config  # type: ignore[union-attr]
    return paged_kv.block_bytes(text, layers=text.num_hidden_layers, tp=1, block_size=block_size,
                                dtype=torch.float32)


def assert_drained(engine: Any, free_at_start: int) -> None:
    assert engine.allocator.num_free == free_at_start == engine.allocator.num_blocks
    stats = engine.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0 and stats["kv_cache_usage"] == 0.0
    assert engine.seqs == {}


# ------------------------------------------------------------------------------------------ thinker


def test_sixteen_batched_requests_equal_their_solo_runs(model_dir: Path, thinker: Any) -> None:
    lengths = [3, 40, 7, 12, 5, 33, 18, 9, 26, 4, 15, 21, 37, 11, 6, 29]
    ids = prompts(lengths)
    alone = [solo(thinker, p, 12) for p in ids]
    assert sum(len(a[0]) for a in alone) > 16 * 3, "the tiny model stops at once: the test would prove little"

    handler = thinker_handler(model_dir, ServeArgs(max_model_len=128, kv_cache_memory="1MiB"))
    engine = handler.batcher.engine
    rec = Recorder(engine)
    d = Driver(handler)
    d.add(*(open_thinker(handler, f"r{i}", p, 12) for i, p in enumerate(ids)))
    chunks = d.run()
    for i, want in enumerate(alone):
        assert_same_run((token_ids(chunks[f"r{i}"]), rec.stacked(f"r{i}")), want, f"r{i} (prompt {lengths[i]} tokens)")
    assert rec.sizes[0] == 16  # one step held all 16 requests (their prefills), and so did the decodes after it
    assert len(rec.sizes) < sum(len(a[0]) for a in alone) / 4  # far fewer steps than tokens
    assert_drained(engine, engine.allocator.num_blocks)


def test_a_request_id_sent_again_before_the_old_tasks_close_runs_on_its_own_state(model_dir: Path,
                                                                                  thinker: Any) -> None:
    """A request cancelled mid-run and sent again at once under its id: the engine loop drops the old task
    at once but closes it (freeing its KV blocks) later, on the compute thread after any step in flight. The
    new task must get a prefill and blocks of its own, and the old close must not free them (keyed by the
    request id, the new task skipped its prefill and failed 'logits before the prompt was prepared')."""
    ids = prompts([9, 14])
    want = solo(thinker, ids[1], 10)
    handler = thinker_handler(model_dir, ServeArgs(max_model_len=128, kv_cache_memory="1MiB"))
    engine = handler.batcher.engine
    rec = Recorder(engine)
    old = open_thinker(handler, "same", ids[0], 10)
    handler.batcher.step_batch([old])  # its prefill: it holds blocks now
    new = open_thinker(handler, "same", ids[1], 10)  # the old one's close has not run yet
    d = Driver(handler)
    d.add(new)
    d.step()
    old.close()  # late, as the compute thread runs it after the step in flight
    chunks = d.run()
    assert_same_run((token_ids(chunks["same"]), rec.stacked("same")[1:]), want, "the id sent again")
    assert_drained(engine, engine.allocator.num_blocks)


def test_two_steps_at_once_in_one_process_equal_their_solo_runs(model_dir: Path, thinker: Any) -> None:
    """In one process (pp = tp = 1) a step of first outputs runs beside a bulk step (EngineLoop `preempt`):
    two threads stepping disjoint requests through one engine at once give each request its solo tokens and
    logits and every block comes back, every time; their forwards overlap in time (nothing serializes them) in
    at least one of three runs: a loaded host may deschedule one thread for the other's whole forward."""
    lengths = [5, 30, 9, 17]
    ids = prompts(lengths, seed=5)
    alone = [solo(thinker, p, 10) for p in ids]
    assert any(_two_steps_at_once(model_dir, ids, alone) for _ in range(3)), "the forwards never overlapped"


def _two_steps_at_once(model_dir: Path, ids: list, alone: list) -> bool:
    """One run of the test above: its outputs checked; did the threads' forwards overlap?"""
    handler = thinker_handler(model_dir, ServeArgs(max_model_len=128, kv_cache_memory="1MiB", stream_interval=1))
    assert handler.preempt and handler.max_inflight_steps == 2  # the CPU stage in one process gets the lane
    engine = handler.batcher.engine
    rec = Recorder(engine)
    inner, both_in, spans = engine.backend.run, threading.Barrier(2, timeout=10), []

    def run(command: Any) -> Any:  # the first forward of each thread waits for the other's: they overlap
        if isinstance(command, LMBatch) and not any(s[0] == threading.get_ident() for s in spans):
            both_in.wait()
        started = time.monotonic()
        try:
            return inner(command)
        finally:
            spans.append((threading.get_ident(), started, time.monotonic()))

    engine.backend.run = run
    drivers = [Driver(handler), Driver(handler)]
    for i, p in enumerate(ids):
        drivers[i % 2].add(open_thinker(handler, f"r{i}", p, 10))
    with ThreadPoolExecutor(2) as pool:
        chunks = [f.result(60) for f in [pool.submit(d.run) for d in drivers]]
    for i, want in enumerate(alone):
        assert_same_run((token_ids(chunks[i % 2][f"r{i}"]), rec.stacked(f"r{i}")), want, f"r{i}")
    a, b = ([s for s in spans if s[0] == t] for t in {s[0] for s in spans})
    assert_drained(engine, engine.allocator.num_blocks)
    return any(x[1] < y[2] and y[1] < x[2] for x in a for y in b)


def test_stream_interval_groups_tokens_after_the_eager_ones(model_dir: Path) -> None:
    """--stream-interval 4 with eager_tokens 3: tokens 1..3 leave one by one, then one chunk per 4 tokens and
    the rest with the last; texts, token ids and the talker's token embeddings are exactly those of the
    one-token-per-chunk run, only grouped. A bad eager_tokens is INVALID_ARGUMENT."""
    one = thinker_handler(model_dir, ServeArgs(max_model_len=128, stream_interval=1))
    four = thinker_handler(model_dir, ServeArgs(max_model_len=128, stream_interval=4))
    ids = prompts([6, 9], seed=11)

    def run(handler: Any, **options: str) -> dict[str, list[StageChunk]]:
        d = Driver(handler)
        d.add(*(open_thinker(handler, f"r{i}", p, 14, talker_inputs="1", **options) for i, p in enumerate(ids)))
        return d.run()

    want, got = run(one), run(four, eager_tokens="3")
    for rid in want:
        n = len(token_ids(want[rid]))
        assert n == 14 and [len(c.tensors["token_ids"]) for c in want[rid]] == [1] * n
        sizes = [len(c.tensors["token_ids"]) for c in got[rid]]
        assert sizes == [1, 1, 1, 4, 4, 3], sizes  # 14 tokens: 3 eager, 4 + 4, the last 3 with the final one
        assert token_ids(got[rid]) == token_ids(want[rid])
        assert "".join(c.text for c in got[rid]) == "".join(c.text for c in want[rid])
        embeds = [torch.cat([c.tensors["token_embeds"] for c in run if "token_embeds" in c.tensors]) for run in
                  (want[rid], got[rid])]
        assert embeds[0].shape == (13, embeds[0].shape[1]) and torch.equal(embeds[0], embeds[1])  # last: unspoken
        assert got[rid][-1].tensors.keys() == {"token_ids", "token_embeds"}  # the final token adds no embedding
        assert "prompt_ids" not in got[rid][1].tensors and got[rid][0].tensors.keys() == want[rid][0].tensors.keys()
    with pytest.raises(ValueError, match="eager_tokens must be a whole number of tokens"):
        open_thinker(four, "bad", ids[0], 4, eager_tokens="0")


def test_long_prompt_is_prefilled_in_chunks_without_stalling_a_decode(model_dir: Path, thinker: Any) -> None:
    short, long = prompts([5, 40], seed=1)
    want_long = solo(thinker, long, 6)  # unchunked: the default budget takes 40 tokens at once
    want_short = solo(thinker, short, 20)
    assert len(want_short[0]) == 20, "the short request must decode all through the long prefill"

    handler = thinker_handler(model_dir, ServeArgs(max_model_len=128, kv_cache_memory="1MiB",
                                                   max_num_batched_tokens=8, stream_interval=1))
    rec = Recorder(handler.batcher.engine)
    batches = record_batches(handler.batcher.engine)
    d = Driver(handler)
    d.add(open_thinker(handler, "short", short, 20))
    d.step()  # the short prompt's prefill: first token
    assert len(token_ids(d.chunks["short"])) == 1
    d.add(open_thinker(handler, "long", long, 6))
    prefill_steps = 0
    while not token_ids(d.chunks["long"]):
        before = len(token_ids(d.chunks["short"]))
        d.step()
        prefill_steps += 1
        assert len(token_ids(d.chunks["short"])) == before + 1, f"the decode stalled at prefill step {prefill_steps}"
    # budget 8: one token for the decode, 7 for the prompt -> ceil(40 / 7) = 6 steps
    assert prefill_steps == 6
    # one LMBatch per step: the decode's row + a 7-row chunk (the last one 5 rows), each chunk after the first
    # attending to the rows already cached
    during = batches[-prefill_steps:]
    assert [b.layout.num_tokens for b in during] == [8, 8, 8, 8, 8, 6]
    assert [sum(p.past > 0 for p in b.layout.prefills) for b in during] == [0, 1, 1, 1, 1, 1]
    chunks = d.run()
    assert_same_run((token_ids(chunks["long"]), rec.stacked("long")), want_long, "chunked prefill")
    assert_same_run((token_ids(chunks["short"]), rec.stacked("short")), want_short, "decode beside it")


def test_a_chunk_deep_in_a_long_prompt_sends_no_mask_to_the_ranks() -> None:
    """A chunk's causal mask over its past is made where attention runs: the layout the driver sends every rank
    each step carries the chunk's slots, not an (n, past + n) mask (256 MiB for 2048 rows at 128k keys)."""
    import pickle

    past, n, block = 30_000, 512, 16
    layout = paged_kv.BatchLayout.build([(n, past, list(range(-(-(past + n) // block))))], block)
    assert len(pickle.dumps(layout)) < 2 * (past + n) * 8  # the slots (int64) and little else
    mask = layout.prefills[0].mask("cpu")
    assert mask is not None and mask.shape == (n, past + n)
    assert mask[0, :past + 1].all() and not mask[0, past + 1:].any() and mask[-1].all()
    assert paged_kv.BatchLayout.build([(n, 0, list(range(n // block)))], block).prefills[0].mask("cpu") is None


def test_preemption_recomputes_and_keeps_tokens_exact(model_dir: Path) -> None:
    block_size, blocks = 4, 10
    # 10 blocks of 4 tokens, 6 tokens a step: requests are preempted, and recomputed in chunks
    args = ServeArgs(max_model_len=32, block_size=block_size, max_num_batched_tokens=6,
                     kv_cache_memory=str(blocks * block_bytes(model_dir, 4)))
    handler = thinker_handler(model_dir, args)
    engine = handler.batcher.engine
    assert engine.allocator.num_blocks == blocks
    ids = prompts([6, 9, 4, 8, 7], seed=2)
    alone = [solo(handler, p, 20) for p in ids]  # each alone fits (<= 29 tokens: 8 blocks)
    assert engine.scheduler.preemptions == 0
    assert sum(len(a[0]) for a in alone) > 60

    rec = Recorder(engine)
    d = Driver(handler)
    d.add(*(open_thinker(handler, f"r{i}", p, 20) for i, p in enumerate(ids)))
    saw_waiting = False
    while d.live:
        d.step()
        saw_waiting |= engine.stats()["waiting"] > 0
        assert d.steps < 2000
    assert engine.scheduler.preemptions > 0 and saw_waiting
    assert handler.batcher.stats()["preemptions"] == engine.scheduler.preemptions
    for i, want in enumerate(alone):
        assert_same_run((token_ids(d.chunks[f"r{i}"]), rec.stacked(f"r{i}")), want, f"r{i}")
    assert_drained(engine, blocks)


def test_preempted_prefill_captures_each_row_once(model_dir: Path) -> None:
    """A request preempted part-way through a prefill whose rows are captured (media rows for the talker) is
    recomputed from its first row; the rows its task already got must not come back a second time."""
    block_size = 4
    args = ServeArgs(max_model_len=16, block_size=block_size, max_num_batched_tokens=8,
                     kv_cache_memory=str(4 * block_bytes(model_dir, block_size)))
    handler = thinker_handler(model_dir, args)
    engine, th = handler.batcher.engine, handler.thinker
    old_ids, new_ids = prompts([12, 16], seed=3)
    old = th.prepare(old_ids)
    new = th.prepare(new_ids)
    capture = torch.ones(16, dtype=torch.bool)

    def new_run() -> InputRun:
        return InputRun(new.embeds, new.positions, capture=capture.clone())

    engine.feed("solo", new_run())
    parts = [engine.step(["solo"])["solo"].captured for _ in range(2)]  # 8 + 8 rows
    engine.remove("solo")
    solo_captured = torch.cat(parts)
    assert solo_captured.shape[0] == 16

    engine.feed("old", InputRun(old.embeds, old.positions))
    engine.step(["old", "new"])  # old: 8 rows (2 blocks)
    engine.feed("new", new_run())
    captured: list[torch.Tensor] = []
    out = engine.step(["old", "new"])  # old: 4 rows -> logits (3 blocks); new: 4 rows (the last block)
    assert out["old"].logits is not None and out["new"].captured is not None
    captured.append(out["new"].captured)
    token = th.token_input(int(out["old"].logits.argmax()), 12, old.rope_delta)
    engine.feed("old", InputRun(token[0].view(1, -1), token[1]))
    out = engine.step(["old", "new"])  # old needs a 4th block: the newest request is preempted
    assert engine.scheduler.preemptions == 1 and "new" not in out
    engine.remove("old")
    while engine.pending_tokens("new"):
        out = engine.step(["new"])
        if out["new"].captured is not None:
            captured.append(out["new"].captured)
    engine.remove("new")
    got = torch.cat(captured)
    assert got.shape[0] == 16, f"{got.shape[0]} captured rows for a 16-row prompt"
    torch.testing.assert_close(got, solo_captured)
    assert engine.allocator.num_free == 4


def test_closing_two_hundred_requests_frees_every_block(model_dir: Path) -> None:
    handler = thinker_handler(model_dir, ServeArgs(max_model_len=64, kv_cache_memory="1MiB"))
    engine = handler.batcher.engine
    start = engine.allocator.num_free
    ids = prompts([3 + i % 8 for i in range(200)], seed=4)
    d = Driver(handler)
    d.add(*(open_thinker(handler, f"r{i}", p, 50) for i, p in enumerate(ids)))
    usage = []
    for _ in range(3):
        d.step()
        usage.append(engine.stats()["kv_cache_usage"])
    assert max(usage) > 0 and engine.stats()["running"] + engine.stats()["waiting"] > 0
    for task in d.live:  # what a cancellation does (EngineLoop closes a cancelled task after its step)
        task.close()
    assert_drained(engine, start)


def test_a_prompt_that_fails_to_prepare_ends_only_its_request(model_dir: Path, thinker: Any) -> None:
    """Any error while preparing one prompt (not only bad media's ValueError) fails that request alone; the
    step's other requests keep their solo tokens, and the failed one holds no blocks."""
    handler = thinker_handler(model_dir, ServeArgs(max_model_len=64, kv_cache_memory="1MiB"))
    engine = handler.batcher.engine
    start = engine.allocator.num_free
    ids = prompts([5, 9, 7], seed=5)
    tasks = [open_thinker(handler, f"r{i}", p, 4) for i, p in enumerate(ids)]

    def broken() -> Any:
        raise RuntimeError("a bug preparing this prompt")

    tasks[1].prompt_run = broken
    out = handler.batcher.step_batch(tasks)
    assert isinstance(out["r1"], RuntimeError) and not engine.has(tasks[1].key)
    tasks[1].close()
    d = Driver(handler)
    d.add(tasks[0], tasks[2])
    d.chunks.update({rid: out[rid] for rid in ("r0", "r2")})
    got = d.run()
    for i in (0, 2):
        assert token_ids(got[f"r{i}"]) == solo(thinker, ids[i], 4)[0], i
    assert_drained(engine, start)


def test_without_chunked_prefill_a_long_prompt_runs_in_one_step_and_equals_its_chunked_run(
        model_dir: Path, thinker: Any) -> None:
    ids = prompts([60], seed=7)[0]
    want = solo(thinker, ids, 6)
    whole = thinker_handler(model_dir, ServeArgs(max_model_len=128, kv_cache_memory="1MiB", stream_interval=1,
                                                 enable_chunked_prefill=False))
    engine = whole.batcher.engine
    assert engine.scheduler.max_num_batched_tokens == 2048  # the default step, already >= max_model_len
    batches = record_batches(engine)
    assert_same_run(solo(whole, ids, 6), want, "a prompt prefilled whole")
    assert batches[0].x.shape[1] == 60  # the whole prompt in the first step
    with pytest.raises(ValueError, match=r"thinker: with --no-enable-chunked-prefill a prompt is prefilled in one step, "
                                         r"so --max-num-batched-tokens \(64\) must be at least max_model_len \(128\)"):
        thinker_handler(model_dir, ServeArgs(max_model_len=128, kv_cache_memory="1MiB", max_num_batched_tokens=64,
                                             enable_chunked_prefill=False))
    chunked = thinker_handler(model_dir, ServeArgs(max_model_len=128, kv_cache_memory="1MiB", stream_interval=1,
                                                   max_num_batched_tokens=16))
    batches = record_batches(chunked.batcher.engine)
    assert_same_run(solo(chunked, ids, 6), want, "the same prompt in chunks of 16")
    assert [b.x.shape[1] for b in batches[:4]] == [16, 16, 16, 12]


def test_too_small_kv_cache_refuses_to_start(model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"holds 16 tokens .*fewer than max_model_len 64.*--kv-cache-memory"):
        thinker_handler(model_dir, ServeArgs(max_model_len=64, kv_cache_memory=str(block_bytes(model_dir, 16))))
    with pytest.raises(ValueError, match="holds no block.*--kv-cache-memory"):
        thinker_handler(model_dir, ServeArgs(max_model_len=64, kv_cache_memory="1KiB"))


# ------------------------------------------------------------------------------------------- talker


@pytest.fixture(scope="module")
def thinker_out(thinker: Any) -> dict[str, list[StageChunk]]:
    """What the thinker sends the talker for 4 requests (talker_inputs on): TalkerPrompt + token_embeds."""
    # the talker speaks what follows the assistant start: a user turn, then `<|im_start|>assistant\n`
    ids = [torch.cat([torch.tensor([400, 413, 10]), body, torch.tensor([401, 10, 400, 414, 10])])
           for body in prompts([2, 9, 5, 14], seed=5)]
    d = Driver(thinker)
    d.add(*(open_thinker(thinker, f"t{i}", p, 8, talker_inputs="1") for i, p in enumerate(ids)))
    out = d.run()
    assert all("token_embeds" in out[f"t{i}"][0].tensors for i in range(4))
    return out


def open_talker(handler: Any, thinker_out: dict[str, list[StageChunk]], rid: str, **options: str) -> Any:
    """A talker task fed its thinker's chunks in order, the last one final (as the stage's edge does)."""
    task = handler.open(stage_pb2.Open(request_id=rid, options={"speaker": "ethan", **options},
                                       sampling=stage_pb2.SamplingParams(temperature=0, max_tokens=20)))
    chunks = thinker_out[rid]
    for n, c in enumerate(chunks):
        task.feed(StageChunk(tensors=c.tensors, seq=n, final=n == len(chunks) - 1))
    return task


def codes(chunks: list[StageChunk]) -> torch.Tensor:
    return torch.cat([c.tensors["codes"] for c in chunks], dim=1)  # (G, n)


def test_talker_batched_equals_solo_with_one_predictor_call_per_step(model_dir: Path, thinker_out: dict) -> None:
    handler = talker_handler(model_dir, ServeArgs(max_model_len=128))
    solo = []
    for i in range(4):
        s = Driver(handler)
        s.add(open_talker(handler, thinker_out, f"t{i}"))
        solo.append(codes(s.run()[f"t{i}"]))
    assert all(c.shape[1] > 2 for c in solo)

    calls: list[int] = []
    per_step: list[int] = []
    inner = handler.batcher.predict_batch

    def predict_batch(prefix: torch.Tensor, params: tuple) -> Any:
        calls.append(len(params))
        per_step[-1] += 1
        return inner(prefix, params)

    handler.batcher.predict_batch = predict_batch
    d = Driver(handler)
    d.add(*(open_talker(handler, thinker_out, f"t{i}") for i in range(4)))
    while d.live:
        per_step.append(0)
        d.step()
    for i in range(4):
        assert torch.equal(codes(d.chunks[f"t{i}"]), solo[i]), f"t{i}"
    assert max(per_step) == 1  # at most one code-predictor call per step
    assert max(calls) == 4  # ... holding every request that needed one
    assert sum(calls) == sum(c.shape[1] for c in solo)  # one prediction per emitted group
    assert_drained(handler.batcher.engine, handler.batcher.engine.allocator.num_blocks)


def test_a_talker_takes_a_thinker_serving_in_another_dtype(model_dir: Path, thinker_out: dict) -> None:
    """A float32 talker fed a bf16 thinker's embeddings and hidden states (a GPU thinker, a CPU talker) speaks as
    when fed those same values in float32; the other tensors (ids, grids) keep their dtypes."""
    from services.llm.talker_task import EMBEDDINGS

    handler = talker_handler(model_dir, ServeArgs(max_model_len=128))
    assert handler.talker.dtype == torch.float32

    def converted(cast: Any) -> dict[str, list[StageChunk]]:
        return {rid: [StageChunk(tensors={k: cast(v) if k in EMBEDDINGS else v for k, v in c.tensors.items()},
                                 seq=c.seq, final=c.final) for c in chunks] for rid, chunks in thinker_out.items()}

    spoken = []
    for inputs in (converted(lambda v: v.to(torch.bfloat16)), converted(lambda v: v.to(torch.bfloat16).float())):
        d = Driver(handler)
        d.add(open_talker(handler, inputs, "t1"))
        spoken.append(codes(d.run()["t1"]))
    assert spoken[0].shape[1] > 2 and torch.equal(spoken[0], spoken[1])


def test_sampled_talker_batched_equals_solo(model_dir: Path, thinker_out: dict) -> None:
    """Seeded sampling (top-k 50, T 0.9: each request draws alone, with its own generator) batched with a
    greedy request: every request's codes equal its solo run, and the greedy one equals its greedy run."""
    handler = talker_handler(model_dir, ServeArgs(max_model_len=128))

    def open_one(rid: str, seed: int | None) -> Any:
        sampling = (stage_pb2.SamplingParams(temperature=0.9, top_k=50, seed=seed, max_tokens=20) if seed is not None
                    else stage_pb2.SamplingParams(temperature=0, max_tokens=20))
        task = handler.open(stage_pb2.Open(request_id=rid, options={"speaker": "ethan"}, sampling=sampling))
        chunks = thinker_out[rid]
        for n, c in enumerate(chunks):
            task.feed(StageChunk(tensors=c.tensors, seq=n, final=n == len(chunks) - 1))
        return task

    seeds = {"t0": 11, "t1": None, "t2": 12}
    solo = {}
    for rid, seed in seeds.items():
        d = Driver(handler)
        d.add(open_one(rid, seed))
        solo[rid] = codes(d.run()[rid])
    d = Driver(handler)
    d.add(*(open_one(rid, seed) for rid, seed in seeds.items()))
    together = d.run()
    for rid in seeds:
        assert torch.equal(codes(together[rid]), solo[rid]), rid


def solo_codes(handler: Any, thinker_out: dict, rids: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Each request's codes, run alone on `handler`."""
    want = {}
    for rid in rids:
        d = Driver(handler)
        d.add(open_talker(handler, thinker_out, rid))
        want[rid] = codes(d.run()[rid])
    return want


def test_a_talker_prompt_that_fails_to_prepare_ends_only_its_request(model_dir: Path, thinker_out: dict) -> None:
    handler = talker_handler(model_dir, ServeArgs(max_model_len=128))
    want = solo_codes(handler, thinker_out, ("t0", "t2"))
    tasks = [open_talker(handler, thinker_out, rid) for rid in ("t0", "t1", "t2")]
    talker, bad_state = handler.batcher.talker, tasks[1].state
    prefill_input = talker.prefill_input

    def t1_fails(state: Any) -> Any:
        if state is bad_state:
            raise RuntimeError("a bug preparing t1's prompt")
        return prefill_input(state)

    talker.prefill_input = t1_fails
    out = handler.batcher.step_batch(tasks)
    assert isinstance(out["t1"], RuntimeError) and not handler.batcher.engine.has(tasks[1].key)
    tasks[1].close()
    d = Driver(handler)
    d.add(tasks[0], tasks[2])
    d.chunks.update({rid: out[rid] for rid in ("t0", "t2")})
    got = d.run()
    for rid in ("t0", "t2"):
        assert torch.equal(codes(got[rid]), want[rid]), rid
    assert_drained(handler.batcher.engine, handler.batcher.engine.allocator.num_blocks)


def test_a_talker_sampling_failure_ends_only_its_request(model_dir: Path, thinker_out: dict) -> None:
    """If the step's batched pick raises, every request picks alone; the one whose pick fails ends with that
    error, the others go on to exactly their codes."""
    handler = talker_handler(model_dir, ServeArgs(max_model_len=128))
    want = solo_codes(handler, thinker_out, ("t0", "t2"))
    talker = handler.batcher.talker
    tasks = {rid: open_talker(handler, thinker_out, rid) for rid in ("t0", "t1", "t2")}
    bad_state = tasks["t1"].state
    one_by_one = talker.sample_next

    def batch_fails(*_: Any) -> bool:
        raise RuntimeError("batched pick failed")

    def t1_fails(state: Any, *args: Any) -> None:
        if state is bad_state:
            raise ValueError("t1's pick failed")
        one_by_one(state, *args)

    talker.sample_next_batch, talker.sample_next = batch_fails, t1_fails
    got: dict[str, list[StageChunk]] = {rid: [] for rid in tasks}
    failed: dict[str, BaseException] = {}
    live = list(tasks.values())
    for _ in range(500):
        if not live:
            break
        for rid, value in handler.batcher.step_batch([t for t in live if t.ready()]).items():
            if isinstance(value, BaseException):
                failed[rid] = value
            else:
                got[rid] += value
        for task in [t for t in live if t.finished or t.request_id in failed]:
            task.close()
            live.remove(task)
    assert set(failed) == {"t1"} and "t1's pick failed" in str(failed["t1"])
    for rid in ("t0", "t2"):
        assert torch.equal(codes(got[rid]), want[rid]), rid
    assert_drained(handler.batcher.engine, handler.batcher.engine.allocator.num_blocks)


def test_talker_sends_its_codes_in_the_vocoders_windows(model_dir: Path, thinker_out: dict) -> None:
    """chunk_codes / first_chunk_codes (the gateway sets the vocoder's windows): the same codes, in chunks of
    the first size, then the steady size, the rest with the final chunk; each chunk leaves in the step that
    made its last group. Bad sizes are INVALID_ARGUMENT (ValueError). (One model round per step, so the step
    counts compare: with first_output_rounds a first chunk of several groups comes out of fewer steps.)"""
    handler = talker_handler(model_dir, ServeArgs(max_model_len=128, stage_overrides='{"talker": {"first_output_rounds": 1}}'))
    per_group = Driver(handler)
    per_group.add(*(open_talker(handler, thinker_out, f"t{i}") for i in range(4)))
    want = per_group.run()
    chunked = Driver(handler)
    chunked.add(*(open_talker(handler, thinker_out, f"t{i}", first_chunk_codes="3", chunk_codes="5") for i in range(4)))
    got = chunked.run()
    for i in range(4):
        rid = f"t{i}"
        n = codes(want[rid]).shape[1]
        assert all(c.tensors["codes"].shape[1] == 1 for c in want[rid])  # the default: one group per chunk
        assert torch.equal(codes(got[rid]), codes(want[rid])), rid
        sizes = [c.tensors["codes"].shape[1] for c in got[rid]]
        expected = [min(3, n)] + [5] * ((n - 3) // 5 if n > 3 else 0)
        if sum(expected) < n:
            expected.append(n - sum(expected))
        assert sizes == expected, (rid, sizes)
    assert chunked.steps == per_group.steps  # held codes never delay the end of a request
    scheduled = Driver(handler)  # a whole schedule (the gateway passes the vocoder's --audio-windows)
    scheduled.add(*(open_talker(handler, thinker_out, f"t{i}", chunk_schedule="2,3,4") for i in range(4)))
    got = scheduled.run()
    for i in range(4):
        rid = f"t{i}"
        n, sizes = codes(want[rid]).shape[1], [c.tensors["codes"].shape[1] for c in got[rid]]
        assert torch.equal(codes(got[rid]), codes(want[rid])), rid
        expected = [2, 3] + [4] * max(0, (n - 5) // 4)
        if sum(expected) < n:
            expected.append(n - sum(expected))
        assert n > 9 and sizes == expected, (rid, sizes)
    with pytest.raises(ValueError, match="option chunk_schedule must be"):
        open_talker(handler, thinker_out, "t0", chunk_schedule="2,x")
    for bad in ({"chunk_codes": "0"}, {"first_chunk_codes": "x"}, {"chunk_codes": "-2"}):
        with pytest.raises(ValueError, match="whole number of codes"):
            open_talker(handler, thinker_out, "t0", **bad)


def test_requests_are_urgent_until_what_the_first_audio_needs_is_out(model_dir: Path, thinker_out: dict) -> None:
    """`urgent()` (the engine runs such steps at the stage's own OS priority): a thinker request until its
    `eager_tokens` tokens are out (the gateway sets what the talker's first codes need), a text-only one until
    its first token; a talker request until its first chunk of codes leaves."""
    thinker = thinker_handler(model_dir, ServeArgs(max_model_len=128))
    ids = prompts([7], seed=3)[0]
    for options, eager in (({"talker_inputs": "1", "eager_tokens": "4"}, 4), ({"talker_inputs": "0"}, 1)):
        task = open_thinker(thinker, "u", ids, 10, **options)
        d, flags, tokens = Driver(thinker), [], []
        d.add(task)
        while d.live:
            flags.append(task.urgent())
            tokens.append(len(token_ids(d.step().get("u", []))))
        assert sum(tokens) == 10
        assert flags == [sum(tokens[:i]) < eager for i in range(len(flags))], (flags, tokens)
        assert flags[0] and not flags[-1]
    talker = talker_handler(model_dir, ServeArgs(max_model_len=128))
    task = open_talker(talker, thinker_out, "t0", first_chunk_codes="3", chunk_codes="5")
    d, flags, sent = Driver(talker), [], []
    d.add(task)
    while d.live:
        flags.append(task.urgent())
        sent.append(len(d.step().get("t0", [])))
    first = sent.index(1)  # the step whose output is the first chunk
    assert flags == [True] * (first + 1) + [False] * (len(flags) - first - 1)


def test_stats_while_requests_run(model_dir: Path, thinker_out: dict) -> None:
    handler = thinker_handler(model_dir, ServeArgs(max_model_len=64, kv_cache_memory="1MiB", max_num_seqs=2))
    d = Driver(handler)
    d.add(*(open_thinker(handler, f"r{i}", p, 10) for i, p in enumerate(prompts([4, 5, 6], seed=6))))
    d.step()
    stats = handler.batcher.stats()
    assert set(stats) >= {"running", "waiting", "kv_cache_usage", "preemptions"}
    assert stats["running"] == 2 and stats["waiting"] == 1  # max_num_seqs=2
    assert 0 < stats["kv_cache_usage"] <= 2 / handler.batcher.engine.allocator.num_blocks
    assert stats["preemptions"] == 0
    d.run()
    assert handler.batcher.stats()["running"] == 0 and handler.batcher.stats()["kv_cache_usage"] == 0

    talker = talker_handler(model_dir, ServeArgs(max_model_len=64))
    assert talker.batcher.stats() == {"running": 0, "waiting": 0, "kv_cache_usage": 0.0, "preemptions": 0}
    d = Driver(talker)
    d.add(*(open_talker(talker, thinker_out, f"t{i}") for i in range(3)))
    d.step()  # the three talker prefills
    stats = talker.batcher.stats()
    assert stats["running"] == 3 and stats["waiting"] == 0 and stats["preemptions"] == 0
    assert 0 < stats["kv_cache_usage"] < 0.01  # a few blocks of a 4 GiB (default CPU) pool
    d.run()
    assert talker.batcher.stats() == {"running": 0, "waiting": 0, "kv_cache_usage": 0.0, "preemptions": 0}


# ------------------------------------------------------------------------------ scheduler unit tests


def run(plan: list[tuple[ScheduledSeq, int]]) -> list[tuple[str, int]]:
    """What the engine does after a step: the scheduled tokens are now cached."""
    for seq, n in plan:
        seq.pending -= n
        seq.cached += n
    return [(seq.rid, n) for seq, n in plan]


def add(sched: LMScheduler, rid: str, pending: int, priority: int = 0) -> ScheduledSeq:
    seq = sched.add(rid, priority)
    seq.pending = pending
    return seq


def test_scheduler_splits_the_budget_between_decodes_and_a_chunked_prefill() -> None:
    sched = LMScheduler(BlockAllocator(100, 4), max_num_seqs=8, max_num_batched_tokens=8)
    a, b = add(sched, "a", 3), add(sched, "b", 2)
    assert run(sched.schedule({"a", "b"})[0]) == [("a", 3), ("b", 2)]
    a.pending = b.pending = 1  # both decode now
    c = add(sched, "c", 20)
    assert run(sched.schedule({"a", "b", "c"})[0]) == [("a", 1), ("b", 1), ("c", 6)]
    a.pending = b.pending = 1
    assert run(sched.schedule({"a", "b", "c"})[0]) == [("a", 1), ("b", 1), ("c", 6)]
    a.pending = b.pending = 1
    assert run(sched.schedule({"a", "b", "c"})[0]) == [("a", 1), ("b", 1), ("c", 6)]
    a.pending = b.pending = 1
    assert run(sched.schedule({"a", "b", "c"})[0]) == [("a", 1), ("b", 1), ("c", 2)]
    assert c.pending == 0 and len(c.blocks) == 5
    # an OLDER request with many rows to (re)compute still leaves one token per running decode
    a.pending, b.pending, c.pending = 30, 1, 1
    assert run(sched.schedule({"a", "b", "c"})[0]) == [("a", 6), ("b", 1), ("c", 1)]
    # more decodes than budget: the oldest decode first, nobody gets more than it needs
    sched2 = LMScheduler(BlockAllocator(100, 4), max_num_seqs=8, max_num_batched_tokens=2)
    seqs = [add(sched2, str(i), 1) for i in range(3)]
    assert run(sched2.schedule({"0", "1", "2"})[0]) == [("0", 1), ("1", 1)]
    assert [s.running for s in seqs] == [True, True, False]


def test_without_chunked_prefill_a_prompt_waits_until_it_fits_one_step_whole() -> None:
    sched = LMScheduler(BlockAllocator(100, 4), max_num_seqs=8, max_num_batched_tokens=8, chunked_prefill=False)
    a, b = add(sched, "a", 3), add(sched, "b", 2)
    assert run(sched.schedule({"a", "b"})[0]) == [("a", 3), ("b", 2)]
    a.pending = b.pending = 1
    c, d = add(sched, "c", 7), add(sched, "d", 1)  # c needs 7 of the 6 the decodes leave; d must not overtake it
    assert run(sched.schedule({"a", "b", "c", "d"})[0]) == [("a", 1), ("b", 1)]
    assert not c.running and c.blocks == [] and [s.rid for s in sched.waiting] == ["c", "d"]
    sched.remove(b)  # one decode fewer: c's 7 fit beside a's 1
    a.pending = 1
    assert run(sched.schedule({"a", "c", "d"})[0]) == [("a", 1), ("c", 7)]
    a.pending = c.pending = 1
    assert run(sched.schedule({"a", "c", "d"})[0]) == [("a", 1), ("c", 1), ("d", 1)]
    assert d.running and d.cached == 1 and sched.waiting == []


def test_scheduler_admits_first_come_first_served() -> None:
    alloc = BlockAllocator(4, 4)
    sched = LMScheduler(alloc, max_num_seqs=8, max_num_batched_tokens=100)
    add(sched, "big", 12)  # 3 blocks
    run(sched.schedule({"big"})[0])
    add(sched, "huge", 8)  # 2 blocks: only 1 free
    add(sched, "small", 2)  # would fit, but must not overtake "huge"
    assert run(sched.schedule({"huge", "small"})[0]) == []
    assert [s.rid for s in sched.waiting] == ["huge", "small"]
    # a waiting request with nothing to run (not ready) does not hold the queue up
    assert run(sched.schedule({"small"})[0]) == [("small", 2)]
    sched.remove(sched.running[0])  # "big" finishes
    assert run(sched.schedule({"huge"})[0]) == [("huge", 8)]
    assert alloc.num_free == 4 - 2 - 1


def test_scheduler_caps_running_requests_at_max_num_seqs() -> None:
    alloc = BlockAllocator(100, 4)
    sched = LMScheduler(alloc, max_num_seqs=2, max_num_batched_tokens=100)
    a, b, c = (add(sched, rid, 3) for rid in "abc")
    assert run(sched.schedule({"a", "b", "c"})[0]) == [("a", 3), ("b", 3)]
    a.pending = b.pending = 1
    assert run(sched.schedule({"a", "b", "c"})[0]) == [("a", 1), ("b", 1)]
    assert sched.stats()["running"] == 2 and sched.stats()["waiting"] == 1
    sched.remove(a)
    b.pending = 1
    assert run(sched.schedule({"b", "c"})[0]) == [("b", 1), ("c", 3)]
    assert alloc.num_free == 100 - 2 - 1


def _three_running(blocks: int, c_tokens: int = 4) -> tuple[LMScheduler, list[ScheduledSeq]]:
    """a, b (1 full block each) and c (`c_tokens`) running in a pool of `blocks` blocks of 4; all decode next."""
    sched = LMScheduler(BlockAllocator(blocks, 4), max_num_seqs=8, max_num_batched_tokens=100)
    seqs = [add(sched, "a", 4), add(sched, "b", 4), add(sched, "c", c_tokens)]
    run(sched.schedule({"a", "b", "c"})[0])
    for s in seqs:
        s.pending = 1
    return sched, seqs


def test_scheduler_preempts_the_newest_running_request() -> None:
    sched, (a, b, c) = _three_running(4)  # 1 block free: a takes it, b needs one more
    plan, preempted = sched.schedule({"a", "b", "c"})
    assert run(plan) == [("a", 1), ("b", 1)] and preempted == [c]
    assert sched.preemptions == 1 and not c.running and c.blocks == [] and c.cached == 0
    assert c.pending == 5  # its 4 cached tokens are recomputed, then its pending decode row
    assert sched.waiting == [c] and sched.allocator.num_free == 0
    # the newest request preempts itself rather than an older one
    sched2, (a2, b2, c2) = _three_running(3)  # no block free
    b2.pending = 0  # only a and c need a block now
    plan, preempted = sched2.schedule({"a", "c"})
    assert run(plan) == [("a", 1)] and preempted == [c2] and a2.running and b2.running


def test_scheduler_does_not_let_a_newer_request_overtake_one_it_preempted() -> None:
    sched, (a, b, c) = _three_running(5, c_tokens=8)  # a 1, b 1, c 2 blocks, 1 free
    d = add(sched, "d", 1)
    plan, preempted = sched.schedule({"a", "b", "c", "d"})
    assert preempted == [c] and run(plan) == [("a", 1), ("b", 1)]
    assert [s.rid for s in sched.waiting] == ["c", "d"] and not d.running


def test_scheduler_never_preempts_busy_requests() -> None:
    sched, (a, b, c) = _three_running(4)  # c is in a step in flight (pipeline parallelism)
    plan, preempted = sched.schedule({"a", "b"}, busy={"c"})
    assert run(plan) == [("a", 1)] and preempted == [b]  # b, newest of the rest, gives way
    assert c.running and len(c.blocks) == 1 and sched.preemptions == 1
    # no block free and every other request busy: the request gives way itself
    sched2, (a2, b2, c2) = _three_running(3)
    plan, preempted = sched2.schedule({"b"}, busy={"a", "c"})
    assert plan == [] and preempted == [b2] and a2.running and c2.running


def test_priority_policy_orders_and_preempts_by_priority() -> None:
    # seats: a waiting request outranking a running one takes its seat; equal priority waits (arrival order)
    sched = LMScheduler(BlockAllocator(100, 4), max_num_seqs=2, max_num_batched_tokens=100, policy="priority")
    a, b = add(sched, "a", 3, priority=5), add(sched, "b", 3, priority=1)
    assert run(sched.schedule({"a", "b"})[0]) == [("b", 3), ("a", 3)]  # b first: lower value, sooner
    a.pending = b.pending = 1
    c = add(sched, "c", 2, priority=0)
    plan, preempted = sched.schedule({"a", "b", "c"})
    assert preempted == [] and run(plan) == [("b", 1), ("a", 1)]  # both are in this step: nothing to take
    d = add(sched, "d", 2, priority=9)  # ranks below every running request: waits
    plan, preempted = sched.schedule({"c", "d"})  # a and b have no input this step
    assert preempted == [a] and run(plan) == [("c", 2)] and not a.running and c.running
    assert sched.waiting == [a, d] and a.pending == 4  # recomputed when it runs again
    e = add(sched, "e", 1, priority=1)  # b (priority 1, older) is not preempted for an equal priority
    assert run(sched.schedule({"e"})[0]) == [] and b.running and not e.running
    # blocks: the lowest-ranked running request (not busy) gives its blocks to a higher-priority newcomer
    sched2 = LMScheduler(BlockAllocator(2, 4), max_num_seqs=8, max_num_batched_tokens=100, policy="priority")
    low, mid = add(sched2, "low", 4, priority=3), add(sched2, "mid", 4, priority=2)
    run(sched2.schedule({"low", "mid"})[0])
    urgent = add(sched2, "urgent", 4, priority=-1)
    plan, preempted = sched2.schedule({"urgent"}, busy={"mid"})
    assert preempted == [low] and run(plan) == [("urgent", 4)] and urgent.running and mid.running
    assert sched2.preemptions == 1


def test_fcfs_ignores_priorities() -> None:
    sched = LMScheduler(BlockAllocator(100, 4), max_num_seqs=1, max_num_batched_tokens=100)
    a, b = add(sched, "a", 3, priority=5), add(sched, "b", 3, priority=-5)
    assert run(sched.schedule({"a", "b"})[0]) == [("a", 3)] and (a.priority, b.priority) == (0, 0)
    a.pending = 1
    plan, preempted = sched.schedule({"b"})
    assert plan == [] and preempted == [] and a.running
    with pytest.raises(ValueError, match="scheduling policy must be one of fcfs, priority, got 'lifo'"):
        LMScheduler(BlockAllocator(1, 4), max_num_seqs=1, max_num_batched_tokens=1, policy="lifo")


def test_thinker_takes_priorities_only_under_the_priority_policy(model_dir: Path) -> None:
    """The request's `priority` option: refused under fcfs (vLLM's rule), the scheduler's order under priority."""
    fcfs = thinker_handler(model_dir, ServeArgs(device="cpu"))
    with pytest.raises(ValueError, match="priority 3 needs --scheduling-policy priority; this stage schedules first"):
        open_thinker(fcfs, "r", prompts([4])[0], 2, priority="3")
    open_thinker(fcfs, "zero", prompts([4])[0], 2, priority="0").close()  # 0 is every stage's
    handler = thinker_handler(model_dir, ServeArgs(device="cpu", scheduling_policy="priority", max_num_seqs=1))
    late = open_thinker(handler, "late", prompts([4])[0], 2, priority="7")
    soon = open_thinker(handler, "soon", prompts([4])[0], 2, priority="-2")
    engine = handler.batcher.engine
    engine.feed(late.key, late.prompt_run())
    engine.feed(soon.key, soon.prompt_run())
    assert [s.rid for s in engine.scheduler.waiting] == [soon.key, late.key]
    with pytest.raises(ValueError, match="option priority must be a whole number, got 'high'"):
        open_thinker(handler, "bad", prompts([4])[0], 2, priority="high")
    for task in (late, soon):
        task.close()
