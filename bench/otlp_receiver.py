"""An OTLP/gRPC trace receiver on 127.0.0.1: what an OpenTelemetry collector would get from a mesh started with
`--otlp-traces-endpoint`. Spans are kept with their service's name. The e2e tests check the mesh's traces with
it (tests/e2e/test_tracing_e2e.py) and bench/tracing_overhead.py gives the traced mesh somewhere to send them.
Needs the `otel` extra (opentelemetry-proto comes with the exporter)."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a root
    attributes: dict
    events: tuple[str, ...]
    start_ns: int
    end_ns: int
    error: bool


def _value(v) -> object:  # an AnyValue
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class TraceCollector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def Export(self, request, context):  # noqa: N802 - the OTLP service's method
        got = []
        for rs in request.resource_spans:
            service = next((str(_value(a.value)) for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(Span(service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                    {a.key: _value(a.value) for a in s.attributes}, tuple(e.name for e in s.events),
                                    s.start_time_unix_nano, s.end_time_unix_nano, s.status.code == 2))
        with self._lock:
            self.spans.extend(got)
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait(self, trace_id: str, names: set[str], timeout_s: float = 20.0) -> dict[str, Span]:
        """The trace's spans by name once all of `names` arrived (AssertionError naming the missing ones)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                found = {s.name: s for s in self.spans if s.trace_id == trace_id}
            if names <= set(found) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert names <= set(found), f"spans {sorted(names - set(found))} of trace {trace_id} never came; got {found}"
        return found

    def stop(self) -> None:
        self.server.stop(1.0)
