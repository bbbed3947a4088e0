"""The targets of `bench/throughput.py` over several rounds: each round measures both sides again, and a
target passes or fails on the median of its rounds.

Role: on a shared host the speed of the machine drifts by ±20% within minutes, so one run of the mesh
followed by one run of `transformers` can put the two sides in different weather. Rounds alternate the
sides (mesh, transformers, mesh, transformers, ...) and the summary takes each target's median, with every
round's value and how many rounds passed beside it, so a reader sees the spread as well as the verdict.

Data flow: `report()` in throughput.py returns one round's targets, `{name: judge(name, value)}`;
`summarize([round_targets, ...])` -> `{name: {"value": median, "rounds": [values], "passed": k, "of": n,
"target", "pass": the median against the target}}`; `print_summary` prints it.
"""

from __future__ import annotations

import operator
import statistics
from typing import Any

TARGET_SPEEDUP_C16 = 8.0  # requests/s at c=16 over sequential transformers: at least
TARGET_TTFP_RATIO_C8 = 2.0  # TTFP p50 at c=8 over its value at c=1: at most
# target name -> (the comparison a value must pass, its symbol, the bound); the names report() uses
BOUNDS = {"throughput_c16_x_sequential": (operator.ge, ">=", TARGET_SPEEDUP_C16),
          "ttfp_p50_c8_over_c1": (operator.le, "<=", TARGET_TTFP_RATIO_C8)}
LABELS = {"throughput_c16_x_sequential": "throughput at c=16 / sequential transformers",
          "ttfp_p50_c8_over_c1": "TTFP p50 at c=8 / c=1"}


def judge(name: str, value: float) -> dict[str, Any]:
    """One measured target -> {"value", "target" (e.g. ">= 8"), "pass"}: what report() records per round."""
    passes, symbol, bound = BOUNDS[name]
    return {"value": value, "target": f"{symbol} {bound:g}", "pass": bool(passes(value, bound))}


def summarize(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each target measured in any round -> its median over the rounds that measured it."""
    out: dict[str, dict[str, Any]] = {}
    for name in [n for n in BOUNDS if any(n in r for r in rounds)]:
        values = [r[name]["value"] for r in rounds if name in r]
        out[name] = {**judge(name, statistics.median(values)), "rounds": values,
                     "passed": sum(judge(name, v)["pass"] for v in values), "of": len(values)}
    return out


def print_summary(summary: dict[str, dict[str, Any]]) -> None:
    print()
    print("targets over the rounds (each round measured omnimesh, then transformers; verdict on the median)")
    for name, s in summary.items():
        values = ", ".join(f"{v:.2f}" for v in s["rounds"])
        print(f"{'PASS' if s['pass'] else 'FAIL'}  {LABELS[name]}: median {s['value']:.2f} (target {s['target']}); "
              f"rounds {values}: {s['passed']} of {s['of']} pass")
