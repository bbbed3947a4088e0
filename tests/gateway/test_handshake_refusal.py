"""`gateway.handshake_refusal.send_error` at the ASGI level: the HTTP answer, the WebSocket denial response where
the server offers the extension, and the 1008 close (reason cut to a close frame's 123 bytes) where it does not."""

from __future__ import annotations

import asyncio
import json

from gateway.handshake_refusal import MAX_CLOSE_REASON_BYTES, close_reason, send_error

BODY = {"error": {"message": "invalid API key", "type": "invalid_request_error", "param": None,
                  "code": "invalid_api_key"}}


def run(scope: dict) -> tuple[list[dict], int]:
    sent: list[dict] = []
    received = 0

    async def receive() -> dict:
        nonlocal received
        received += 1
        return {"type": "websocket.connect"}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(send_error(scope, receive, send, 401, BODY, [(b"www-authenticate", b"Bearer")]))
    return sent, received


def test_a_handshake_gets_the_status_and_body_where_the_server_offers_the_extension() -> None:
    sent, received = run({"type": "websocket", "extensions": {"websocket.http.response": {}}})
    assert received == 0 and [m["type"] for m in sent] == ["websocket.http.response.start",
                                                           "websocket.http.response.body"]
    start, body = sent
    assert start["status"] == 401 and (b"www-authenticate", b"Bearer") in start["headers"]
    assert (b"content-length", str(len(body["body"])).encode()) in start["headers"]
    assert json.loads(body["body"]) == BODY


def test_a_plain_request_gets_the_same_answer() -> None:
    sent, _ = run({"type": "http"})
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[0]["status"] == 401 and json.loads(sent[1]["body"]) == BODY


def test_without_the_extension_the_handshake_closes_with_1008_and_the_message() -> None:
    for scope in ({"type": "websocket"}, {"type": "websocket", "extensions": {}}):
        sent, received = run(scope)
        assert received == 1  # websocket.connect first, as ASGI wants before a close
        assert sent == [{"type": "websocket.close", "code": 1008, "reason": "invalid API key"}]


def test_a_long_reason_is_cut_on_a_character_boundary() -> None:
    assert close_reason("short") == "short"
    for text in ("x" * 200, "é" * 100, "a" + "語" * 60):
        cut = close_reason(text)
        assert len(cut.encode()) <= MAX_CLOSE_REASON_BYTES and cut.endswith("...")
        assert text.startswith(cut[:-3])
    exact = "y" * MAX_CLOSE_REASON_BYTES
    assert close_reason(exact) == exact
