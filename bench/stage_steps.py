"""How each stage batched during a benchmark run: engine steps, requests per step and step time, per stage,
and the steps first outputs waited for.

Role: the benchmarks' view of batching (a CPU-bound run's per-request cost falls as steps carry more
requests) and of what time to first audio is made of. `scrape(url)` reads the gateway's /metrics (every
stage's `omnimesh:iteration_requests`, `omnimesh:engine_step_seconds` and
`omnimesh:first_output_step_seconds` histograms) -> per stage a `StageSteps`; `since(before, after)` is
what one run added. Stages without engine steps in the run are left out.
"""

from __future__ import annotations

from typing import NamedTuple

import httpx

from omnimesh.engine.metrics import parse_exposition


class StageSteps(NamedTuple):
    steps: float = 0.0  # engine steps
    requests: float = 0.0  # requests advanced, summed over the steps
    seconds: float = 0.0  # wall time of the steps
    first_steps: float = 0.0  # steps with a request in them that waited for its first output
    first_seconds: float = 0.0  # their wall time


Steps = dict[str, StageSteps]

_FIELDS = {
    ("omnimesh:iteration_requests", "_count"): "steps",
    ("omnimesh:iteration_requests", "_sum"): "requests",
    ("omnimesh:engine_step_seconds", "_sum"): "seconds",
    ("omnimesh:first_output_step_seconds", "_count"): "first_steps",
    ("omnimesh:first_output_step_seconds", "_sum"): "first_seconds",
}


def parse(text: str) -> Steps:
    """Prometheus text (the gateway's /metrics) -> per stage its `StageSteps`."""
    out: dict[str, dict[str, float]] = {}
    for fam in parse_exposition(text):
        for s in fam.samples:
            stage = s.labels.get("stage")
            field = _FIELDS.get((fam.name, s.name[len(fam.name):]))
            if stage is not None and field is not None:
                out.setdefault(stage, {})[field] = s.value
    return {stage: StageSteps(**fields) for stage, fields in out.items()}


def scrape(url: str) -> Steps:
    return parse(httpx.get(f"{url}/metrics", timeout=30).text)


def since(before: Steps, after: Steps) -> Steps:
    """What the run between two scrapes added, per stage that stepped in it."""
    out: Steps = {}
    for stage, now in after.items():
        then = before.get(stage, StageSteps())
        if now.steps - then.steps > 0:
            out[stage] = StageSteps(*(a - b for a, b in zip(now, then)))
    return out
