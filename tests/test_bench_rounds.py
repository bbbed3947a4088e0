"""bench/rounds.py: the throughput bench's targets over several rounds, judged on their medians.

Run: python -m pytest tests/test_bench_rounds.py -q
"""

from __future__ import annotations

from bench import rounds


def _round(x: float | None, ttfp: float | None) -> dict[str, dict[str, object]]:
    """One round's targets as throughput.report() returns them (a target left out was not measured)."""
    out: dict[str, dict[str, object]] = {}
    if x is not None:
        out["throughput_c16_x_sequential"] = rounds.judge("throughput_c16_x_sequential", x)
    if ttfp is not None:
        out["ttfp_p50_c8_over_c1"] = rounds.judge("ttfp_p50_c8_over_c1", ttfp)
    return out


def test_a_round_is_judged_against_its_bound_the_bound_itself_passing() -> None:
    assert rounds.judge("throughput_c16_x_sequential", 7.99) == {"value": 7.99, "target": ">= 8", "pass": False}
    assert rounds.judge("throughput_c16_x_sequential", 8.0)["pass"]
    assert rounds.judge("ttfp_p50_c8_over_c1", 2.0) == {"value": 2.0, "target": "<= 2", "pass": True}
    assert not rounds.judge("ttfp_p50_c8_over_c1", 2.01)["pass"]


def test_the_verdict_is_the_median_with_every_round_beside_it() -> None:
    s = rounds.summarize([_round(7.6, 2.4), _round(8.4, 1.9), _round(8.1, 2.2)])
    x, t = s["throughput_c16_x_sequential"], s["ttfp_p50_c8_over_c1"]
    assert (x["value"], x["rounds"], x["passed"], x["of"], x["pass"]) == (8.1, [7.6, 8.4, 8.1], 2, 3, True)
    assert (t["value"], t["rounds"], t["passed"], t["of"], t["pass"]) == (2.2, [2.4, 1.9, 2.2], 1, 3, False)
    assert x["target"] == ">= 8" and t["target"] == "<= 2"


def test_an_even_count_takes_the_middle_two_and_a_bound_itself_passes() -> None:
    s = rounds.summarize([_round(7.0, 2.0), _round(9.0, 2.0)])
    assert s["throughput_c16_x_sequential"]["value"] == 8.0 and s["throughput_c16_x_sequential"]["pass"]
    assert s["ttfp_p50_c8_over_c1"]["pass"] and s["ttfp_p50_c8_over_c1"]["passed"] == 2


def test_a_target_no_round_measured_is_left_out() -> None:
    s = rounds.summarize([_round(8.5, None), _round(7.5, None)])
    assert list(s) == ["throughput_c16_x_sequential"]
    assert rounds.summarize([_round(None, None)]) == {}


def test_the_summary_prints_the_verdict_and_the_spread(capsys) -> None:
    rounds.print_summary(rounds.summarize([_round(7.6, 2.4), _round(8.4, 1.9), _round(8.1, 2.2)]))
    out = capsys.readouterr().out
    assert "PASS  throughput at c=16 / sequential transformers: median 8.10 (target >= 8); rounds 7.60, 8.40, 8.10: 2 of 3 pass" in out
    assert "FAIL  TTFP p50 at c=8 / c=1: median 2.20 (target <= 2); rounds 2.40, 1.90, 2.20: 1 of 3 pass" in out
