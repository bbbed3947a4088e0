"""How each stage batched during a benchmark run: engine steps, requests per step and step time, per stage.

Role: the benchmarks' view of batching (a CPU-bound run's per-request cost falls as steps carry more
requests). `scrape(url)` reads the gateway's /metrics (every stage's `omnimesh:iteration_requests` and
`omnimesh:engine_step_seconds` histograms) -> per stage (steps, request-steps, step seconds);
`since(before, after)` is what one run added. Stages without engine steps in the run are left out.
"""

from __future__ import annotations

import httpx

from omnimesh.engine.metrics import parse_exposition

Steps = dict[str, tuple[float, float, float]]  # stage -> (steps, requests summed over steps, seconds)


def parse(text: str) -> Steps:
    """Prometheus text (the gateway's /metrics) -> per stage (steps, request-steps, step seconds)."""
    out: dict[str, list[float]] = {}
    for fam in parse_exposition(text):
        if fam.name not in ("omnimesh:iteration_requests", "omnimesh:engine_step_seconds"):
            continue
        for s in fam.samples:
            stage = s.labels.get("stage")
            if stage is None:
                continue
            row = out.setdefault(stage, [0.0, 0.0, 0.0])
            if fam.name == "omnimesh:iteration_requests" and s.name.endswith("_count"):
                row[0] = s.value
            elif fam.name == "omnimesh:iteration_requests" and s.name.endswith("_sum"):
                row[1] = s.value
            elif fam.name == "omnimesh:engine_step_seconds" and s.name.endswith("_sum"):
                row[2] = s.value
    return {stage: (r[0], r[1], r[2]) for stage, r in out.items()}


def scrape(url: str) -> Steps:
    return parse(httpx.get(f"{url}/metrics", timeout=30).text)


def since(before: Steps, after: Steps) -> Steps:
    """What the run between two scrapes added, per stage that stepped in it."""
    out: Steps = {}
    for stage, (n, reqs, secs) in after.items():
        n0, r0, s0 = before.get(stage, (0.0, 0.0, 0.0))
        if n - n0 > 0:
            out[stage] = (n - n0, reqs - r0, secs - s0)
    return out
