"""A REST request's work, stopped when its client disconnects (vLLM's `with_cancellation`).

Role: a non-streaming answer (and the preparation of a streaming one: decoding its media, building its prompt,
waiting for its first event) is work the client can walk away from: a client that times out and retries
would otherwise leave the thinker generating the whole abandoned answer (a 3,000-token answer kept running
2 s after its client left, on the tiny model; minutes of accelerator time on a real one). Once the body is
read, the next ASGI message is the client's `http.disconnect`; `until_client_leaves` races the work against
it and cancels the work when the client goes first: the pipeline's runs close, and the stages hear of it
(gateway/pipeline.py). A streaming answer, once its stream starts, is watched by Starlette's own
StreamingResponse instead.

Data flow: `RestGateway.answer` -> read_body -> `until_client_leaves(request, work)` -> the work's result, or
None (the work cancelled and awaited) when the disconnect came first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, TypeVar

from starlette.requests import Request

T = TypeVar("T")
CLIENT_GONE = 499  # nginx's "client closed request": what the metrics count such a request as
log = logging.getLogger(__name__)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass  # nothing else comes after the body, but an ASGI server may send more


async def until_client_leaves(request: Request, work: asyncio.Future[T]) -> T | None:
    """`work`'s result (or its exception), or None when the client disconnects first: `work` is then cancelled
    and awaited. Call it after the body has been read."""
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        either: set[asyncio.Future[Any]] = {work, gone}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the handler itself is cancelled (the server stops): so is its work
        gone.cancel()
        work.cancel()
        raise
    if work.done():
        gone.cancel()
        return work.result()
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        try:
            await work
        except Exception:  # the work failed as it was cancelled: nobody is left to answer
            log.debug("a request's work failed after its client left", exc_info=True)
    return None
