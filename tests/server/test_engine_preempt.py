"""Urgent steps overtake bulk ones (EngineLoop `preempt`, `StepGate`): in a stage with two compute slots, a
step with a request waiting for its first output starts at once beside a bulk step in flight, and the bulk
step waits at its next model checkpoint until the urgent step is over (for at most `max_pause_s` per step).
Checked on the gate alone (threads calling `checkpoint`), and on an engine loop whose fake batcher records
when each step ran, against the same loop without `preempt` (the urgent step then waits for the bulk one)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from omnimesh.engine.loop import EngineDone, EngineLoop
from omnimesh.engine.step_gate import StepGate, checkpoint
from omnimesh.engine.task import StageTask
from omnimesh.transport.frames import StageChunk

BULK_ROUNDS = 30  # checkpoints of the fake bulk step, ROUND_S apart: ~0.15 s of work
ROUND_S = 0.005


def _bulk_step(gate: StepGate, rounds: int, marks: list[float]) -> None:
    """A bulk step on this thread: `rounds` checkpoints, each followed by a little work (a mark, a sleep)."""
    with gate.bulk():
        for _ in range(rounds):
            checkpoint()
            marks.append(time.monotonic())
            time.sleep(ROUND_S)


def test_a_bulk_step_waits_at_its_checkpoints_while_an_urgent_step_runs() -> None:
    gate = StepGate(max_pause_s=5.0)
    marks: list[float] = []
    bulk = threading.Thread(target=_bulk_step, args=(gate, BULK_ROUNDS, marks))
    bulk.start()
    while len(marks) < 3:  # the bulk step is under way
        time.sleep(0.001)
    with gate.urgent():
        entered = time.monotonic()
        time.sleep(0.2)
        left = time.monotonic()
    bulk.join(10)
    assert not bulk.is_alive() and len(marks) == BULK_ROUNDS  # it finished all its work after the pause
    during = [m for m in marks if entered + ROUND_S * 2 < m < left]  # (one round may have been past its checkpoint)
    assert during == [], "the bulk step went on while the urgent step ran"
    assert any(m >= left for m in marks) and gate.pauses >= 1


def test_a_bulk_step_pauses_at_most_max_pause_s_in_all() -> None:
    gate = StepGate(max_pause_s=0.2)
    marks: list[float] = []
    with gate.urgent():  # urgent work that outlasts the budget: the bulk step waits 0.2 s in all, then goes on
        started = time.monotonic()
        _bulk_step(gate, 10, marks)
        took = time.monotonic() - started
    assert len(marks) == 10 and gate.pauses == 1  # the budget was spent at its first checkpoint
    assert 0.2 <= took < 0.2 + 10 * ROUND_S + 0.5, took


def test_checkpoints_outside_a_gated_bulk_step_never_wait() -> None:
    gate = StepGate(max_pause_s=5.0)
    with gate.urgent():
        started = time.monotonic()
        for _ in range(1000):
            checkpoint()  # an urgent step's own checkpoints, a rank process, a test: no gate on this thread
        with gate.bulk():
            pass  # a bulk step that ended: its thread is ungated again
        checkpoint()
    assert time.monotonic() - started < 0.5 and gate.pauses == 0


def test_an_urgent_step_that_fails_lets_the_bulk_step_go_on() -> None:
    gate = StepGate(max_pause_s=5.0)
    marks: list[float] = []
    bulk = threading.Thread(target=_bulk_step, args=(gate, 5, marks))
    with pytest.raises(RuntimeError, match="model bug"), gate.urgent():
        bulk.start()
        while gate.pauses == 0:  # the bulk step waits at its first checkpoint
            time.sleep(0.001)
        raise RuntimeError("model bug")
    bulk.join(2)
    assert not bulk.is_alive() and len(marks) == 5  # resumed at once, long before its 5 s budget


def test_a_negative_pause_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="max_pause_s"):
        StepGate(max_pause_s=-1)


class Job(StageTask):
    """`steps` steps of `rounds` checkpoints each; urgent (waits for its first output) until its first step."""

    def __init__(self, rid: str, steps: int, rounds: int, urgent: bool):
        super().__init__(rid)
        self.left, self.rounds, self.is_urgent = steps, rounds, urgent
        self.started = threading.Event()

    def feed(self, chunk: StageChunk) -> None:
        pass

    def ready(self) -> bool:
        return self.left > 0

    def urgent(self) -> bool:
        return self.is_urgent and self.completion_tokens == 0

    def step(self) -> list[StageChunk]:  # the batcher steps it
        raise AssertionError("stepped outside its batcher")


class SpanBatcher:
    """A batcher without lanes (like the thinker's): records (request ids, start, end, urgent) per step; each
    step runs the largest `rounds` of its requests, a checkpoint before each round."""

    def __init__(self) -> None:
        self.spans: list[tuple[list[str], float, float, bool]] = []
        self.bulk_rounds: list[float] = []  # when each round of a bulk step ran

    def step_batch(self, tasks: list[StageTask]) -> dict[str, list[StageChunk] | BaseException]:
        jobs = [t for t in tasks if isinstance(t, Job)]
        urgent = any(j.urgent() for j in jobs)
        started = time.monotonic()
        for job in jobs:
            job.started.set()
        for _ in range(max(j.rounds for j in jobs)):
            checkpoint()
            if not urgent:
                self.bulk_rounds.append(time.monotonic())
            time.sleep(ROUND_S)
        out: dict[str, list[StageChunk] | BaseException] = {}
        for job in jobs:
            job.left -= 1
            job.completion_tokens += 1
            job.finished = job.left == 0
            out[job.request_id] = [StageChunk()]
        self.spans.append((sorted(j.request_id for j in jobs), started, time.monotonic(), urgent))
        return out


async def _overtake(preempt: bool) -> SpanBatcher:
    """A stream in a long bulk step; a new request arrives during it and needs one short step."""
    batcher = SpanBatcher()
    loop = EngineLoop("llm", max_inflight=2 if preempt else 1, batcher=batcher, yield_steps=16, preempt=preempt)
    loop.start()
    try:
        stream = Job("stream", steps=2, rounds=BULK_ROUNDS, urgent=False)
        streamed = loop.submit(stream)
        assert await asyncio.to_thread(stream.started.wait, 10)
        await asyncio.sleep(0.02)
        new = loop.submit(Job("new", steps=1, rounds=8, urgent=True))
        for queue in (new, streamed):
            while not isinstance(await asyncio.wait_for(queue.get(), 10), EngineDone):
                pass
    finally:
        await loop.stop()
    return batcher


def test_an_urgent_step_starts_beside_a_bulk_step_which_pauses_for_it() -> None:
    batcher = asyncio.run(_overtake(preempt=True))
    spans = batcher.spans
    bulk = next(s for s in spans if s[0] == ["stream"])
    urgent = next(s for s in spans if s[0] == ["new"])
    assert bulk[1] < urgent[1] and urgent[2] < bulk[2], spans  # started and ended inside the bulk step
    assert urgent[2] - urgent[1] < 0.5 * (bulk[2] - bulk[1])
    # the bulk step did no round while the urgent one ran (one may have been past its checkpoint already)
    assert [t for t in batcher.bulk_rounds if urgent[1] + 2 * ROUND_S < t < urgent[2]] == [], (urgent, batcher.bulk_rounds)
    # two steps ran at once only as a bulk step and an urgent one
    for a in spans:
        for b in spans:
            if a is not b and a[1] < b[2] and b[1] < a[2]:
                assert a[3] != b[3], spans


def test_without_preempt_the_urgent_step_waits_for_the_bulk_step() -> None:
    spans = asyncio.run(_overtake(preempt=False)).spans
    bulk = next(s for s in spans if s[0] == ["stream"])
    urgent = next(s for s in spans if "new" in s[0])
    assert urgent[1] >= bulk[2], spans


def test_preempt_needs_two_slots() -> None:
    with pytest.raises(ValueError, match="max_inflight 2"):
        EngineLoop("llm", max_inflight=1, batcher=SpanBatcher(), preempt=True)
