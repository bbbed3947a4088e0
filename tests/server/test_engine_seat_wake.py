"""A request waiting for a seat is stepped as soon as a finished request's `close` frees one. The close runs on
the compute executor: with two steps in flight it can run beside the waiting request's next step, which then
finds no seat, makes no progress, and leaves the loop idle until news comes. A close was no news: on a quiet
stage the waiting request hung until its deadline (seen once in CI: the thinker test of
--max-waiting-requests waited its 60 s). A close now wakes the loop."""

from __future__ import annotations

import threading
import time

from test_engine_priority import run_to_end

from omnimesh.engine.loop import EngineLoop
from omnimesh.engine.task import StageTask
from omnimesh.transport.frames import StageChunk


class SeatTask(StageTask):
    """`steps` steps; its seat (in `seats`) is given back only by `close`, a moment after the request ends (as
    the thinker's KV sequence is freed by its close)."""

    def __init__(self, rid: str, steps: int, seats: list[str], lock: threading.Lock):
        super().__init__(rid)
        self.left, self.seats, self.lock = steps, seats, lock

    def feed(self, chunk: StageChunk) -> None:
        pass

    def ready(self) -> bool:
        return self.left > 0

    def step(self) -> list[StageChunk]:
        self.left -= 1
        self.finished = self.left == 0
        return [StageChunk()]

    def close(self) -> None:
        time.sleep(0.3)  # the step beside it runs first and finds no seat
        with self.lock:
            if self.request_id in self.seats:
                self.seats.remove(self.request_id)


class OneSeat:
    """A batcher with one seat: it steps only the request holding it; the others are left out and wait."""

    def __init__(self) -> None:
        self.seats: list[str] = []
        self.lock = threading.Lock()

    def step_batch(self, tasks: list[StageTask]) -> dict[str, list[StageChunk] | BaseException]:
        with self.lock:
            for task in tasks:
                if not self.seats:
                    self.seats.append(task.request_id)
            return {t.request_id: t.step() for t in tasks if t.request_id in self.seats}


async def test_a_freed_seat_wakes_the_loop() -> None:
    batcher = OneSeat()
    loop = EngineLoop("llm", max_inflight=2, batcher=batcher)
    first, second = (SeatTask(rid, 2, batcher.seats, batcher.lock) for rid in ("a", "b"))
    queues = [loop.submit(first), loop.submit(second)]
    loop.start()
    try:
        for queue in queues:
            await run_to_end(queue)
    finally:
        await loop.stop()
    assert first.left == 0 and second.left == 0
