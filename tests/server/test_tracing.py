"""omnimesh/tracing.py and `--otlp-traces-endpoint` without a mesh: the flag's checks, where it reaches, the
advice when OpenTelemetry is missing, the stage's span written from the engine's timestamps (exported to an
in-process receiver), and nothing at all while tracing is off. Through the mesh: tests/e2e/test_tracing_e2e.py."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from omnimesh import tracing
from omnimesh.config.serve_args import ServeArgs
from omnimesh.engine.loop import EngineDone, EngineFailed
from omnimesh.engine.metrics import EngineMetrics
from omnimesh.launcher import MeshLauncher

from bench.otlp_receiver import TraceCollector

ENDPOINT = "http://127.0.0.1:4317"


@pytest.mark.parametrize(("value", "needle"), [
    ("127.0.0.1:4317", "must be an http(s)://HOST:PORT URL"), ("grpc://collector:4317", "must be an http(s)"),
    ("http://:4317", "must be an http(s)"), ("http://collector:otlp", "port of"),
])
def test_a_bad_endpoint_stops_start_up_naming_the_flag(value: str, needle: str) -> None:
    with pytest.raises(ValueError, match="--otlp-traces-endpoint") as e:
        ServeArgs(otlp_traces_endpoint=value)  # checked as it is built (__post_init__)
    assert needle in str(e.value)


def test_the_flag_reaches_every_stage_and_the_gateway(tmp_path: Path) -> None:
    launcher = MeshLauncher(ServeArgs(otlp_traces_endpoint=ENDPOINT), tmp_path)
    for argv in (launcher._stage_argv("thinker", 1), launcher._stage_argv("vocoder", 2), launcher._gateway_argv({})):
        assert argv[argv.index("--otlp-traces-endpoint") + 1] == ENDPOINT
    assert "--otlp-traces-endpoint" not in MeshLauncher(ServeArgs(), tmp_path)._stage_argv("thinker", 1)


def test_missing_packages_are_named_with_the_install_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    with pytest.raises(RuntimeError, match=r"pip install 'omnimesh\[otel\]'"):
        tracing.init("omnimesh-test", ENDPOINT)
    assert not tracing.enabled()


def test_off_means_no_spans_and_one_warning_for_a_traced_request(caplog: pytest.LogCaptureFixture,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    assert not tracing.init("omnimesh-test", None) and not tracing.enabled()
    monkeypatch.setattr(tracing, "_warned_untraced", False)
    header = {"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"}
    with caplog.at_level(logging.WARNING, logger="omnimesh.tracing"):
        assert tracing.extract(header) is None and tracing.extract(header) is None
        assert tracing.extract({"user-agent": "x"}) is None
    assert caplog.text.count("tracing is off") == 1
    assert tracing.start_span("x") is None and tracing.inject(None) == {}
    timing = EngineMetrics("thinker").request(trace=None)
    assert not timing.traced


@pytest.fixture()
def collector() -> Iterator[TraceCollector]:
    c = TraceCollector()
    tracing.init("omnimesh-thinker", c.endpoint)
    yield c
    tracing.shutdown()
    c.stop()


class _Task:
    request_id, prompt_tokens, completion_tokens = "req-1", 12, 5


def test_a_stage_span_from_the_engine_timestamps(collector: TraceCollector) -> None:
    """`RequestTiming` writes `<stage>_request` under the caller's context: begun at submit, its events at
    inputs-ready / first step / first output, the tokens, the queue and first-token latencies."""
    trace, parent = "12" * 16, "34" * 8
    metrics = EngineMetrics("thinker", model_name="tiny")
    timing = metrics.request(tracing.extract({"traceparent": f"00-{trace}-{parent}-01"}))
    assert timing.traced
    time.sleep(0.01)
    timing.ready()
    time.sleep(0.01)
    timing.stepped(time.monotonic())
    time.sleep(0.01)
    timing.output()
    timing.output()
    timing.finished(_Task(), EngineDone("length", 12, 5))  # type: ignore[arg-type]
    failed = metrics.request(None)
    failed.finished(_Task(), EngineFailed(__import__("grpc").StatusCode.INVALID_ARGUMENT, "bad stop id"))  # type: ignore[arg-type]
    tracing.shutdown()  # flush
    span = collector.wait(trace, {"thinker_request"})["thinker_request"]
    a = span.attributes
    assert (span.service, span.parent_id) == ("omnimesh-thinker", parent)
    assert span.events == ("inputs_ready", "first_step", "first_output")
    assert (a["gen_ai.request.id"], a["gen_ai.response.model"], a["omnimesh.stage"]) == ("req-1", "tiny", "thinker")
    assert (a["gen_ai.usage.prompt_tokens"], a["gen_ai.usage.completion_tokens"]) == (12, 5)
    assert 0.005 < a["gen_ai.latency.time_in_queue"] < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    assert a["omnimesh.finish_reason"] == "length" and not span.error
    assert 25_000_000 < span.end_ns - span.start_ns < 5_000_000_000
    bad = [s for s in collector.spans if s.trace_id != trace]
    assert len(bad) == 1 and bad[0].error and bad[0].parent_id == ""  # no caller context: a root of its own
    assert bad[0].attributes["omnimesh.error_code"] == "INVALID_ARGUMENT"
