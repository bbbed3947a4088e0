"""Engine metrics through the Stage `Metrics` RPC: an EngineLoop + StageServicer on a real gRPC server on
127.0.0.1 with a small counting stage (input `ids` of n tokens, then option `steps` decode steps with
one output chunk each), scraped with `StageClient.metrics()` and parsed as Prometheus text."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from omnimesh.engine.loop import EngineLoop
from omnimesh.engine.metrics import EngineMetrics
from omnimesh.engine.task import StageTask
from omnimesh.transport.frames import StageChunk
from omnimesh.transport.stage_client import StageCallError, StageClient
from omnimesh.v1 import stage_pb2
from tests.stage_harness import served_stage

LABELS = {"stage": "count", "model_name": "tiny"}


class CountTask(StageTask):
    def __init__(self, rid: str, steps: int, reason: str, fail: bool):
        super().__init__(rid)
        self.steps_left, self.fail, self.fed = steps, fail, False
        self.finish_reason = reason

    def feed(self, chunk: StageChunk) -> None:
        self.prompt_tokens += int(chunk.tensors["ids"].numel())
        self.fed = self.fed or chunk.final

    def ready(self) -> bool:
        return self.fed

    def urgent(self) -> bool:
        return self.completion_tokens == 0  # until its first output

    def step(self) -> list[StageChunk]:
        if self.fail:
            raise RuntimeError("boom")
        time.sleep(0.002)
        self.steps_left -= 1
        self.completion_tokens += 1
        self.finished = self.steps_left <= 0
        return [StageChunk(text="t")]


class CountHandler:
    name = "count"

    def info(self) -> stage_pb2.StageInfo:
        return stage_pb2.StageInfo(stage="count", model="tiny")

    def open(self, msg: stage_pb2.Open) -> StageTask:
        o = msg.options
        return CountTask(msg.request_id, int(o.get("steps", "1")), o.get("reason", "stop"), o.get("fail") == "1")


class FakeBatcher:
    """Steps each task itself; reports the load an LM batcher would."""

    def __init__(self) -> None:
        self.load = {"running": 3, "waiting": 2, "kv_cache_usage": 0.25, "preemptions": 4}
        self.batches: list[int] = []  # requests per step_batch call

    def step_batch(self, tasks: list[StageTask]) -> dict[str, list[StageChunk] | BaseException]:
        self.batches.append(len(tasks))
        return {t.request_id: t.step() for t in tasks}

    def stats(self) -> dict:
        return dict(self.load)


def _serve(batcher: FakeBatcher | None = None):
    """The count stage with engine metrics, served: `async with _serve() as served`."""
    metrics = EngineMetrics("count", model_name="tiny")
    return served_stage(CountHandler(), EngineLoop("count", batcher=batcher, metrics=metrics), metrics=metrics)


@pytest.fixture
async def stage():
    async with _serve() as served:
        yield served.client, served.engine


async def run(client: StageClient, rid: str, n_prompt: int, **options: str) -> list[StageChunk]:
    s = await client.open(rid, options=options)
    await s.send(StageChunk(tensors={"ids": torch.zeros(n_prompt, dtype=torch.long)}, final=True))
    return [c async for c in s]


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of the text (which must parse) by (name, labels); each carries the stage's labels."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = dict(s.labels)
            assert {k: labels.pop(k, None) for k in LABELS} == LABELS, s
            out[(s.name, frozenset(labels.items()))] = s.value
    return out


def value(got: dict, name: str, **labels: str) -> float:
    return got.get((name, frozenset(labels.items())), 0.0)


async def test_counters_and_histograms_match_what_ran(stage):
    client, engine = stage
    await asyncio.gather(run(client, "a", 5, steps="1"), run(client, "b", 7, steps="2"),
                         run(client, "c", 11, steps="3", reason="length"))
    with pytest.raises(StageCallError):
        await run(client, "f", 2, fail="1")
    held = await client.open("held", options={"steps": "1"})  # open, no input yet: in the engine, not stepped
    await held.send(StageChunk(tensors={"ids": torch.zeros(3, dtype=torch.long)}))
    await asyncio.sleep(0.05)

    got = samples(await client.metrics())
    assert value(got, "omnimesh:prompt_tokens_total") == 5 + 7 + 11 + 2
    assert value(got, "omnimesh:generation_tokens_total") == 1 + 2 + 3
    assert value(got, "omnimesh:request_success_total", finished_reason="stop") == 2
    assert value(got, "omnimesh:request_success_total", finished_reason="length") == 1
    assert value(got, "omnimesh:request_failure_total", code="INTERNAL") == 1
    assert value(got, "omnimesh:time_to_first_token_seconds_count") == 3  # one per request with output
    assert value(got, "omnimesh:inter_token_latency_seconds_count") == 0 + 1 + 2
    assert value(got, "omnimesh:e2e_request_latency_seconds_count") == 3
    assert value(got, "omnimesh:e2e_request_latency_seconds_bucket", le="+Inf") == 3
    assert 0 < value(got, "omnimesh:e2e_request_latency_seconds_sum") < 30
    assert value(got, "omnimesh:request_queue_time_seconds_count") == 4  # the failed one was stepped too
    # no batcher: one request per step; steps = 1 + 2 + 3 outputs + the failed one's step
    assert value(got, "omnimesh:iteration_requests_count") == value(got, "omnimesh:iteration_requests_sum") == 7
    assert value(got, "omnimesh:iteration_requests_bucket", le="1.0") == 7
    assert value(got, "omnimesh:engine_step_seconds_count") == 7
    # the steps a request waited in for its first output: the first of a, b and c, and f's only one
    assert value(got, "omnimesh:first_output_step_seconds_count") == 4
    # three of them sleep 2 ms (f fails before it sleeps); together they are a part of all steps' time
    assert 3 * 0.002 <= value(got, "omnimesh:first_output_step_seconds_sum") < value(
        got, "omnimesh:engine_step_seconds_sum")
    # no batcher: every request in the engine counts as running, none waits; no KV-cache series at all
    assert value(got, "omnimesh:num_requests_running") == 1 and engine.num_requests == 1
    assert value(got, "omnimesh:num_requests_waiting") == 0
    assert not any(name.startswith(("omnimesh:kv_cache", "omnimesh:num_preemptions")) for name, _ in got)

    await held.send(StageChunk(tensors={"ids": torch.zeros(1, dtype=torch.long)}, final=True))
    assert len([c async for c in held]) == 1
    await held.cancel()
    got = samples(await client.metrics())
    assert value(got, "omnimesh:num_requests_running") == 0
    assert value(got, "omnimesh:prompt_tokens_total") == 25 + 4
    assert value(got, "omnimesh:request_success_total", finished_reason="stop") == 3


async def drained(engine: EngineLoop) -> None:
    """Wait (up to 1 s) until the engine has no request left."""
    for _ in range(100):
        if engine.num_requests == 0:
            return
        await asyncio.sleep(0.01)


async def test_cancelled_request_counts_but_has_no_e2e_latency(stage):
    client, engine = stage
    s = await client.open("long", options={"steps": "100000"})
    await s.send(StageChunk(tensors={"ids": torch.zeros(4, dtype=torch.long)}, final=True))
    await asyncio.sleep(0.1)
    await s.cancel()
    await drained(engine)
    got = samples(await client.metrics())
    assert value(got, "omnimesh:request_success_total", finished_reason="cancelled") == 1
    assert value(got, "omnimesh:e2e_request_latency_seconds_count") == 0
    assert value(got, "omnimesh:prompt_tokens_total") == 4
    assert value(got, "omnimesh:generation_tokens_total") > 0  # what it generated before the cancel


async def test_tokens_count_as_they_are_generated(stage):
    """As vLLM's, every step: a long request's tokens are in the counters while it runs (at e1042a7 they came
    only at its end, so the stage's throughput line said 0 tokens/s for a minute and then spiked)."""
    client, engine = stage
    s = await client.open("long", options={"steps": "100000"})
    await s.send(StageChunk(tensors={"ids": torch.zeros(4, dtype=torch.long)}, final=True))
    chunks = aiter(s)
    for _ in range(5):
        await anext(chunks)
    got = samples(await client.metrics())
    assert value(got, "omnimesh:prompt_tokens_total") == 4
    assert value(got, "omnimesh:generation_tokens_total") >= 5
    assert value(got, "omnimesh:request_success_total", finished_reason="cancelled") == 0  # still running
    await s.cancel()
    await drained(engine)
    after = samples(await client.metrics())
    assert value(after, "omnimesh:prompt_tokens_total") == 4  # counted once
    assert value(after, "omnimesh:generation_tokens_total") >= value(got, "omnimesh:generation_tokens_total")


async def test_batcher_stats_are_the_load_gauges():
    batcher = FakeBatcher()
    async with _serve(batcher) as served:
        client = served.client
        assert len(await run(client, "r", 3, steps="2")) == 2
        got = samples(await client.metrics())
        assert value(got, "omnimesh:num_requests_running") == 3
        assert value(got, "omnimesh:num_requests_waiting") == 2
        assert value(got, "omnimesh:kv_cache_usage_perc") == 0.25
        assert value(got, "omnimesh:num_preemptions_total") == 4
        assert value(got, "omnimesh:generation_tokens_total") == 2
        batcher.load = {"running": 0, "waiting": 0, "preemptions": 5}  # no KV figure: no KV series
        await asyncio.gather(*(run(client, f"b{i}", 2, steps="3") for i in range(4)))
        got = samples(await client.metrics())
        # one observation per step_batch call, of the requests it advanced
        assert value(got, "omnimesh:iteration_requests_count") == len(batcher.batches)
        assert value(got, "omnimesh:iteration_requests_sum") == sum(batcher.batches) == 2 + 4 * 3
        assert value(got, "omnimesh:iteration_requests_bucket", le="1.0") == batcher.batches.count(1)
        assert value(got, "omnimesh:engine_step_seconds_count") == len(batcher.batches)
        got = samples(await client.metrics())
        assert value(got, "omnimesh:num_preemptions_total") == 5
        assert not any(name == "omnimesh:kv_cache_usage_perc" for name, _ in got)
        assert not any(name.startswith("omnimesh:prefix_cache") for name, _ in got)  # no cache: no series
        batcher.load = {"running": 0, "waiting": 0, "prefix_cache_queries": 90, "prefix_cache_hits": 32}
        got = samples(await client.metrics())
        assert value(got, "omnimesh:prefix_cache_queries_total") == 90
        assert value(got, "omnimesh:prefix_cache_hits_total") == 32


async def test_servicer_without_metrics_answers_empty_text():
    async with served_stage(CountHandler(), EngineLoop("count")) as served:
        assert await served.client.metrics() == ""
