"""bench/stage_steps.py: per stage engine steps, requests per step and step time from the gateway's /metrics.

Run: python -m pytest tests/test_bench_stage_steps.py -q
"""

from __future__ import annotations

from bench import stage_steps
from omnimesh.engine.metrics import EngineMetrics, merge_families, parse_exposition


def _exposition(thinker: EngineMetrics, talker: EngineMetrics) -> str:
    """The stages' metrics joined as the gateway's /metrics joins them."""
    return merge_families([parse_exposition(thinker.render()), parse_exposition(talker.render())])


def test_steps_per_stage_and_what_a_run_added() -> None:
    thinker, talker = EngineMetrics("thinker", model_name="tiny"), EngineMetrics("talker", model_name="tiny")
    thinker.step(4, 0.002)
    before = stage_steps.parse(_exposition(thinker, talker))
    assert before == {"thinker": (1.0, 4.0, 0.002), "talker": (0.0, 0.0, 0.0)}
    for n, s in ((8, 0.003), (2, 0.001)):
        thinker.step(n, s)
    talker.step(16, 0.005)
    after = stage_steps.parse(_exposition(thinker, talker))
    added = stage_steps.since(before, after)
    assert set(added) == {"thinker", "talker"}
    steps, reqs, secs = added["thinker"]
    assert (steps, reqs) == (2.0, 10.0) and abs(secs - 0.004) < 1e-9
    assert added["talker"] == (1.0, 16.0, 0.005)
    assert stage_steps.since(after, after) == {}  # a stage that did not step is left out
