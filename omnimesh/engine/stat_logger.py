"""The stage's periodic load line, as vLLM's engine logs it (`--disable-log-stats` turns it off).

Data flow: every `interval_s` (10 s, `OMNIMESH_LOG_STATS_INTERVAL` to change it) `StatLogger.line()`
reads the stage's `EngineMetrics`: the running totals since the last line (prompt and generated tokens,
counted when a request finishes; finished and failed requests) and the load now (running / waiting
requests, KV-cache usage, preemptions, from the loop's bound stats source) ->
`thinker: Avg prompt throughput: 312.4 tokens/s, Avg generation throughput: 88.0 tokens/s, Running: 3 reqs,
Waiting: 0 reqs, KV cache usage: 4.1%, Finished: 11 reqs` (the talker's and the vocoder's tokens are codec
code groups). A stage that was idle for a whole interval, and still is, logs nothing, so an idle mesh's
log stays quiet.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable

from omnimesh.engine.metrics import EngineMetrics

log = logging.getLogger(__name__)

ENV_INTERVAL = "OMNIMESH_LOG_STATS_INTERVAL"
DEFAULT_INTERVAL_S = 10.0  # vLLM's VLLM_LOG_STATS_INTERVAL default


def interval_from_env() -> float:
    text = os.environ.get(ENV_INTERVAL)
    if not text:
        return DEFAULT_INTERVAL_S
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ValueError(f"{ENV_INTERVAL} must be a number of seconds > 0, got {text!r}")
    return value


class StatLogger:
    def __init__(self, metrics: EngineMetrics, interval_s: float = DEFAULT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.m, self.interval_s, self.clock = metrics, interval_s, clock
        self._last_t = clock()
        self._last = dict(metrics.totals)
        self._was_idle = True
        self._last_prefix = (0.0, 0.0)  # prefix-cache (queries, hits) at the last line

    def line(self) -> str | None:
        """The line for the interval that ends now, or None when the stage was and is idle."""
        now = self.clock()
        dt = max(now - self._last_t, 1e-9)
        totals = dict(self.m.totals)
        delta = {k: totals[k] - self._last.get(k, 0) for k in totals}
        self._last_t, self._last = now, totals
        load = self.m.load()
        running, waiting = int(load.get("running") or 0), int(load.get("waiting") or 0)
        idle = not any(delta.values()) and running == 0 and waiting == 0
        if idle and self._was_idle:
            return None
        self._was_idle = idle
        parts = [f"Avg prompt throughput: {delta['prompt_tokens'] / dt:.1f} tokens/s",
                 f"Avg generation throughput: {delta['generation_tokens'] / dt:.1f} tokens/s",
                 f"Running: {running} reqs", f"Waiting: {waiting} reqs"]
        if load.get("kv_cache_usage") is not None:
            parts.append(f"KV cache usage: {100.0 * float(load['kv_cache_usage']):.1f}%")
        parts.append(f"Finished: {delta['finished']} reqs")
        if delta["failed"]:
            parts.append(f"Failed: {delta['failed']} reqs")
        if load.get("preemptions"):
            parts.append(f"Preemptions: {int(load['preemptions'])} in all")
        if load.get("prefix_cache_queries") is not None:  # over this interval, as vLLM's line
            prefix = (float(load["prefix_cache_queries"]), float(load.get("prefix_cache_hits") or 0))
            queries, hits = prefix[0] - self._last_prefix[0], prefix[1] - self._last_prefix[1]
            self._last_prefix = prefix
            parts.append(f"Prefix cache hit rate: {100.0 * hits / queries if queries else 0.0:.1f}%")
        return f"{self.m.stage}: " + ", ".join(parts)

    async def run(self) -> None:
        """Log a line every interval until cancelled (a task on the stage's event loop)."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                text = self.line()
            except Exception:  # a stats source that fails must not end the stage's logging for good
                log.exception("stage %s: reading the load for the log line failed", self.m.stage)
                continue
            if text is not None:
                log.info("%s", text)
