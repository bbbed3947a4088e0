"""POST /invocations: vLLM's (and SageMaker's) one generating route, beside /ping.

Data flow: the body (size-capped, as every route's) -> its kind from its fields: `messages` a chat completion,
`prompt` a completion (vLLM tries its request types in that order) -> the body replayed into that route's own
handler, which answers exactly as /v1/chat/completions or /v1/completions would (streamed or not, the same
errors). A body that is neither is a 400 naming both; not JSON, a 400. Behind --api-key like /v1.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from gateway.events import PipelineError
from gateway.http_errors import error_json, read_body
from gateway.media import invalid_request
from omnimesh import json_text

Route = Callable[[Request], Awaitable[Response]]


class InvocationRoutes:
    def __init__(self, chat: Route, completions: Route | None, max_request_bytes: int) -> None:
        self.chat, self.completions, self.limit = chat, completions, max_request_bytes

    async def invocations(self, request: Request) -> Response:
        try:
            raw = await read_body(request, self.limit)
            route = self._route(await asyncio.to_thread(_fields, raw))
        except PipelineError as err:
            return error_json(err)
        return await route(_replayed(request, raw))

    def _route(self, fields: set[str]) -> Route:
        if "messages" in fields:
            return self.chat
        if "prompt" in fields and self.completions is not None:
            return self.completions
        kinds = "a chat completion (with `messages`)" + (
            " or a completion (with `prompt`)" if self.completions is not None else "")
        raise invalid_request(f"/invocations takes the body of {kinds}; this one has "
                              f"{', '.join(sorted(fields)) or 'no fields'}")


def _fields(raw: bytes) -> set[str]:
    try:
        body = json_text.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise invalid_request(f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise invalid_request(f"the body must be a JSON object, got {type(body).__name__}")
    return set(body)


def _replayed(request: Request, raw: bytes) -> Request:
    """The same request with its body, already read, given again to whoever reads it next."""
    sent = False

    async def receive() -> MutableMapping[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await request.receive()  # after the body: the client's disconnect, as the route expects

    return Request(request.scope, receive)
