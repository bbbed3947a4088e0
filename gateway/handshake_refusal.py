"""Refusing a WebSocket handshake (`/v1/realtime`) with an HTTP status and OpenAI's error body, as REST answers.

A handshake closed before `accept` reaches the client as a bare HTTP 403 whatever the cause (a wrong key reads
like a wrong model; the close frame's reason never arrives). The ASGI WebSocket denial-response extension
(`websocket.http.response`, which uvicorn serves) lets the app answer the handshake with any HTTP response
instead: here the same status and `{"error": {message, type, param, code}}` body that a REST request with the
same mistake gets (401 + `WWW-Authenticate: Bearer` for the key, 404 for the model, 400
for a bad query). A server without the extension closes with code 1008 and the message as its reason (cut to
the 123 bytes a close frame holds), which clients see as a 403.

Data flow: (scope, receive, send) of the handshake + status + body -> `websocket.http.response.start/body`,
or `websocket.connect` received -> `websocket.close`. Plain HTTP scopes get `http.response.start/body`, so
one call answers both (the API-key middleware's case).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping
from typing import Any

DENIAL_EXTENSION = "websocket.http.response"
MAX_CLOSE_REASON_BYTES = 123  # RFC 6455: a close frame's payload is at most 125 bytes, 2 of them the code


def close_reason(message: str) -> str:
    """`message` cut to what a close frame can carry, on a character boundary."""
    data = message.encode()
    if len(data) <= MAX_CLOSE_REASON_BYTES:
        return message
    return data[:MAX_CLOSE_REASON_BYTES - 3].decode(errors="ignore") + "..."


async def send_error(scope: MutableMapping[str, Any], receive: Callable[[], Awaitable[Mapping[str, Any]]],
                     send: Callable[[dict[str, Any]], Awaitable[None]], status: int, body: dict[str, Any],
                     headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    """Answer an HTTP request, or refuse a WebSocket handshake not yet accepted, with `status` and `body`."""
    prefix = ""
    if scope["type"] == "websocket":
        if DENIAL_EXTENSION not in (scope.get("extensions") or {}):
            await receive()  # websocket.connect
            error = body.get("error")
            message = error.get("message", "refused") if isinstance(error, dict) else "refused"
            await send({"type": "websocket.close", "code": 1008, "reason": close_reason(str(message))})
            return
        prefix = "websocket."
    data = json.dumps(body).encode()
    await send({"type": f"{prefix}http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *headers]})
    await send({"type": f"{prefix}http.response.body", "body": data})
