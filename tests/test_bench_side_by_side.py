"""bench/common.SideBySide: every mesh gets the same requests in each round and at each concurrency, the
baseline first; the table gives each metric's quantile (or the median of per-turn values) and the ratio."""

from __future__ import annotations

import pytest

from bench.common import SideBySide


def test_the_meshes_take_turns_on_the_same_requests(capsys: pytest.CaptureFixture[str]) -> None:
    turns: list[tuple[str, list[dict], int]] = []

    def measure(url: str, bodies: list[dict], c: int) -> dict[str, list[float]]:
        turns.append((url, bodies, c))
        slow = 2.0 if url == "http://b" else 1.0
        return {"latency": [slow * (b["i"] + 1) for b in bodies], "rps": [10.0 / slow]}

    table = SideBySide([("base", "http://a"), ("other", "http://b")], [1, 4])
    table.run(2, 3, lambda first, n: [{"i": first + i} for i in range(n)], measure)
    assert [(u, c) for u, _, c in turns] == [("http://a", 1), ("http://b", 1), ("http://a", 4), ("http://b", 4)] * 2
    assert turns[0][1] == turns[1][1] == [{"i": 0}, {"i": 1}, {"i": 2}] and turns[2][1][0] == {"i": 3}
    assert table.samples[("base", 1)]["latency"] == [1.0, 2.0, 3.0, 7.0, 8.0, 9.0]
    table.print([("latency p50 (s)", "latency", 0.5), ("requests/s", "rps", None)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["c", "metric", "base", "other", "other/base"]
    assert lines[1].split()[-1] == "2.000" and lines[2].split()[-3:] == ["10.0000", "5.0000", "0.500"]
