"""The `/v1/realtime` WebSocket route: the handshake's checks, the sessions open, and their end at a shutdown.

Data flow: a handshake -> refused before it is accepted (an unknown model 404, a bad intent 400, past
--max-realtime-sessions 429 with Retry-After, while the server shuts down 503; OpenAI's error body, as REST's)
or accepted -> a `RealtimeSession` (gateway/realtime_api.py) runs it until the client leaves, it reaches
--max-realtime-session-duration, or `drain` ends it: at a shutdown each open session finishes the response in
progress (within the grace), gets an error event (code `server_shutting_down`) and is closed with 1012 (service
restart), before the HTTP server closes the sockets itself (uvicorn closes a WebSocket at once, mid-answer).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from fastapi import WebSocket

from gateway.auth import KEY_SUBPROTOCOL
from gateway.events import PipelineError
from gateway.handshake_refusal import send_error
from gateway.http_errors import RETRY_AFTER_S
from gateway.media import invalid_request
from gateway.openai_schema import default_modalities, dump, error_response, unknown_model
from gateway.realtime_api import RealtimeSession
from gateway.realtime_settings import RealtimeSettings, updated
from omnimesh import tracing

if TYPE_CHECKING:
    from gateway.rest import RestGateway


def sessions_full(limit: int) -> PipelineError:
    """The 429 of a handshake past --max-realtime-sessions."""
    return PipelineError(f"this server already has its {limit} Realtime sessions open (--max-realtime-sessions); "
                         "try again when one closes", http_status=429,
                         grpc_code=8, kind="rate_limit_error")  # 8: RESOURCE_EXHAUSTED


def asks_beta(header: str, subprotocols: list[str]) -> bool:
    """The client asks for the beta interface: the header `OpenAI-Beta: realtime=v1` (the SDK's
    `client.beta.realtime`), or a browser's subprotocol `openai-beta.realtime-v1`. Anything else speaks GA, as
    OpenAI's own server since the beta's end."""
    return "realtime=v1" in header or "openai-beta.realtime-v1" in subprotocols


def shutting_down() -> PipelineError:
    """The 503 of a handshake while the server shuts down."""
    return PipelineError("the server is shutting down: connect to another replica, or again once it is back",
                         http_status=503, grpc_code=14, kind="server_error")  # 14: UNAVAILABLE


async def refuse(ws: WebSocket, err: PipelineError) -> None:
    """The handshake refused before it is accepted, with the error's HTTP status and OpenAI's body (a 429 with
    Retry-After, as REST's)."""
    retry = [(b"retry-after", str(RETRY_AFTER_S).encode())] if err.http_status == 429 else []
    await send_error(ws.scope, ws.receive, ws.send, err.http_status, dump(error_response(err)), retry)


class RealtimeRoutes:
    """The `/v1/realtime` WebSocket on one `RestGateway`. `max_sessions` (--max-realtime-sessions; None: no
    bound) caps the sessions open at once: one more handshake is refused with a 429 and Retry-After, before it
    is accepted (each session holds its conversation, up to the input limits, for as long as it is open);
    `max_duration` (--max-realtime-session-duration; None: no limit) is how long each may stay open."""

    def __init__(self, gw: RestGateway, max_sessions: int | None = None, max_duration: float | None = None) -> None:
        self.gw = gw
        self.max_sessions = max_sessions
        self.max_duration = max_duration
        self.open = 0  # sessions accepted and not yet closed
        self.sessions: dict[str, tuple[RealtimeSession, asyncio.Task]] = {}  # by id: those running, and their task
        self.closing = False  # the server shuts down: no new session
        gw.metrics.realtime_sessions.set_function(lambda: self.open)  # read at each scrape

    async def drain(self, grace_s: float) -> None:
        """Shutdown: no new session; each open one finishes what it runs (at most `grace_s`), is told why and
        closed (1012). Returns once they all are, or after the grace and a second for their goodbyes."""
        self.closing = True
        loop = asyncio.get_running_loop()
        by = loop.time() + grace_s
        for session, _ in self.sessions.values():
            session.shut(by)
        tasks = [task for _, task in self.sessions.values()]
        if tasks:
            await asyncio.wait(tasks, timeout=grace_s + 1.0)

    async def realtime(self, ws: WebSocket) -> None:
        model = ws.query_params.get("model")
        if model and model not in self.gw.served_model_names:  # refused as REST refuses it: 404, OpenAI's body
            await refuse(ws, unknown_model(model, self.gw.served_model_names))
            return
        # OpenAI's live captions connect with ?intent=transcription (no model): a GA transcription session from
        # session.created on; beta's transcription sessions (transcription_session.update) are not served
        intent = ws.query_params.get("intent")
        # a browser's subprotocols (OpenAI's: "realtime", the key, "openai-beta.realtime-v1"): one must be
        # chosen in the answer or the browser drops the connection; never the key
        offered = [p for p in ws.scope.get("subprotocols") or () if not p.startswith(KEY_SUBPROTOCOL)]
        beta = asks_beta(ws.headers.get("openai-beta", ""), offered)
        if intent not in (None, "transcription") or (intent and beta):
            await refuse(ws, invalid_request(f"intent {intent!r}: only 'transcription' (GA's, without the "
                                             "OpenAI-Beta: realtime=v1 header) is served", "intent"))
            return
        if self.closing:
            await refuse(ws, shutting_down())
            return
        if self.max_sessions is not None and self.open >= self.max_sessions:
            await refuse(ws, sessions_full(self.max_sessions))
            return
        self.open += 1  # counted before the first await: the check and the count are one step on the loop
        try:
            await ws.accept(subprotocol="realtime" if "realtime" in offered else (offered[0] if offered else None))
            await self._session(ws, model, intent, beta)
        finally:
            self.open -= 1

    async def _session(self, ws: WebSocket, model: str | None, intent: str | None, beta: bool) -> None:
        # the handshake's traceparent, when tracing: every response of the session is a run under it
        trace = tracing.set_request_parent(ws.headers.items())
        try:
            settings = RealtimeSettings(modalities=default_modalities(self.gw.pipeline))  # text alone: no speech here
            if intent == "transcription":  # text out, each committed turn transcribed (with the defaults)
                settings = updated(settings, {"modalities": ["text"], "input_audio_transcription": {}},
                                   self.gw.pipeline)
            session = RealtimeSession(self.gw, ws, model or self.gw.served_model_names[0], settings=settings,
                                      ga=not beta,
                                      transcription=intent == "transcription", max_duration=self.max_duration)
            task = asyncio.current_task()
            assert task is not None
            self.sessions[session.id] = (session, task)
            if self.closing:  # accepted while the server began to shut down: it ends at its first event
                session.shut(asyncio.get_running_loop().time())
            try:
                await session.run()
            finally:
                del self.sessions[session.id]
        finally:
            tracing.reset_request_parent(trace)
