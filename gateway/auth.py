"""API keys at the gateway (vLLM's `--api-key`): the OpenAI routes and the gRPC Omni service need one.

Data flow: `--api-key` (or, when the flag is not given, the `OMNIMESH_API_KEY` environment variable, as
vLLM reads `VLLM_API_KEY`) -> `parse_api_keys` -> a tuple of keys (comma-separated: several keys are valid
at once, so one can be rotated without downtime) ->
- REST: `ApiKeyMiddleware` (plain ASGI, so streamed responses pass untouched) answers a `/v1/...` request
  whose `Authorization` header is not `Bearer <one of the keys>` with OpenAI's 401 body before any handler
  runs (the `/v1/realtime` WebSocket handshake: refused with the same 401 and body; a browser, which cannot
  set headers on a WebSocket, may give the key as OpenAI's subprotocol `openai-insecure-api-key.<key>`); `/health` and
  `/metrics` stay open, as in vLLM, for probes and Prometheus;
- gRPC: `ApiKeyInterceptor` does the same for `omnimesh.v1.Omni` methods from the `authorization`
  metadata (UNAUTHENTICATED); `grpc.health.v1` and reflection stay open.
/tokenize and /detokenize need the key too (vLLM leaves them open, but they decode a body's media);
/version stays open.
Keys are compared in constant time (`hmac.compare_digest`); no key set means no check at all (and neither
piece is installed). The launcher hands the key to the gateway process in its environment, never on a
command line that `ps` shows.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from gateway.handshake_refusal import send_error

ENV_VAR = "OMNIMESH_API_KEY"
PROTECTED_GRPC_PREFIX = "/omnimesh.v1.Omni/"
# the OpenAI routes, vLLM's /tokenize and /detokenize (they run the processor on a body's media) and /invocations
PROTECTED_PATH_PREFIXES = ("/v1", "/tokenize", "/detokenize", "/invocations")
_MISSING = "missing API key: send the header 'Authorization: Bearer <key>' (the server runs with --api-key)"
_WRONG = "invalid API key"


def parse_api_keys(flag: str | None, environ: dict[str, str] | os._Environ[str] = os.environ) -> tuple[str, ...]:
    """The keys the gateway accepts: the flag's, else the environment's; empty = no key needed.

    A value that is only commas or spaces is refused (it would look like protection and give none)."""
    raw = flag if flag is not None else environ.get(ENV_VAR)
    if raw is None or raw == "":
        return ()
    keys = tuple(k.strip() for k in raw.split(",") if k.strip())
    if not keys:
        raise ValueError(f"--api-key / {ENV_VAR} holds no key (only commas or spaces); give one or more keys, "
                         "comma-separated")
    return keys


def check_bearer(header: str | None, keys: tuple[str, ...]) -> str | None:
    """None when `header` ("Bearer <key>") carries one of `keys`; else why not (the client's error message)."""
    if not header:
        return _MISSING
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return _MISSING
    given = token.strip().encode()
    ok = False
    for key in keys:  # every key is compared, so the time does not tell which one nearly matched
        ok |= hmac.compare_digest(given, key.encode())
    return None if ok else _WRONG


ASGIApp = Callable[[dict[str, Any], Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


KEY_SUBPROTOCOL = "openai-insecure-api-key."  # OpenAI's way for a browser WebSocket to carry its key


def websocket_key(subprotocols: Any) -> str | None:
    """The key a WebSocket handshake offers as a subprotocol (`openai-insecure-api-key.<key>`), if any."""
    return next((p[len(KEY_SUBPROTOCOL):] for p in subprotocols if p.startswith(KEY_SUBPROTOCOL)), None)


def route_path(scope: dict[str, Any]) -> str:
    """The path the router matches: the scope's path less its root_path prefix (--root-path), as Starlette's."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("", "/"):
        return path[len(root):] or "/"
    return path


class ApiKeyMiddleware:
    """ASGI: `/v1/...`, /tokenize and /detokenize need `Authorization: Bearer <key>`; the rest passes as it is."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...]) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict]],
                       send: Callable[[dict], Awaitable[None]]) -> None:
        if scope["type"] not in ("http", "websocket") or not route_path(scope).startswith(PROTECTED_PATH_PREFIXES):
            await self.app(scope, receive, send)
            return
        header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
        if header is None and scope["type"] == "websocket":
            key = websocket_key(scope.get("subprotocols") or ())
            header = None if key is None else f"Bearer {key}"
        why = check_bearer(header, self.keys)
        if why is None:
            await self.app(scope, receive, send)
            return
        body = {"error": {"message": why, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
        # a request, or /v1/realtime's WebSocket handshake (refused with the same 401 before it is accepted)
        await send_error(scope, receive, send, 401, body, [(b"www-authenticate", b"Bearer")])


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """gRPC: Omni methods need `authorization: Bearer <key>` metadata; health and reflection stay open."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        self.keys = keys

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(PROTECTED_GRPC_PREFIX):
            return handler
        metadata = dict(details.invocation_metadata or ())
        why = check_bearer(metadata.get("authorization"), self.keys)  # type: ignore[arg-type]
        if why is None:
            return handler

        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(refuse)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(refuse)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(refuse)
        return grpc.unary_unary_rpc_method_handler(refuse)
