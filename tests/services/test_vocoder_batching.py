"""The vocoder's continuous batching: one model call per engine step for all ready requests, each request's
audio equal to its solo run and to one-piece decoding.

Folder: the tiny one, with code2wav's pre-transformer sharpened (q/k x 8, layer scales U(0.5, 1.5)): the
tiny init (layer scale 0.01) leaves the pre-transformer almost silent in the audio, so a mask or padding
error in the batched attention would move the samples by far less than the tolerance;
`test_the_pre_transformer_is_audible` proves the comparisons see it. Requests: window 10, code lengths
1, 7 (shorter than a window), 25 and 46 (end mid-window), 30 (whole windows) and 83 (past the 72-code
sliding window), fed in uneven chunks and joining at different steps, so one batch mixes first windows
(no conv state, empty caches) with later ones and with short last windows.

Run: python -m pytest tests/services/test_vocoder_batching.py -q
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from omnimesh.engine.loop import EngineDone, EngineLoop
from omnimesh.models.qwen3_omni.code2wav_shard import C2WShardSpec, Code2WavTransformerBackend
from omnimesh.models.qwen3_omni.stage_loading import load_code2wav
from omnimesh.models.qwen3_omni.tiny import build_tiny_qwen3_omni
from omnimesh.transport.frames import StageChunk
from services.vocoder.vocoder_batcher import VocoderBatcher
from services.vocoder.vocoder_task import VocoderTask

WINDOW = 10
LENGTHS = {"a": 1, "b": 7, "c": 25, "d": 30, "e": 46, "f": 83}
JOIN = {"a": 2, "b": 0, "c": 1, "d": 0, "e": 3, "f": 0}  # step at which each request's first chunk arrives
CHUNKS = (4, 9, 3, 13)  # sizes of the chunks the talker sends, cycled
PREFIX = "code2wav.pre_transformer."
TOL = 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    folder = build_tiny_qwen3_omni(tmp_path_factory.mktemp("tiny") / "m")
    path = str(folder / "model.safetensors")
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(0)
    for key in sorted(k for k in tensors if k.startswith(PREFIX)):
        if key.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            tensors[key] = tensors[key] * 8
        elif key.endswith("layer_scale.scale"):
            tensors[key] = 0.5 + torch.rand(tensors[key].shape, generator=gen)
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def model(model_dir: Path) -> tuple[Any, Code2WavTransformerBackend]:
    return load_code2wav(model_dir)  # (embedding + convs, in-process pre-transformer backend)


@pytest.fixture(scope="module")
def codes() -> dict[str, torch.Tensor]:
    return {rid: torch.randint(0, 256, (4, n), generator=torch.Generator().manual_seed(i))
            for i, (rid, n) in enumerate(LENGTHS.items())}


@pytest.fixture(scope="module")
def one_piece(model_dir: Path, codes: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from transformers import Qwen3OmniMoeForConditionalGeneration

    ref = Qwen3OmniMoeForConditionalGeneration.from_pretrained(model_dir).code2wav.eval()
    with torch.no_grad():
        return {rid: ref(c.unsqueeze(0)).view(-1) for rid, c in codes.items()}  # (n * 1920 - 555,)


def chunks_of(codes: torch.Tensor) -> list[StageChunk]:
    out, start, i = [], 0, 0
    while start < codes.shape[1]:
        size = CHUNKS[i % len(CHUNKS)]
        out.append(StageChunk(tensors={"codes": codes[:, start:start + size]}))
        start, i = start + size, i + 1
    out[-1].final = True
    return out


Step = Callable[[list[VocoderTask]], dict[str, Any]]


def drive(model: tuple[Any, Any], codes: dict[str, torch.Tensor], step: Step,
          prepare: Callable[[dict[str, VocoderTask]], None] = lambda tasks: None) -> dict[str, Any]:
    """The engine's schedule: at step s every request that joined gets its next input chunk, then every ready
    request is stepped by `step`. -> per request its pcm pieces (or the exception that ended it)."""
    c2w, backend = model
    tasks = {rid: VocoderTask(rid, c2w, (WINDOW,), backend) for rid in codes}
    prepare(tasks)
    inputs = {rid: chunks_of(c) for rid, c in codes.items()}
    out: dict[str, Any] = {rid: [] for rid in codes}
    for s in range(200):
        for rid, task in tasks.items():
            if s >= JOIN[rid] and inputs[rid] and not isinstance(out[rid], BaseException):
                task.feed(inputs[rid].pop(0))
        ready = [t for t in tasks.values() if not t.finished and not isinstance(out[t.request_id], BaseException)
                 and t.ready()]
        if not ready and not any(inputs.values()):
            break
        for rid, result in step(ready).items():
            out[rid] = result if isinstance(result, BaseException) else out[rid] + [c.tensors["pcm"] for c in result]
    for rid, task in tasks.items():
        assert isinstance(out[rid], BaseException) or (task.finished and task.completion_tokens == LENGTHS[rid])
        task.close()
    return out


def solo(tasks: list[VocoderTask]) -> dict[str, Any]:
    return {t.request_id: t.step() for t in tasks}  # each request alone: VocoderTask.step


class Counted:
    """Counts the model calls: pre-transformer (with its batch size) and conv stack."""

    def __init__(self, c2w: Any, backend: Any) -> None:
        self.transformer: list[int] = []
        self.convs = 0
        self._backend, self._forward = backend, backend.forward
        backend.forward = self._count_forward
        self._hook = c2w.decoder[0].conv.register_forward_hook(self._count_convs)  # once per conv-stack call

    def _count_forward(self, handles: Any, x: torch.Tensor, *args: Any) -> torch.Tensor:
        self.transformer.append(x.shape[0])
        return self._forward(handles, x, *args)

    def _count_convs(self, *_: Any) -> None:
        self.convs += 1

    def close(self) -> None:
        self._backend.forward = self._forward
        self._hook.remove()


def test_batched_equals_solo_and_one_piece(model: tuple[Any, Any], codes: dict[str, torch.Tensor],
                                           one_piece: dict[str, torch.Tensor]) -> None:
    alone = drive(model, codes, solo)
    batcher = VocoderBatcher()
    counted = Counted(*model)
    steps: list[int] = []  # per step: how many of its requests decoded codes
    offered: list[tuple[int, int, bool]] = []  # per step: requests with codes, first windows, only those ran

    def batched(tasks: list[VocoderTask]) -> dict[str, Any]:
        sizes = {t.request_id: t.next_window_size() for t in tasks}
        firsts = {t.request_id for t in tasks if t.completion_tokens == 0 and sizes[t.request_id]}
        result = batcher.step_batch(list(tasks))
        steps.append(sum(sizes[rid] > 0 for rid in result))
        offered.append((sum(n > 0 for n in sizes.values()), len(firsts), set(result) == firsts))
        return result

    try:
        together = drive(model, codes, batched)
    finally:
        counted.close()
    worst = 0.0
    for rid in codes:
        # same windows -> same chunks as the solo run, each equal to it; all of them == one-piece decode
        assert [p.shape for p in together[rid]] == [p.shape for p in alone[rid]]
        assert all(p.dtype == torch.float32 for p in together[rid])
        torch.testing.assert_close(torch.cat(together[rid]), torch.cat(alone[rid]), atol=TOL, rtol=0)
        torch.testing.assert_close(torch.cat(together[rid]), one_piece[rid], atol=TOL, rtol=0)
        worst = max(worst, float((torch.cat(together[rid]) - torch.cat(alone[rid])).abs().max()))
    print(f"batched vs solo: max |diff| = {worst:.3g} ({'bit-identical' if worst == 0 else 'not bit-identical'})")
    # one pre-transformer call per step for every request with codes in it; the conv stack in groups of
    # CPU_CONV_ROWS rows on CPU (wider batches are slower there, see code2wav.run_convs)
    from omnimesh.models.qwen3_omni.code2wav import CPU_CONV_ROWS

    decoding = [n for n in steps if n]
    assert counted.transformer == decoding and counted.convs == sum(-(-n // CPU_CONV_ROWS) for n in decoding)
    assert max(decoding) >= 3  # the schedule really batches
    # a request's first window goes ahead of later windows in a step of its own, never twice in a row
    first_only = [i for i, (n, f, only) in enumerate(offered) if only and 0 < f < n]
    assert first_only, offered
    assert all(not offered[i + 1][2] or offered[i + 1][1] in (0, offered[i + 1][0]) for i in first_only
               if i + 1 < len(offered)), offered


def test_the_pre_transformer_is_audible(model: tuple[Any, Any], codes: dict[str, torch.Tensor],
                                        one_piece: dict[str, torch.Tensor]) -> None:
    """Decoding f's codes after a forgotten history (fresh cache, same positions) changes the audio by far
    more than the tolerance: the comparisons above would see a mask that leaks or drops keys."""
    c2w, backend = model
    task = VocoderTask("x", c2w, (80,), backend)
    task.feed(StageChunk(tensors={"codes": codes["f"]}, final=True))
    task.step()  # codes 0..79
    task.streamer.close()  # forget the history only (task.close() would end the request)
    task.streamer._handle = backend.open()  # a new, empty cache; positions continue at 80
    (last,) = task.step()
    task.close()
    tail = one_piece["f"][-last.tensors["pcm"].shape[0]:]
    assert float((last.tensors["pcm"] - tail).abs().max()) > 1e-3


def test_a_bad_request_fails_alone(model: tuple[Any, Any], codes: dict[str, torch.Tensor],
                                   one_piece: dict[str, torch.Tensor]) -> None:
    def corrupt(tasks: dict[str, VocoderTask]) -> None:
        original = tasks["c"].take_window
        tasks["c"].take_window = lambda: original().clamp(max=-3)  # type: ignore[method-assign]  # a bug upstream
        tasks["d"].streamer.close()  # its pre-transformer cache is gone

    batcher = VocoderBatcher()
    out = drive(model, codes, lambda tasks: batcher.step_batch(list(tasks)), corrupt)
    assert isinstance(out["c"], IndexError)
    assert isinstance(out["d"], ValueError) and "closed" in str(out["d"])
    for rid in ("a", "b", "e", "f"):
        torch.testing.assert_close(torch.cat(out[rid]), one_piece[rid], atol=TOL, rtol=0)


def test_max_codes_leaves_requests_for_the_next_step(model: tuple[Any, Any], codes: dict[str, torch.Tensor]) -> None:
    c2w, backend = model
    tasks = [VocoderTask(rid, c2w, (WINDOW,), backend) for rid in ("x", "y", "z")]
    for task, n in zip(tasks, (12, 10, 4)):
        task.feed(StageChunk(tensors={"codes": codes["f"][:, :n]}, final=True))
    result = VocoderBatcher(max_codes=15).step_batch(list(tasks))
    assert set(result) == {"x", "z"}  # 10 + 4 codes fit, y's 10 more would not
    assert [t.n_pending for t in tasks] == [2, 10, 0] and tasks[1].ready() and tasks[2].finished
    for task in tasks:
        task.close()


async def test_engine_loop_runs_the_batcher(model: tuple[Any, Any], codes: dict[str, torch.Tensor],
                                            one_piece: dict[str, torch.Tensor]) -> None:
    c2w, backend = model
    loop = EngineLoop("vocoder", batcher=VocoderBatcher())
    loop.start()
    try:
        queues = {rid: loop.submit(VocoderTask(rid, c2w, (WINDOW,), backend)) for rid in ("b", "c", "e")}
        for rid in queues:
            for chunk in chunks_of(codes[rid]):
                loop.feed(rid, chunk)
        for rid, queue in queues.items():
            pieces, event = [], await asyncio.wait_for(queue.get(), 60)
            while isinstance(event, StageChunk):
                pieces.append(event.tensors["pcm"])
                final = event.final
                event = await asyncio.wait_for(queue.get(), 60)
            assert isinstance(event, EngineDone) and final and event.completion_tokens == LENGTHS[rid]
            torch.testing.assert_close(torch.cat(pieces), one_piece[rid], atol=TOL, rtol=0)
    finally:
        await loop.stop()


def test_pipeline_parallel_batch_equals_single_rank(model_dir: Path, model: tuple[Any, Any],
                                                    codes: dict[str, torch.Tensor]) -> None:
    """The batched step over 2 gloo pipeline ranks (hidden (B, T, H) crosses the boundary) == in-process."""
    c2w, single = model
    backend = Code2WavTransformerBackend.build(C2WShardSpec(model_dir), pp=2, tp=1, timeout_s=120.0)
    try:
        batcher = VocoderBatcher()
        two_ranks = drive((c2w, backend), codes, lambda tasks: batcher.step_batch(list(tasks)))
    finally:
        assert backend.executor is not None
        backend.executor.shutdown()
    one_rank = drive((c2w, single), codes, lambda tasks: batcher.step_batch(list(tasks)))
    for rid in codes:
        torch.testing.assert_close(torch.cat(two_ranks[rid]), torch.cat(one_rank[rid]), atol=TOL, rtol=0)


def test_lanes_plan_a_first_window_beside_a_step_in_flight(model: tuple[Any, Any], codes: dict[str, torch.Tensor]) -> None:
    c2w, backend = model
    tasks = {rid: VocoderTask(rid, c2w, (3, WINDOW), backend) for rid in ("old", "new")}
    tasks["old"].feed(StageChunk(tensors={"codes": codes["d"][:, :3]}))
    tasks["old"].step()  # its first window is done: the next is a later one
    for task in tasks.values():
        task.feed(StageChunk(tensors={"codes": codes["d"][:, 3:20]}))
    old, new = tasks["old"], tasks["new"]
    assert not old.urgent() and new.urgent()  # urgent until its first window is decoded
    assert old.samples_out == 3 * 1920 - 555 and old.first_audio_at is not None  # the playback clock started
    assert new.audio_left() == float("inf") and not new.behind()  # no audio yet: no playback deadline
    old.samples_out = 10 * 24000  # as if 10 s of its audio were out: far from its playback deadline
    assert not old.behind()
    lane = VocoderBatcher(first_lane=True)
    ready = [old, new]
    assert lane.lanes(ready, free=2, busy=0) == [ready]  # nothing in flight: one step over everything
    assert lane.lanes(ready, free=1, busy=1) == [[new]]  # beside a step: first windows only
    assert lane.lanes([old], free=1, busy=1) == []
    assert lane.lanes(ready, free=0, busy=2) == []
    # 0.217 s of audio out and 0.1 s of it played: 0.117 s left, under the margin: its deadline is near
    old.samples_out, old.first_audio_at = 3 * 1920 - 555, time.monotonic() - 0.1
    assert old.behind() and not old.urgent() and 0.05 < old.audio_left() < 0.118
    assert lane.lanes([old], free=1, busy=1) == [[old]]  # so it gets the lane beside the step in flight
    assert lane.lanes(ready, free=1, busy=1) == [[new]]  # first windows still go first
    plain = VocoderBatcher()  # no lane (a pipeline-parallel stage): the engine's own share per free slot
    assert plain.lanes(ready, free=2, busy=0) is None
    for task in tasks.values():
        task.close()


LONG = 243  # codes of the long request: one 240-code window (~0.3 s here, ~10x the new one's first), then 3


@pytest.fixture(scope="module")
def long_codes(model_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes (4, LONG), their one-piece waveform)."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    codes = torch.randint(0, 256, (4, LONG), generator=torch.Generator().manual_seed(99))
    ref = Qwen3OmniMoeForConditionalGeneration.from_pretrained(model_dir).code2wav.eval()
    with torch.no_grad():
        return codes, ref(codes.unsqueeze(0)).view(-1)


async def test_a_first_window_does_not_wait_for_a_long_step(model: tuple[Any, Any], codes: dict[str, torch.Tensor],
                                                            one_piece: dict[str, torch.Tensor],
                                                            long_codes: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Two slots (the CPU stage): while one request decodes a long window, a new request's first window runs
    beside it and its audio comes out first; both streams still equal one-piece decoding."""
    c2w, backend = model
    loop = EngineLoop("vocoder", max_inflight=2, batcher=VocoderBatcher(first_lane=True))
    loop.start()
    arrived: dict[str, float] = {}
    one_piece = {**one_piece, "f": long_codes[1]}
    try:
        long_q = loop.submit(VocoderTask("f", c2w, (LONG - 3,), backend))
        loop.feed("f", StageChunk(tensors={"codes": long_codes[0]}, final=True))
        deadline = time.monotonic() + 10
        while loop._entries["f"].inflight is None:  # until its long step runs (not a guess at how soon)
            assert time.monotonic() < deadline, "the long request never started"
            await asyncio.sleep(0.001)
        new_q = loop.submit(VocoderTask("c", c2w, (2, WINDOW), backend))
        loop.feed("c", StageChunk(tensors={"codes": codes["c"]}, final=True))

        async def collect(rid: str, queue: asyncio.Queue) -> torch.Tensor:
            pieces, event = [], await asyncio.wait_for(queue.get(), 60)
            while isinstance(event, StageChunk):
                arrived.setdefault(rid, time.monotonic())
                pieces.append(event.tensors["pcm"])
                event = await asyncio.wait_for(queue.get(), 60)
            assert isinstance(event, EngineDone)
            return torch.cat(pieces)

        got = dict(zip(("f", "c"), await asyncio.gather(collect("f", long_q), collect("c", new_q))))
    finally:
        await loop.stop()
    assert arrived["c"] < arrived["f"], arrived
    for rid in ("f", "c"):
        torch.testing.assert_close(got[rid], one_piece[rid], atol=TOL, rtol=0)
