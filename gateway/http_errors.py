"""What every REST route shares: the size-capped body read and OpenAI's error response.

`read_body(request, limit)` -> the body bytes (413 as soon as it is over the limit, from Content-Length or
while streaming in; 408 when it stops arriving for BODY_IDLE_TIMEOUT_S, as nginx's client_body_timeout; a
client that disconnects mid-body is a PipelineError of status 499, counted as such, not a logged 500);
`error_json(PipelineError)` -> `{"error": {message, type, param, code}}` with the error's HTTP status (a 429
carries `Retry-After`); `internal_error(exc)` -> the 500 for a bug.
"""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from gateway.client_gone import CLIENT_GONE
from gateway.events import PipelineError
from gateway.media import too_large
from gateway.openai_schema import dump, error_response

RETRY_AFTER_S = 1  # the Retry-After of a 429: queues drain as requests finish, so soon is worth a try
BODY_IDLE_TIMEOUT_S = 60.0  # nginx's client_body_timeout: the longest wait for the body's next bytes
_GRPC_CANCELLED, _GRPC_DEADLINE_EXCEEDED = 1, 4


def error_json(err: PipelineError) -> JSONResponse:
    # 429 (a stage's queue is full: --max-waiting-requests) says when to try again, as rate limiters do
    headers = {"Retry-After": str(RETRY_AFTER_S)} if err.http_status == 429 else None
    return JSONResponse(dump(error_response(err)), status_code=err.http_status, headers=headers)


def internal_error(e: BaseException) -> PipelineError:
    return PipelineError(f"internal error: {type(e).__name__}: {e}", http_status=500, grpc_code=13,
                         kind="server_error")


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(f"request body is {int(declared)} bytes; the limit is {limit}")
    buf = bytearray()
    chunks = aiter(request.stream())
    while True:
        try:
            async with asyncio.timeout(BODY_IDLE_TIMEOUT_S):  # a body shorter than its Content-Length waits here
                chunk = await anext(chunks)
        except StopAsyncIteration:
            return bytes(buf)
        except TimeoutError:
            raise PipelineError(f"the request body stopped arriving: no bytes for {BODY_IDLE_TIMEOUT_S:g} s after "
                                f"{len(buf)} (is its Content-Length larger than the body?)", http_status=408,
                                grpc_code=_GRPC_DEADLINE_EXCEEDED, kind="invalid_request_error") from None
        except ClientDisconnect:
            raise PipelineError("the client disconnected while sending its request body", http_status=CLIENT_GONE,
                                grpc_code=_GRPC_CANCELLED, kind="client_gone") from None
        buf += chunk
        if len(buf) > limit:
            raise too_large(f"request body is larger than the limit of {limit} bytes")
