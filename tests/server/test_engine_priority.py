"""EngineLoop priorities (`bulk_nice`, `BulkLane`): a step with a request that still waits for its first
output (`StageTask.urgent`) runs on a compute thread at the stage's own OS priority; a step without one runs
on a bulk thread that lowered its own nice value by `bulk_nice` (Linux keeps nice per thread). An urgent
request that becomes ready while a bulk step holds the only slot lifts that step back (where the OS allows
raising a priority). With one step in flight at a time, a request's `close` never overlaps a step on the
other thread."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from omnimesh.engine.loop import EngineDone, EngineLoop
from omnimesh.engine.task import StageTask
from omnimesh.transport.frames import StageChunk

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")


def thread_name() -> str:
    return Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()


class CountTask(StageTask):
    """`steps` steps, one output each; urgent for its first `urgent_steps`. Each step records the OS priority
    and name of the thread it ran on; `hold` (an Event) keeps a step running until it is set."""

    def __init__(self, rid: str, steps: int, urgent_steps: int, hold: threading.Event | None = None):
        super().__init__(rid)
        self.left, self.urgent_steps, self.hold = steps, urgent_steps, hold
        self.seen: list[tuple[int, str]] = []
        self.spans: list[tuple[float, float]] = []
        self.closed_at = 0.0
        self.started = threading.Event()
        self.held_until: list[int] = []  # per step, the thread's priority when `hold` let it go on

    def feed(self, chunk: StageChunk) -> None:
        pass

    def ready(self) -> bool:
        return self.left > 0

    def urgent(self) -> bool:
        return self.completion_tokens < self.urgent_steps

    def step(self) -> list[StageChunk]:
        t0 = time.monotonic()
        self.seen.append((os.getpriority(os.PRIO_PROCESS, 0), thread_name()))
        self.started.set()
        if self.hold is not None:
            assert self.hold.wait(10)
            self.held_until.append(os.getpriority(os.PRIO_PROCESS, 0))
        self.left -= 1
        self.completion_tokens += 1
        self.finished = self.left == 0
        self.spans.append((t0, time.monotonic()))
        return [StageChunk(text=str(self.left))]

    def close(self) -> None:
        self.closed_at = time.monotonic()


async def run_to_end(queue: asyncio.Queue) -> None:
    while not isinstance(await asyncio.wait_for(queue.get(), 10), EngineDone):
        pass


async def run_alone(task: CountTask, name: str, bulk_nice: int = 0) -> CountTask:
    loop = EngineLoop(name, bulk_nice=bulk_nice)
    loop.start()
    try:
        await run_to_end(loop.submit(task))
    finally:
        await loop.stop()
    return task


async def test_steps_without_an_urgent_request_run_lower() -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    task = await run_alone(CountTask("r", steps=4, urgent_steps=2), "prio", bulk_nice=5)
    assert task.seen == [(base, "prio-compute")] * 2 + [(min(19, base + 5), "prio-bulk")] * 2
    assert os.getpriority(os.PRIO_PROCESS, 0) == base  # only the bulk thread lowered itself


class BehindTask(CountTask):
    """Never urgent after its first step; `behind` (its playback deadline near) for the steps in `behind_at`."""

    def __init__(self, rid: str, steps: int, behind_at: set[int]):
        super().__init__(rid, steps, urgent_steps=0)
        self.behind_at = behind_at

    def behind(self) -> bool:
        return self.completion_tokens in self.behind_at


async def test_a_request_whose_deadline_is_near_steps_at_the_stage_priority() -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    task = await run_alone(BehindTask("r", steps=4, behind_at={1, 2}), "due", bulk_nice=5)
    low = (min(19, base + 5), "due-bulk")
    assert task.seen == [low, (base, "due-compute"), (base, "due-compute"), low]


async def test_without_bulk_nice_every_step_keeps_the_stage_priority() -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    task = await run_alone(CountTask("r", steps=3, urgent_steps=0), "flat")
    assert task.seen == [(base, "flat-compute")] * 3


@contextlib.asynccontextmanager
async def bulk_step_in_flight(name: str, bulk_nice: int, steps: int) -> AsyncIterator[tuple[EngineLoop, CountTask, threading.Event, asyncio.Queue]]:
    """An engine whose only slot runs a bulk step held open until the yielded Event is set."""
    hold = threading.Event()
    loop = EngineLoop(name, bulk_nice=bulk_nice)
    loop.start()
    try:
        bulk = CountTask("bulk", steps=steps, urgent_steps=0, hold=hold)
        done = loop.submit(bulk)
        assert await asyncio.to_thread(bulk.started.wait, 10)
        yield loop, bulk, hold, done
    finally:
        hold.set()
        await loop.stop()


async def wait_until(condition: Callable[[], object]) -> None:
    for _ in range(100):
        if condition():
            return
        await asyncio.sleep(0.01)


async def test_a_close_never_overlaps_a_bulk_step() -> None:
    """One step at a time: a cancelled request's close goes to the urgent thread while a bulk step runs on the
    other one; it waits for that step to end (close frees model state, e.g. KV blocks)."""
    async with bulk_step_in_flight("serial", 3, steps=1) as (loop, bulk, hold, done):
        idle = CountTask("idle", steps=0, urgent_steps=1)  # never ready: no step of its own
        loop.submit(idle)
        loop.cancel("idle")
        await asyncio.sleep(0.1)
        assert idle.closed_at == 0.0  # still waiting for the bulk step
        hold.set()
        await run_to_end(done)
        await wait_until(lambda: idle.closed_at)
    assert bulk.seen[0][1] == "serial-bulk"
    assert idle.closed_at >= bulk.spans[0][1]


def may_raise_priority() -> bool:
    """Whether this process may raise a thread's priority again (CAP_SYS_NICE or RLIMIT_NICE)."""
    result: list[bool] = []

    def probe() -> None:
        base = os.getpriority(os.PRIO_PROCESS, 0)
        if base >= 19:
            result.append(False)
            return
        os.setpriority(os.PRIO_PROCESS, 0, base + 1)
        try:
            os.setpriority(os.PRIO_PROCESS, 0, base)
            result.append(True)
        except PermissionError:
            result.append(False)

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return result[0]


async def test_an_urgent_request_lifts_the_bulk_step_it_waits_for() -> None:
    if not may_raise_priority():
        pytest.skip("raising a thread's priority needs CAP_SYS_NICE or RLIMIT_NICE here")
    base = os.getpriority(os.PRIO_PROCESS, 0)
    async with bulk_step_in_flight("lift", 6, steps=2) as (loop, bulk, hold, done):
        assert bulk.seen[0] == (min(19, base + 6), "lift-bulk")
        urgent = CountTask("urgent", steps=1, urgent_steps=1)
        urgent_done = loop.submit(urgent)  # ready at once: waits for the bulk step (one slot)
        await wait_until(lambda: loop._bulk is not None and loop._bulk.boosts)
        hold.set()
        await run_to_end(urgent_done)
        await run_to_end(done)
    assert bulk.held_until[0] == base  # lifted while the urgent request waited
    assert bulk.seen[1] == (min(19, base + 6), "lift-bulk")  # the next bulk step starts low again
    assert bulk.held_until[1] == min(19, base + 6)
    assert urgent.seen == [(base, "lift-compute")]


def test_bulk_nice_is_checked() -> None:
    with pytest.raises(ValueError, match="bulk_nice must be from 0 to 19"):
        EngineLoop("bad", bulk_nice=20)


def test_a_refused_lift_turns_boosting_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the right to raise a priority (no CAP_SYS_NICE / RLIMIT_NICE), the first refusal turns the
    boost off: bulk steps then run to their end at their low priority, and nothing fails."""
    from omnimesh.engine import bulk_lane

    lane = bulk_lane.BulkLane("deny", 4, 1)
    started, hold = threading.Event(), threading.Event()

    def step() -> int:
        started.set()
        assert hold.wait(10)
        return os.getpriority(os.PRIO_PROCESS, 0)

    future = lane.executor.submit(lane.run, step)
    try:
        assert started.wait(10)

        def refuse(which: int, who: int, value: int) -> None:
            raise PermissionError(1, "Operation not permitted")

        monkeypatch.setattr(bulk_lane.os, "setpriority", refuse)
        assert lane.boost() == 0 and not lane.can_boost
        assert lane.boost() == 0  # no second try
    finally:
        hold.set()
    assert future.result(10) == lane.value
    lane.shutdown()


async def test_bulk_nice_is_ignored_where_nice_is_not_per_thread(monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """Elsewhere than Linux, lowering "this thread" would lower the whole process: the setting is ignored with
    a warning, and every step runs at the stage's priority."""
    from omnimesh.engine import loop as engine_loop

    monkeypatch.setattr(engine_loop, "thread_priority_is_own", lambda: False)
    base = os.getpriority(os.PRIO_PROCESS, 0)
    task = await run_alone(CountTask("r", steps=2, urgent_steps=0), "other", bulk_nice=5)
    assert task.seen == [(base, "other-compute")] * 2
    assert "bulk_nice 5 is ignored: per-thread priorities need Linux" in caplog.text
