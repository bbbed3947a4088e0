"""How a Realtime session ends on the server's side (gateway/realtime_api.py, gateway/realtime_routes.py).

At --max-realtime-session-duration: the session says when (`expires_at`, beta and GA); then a response in
progress is cancelled (its events end with response.done), the client gets an error event with code
`session_expired` and the WebSocket is closed (1000), freeing its --max-realtime-sessions slot. At a shutdown
(`stop_rest`, what the gateway runs on SIGTERM): a response in progress finishes within the grace (past it, it is
cancelled), the client gets `server_shutting_down` and the close is 1012 (service restart); a handshake meanwhile
is a 503. Against a scripted pipeline, on a real uvicorn server with a real WebSocket client."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
from gateway_harness import RestServer, ScriptedPipeline
from test_realtime import BETA, TIMEOUT_S, recv, refused_with, send, until, url
from test_realtime_limits import _sessions_gauge
from websockets.exceptions import ConnectionClosedError, ConnectionClosedOK, InvalidStatus
from websockets.sync.client import ClientConnection, connect
from websockets.typing import Subprotocol

from gateway.rest import create_app
from gateway.server import stop_rest
from omnimesh.config.serve_args import ServeArgs


def test_an_idle_session_ends_at_its_maximum_duration(pipeline: ScriptedPipeline) -> None:
    app = create_app(pipeline, served_model_names=("tiny-omni",), max_realtime_session_s=1.5)
    with RestServer(app) as server, connect(url(server), additional_headers=BETA, open_timeout=TIMEOUT_S) as conn:
        opened = time.time()
        session = recv(conn)["session"]
        assert opened <= session["expires_at"] + 1 and session["expires_at"] <= opened + 1.5
        send(conn, type="session.update", session={})  # the session serves until then
        assert recv(conn)["type"] == "session.updated"
        error = recv(conn)["error"]
        waited = time.time() - opened
        assert error["code"] == "session_expired" and error["type"] == "invalid_request_error"
        assert "maximum duration of 1.5 seconds (--max-realtime-session-duration)" in error["message"]
        assert 1.3 <= waited < TIMEOUT_S
        with pytest.raises(ConnectionClosedOK):
            conn.recv(timeout=TIMEOUT_S)
        assert conn.close_code == 1000 and conn.close_reason == "session expired"
        deadline = time.monotonic() + TIMEOUT_S  # its slot is free
        while _sessions_gauge(server) != 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _sessions_gauge(server) == 0


def test_a_response_in_progress_is_cancelled_at_the_end(pipeline: ScriptedPipeline) -> None:
    pipeline.event_delay_s = 5.0  # far past the session's end
    app = create_app(pipeline, served_model_names=("tiny-omni",), max_realtime_session_s=2)
    with RestServer(app) as server, connect(url(server), additional_headers=BETA, open_timeout=TIMEOUT_S) as conn:
        assert recv(conn)["type"] == "session.created"
        send(conn, type="conversation.item.create", item={"type": "message", "role": "user",
                                                          "content": [{"type": "input_text", "text": "Talk."}]})
        assert recv(conn)["type"] == "conversation.item.created"
        send(conn, type="response.create")
        events = until(conn, "error")
        done = [e for e in events if e["type"] == "response.done"]
        assert len(done) == 1 and done[0]["response"]["status"] == "cancelled"  # before the error: it ended first
        assert done[0]["response"]["status_details"]["reason"] == "session_expired"
        assert events[-1]["error"]["code"] == "session_expired"
        assert "maximum duration of 2 seconds" in events[-1]["error"]["message"]
        with pytest.raises(ConnectionClosedOK):
            conn.recv(timeout=TIMEOUT_S)
        assert pipeline.closed == [done[0]["response"]["id"]]  # the run was closed in the stages
        assert _sessions_gauge(server) == 0


def test_expires_at_in_ga_sessions_and_none_without_a_limit(pipeline: ScriptedPipeline) -> None:
    minutes = create_app(pipeline, served_model_names=("tiny-omni",), max_realtime_session_s=3600)
    with RestServer(minutes) as server, connect(url(server), open_timeout=TIMEOUT_S,
                                                subprotocols=[Subprotocol("realtime")]) as conn:
        session = recv(conn)["session"]
        assert session["type"] == "realtime" and abs(session["expires_at"] - (time.time() + 3600)) < 5
    with RestServer(create_app(pipeline, served_model_names=("tiny-omni",))) as server, \
            connect(url(server), additional_headers=BETA, open_timeout=TIMEOUT_S) as conn:
        assert recv(conn)["session"]["expires_at"] is None
        send(conn, type="session.update", session={"type": "transcription"})  # a GA transcription session too
        assert recv(conn)["session"]["expires_at"] is None


def test_the_flag_is_checked_and_reaches_the_gateway(tmp_path: Path) -> None:
    from omnimesh.launcher import MeshLauncher

    assert ServeArgs().max_realtime_session_duration == 3600
    with pytest.raises(ValueError, match="--max-realtime-session-duration must be >= 0 seconds"):
        ServeArgs(max_realtime_session_duration=-1)
    argv = MeshLauncher(ServeArgs(max_realtime_session_duration=90), tmp_path)._gateway_argv({})
    assert argv[argv.index("--max-realtime-session-duration") + 1] == "90"


def _talk(conn: ClientConnection) -> None:
    assert recv(conn)["type"] == "session.created"
    send(conn, type="conversation.item.create", item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "Talk."}]})
    assert recv(conn)["type"] == "conversation.item.created"
    send(conn, type="response.create")
    assert recv(conn)["type"] == "response.created"


def _shut_down(server: RestServer, grace_s: float) -> Future:
    """What the gateway runs on SIGTERM, on the server's loop."""
    app = server.server.config.app
    return asyncio.run_coroutine_threadsafe(stop_rest(server.server, app.state.realtime, grace_s),
                                            server.server.servers[0].get_loop())


def _closed_for_shutdown(conn: ClientConnection) -> None:
    with pytest.raises(ConnectionClosedError):
        conn.recv(timeout=TIMEOUT_S)
    assert conn.close_code == 1012 and conn.close_reason == "server shutting down"


def test_a_shutdown_lets_the_response_in_progress_finish(pipeline: ScriptedPipeline) -> None:
    pipeline.event_delay_s = 0.3  # 5 events: 1.5 s
    server = RestServer(create_app(pipeline, served_model_names=("tiny-omni",))).start()
    try:
        with connect(url(server), additional_headers=BETA, open_timeout=TIMEOUT_S) as conn, \
                connect(url(server), additional_headers=BETA, open_timeout=TIMEOUT_S) as idle:
            _talk(conn)
            assert recv(idle)["type"] == "session.created"
            stopping = _shut_down(server, grace_s=TIMEOUT_S)
            events = until(conn, "error")  # the answer whole, then why the session ends
            done = [e for e in events if e["type"] == "response.done"]
            assert len(done) == 1 and done[0]["response"]["status"] == "completed"
            assert "".join(e["delta"] for e in events if e["type"] == "response.audio_transcript.delta") \
                == "Hello world"
            error = events[-1]["error"]
            assert error["code"] == "server_shutting_down" and error["type"] == "server_error"
            _closed_for_shutdown(conn)
            assert recv(idle)["error"]["code"] == "server_shutting_down"  # an idle one at once
            _closed_for_shutdown(idle)
            stopping.result(TIMEOUT_S)
    finally:
        server.stop()


def test_a_response_past_the_grace_is_cancelled(pipeline: ScriptedPipeline) -> None:
    pipeline.event_delay_s = 30.0
    server = RestServer(create_app(pipeline, served_model_names=("tiny-omni",))).start()
    try:
        with connect(url(server), additional_headers=BETA, open_timeout=TIMEOUT_S) as conn:
            _talk(conn)
            started = time.monotonic()
            stopping = _shut_down(server, grace_s=1.0)
            events = until(conn, "error")
            done = [e for e in events if e["type"] == "response.done"]
            assert len(done) == 1 and done[0]["response"]["status"] == "cancelled"
            assert done[0]["response"]["status_details"]["reason"] == "server_shutting_down"
            assert events[-1]["error"]["code"] == "server_shutting_down"
            _closed_for_shutdown(conn)
            stopping.result(TIMEOUT_S)
            assert time.monotonic() - started < 1.0 + 3.0  # the grace, then at once
            assert pipeline.closed == [done[0]["response"]["id"]]  # the run was closed in the stages
    finally:
        server.stop()


def test_a_handshake_while_the_server_shuts_down_is_a_503(pipeline: ScriptedPipeline) -> None:
    app = create_app(pipeline, served_model_names=("tiny-omni",))
    with RestServer(app) as server:
        app.state.realtime.closing = True  # as drain sets it: a connection taken before the listener closed
        with pytest.raises(InvalidStatus) as refused:
            connect(url(server), additional_headers=BETA, open_timeout=TIMEOUT_S)
        error = refused_with(refused.value, 503)
        assert error["type"] == "server_error" and "shutting down" in error["message"]


def test_a_session_accepted_as_the_drain_begins_is_shut_at_once(pipeline: ScriptedPipeline,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The race the 503 cannot cover: the handshake passed the check, then the drain began while it was being
    accepted (one await). The session must not serve on: it says why and closes as the others do."""
    from starlette.websockets import WebSocket

    app = create_app(pipeline, served_model_names=("tiny-omni",))
    accept = WebSocket.accept

    async def accept_as_the_drain_begins(self: WebSocket, *args: object, **kwargs: object) -> None:
        app.state.realtime.closing = True  # as drain sets it, between the check and the session's start
        await accept(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(WebSocket, "accept", accept_as_the_drain_begins)
    with RestServer(app) as server, connect(url(server), additional_headers=BETA, open_timeout=TIMEOUT_S) as conn:
        assert recv(conn)["type"] == "session.created"
        error = recv(conn)["error"]
        assert error["code"] == "server_shutting_down" and error["type"] == "server_error"
        _closed_for_shutdown(conn)
        assert app.state.realtime.sessions == {} and app.state.realtime.open == 0
        assert pipeline.closed == []  # nothing ran
