"""EngineLoop `yield_steps` (first outputs first): while some ready requests wait for their first output and
others already stream, a batched step carries the waiting ones alone, and a streaming request sits out at
most `yield_steps` steps in a row; 0 keeps every step carrying every ready request. Checked on the steps a
fake batcher records, and on the stage configuration that sets it."""

from __future__ import annotations

import asyncio

import pytest

from omnimesh.config.serve_args import ServeArgs
from omnimesh.config.stage_config import StageConfig
from omnimesh.engine.loop import EngineDone, EngineLoop
from omnimesh.engine.task import StageTask
from omnimesh.transport.frames import StageChunk
from test_engine_priority import BehindTask  # never urgent; behind (its playback deadline near) at given steps
from test_engine_priority import CountTask as Stream  # steps, one output each; urgent for its first urgent_steps


class RecordingBatcher:
    """Steps every task it is given by one (its own `step`); records each step's request ids, in order."""

    def __init__(self) -> None:
        self.steps: list[list[str]] = []

    def step_batch(self, tasks: list[StageTask]) -> dict[str, list[StageChunk] | BaseException]:
        self.steps.append(sorted(t.request_id for t in tasks))
        return {task.request_id: task.step() for task in tasks}


class SeatedBatcher(RecordingBatcher):
    """Like a thinker at --max-num-seqs `seats`: steps only the requests holding a seat (first come, first
    seated); a request without one is left out of the step's results and waits."""

    def __init__(self, seats: int) -> None:
        super().__init__()
        self.seats, self.seated = seats, []  # type: list[str]

    def step_batch(self, tasks: list[StageTask]) -> dict[str, list[StageChunk] | BaseException]:
        for task in tasks:
            if task.request_id not in self.seated and len(self.seated) < self.seats:
                self.seated.append(task.request_id)
        out = super().step_batch([t for t in tasks if t.request_id in self.seated])
        self.seated = [rid for rid in self.seated if not any(t.request_id == rid and t.finished for t in tasks)]
        return out


async def _run(tasks: list[Stream], yield_steps: int, batcher: RecordingBatcher | None = None) -> list[list[str]]:
    batcher = batcher or RecordingBatcher()
    loop = EngineLoop("llm", batcher=batcher, yield_steps=yield_steps)
    queues = [loop.submit(t) for t in tasks]  # all in before the loop's first pass
    loop.start()
    try:
        for queue in queues:
            while not isinstance(await asyncio.wait_for(queue.get(), 10), EngineDone):
                pass
    finally:
        await loop.stop()
    return batcher.steps


def test_first_outputs_step_alone_and_streams_sit_out_at_most_yield_steps() -> None:
    # b and c already stream (nothing urgent left); a is new and waits for its first output for 4 steps
    tasks = [Stream("a", 6, urgent_steps=4), Stream("b", 6, urgent_steps=0), Stream("c", 6, urgent_steps=0)]
    steps = asyncio.run(_run(tasks, yield_steps=2))
    assert steps[:5] == [["a"], ["a"], ["a", "b", "c"], ["a"], ["a", "b", "c"]]
    # a ran in every step while urgent, then with the others; every request got all its steps
    assert all("a" in s for s in steps[:4])
    assert sum(s.count("b") for s in steps) == sum(s.count("c") for s in steps) == 6
    for rid in ("b", "c"):  # never more than yield_steps steps in a row without it while it was ready
        run = longest = 0
        for s in steps[: max(i for i, s in enumerate(steps) if rid in s) + 1]:
            run = 0 if rid in s else run + 1
            longest = max(longest, run)
        assert longest <= 2, (rid, steps)


def test_a_first_output_without_a_seat_never_stalls_the_stream_that_holds_it() -> None:
    """One seat (like --max-num-seqs 1): a streams in it; b arrives waiting for its first output but cannot
    run alone (no seat). The loop must go on stepping a (b rides along, left out) until a ends and b is
    seated, instead of retrying b alone or going idle."""
    tasks = [Stream("a", 40, urgent_steps=0), Stream("b", 3, urgent_steps=3)]
    batcher = SeatedBatcher(seats=1)
    batcher.seated.append("a")
    steps = asyncio.run(_run(tasks, yield_steps=16, batcher=batcher))
    stepped = [s for s in steps if s]  # the requests each step advanced
    assert stepped == [["a"]] * 40 + [["b"]] * 3


def test_zero_keeps_every_ready_request_in_every_step() -> None:
    tasks = [Stream("a", 3, urgent_steps=3), Stream("b", 3, urgent_steps=0)]
    assert asyncio.run(_run(tasks, yield_steps=0)) == [["a", "b"]] * 3


def test_when_every_ready_request_is_urgent_the_step_is_a_plain_one() -> None:
    tasks = [Stream("a", 2, urgent_steps=2), Stream("b", 2, urgent_steps=2)]
    assert asyncio.run(_run(tasks, yield_steps=4)) == [["a", "b"]] * 2


def test_a_request_whose_deadline_is_near_does_not_step_alone() -> None:
    """Only a first output steps alone; a request that is behind (`StageTask.behind`) rides in the plain step,
    beside the others (its step runs at the stage's priority: test_engine_priority)."""
    tasks = [BehindTask("a", 3, behind_at={0, 1, 2}), Stream("b", 3, urgent_steps=0)]
    assert asyncio.run(_run(tasks, yield_steps=4)) == [["a", "b"]] * 3


def test_a_negative_yield_steps_is_refused() -> None:
    with pytest.raises(ValueError, match="yield_steps must be >= 0"):
        EngineLoop("llm", yield_steps=-1)
    with pytest.raises(ValueError, match="yield_steps must be a whole number >= 0"):
        StageConfig(yield_steps=-2)


def test_the_llm_stages_yield_by_default_and_overrides_reach_the_stage(tmp_path) -> None:
    from omnimesh.cli import build_parser
    from omnimesh.config.serve_args import from_namespace
    from omnimesh.launcher import MeshLauncher

    defaults = ServeArgs().stage_configs()
    assert {s: c.effective_yield_steps(s) for s, c in defaults.items()} == {
        "encoder": 0, "thinker": 16, "talker": 16, "vocoder": 0}
    launcher = MeshLauncher(ServeArgs(stage_overrides='{"talker": {"yield_steps": 0}}'), tmp_path)
    argv = launcher._stage_argv("talker", 50053)
    cfg = from_namespace(build_parser().parse_args(argv)).stage_configs()["talker"]
    assert cfg.effective_yield_steps("talker") == 0
