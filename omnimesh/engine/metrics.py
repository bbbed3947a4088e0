"""Prometheus metrics of one stage's engine (vLLM's metric names, `omnimesh:` prefix, a `stage` label).

Data flow: the `EngineLoop` calls `request()` on submit and then, on the returned `RequestTiming`,
`ready()` (first time the request can step), `stepped(t)` (a step that included it started at t),
`output()` (a step gave it output chunks) and `finished(task, event)`, and `step(n, seconds)` per
engine step; those become counters and histograms in the engine's own `CollectorRegistry`. With tracing on
(omnimesh/tracing.py) `finished` also writes the request's span in this stage from the same timestamps,
under the caller's trace context given to `request(trace)`. Load gauges
(running / waiting requests, KV-cache usage, preemptions) are read at scrape time from a stats source the
loop binds with `bind_stats`.
`render()` -> Prometheus text, served by the stage's `Metrics` RPC; the gateway scrapes every stage and
joins the texts with `merge_families` (one HELP / TYPE per family, the stages told apart by `stage`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from omnimesh import tracing

if TYPE_CHECKING:
    from omnimesh.engine.loop import EngineDone, EngineFailed
    from omnimesh.engine.task import StageTask

log = logging.getLogger(__name__)

# vLLM's buckets, thinned
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               10.0, 20.0, 80.0)
ITERATION_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0)

Stats = dict[str, Any]  # {"running": int, "waiting": int, "kv_cache_usage": float 0..1, "preemptions": int}


class EngineMetrics:
    """The metrics of one stage; every series carries `stage` (and `model_name` when given)."""

    def __init__(self, stage: str, model_name: str = "") -> None:
        self.stage = stage
        self.labels = {"stage": stage, **({"model_name": model_name} if model_name else {})}
        self.registry = CollectorRegistry()
        names, r = list(self.labels), self.registry
        self.prompt_tokens = Counter("omnimesh:prompt_tokens", "Prompt tokens processed", names, registry=r)
        self.generation_tokens = Counter("omnimesh:generation_tokens", "Tokens generated", names, registry=r)
        self.success = Counter("omnimesh:request_success", "Finished requests by finish reason",
                               [*names, "finished_reason"], registry=r)
        self.failure = Counter("omnimesh:request_failure", "Requests ended by an error, by gRPC status",
                               [*names, "code"], registry=r)
        self.ttft = Histogram("omnimesh:time_to_first_token_seconds", "Submit to the first output chunk",
                              names, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("omnimesh:inter_token_latency_seconds", "Between consecutive steps with output",
                             names, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("omnimesh:e2e_request_latency_seconds", "Submit to finish (not cancelled)",
                             names, buckets=E2E_BUCKETS, registry=r)
        self.queue = Histogram("omnimesh:request_queue_time_seconds", "Ready (inputs in) to its first step",
                               names, buckets=TTFT_BUCKETS, registry=r)
        # batching at a glance: how many requests each engine step advanced and how long it took
        # (vLLM exports tokens per step as vllm:iteration_tokens_total; a stage step here is per request)
        self.iteration_requests = Histogram("omnimesh:iteration_requests", "Requests one engine step advanced",
                                            names, buckets=ITERATION_BUCKETS, registry=r)
        self.step_seconds = Histogram("omnimesh:engine_step_seconds", "Wall time of one engine step's model call",
                                      names, buckets=STEP_BUCKETS, registry=r)
        # the part of those steps that time to first output is made of: steps with a request in them that
        # still waited for its first output (StageTask.urgent), and their wall time
        self.first_output_step_seconds = Histogram(
            "omnimesh:first_output_step_seconds",
            "Wall time of an engine step that carried a request waiting for its first output", names,
            buckets=STEP_BUCKETS, registry=r)
        for series in (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e, self.queue,
                       self.iteration_requests, self.step_seconds, self.first_output_step_seconds):
            series.labels(**self.labels)  # exported (as 0) from the start
        self._stats: Callable[[], Stats] | None = None
        r.register(_LoadCollector(self))
        # plain running totals beside the counters, for the periodic log line (omnimesh/engine/stat_logger.py)
        self.totals = {"prompt_tokens": 0, "generation_tokens": 0, "finished": 0, "failed": 0}

    def bind_stats(self, source: Callable[[], Stats]) -> None:
        """Where the load gauges come from (called at scrape time, on the asyncio thread)."""
        self._stats = source

    def load(self) -> Stats:
        """The bound stats source's values now ({} when none is bound)."""
        return self._stats() if self._stats is not None else {}

    def request(self, trace: Any = None) -> RequestTiming:
        """A request's timing; `trace`: the caller's trace context (tracing.extract), its span's parent."""
        return RequestTiming(self, trace)

    def step(self, requests: int, seconds: float, first_output: bool = False) -> None:
        """One engine step advanced `requests` requests in `seconds` (from the loop, on the asyncio thread);
        `first_output`: a request in it waited for its first output when it started."""
        self.iteration_requests.labels(**self.labels).observe(requests)
        self.step_seconds.labels(**self.labels).observe(seconds)
        if first_output:
            self.first_output_step_seconds.labels(**self.labels).observe(seconds)

    def render(self) -> str:
        return generate_latest(self.registry).decode()


class RequestTiming:
    """One request's timestamps (time.monotonic) inside the engine loop."""

    __slots__ = ("m", "submitted", "ready_at", "first_step", "first_output", "last_output", "trace", "traced",
                 "counted_prompt", "counted_generation")

    def __init__(self, metrics: EngineMetrics, trace: Any = None) -> None:
        self.m = metrics
        self.submitted = time.monotonic()
        self.ready_at = 0.0
        self.first_step = 0.0
        self.first_output = 0.0
        self.last_output = 0.0
        self.trace = trace  # the caller's context: this stage's span goes under it
        self.traced = tracing.enabled()
        self.counted_prompt = self.counted_generation = 0  # the task's tokens already in the counters

    def ready(self) -> None:
        if not self.ready_at:
            self.ready_at = time.monotonic()

    def stepped(self, started: float) -> None:
        if not self.first_step:
            self.first_step = started
            self.m.queue.labels(**self.m.labels).observe(max(0.0, started - (self.ready_at or self.submitted)))

    def count(self, task: StageTask) -> None:
        """Add the tokens the task processed since the last call to the counters: after every step, as vLLM
        counts each iteration's, so a long request's tokens (the stage's throughput line, a rate() over the
        counters) show while it runs, not all at its end."""
        m, labels = self.m, self.m.labels
        prompt, generation = max(0, task.prompt_tokens), max(0, task.completion_tokens)
        if prompt > self.counted_prompt:
            m.prompt_tokens.labels(**labels).inc(prompt - self.counted_prompt)
            m.totals["prompt_tokens"] += prompt - self.counted_prompt
            self.counted_prompt = prompt
        if generation > self.counted_generation:
            m.generation_tokens.labels(**labels).inc(generation - self.counted_generation)
            m.totals["generation_tokens"] += generation - self.counted_generation
            self.counted_generation = generation

    def output(self) -> None:
        now = time.monotonic()
        if self.last_output:
            self.m.itl.labels(**self.m.labels).observe(now - self.last_output)
        else:
            self.m.ttft.labels(**self.m.labels).observe(now - self.submitted)
            self.first_output = now
        self.last_output = now

    def finished(self, task: StageTask, event: EngineDone | EngineFailed) -> None:
        if self.traced:
            self._span(task, event)
        self.count(task)
        m, labels = self.m, self.m.labels
        m.totals["finished"] += 1
        code = getattr(event, "code", None)  # EngineFailed
        if code is not None:
            m.totals["failed"] += 1
            m.failure.labels(**labels, code=code.name).inc()
            return
        reason = getattr(event, "finish_reason", "stop")
        m.success.labels(**labels, finished_reason=reason).inc()
        if reason != "cancelled":
            m.e2e.labels(**labels).observe(time.monotonic() - self.submitted)

    def _span(self, task: StageTask, event: EngineDone | EngineFailed) -> None:
        """This request's span in this stage (vLLM's gen_ai.* names where they exist)."""
        now = time.monotonic()
        code = getattr(event, "code", None)  # EngineFailed
        reason = None if code is not None else getattr(event, "finish_reason", "stop")
        since = {"time_in_queue": self.first_step - (self.ready_at or self.submitted) if self.first_step else None,
                 "time_to_first_token": self.first_output - self.submitted if self.first_output else None}
        tracing.record(f"{self.m.stage}_request", self.trace, self.submitted,
                       {"inputs_ready": self.ready_at, "first_step": self.first_step,
                        "first_output": self.first_output},
                       {"gen_ai.request.id": task.request_id, "omnimesh.stage": self.m.stage,
                        "gen_ai.response.model": self.m.labels.get("model_name"),
                        "gen_ai.usage.prompt_tokens": max(0, task.prompt_tokens),
                        "gen_ai.usage.completion_tokens": max(0, task.completion_tokens),
                        **{f"gen_ai.latency.{k}": v for k, v in since.items() if v is not None},
                        "gen_ai.latency.e2e": now - self.submitted, "omnimesh.finish_reason": reason,
                        "omnimesh.error_code": code.name if code is not None else None},
                       error=f"{code.name}: {getattr(event, 'message', '')}" if code is not None else None)


class _LoadCollector(Collector):
    """Scrape-time gauges from the bound stats source; a value the source lacks is not exported."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self.m = metrics

    def collect(self) -> Iterable[Metric]:
        if self.m._stats is None:
            return []
        try:
            stats = self.m.load()
        except Exception:
            log.exception("stage %s: reading the engine stats failed", self.m.stage)
            return []
        names, values = list(self.m.labels), list(self.m.labels.values())
        out: list[Metric] = []
        for key, name, doc in (("running", "omnimesh:num_requests_running", "Requests being stepped"),
                               ("waiting", "omnimesh:num_requests_waiting", "Requests waiting for a batch slot"),
                               ("kv_cache_usage", "omnimesh:kv_cache_usage_perc", "KV-cache blocks in use, 0..1"),
                               ("prefix_cache_kept_bytes", "omnimesh:prefix_cache_kept_bytes",
                                "Host memory of the media rows' hidden states kept with cached blocks for speech-out "
                                "requests (at most one row per cached token; freed with the block)"),
                               ("encoder_cache_usage_bytes", "omnimesh:encoder_cache_usage_bytes",
                                "Memory the encoder cache's media outputs take (--encoder-cache-memory)")):
            if stats.get(key) is not None:
                g = GaugeMetricFamily(name, doc, labels=names)
                g.add_metric(values, float(stats[key]))
                out.append(g)
        for key, name, doc in (("preemptions", "omnimesh:num_preemptions", "Requests preempted (cumulative)"),
                               ("prefix_cache_queries", "omnimesh:prefix_cache_queries",
                                "Prompt tokens looked up in the prefix cache (--enable-prefix-caching)"),
                               ("prefix_cache_hits", "omnimesh:prefix_cache_hits",
                                "Prompt tokens the prefix cache served"),
                               ("encoder_cache_queries", "omnimesh:encoder_cache_queries",
                                "Media items (audio clips, images, videos) looked up in the encoder cache"),
                               ("encoder_cache_hits", "omnimesh:encoder_cache_hits",
                                "Media items the encoder cache served without running a tower")):
            if stats.get(key) is not None:
                c = CounterMetricFamily(name, doc, labels=names)
                c.add_metric(values, float(stats[key]))
                out.append(c)
        return out


def parse_exposition(text: str) -> list[Metric]:
    """Prometheus text -> its families; ValueError when it does not parse."""
    try:
        return list(text_string_to_metric_families(text))
    except Exception as exc:
        raise ValueError(f"not Prometheus text: {exc}") from exc


def merge_families(groups: Iterable[Iterable[Metric]]) -> str:
    """Families of several sources (each `parse_exposition` of its text, so `_created` samples are gauge
    families of their own everywhere) -> one valid exposition with a single HELP / TYPE per name; a
    family whose type differs from the first one of its name is dropped."""
    families: dict[str, Metric] = {}
    for group in groups:
        for fam in group:
            have = families.get(fam.name)
            if have is None:
                families[fam.name] = merged = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                merged.samples = list(fam.samples)
            elif have.type != fam.type:
                log.warning("metric %s is a %s here, a %s elsewhere: dropped", fam.name, fam.type, have.type)
            else:
                have.samples.extend(fam.samples)
    return generate_latest(_Families(list(families.values()))).decode()


class _Families(Collector):
    """A registry stand-in for `generate_latest`."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)
