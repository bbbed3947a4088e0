"""bench/stage_steps.py: per stage engine steps, requests per step, step time and the first-output steps from the
gateway's /metrics.

Run: python -m pytest tests/test_bench_stage_steps.py -q
"""

from __future__ import annotations

from bench import stage_steps
from bench.stage_steps import StageSteps
from omnimesh.engine.metrics import EngineMetrics, merge_families, parse_exposition


def _exposition(thinker: EngineMetrics, talker: EngineMetrics) -> str:
    """The stages' metrics joined as the gateway's /metrics joins them."""
    return merge_families([parse_exposition(thinker.render()), parse_exposition(talker.render())])


def test_steps_per_stage_and_what_a_run_added() -> None:
    thinker, talker = EngineMetrics("thinker", model_name="tiny"), EngineMetrics("talker", model_name="tiny")
    thinker.step(4, 0.002)
    before = stage_steps.parse(_exposition(thinker, talker))
    assert before == {"thinker": (1.0, 4.0, 0.002, 0.0, 0.0), "talker": StageSteps()}
    for n, s, first in ((8, 0.003, True), (2, 0.001, False)):
        thinker.step(n, s, first)
    talker.step(16, 0.005, first_output=True)
    after = stage_steps.parse(_exposition(thinker, talker))
    added = stage_steps.since(before, after)
    assert set(added) == {"thinker", "talker"}
    got = added["thinker"]
    assert (got.steps, got.requests, got.first_steps) == (2.0, 10.0, 1.0)
    assert abs(got.seconds - 0.004) < 1e-9 and abs(got.first_seconds - 0.003) < 1e-9
    assert added["talker"] == StageSteps(1.0, 16.0, 0.005, 1.0, 0.005)
    assert stage_steps.since(after, after) == {}  # a stage that did not step is left out
