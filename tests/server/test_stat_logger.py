"""The stages' periodic load line (omnimesh/engine/stat_logger.py): rates over the interval from the
request totals, the load now, KV-cache usage only where the stage has one, failures and preemptions when
there are some, silence while idle (after one line saying the stage went idle); a bad
OMNIMESH_LOG_STATS_INTERVAL is refused before anything starts; --disable-log-stats reaches the stages."""

from __future__ import annotations

import pytest

from omnimesh.config.serve_args import ServeArgs
from omnimesh.engine.metrics import EngineMetrics
from omnimesh.engine.stat_logger import ENV_INTERVAL, StatLogger, interval_from_env
from omnimesh.launcher import MeshLauncher


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_rates_load_and_idle_silence() -> None:
    m, clock = EngineMetrics("thinker"), Clock()
    load = {"running": 0, "waiting": 0, "kv_cache_usage": 0.0, "preemptions": 0}
    m.bind_stats(lambda: load)
    stats = StatLogger(m, 10.0, clock)
    clock.t += 10
    assert stats.line() is None  # idle, and idle before
    m.totals.update(prompt_tokens=500, generation_tokens=120, finished=4)
    load.update(running=3, waiting=1, kv_cache_usage=0.125)
    clock.t += 10
    assert stats.line() == ("thinker: Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: 12.0 tokens/s, "
                            "Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 12.5%, Finished: 4 reqs")
    m.totals.update(generation_tokens=170, finished=6, failed=1)
    load.update(running=0, waiting=0, kv_cache_usage=0.0, preemptions=2)
    clock.t += 5
    assert stats.line() == ("thinker: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 10.0 tokens/s, "
                            "Running: 0 reqs, Waiting: 0 reqs, KV cache usage: 0.0%, Finished: 2 reqs, Failed: 1 reqs, "
                            "Preemptions: 2 in all")
    clock.t += 10
    assert "Finished: 0 reqs" in (stats.line() or "")  # the line that says it went idle
    clock.t += 10
    assert stats.line() is None


def test_prefix_cache_hit_rate_is_over_the_interval() -> None:
    m, clock = EngineMetrics("thinker"), Clock()
    load = {"running": 1, "waiting": 0, "prefix_cache_queries": 400, "prefix_cache_hits": 100}
    m.bind_stats(lambda: load)
    stats = StatLogger(m, 10.0, clock)
    assert (stats.line() or "").endswith("Prefix cache hit rate: 25.0%")
    load.update(prefix_cache_queries=600, prefix_cache_hits=250)  # 150 of the last 200
    assert (stats.line() or "").endswith("Prefix cache hit rate: 75.0%")
    assert (stats.line() or "").endswith("Prefix cache hit rate: 0.0%")  # nothing looked up since


def test_a_stage_without_kv_cache_leaves_it_out() -> None:
    m, clock = EngineMetrics("vocoder"), Clock()
    m.bind_stats(lambda: {"running": 2, "waiting": 0})
    line = StatLogger(m, 10.0, clock).line()
    assert line is not None and "KV cache" not in line and "Running: 2 reqs" in line


def test_the_request_totals_follow_the_finished_requests() -> None:
    from omnimesh.engine.loop import EngineDone

    class Task:
        prompt_tokens, completion_tokens = 7, 3

    m = EngineMetrics("talker")
    m.request().finished(Task(), EngineDone("stop", 7, 3))  # type: ignore[arg-type]
    assert m.totals == {"prompt_tokens": 7, "generation_tokens": 3, "finished": 1, "failed": 0}


def test_interval_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.delenv(ENV_INTERVAL, raising=False)
    assert interval_from_env() == 10.0
    monkeypatch.setenv(ENV_INTERVAL, "2.5")
    assert interval_from_env() == 2.5
    for bad in ("0", "-1", "soon", "nan"):
        monkeypatch.setenv(ENV_INTERVAL, bad)
        with pytest.raises(ValueError, match=f"{ENV_INTERVAL} must be a number of seconds > 0"):
            ServeArgs()
    assert ServeArgs(disable_log_stats=True).disable_log_stats  # the variable does not matter then
    monkeypatch.delenv(ENV_INTERVAL)
    launcher = MeshLauncher(ServeArgs(disable_log_stats=True), tmp_path)
    assert "--disable-log-stats" in launcher._stage_argv("thinker", 1)
    assert "--disable-log-stats" not in MeshLauncher(ServeArgs(), tmp_path)._stage_argv("thinker", 1)
