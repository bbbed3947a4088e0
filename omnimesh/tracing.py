"""OpenTelemetry tracing of requests across the mesh (vLLM's `--otlp-traces-endpoint`), off by default.

Role: with an endpoint, each process (the gateway and every stage) exports spans over OTLP/gRPC to it; one
request is one trace:
    client span (from the request's W3C `traceparent` / `tracestate` headers or gRPC metadata, when sent)
      └─ llm_request          the gateway: one run of the chain (vLLM's span name and gen_ai.* attributes)
           ├─ encoder_request  each stage the run used, from the stage's own timestamps: submitted, inputs
           ├─ thinker_request  in, first step, first output, end; its tokens and finish reason
           ├─ talker_request
           └─ vocoder_request
The gateway's span context reaches the stages as `traceparent` metadata on their Process call
(`inject` -> StageClient.open -> `extract` in the stage servicer -> the engine's `RequestTiming`, which
writes the stage's span when the request ends).

Without an endpoint nothing here imports OpenTelemetry and every hook returns at once (`enabled()` is
False). With one, the `opentelemetry-sdk` and `opentelemetry-exporter-otlp-proto-grpc` packages
(`pip install 'omnimesh[otel]'`) must be installed, else start-up stops with that advice. The exporter's
own environment variables apply (OTEL_EXPORTER_OTLP_TRACES_HEADERS, OTEL_EXPORTER_OTLP_TRACES_INSECURE /
_CERTIFICATE, OTEL_BSP_SCHEDULE_DELAY ...); OTEL_SERVICE_NAME overrides the service name
(`omnimesh-gateway`, `omnimesh-thinker`, ...). Spans leave in batches from a background thread and the
rest are flushed when the process exits.
"""

from __future__ import annotations

import logging
import time
import urllib.parse
from collections.abc import Iterable, Mapping
from contextvars import ContextVar, Token
from typing import Any

log = logging.getLogger(__name__)

TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context: what is read from requests and sent on
INSTALL_HINT = "pip install 'omnimesh[otel]' (opentelemetry-sdk and opentelemetry-exporter-otlp-proto-grpc)"

_tracer: Any = None  # the process's tracer once `init` ran with an endpoint
_provider: Any = None
_warned_untraced = False


def check_endpoint(endpoint: str | None, flag: str = "--otlp-traces-endpoint") -> None:
    """The flag's value: an http(s)://host:port URL of an OTLP/gRPC receiver (ValueError naming the flag)."""
    if endpoint is None:
        return
    parsed = urllib.parse.urlsplit(endpoint)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"{flag} must be an http(s)://HOST:PORT URL of an OTLP/gRPC trace receiver (such as an "
                         f"OpenTelemetry collector on port 4317), got {endpoint!r}")
    try:
        parsed.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        raise ValueError(f"{flag}: the port of {endpoint!r} is not a number") from None


def init(service: str, endpoint: str | None) -> bool:
    """Export this process's spans to `endpoint` as `service` (no endpoint: tracing stays off). Returns
    whether tracing is on; RuntimeError with the install advice when the packages are missing."""
    global _tracer, _provider
    if endpoint is None:
        return False
    check_endpoint(endpoint)
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise RuntimeError(f"--otlp-traces-endpoint needs OpenTelemetry ({exc.name} is missing): {INSTALL_HINT}") from None
    import os

    name = os.environ.get("OTEL_SERVICE_NAME") or service
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    insecure = urllib.parse.urlsplit(endpoint).scheme == "http"
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=insecure)))
    _provider, _tracer = provider, provider.get_tracer("omnimesh")
    log.info("tracing: spans of %s go to %s (OTLP/gRPC)", name, endpoint)
    return True


def enabled() -> bool:
    return _tracer is not None


def shutdown() -> None:
    """Flush and stop the exporter (the SDK also does it at exit)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def extract(carrier: Mapping[str, str] | Iterable[tuple[str, str]]) -> Any:
    """The parent context a request's headers or metadata carry (None when tracing is off). A request that
    carries one while tracing is off is named once in the log, as vLLM does."""
    global _warned_untraced
    items = carrier.items() if isinstance(carrier, Mapping) else carrier
    headers = {k.lower(): v for k, v in items if k.lower() in TRACE_HEADERS}
    if _tracer is None:
        if headers and not _warned_untraced:
            _warned_untraced = True
            log.warning("a request carries trace context (traceparent) but tracing is off: start with "
                        "--otlp-traces-endpoint to export spans")
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(headers)


def inject(span: Any) -> dict[str, str]:
    """`span`'s context as W3C headers (gRPC metadata for the next hop); {} without a span."""
    if span is None:
        return {}
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def _known(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    """The attributes with a value (None: not known for this request, so not set)."""
    return {k: v for k, v in (attributes or {}).items() if v is not None}


def start_span(name: str, parent: Any = None, attributes: Mapping[str, Any] | None = None,
               start_ns: int | None = None) -> Any:
    """A started server span under `parent` (a context from `extract`; None: the current one), or None when
    tracing is off. End it with `end`."""
    if _tracer is None:
        return None
    from opentelemetry.trace import SpanKind

    return _tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes=_known(attributes),
                              start_time=start_ns)


def end(span: Any, attributes: Mapping[str, Any] | None = None, error: str | None = None) -> None:
    """Set the final attributes, mark an error (its description) and end the span; None: nothing to do."""
    if span is None:
        return
    span.set_attributes(_known(attributes))
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error))
    span.end()


def wall_ns(monotonic_s: float) -> int:
    """A `time.monotonic()` value as wall-clock nanoseconds (span times are wall clock)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def record(name: str, parent: Any, started: float, events: Mapping[str, float], attributes: Mapping[str, Any],
           error: str | None = None) -> None:
    """A span already over, from `time.monotonic()` timestamps: it began at `started`, ends now, and its
    `events` (name -> monotonic time, 0 = never happened) mark the moments between."""
    span = start_span(name, parent, start_ns=wall_ns(started))
    if span is None:
        return
    for event, at in events.items():
        if at:
            span.add_event(event, timestamp=wall_ns(at))
    end(span, attributes, error)


# the trace context of the client request being served (set by the gateway's fronts, read by the run it starts)
_request_parent: ContextVar[Any] = ContextVar("omnimesh_trace_parent", default=None)


def set_request_parent(carrier: Mapping[str, str] | Iterable[tuple[str, str]]) -> Token | None:
    """A front (REST, gRPC) received a request: its trace headers become the parent of the runs it starts in
    this task and the tasks it creates. Returns the token for `reset_request_parent` (None: nothing set)."""
    parent = extract(carrier)
    return None if parent is None else _request_parent.set(parent)


def reset_request_parent(token: Token | None) -> None:
    if token is not None:
        _request_parent.reset(token)


def request_parent() -> Any:
    return _request_parent.get()
