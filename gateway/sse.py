"""Server-sent events plumbing shared by the streamed REST answers (chat completions, completions).

Data flow: a route awaits its first pipeline event, then returns `SSEResponse(StreamState(...), body)`
where `body` yields `sse(chunk)` bytes and ends with `DONE`. `StreamState` settles the request's metrics
(running gauge, requests_total, latency) exactly once and closes the pipeline's events, however the stream
ends: finished, failed midway, or the client gone (even before the first byte, when Starlette never runs
the body at all).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.choices import close_events
from gateway.events import Finished, PipelineError
from gateway.http_errors import internal_error

if TYPE_CHECKING:
    from gateway.rest import RestGateway

log = logging.getLogger(__name__)
DONE = b"data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> bytes:
    """One SSE `data:` event holding `obj` as compact JSON."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


async def run_to_end(first: Any, events: AsyncIterator[Any], take: Callable[[Any], object]) -> Finished:
    """A single run's indexed events (`first`, then the rest) handed to `take` up to its `Finished`, which it
    returns; the events are closed however it ends, and a run that ends without one is a 500."""
    try:
        async for _, ev in chain(first, events):
            take(ev)
            if isinstance(ev, Finished):
                return ev
    finally:
        await close_events(events)
    raise internal_error(RuntimeError("the pipeline ended without a Finished event"))


async def chain(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """`first` (an event already awaited) followed by the rest of the events."""
    yield first
    async for item in rest:
        yield item


async def guarded(body: AsyncIterator[bytes], state: StreamState, what: str) -> AsyncIterator[bytes]:
    """An SSE body whose end settles the stream: 200 when `body` runs out, an error midway sent as an error
    event and `[DONE]` (its status; anything not a PipelineError a logged 500), 499 for a client gone; the
    pipeline's events closed however it ends. `what` names the stream in the log."""
    from gateway.openai_schema import error_response

    status = 499  # client closed, unless the stream gets to its end
    try:
        async for data in body:
            yield data
        status = 200
    except PipelineError as e:
        status = e.http_status
        yield sse(error_response(e).model_dump(mode="json"))
        yield DONE
    except Exception as e:
        log.exception("%s stream failed", what)
        status = 500
        yield sse(error_response(internal_error(e)).model_dump(mode="json"))
        yield DONE
    finally:
        await close_events(body)  # type: ignore[arg-type]
        state.settle(status)
        await state.close_events()


class StreamState:
    """Bookkeeping of one streamed response (`endpoint` labels its metrics), settled exactly once."""

    def __init__(self, gw: RestGateway, endpoint: str, request_id: str, started: float,
                 events: AsyncIterator[Any]) -> None:
        self.gw, self.endpoint, self.request_id, self.started, self.events = gw, endpoint, request_id, started, events
        self.settled = self.events_closed = False

    def settle(self, status: int) -> None:
        if not self.settled:
            self.settled = True
            self.gw.metrics.running.dec()
            self.gw._finish(self.endpoint, status, self.started)

    async def close_events(self) -> None:
        if not self.events_closed:
            self.events_closed = True
            await close_events(self.events)


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its generator and the pipeline's events, even when the
    client disconnects before the first byte (Starlette then never starts or finishes the generator).
    Server-sent events by default; `media_type` for another stream (raw PCM audio)."""

    def __init__(self, stream: StreamState, body: AsyncIterator[bytes], media_type: str = "text/event-stream") -> None:
        super().__init__(body, media_type=media_type,
                         headers={"Cache-Control": "no-cache", "X-Request-Id": stream.request_id})
        self._stream_state = stream
        self._body = body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._body.aclose()  # type: ignore[attr-defined]
            except Exception:
                log.debug("closing the SSE generator failed", exc_info=True)
            self._stream_state.settle(499)
            await self._stream_state.close_events()
