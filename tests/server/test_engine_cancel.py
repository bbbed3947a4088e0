"""EngineLoop cancellation racing a step: a request cancelled after the loop planned a step with it, but
before that step started (the cancel's callback already queued on the event loop, as a client's disconnect
is), is closed only after the step: the batcher never sees a closed task, and the step's other requests
run to their end. At e1042a7 the close ran first; the thinker's batcher then raised for the closed task
and every request in the step failed with it (HTTP 500s under load with clients going away)."""

from __future__ import annotations

import asyncio
import threading

from omnimesh.engine.loop import EngineDone, EngineLoop
from omnimesh.engine.task import StageTask
from omnimesh.transport.frames import StageChunk


class Steps(StageTask):
    """`steps` steps, one output each; `closed` once closed. `on_ready` runs each time the loop asks `ready`."""

    def __init__(self, rid: str, steps: int) -> None:
        super().__init__(rid)
        self.left = steps
        self.closed = threading.Event()
        self.on_ready = lambda: None

    def feed(self, chunk: StageChunk) -> None:
        pass

    def ready(self) -> bool:
        self.on_ready()
        return self.left > 0

    def step(self) -> list[StageChunk]:
        self.left -= 1
        self.completion_tokens += 1
        self.finished = self.left == 0
        return [StageChunk()]

    def close(self) -> None:
        self.closed.set()


class ClosedTaskAlarm:
    """A batcher that, like the thinker's, cannot step a closed task: it fails the whole call if given one."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def step_batch(self, tasks: list[StageTask]) -> dict[str, list[StageChunk] | BaseException]:
        self.calls.append(sorted(t.request_id for t in tasks))
        for task in tasks:
            if task.closed.is_set():  # type: ignore[attr-defined]
                raise RuntimeError(f"stepped {task.request_id} after its close")
        return {task.request_id: task.step() for task in tasks}


async def _cancel_between_plan_and_step() -> tuple[dict[str, object], ClosedTaskAlarm, list[Steps]]:
    batcher = ClosedTaskAlarm()
    engine = EngineLoop("llm", batcher=batcher)
    tasks = [Steps(rid, 3) for rid in ("a", "b", "c")]
    victim = tasks[1]
    loop = asyncio.get_running_loop()
    asked = 0

    def cancel_once_planned() -> None:  # the loop asks `ready` right before planning the step it goes in
        nonlocal asked
        asked += 1
        if asked == 2:  # its second step: queued now, this cancel runs before the step's task gets a turn
            loop.call_soon(engine.cancel, "b")

    victim.on_ready = cancel_once_planned
    queues = {t.request_id: engine.submit(t) for t in tasks}
    engine.start()
    try:
        ends: dict[str, object] = {}
        for rid, queue in queues.items():
            event = await asyncio.wait_for(queue.get(), 10)
            while isinstance(event, StageChunk):
                event = await asyncio.wait_for(queue.get(), 10)
            ends[rid] = event
        await asyncio.wait_for(asyncio.to_thread(victim.closed.wait, 10), 15)
    finally:
        await engine.stop()
    return ends, batcher, tasks


def test_a_cancel_queued_before_its_planned_step_closes_the_request_after_that_step() -> None:
    ends, batcher, tasks = asyncio.run(_cancel_between_plan_and_step())
    assert ["a", "b", "c"] in batcher.calls[1:], batcher.calls  # b was in the step planned with the cancel
    assert isinstance(ends["b"], EngineDone) and ends["b"].finish_reason == "cancelled"
    for rid in ("a", "c"):  # the step's other requests were not failed with it
        end = ends[rid]
        assert isinstance(end, EngineDone) and end.finish_reason == "stop", (rid, end)
    assert [t.completion_tokens for t in tasks] == [3, 2, 3]  # b's planned step ran (its output went nowhere)
    assert all(t.closed.is_set() for t in tasks)
