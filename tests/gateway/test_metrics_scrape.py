"""The gateway's /metrics with stages: its own series followed by every stage's, scraped over the Stage
`Metrics` RPC. Real stages (EngineLoop + EngineMetrics + StageServicer on 127.0.0.1 gRPC servers: a thinker
and two talker replicas), a vocoder address where nothing listens, and the REST app driven in-process (httpx
ASGI transport) on the same event loop as the stages' StageClients."""

from __future__ import annotations

import asyncio
import re
import socket

import httpx
import pytest
import torch
from gateway_harness import ScriptedPipeline
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

import gateway.rest as rest
from gateway.rest import create_app
from omnimesh.engine.loop import EngineLoop
from omnimesh.engine.metrics import EngineMetrics, merge_families, parse_exposition
from omnimesh.engine.task import StageTask
from omnimesh.server.grpc_server import make_server
from omnimesh.server.stage_servicer import StageServicer
from omnimesh.transport.frames import StageChunk
from omnimesh.transport.stage_client import StageClient
from omnimesh.v1 import stage_pb2, stage_pb2_grpc


class OneStepTask(StageTask):
    fed = False

    def feed(self, chunk: StageChunk) -> None:
        self.prompt_tokens += int(chunk.tensors["ids"].numel())
        self.fed = True

    def ready(self) -> bool:
        return self.fed and not self.finished

    def step(self) -> list[StageChunk]:
        self.completion_tokens, self.finished = 1, True
        return [StageChunk(text="x")]


class OneStepHandler:
    def __init__(self, name: str) -> None:
        self.name = name

    def info(self) -> stage_pb2.StageInfo:
        return stage_pb2.StageInfo(stage=self.name)

    def open(self, msg: stage_pb2.Open) -> StageTask:
        return OneStepTask(msg.request_id)


class Source:
    """A stand-in stage for /metrics: fixed text, or a stage too slow to answer."""

    def __init__(self, text: str = "", delay_s: float = 0.0) -> None:
        self.text, self.delay_s = text, delay_s

    async def metrics(self, timeout_s: float = 2.0) -> str:
        await asyncio.sleep(self.delay_s)
        return self.text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
async def stages():
    """{"thinker": [one replica], "talker": [two replicas]} served for real, "vocoder" at a port where nothing
    listens."""
    running, clients = [], {}
    for name in ("thinker", "talker", "talker"):
        metrics = EngineMetrics(name)
        engine = EngineLoop(name, metrics=metrics)
        engine.start()
        server, _ = make_server([])
        stage_pb2_grpc.add_StageServicer_to_server(StageServicer(OneStepHandler(name), engine, metrics), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        running.append((server, engine))
        clients.setdefault(name, []).append(StageClient(name, f"127.0.0.1:{port}"))
    clients["vocoder"] = [StageClient("vocoder", f"127.0.0.1:{_free_port()}")]
    yield clients
    for replicas in clients.values():
        for client in replicas:
            await client.close()
    for server, engine in running:
        await server.stop(0)
        await engine.stop()


async def _get_metrics(app) -> str:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as http:
        r = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200
        m = await http.get("/metrics")
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    return m.text


def _by_name(text: str) -> dict[str, list]:
    """Parse the whole exposition (it must be valid); each family's TYPE line appears exactly once."""
    families = {f.name: f for f in text_string_to_metric_families(text)}
    types = re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE)
    assert len(types) == len(set(types)), "a family is declared twice"
    return {name: f.samples for name, f in families.items()}


async def test_metrics_has_gateway_and_stage_series_and_skips_a_down_stage(stages):
    thinker = await stages["thinker"][0].open("r1")
    await thinker.send(StageChunk(tensors={"ids": torch.zeros(6, dtype=torch.long)}, final=True))
    assert [c.text async for c in thinker] == ["x"]
    app = create_app(ScriptedPipeline(), stage_metrics=stages)

    fams = _by_name(await _get_metrics(app))

    def value(family: str, sample: str, **labels: str) -> float | None:
        hits = [s.value for s in fams.get(family, []) if s.name == sample and s.labels == labels]
        assert len(hits) <= 1
        return hits[0] if hits else None

    # the gateway's own series keep their names and labels (no `stage` label)
    assert value("omnimesh:requests", "omnimesh:requests_total", endpoint="chat", status="200") == 1
    assert value("omnimesh:requests_running", "omnimesh:requests_running") == 0
    assert value("omnimesh:time_to_first_audio_seconds", "omnimesh:time_to_first_audio_seconds_count") == 0
    # one family, gateway and stage series side by side, told apart by `stage` and `replica`
    gen = "omnimesh:generation_tokens"
    assert value(gen, gen + "_total") == 2  # the scripted pipeline's completion tokens
    assert value(gen, gen + "_total", stage="thinker", replica="0") == 1
    assert value(gen, gen + "_total", stage="talker", replica="0") == 0
    assert value(gen, gen + "_total", stage="talker", replica="1") == 0  # the second replica: its own series
    assert value("omnimesh:prompt_tokens", "omnimesh:prompt_tokens_total", stage="thinker", replica="0") == 6
    ttft = "omnimesh:time_to_first_token_seconds"
    assert value(ttft, ttft + "_count") == 1 and value(ttft, ttft + "_count", stage="thinker", replica="0") == 1
    for stage, replica in (("thinker", "0"), ("talker", "0"), ("talker", "1")):
        assert value("omnimesh:num_requests_running", "omnimesh:num_requests_running", stage=stage,
                     replica=replica) == 0
        assert value("omnimesh:stage_scrape_up", "omnimesh:stage_scrape_up", stage=stage, replica=replica) == 1
    # the stage that is down: skipped, and said so
    assert value("omnimesh:stage_scrape_up", "omnimesh:stage_scrape_up", stage="vocoder", replica="0") == 0
    assert not [s for f in fams.values() for s in f
                if s.labels.get("stage") == "vocoder" and s.name != "omnimesh:stage_scrape_up"]


async def test_slow_or_garbled_stage_is_skipped(monkeypatch):
    monkeypatch.setattr(rest, "STAGE_SCRAPE_TIMEOUT_S", 0.2)
    good = EngineMetrics("thinker")
    good.bind_stats(lambda: {"running": 2, "waiting": 1, "kv_cache_usage": 0.5, "preemptions": 0})
    app = create_app(ScriptedPipeline(), stage_metrics={
        "thinker": Source(good.render()), "talker": Source(good.render(), delay_s=5.0),
        "vocoder": Source("this is {not prometheus")})
    fams = _by_name(await _get_metrics(app))
    up = {s.labels["stage"]: s.value for s in fams["omnimesh:stage_scrape_up"]}
    assert up == {"thinker": 1, "talker": 0, "vocoder": 0}
    assert [s.value for s in fams["omnimesh:kv_cache_usage_perc"]] == [0.5]
    assert [s.labels["stage"] for s in fams["omnimesh:num_requests_waiting"]] == ["thinker"]


def test_merge_keeps_one_family_per_name_and_drops_a_type_clash():
    gauge = GaugeMetricFamily("omnimesh:x", "a gauge", labels=["stage"])
    gauge.add_metric(["a"], 1.0)
    clash = CounterMetricFamily("omnimesh:x", "a counter", labels=["stage"])
    clash.add_metric(["b"], 2.0)
    other = GaugeMetricFamily("omnimesh:x", "the same gauge", labels=["stage"])
    other.add_metric(["c"], 3.0)
    text = merge_families([[gauge], [clash], parse_exposition(merge_families([[other]]))])  # via text too
    assert text.count("# TYPE omnimesh:x ") == 1 and "omnimesh:x_total" not in text
    assert {s.labels["stage"]: s.value for f in text_string_to_metric_families(text) for s in f.samples} == \
        {"a": 1.0, "c": 3.0}
    with pytest.raises(ValueError):
        parse_exposition('omnimesh:x{stage="a"} one')
