"""A request that fails inside a batched step lets go of the step's data at once. The batcher returns the
request's exception (as the thinker's does for a prompt it cannot prepare), and that exception's traceback
holds the batcher's frame, whose locals (the step's results: a batch's logits) hold the exception again: a
cycle that only a full collection frees, and full collections are rare in a stage (its start-up heap is
frozen). The loop drops the traceback once the failure is answered."""

from __future__ import annotations

import asyncio
import gc
import weakref

from omnimesh.engine.loop import EngineFailed, EngineLoop
from omnimesh.engine.task import StageTask
from omnimesh.transport.frames import StageChunk


class Logits:  # stands for a step's results
    pass


class OneStep(StageTask):
    def feed(self, chunk: StageChunk) -> None:
        pass

    def ready(self) -> bool:
        return not self.finished

    def step(self) -> list[StageChunk]:
        raise AssertionError("the batcher steps it")


class FailingBatcher:
    def __init__(self) -> None:
        self.alive: list[weakref.ref] = []

    def step_batch(self, tasks: list[StageTask]) -> dict[str, list[StageChunk] | BaseException]:
        results = Logits()
        self.alive.append(weakref.ref(results))
        out: dict[str, list[StageChunk] | BaseException] = {}
        for task in tasks:
            try:
                raise ValueError("this request's sampling failed")
            except ValueError as exc:
                out[task.request_id] = exc  # the frame holds `out`, which holds the exception: a cycle
        return out


async def test_a_failed_requests_step_data_is_freed_without_a_collection() -> None:
    batcher = FailingBatcher()
    loop = EngineLoop("llm", batcher=batcher)
    queue = loop.submit(OneStep("a"))
    gc.disable()
    loop.start()
    try:
        failed = await asyncio.wait_for(queue.get(), 10)
        assert isinstance(failed, EngineFailed) and "sampling failed" in failed.message
        await asyncio.sleep(0.05)
        assert batcher.alive and all(ref() is None for ref in batcher.alive)
    finally:
        await loop.stop()
        gc.enable()
