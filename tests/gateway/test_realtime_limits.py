"""What one Realtime session and all of them together may hold (gateway/realtime_api.py): a conversation is
bounded by the input limits one REST request has (max_messages items, max_request_bytes characters of text),
whatever adds to it (a created item, a commit, a server_vad turn, a response) is refused past them with
`conversation_too_large` and nothing else is lost; `--max-realtime-sessions` refuses one more handshake with 429
and Retry-After, and `omnimesh:realtime_sessions` counts the open sessions. Against a scripted pipeline, with a
real WebSocket client."""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from gateway_harness import RestServer, ScriptedPipeline
from test_realtime import BETA, TIMEOUT_S, _pcm, audio_b64, recv, refused_with, send, until, url
from websockets.exceptions import InvalidStatus
from websockets.sync.client import ClientConnection, connect

from gateway.input_limits import InputLimits
from gateway.rest import create_app
from omnimesh.config.serve_args import ServeArgs


@pytest.fixture()
def small(pipeline: ScriptedPipeline) -> Iterator[ClientConnection]:
    """A session on a server whose conversations hold 3 items and 1,000 characters of text."""
    limits = InputLimits(max_messages=3, max_request_bytes=1_000)
    with RestServer(create_app(pipeline, served_model_names=("tiny-omni",), limits=limits)) as server, \
            connect(url(server), additional_headers=BETA, open_timeout=TIMEOUT_S) as conn:
        assert recv(conn)["type"] == "session.created"
        yield conn


def text_item(conn: ClientConnection, text: str, **extra: object) -> dict:
    send(conn, type="conversation.item.create", **extra,
         item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
    return recv(conn)


def test_the_conversation_holds_at_most_max_messages_items(small: ClientConnection) -> None:
    ids = [text_item(small, f"turn {i}")["item"]["id"] for i in range(3)]
    send(small, type="conversation.item.create", event_id="evt_4",
         item={"id": "mine", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "more"}]})
    refused = recv(small)["error"]
    assert refused["code"] == "conversation_too_large" and refused["event_id"] == "evt_4"
    assert "would hold 4 items, over this server's max_messages of 3" in refused["message"]
    assert "conversation.item.delete" in refused["message"]
    send(small, type="response.create")  # its answer would be a 4th item
    assert recv(small)["error"]["code"] == "conversation_too_large"
    # a commit past it is refused and the buffer keeps its audio: after a delete, the same commit goes in
    send(small, type="input_audio_buffer.append", audio=audio_b64(0.5))
    send(small, type="input_audio_buffer.commit")
    assert recv(small)["error"]["code"] == "conversation_too_large"
    send(small, type="conversation.item.delete", item_id=ids[0])
    assert recv(small)["type"] == "conversation.item.deleted"
    send(small, type="input_audio_buffer.commit")
    committed = recv(small)
    assert committed["type"] == "input_audio_buffer.committed" and committed["previous_item_id"] == ids[2]
    assert recv(small)["item"]["content"][0]["type"] == "input_audio"
    # the refused item was not kept
    send(small, type="conversation.item.retrieve", item_id="mine")
    assert recv(small)["error"]["code"] == "item_not_found"


def test_a_response_may_take_the_conversation_to_its_bound(small: ClientConnection,
                                                           pipeline: ScriptedPipeline) -> None:
    text_item(small, "hello")
    text_item(small, "again")
    send(small, type="response.create", response={"modalities": ["text"]})
    done = until(small, "response.done")[-1]
    assert done["response"]["status"] == "completed"
    assert len(pipeline.requests[-1].messages) == 2  # the two user turns
    assert text_item(small, "a fourth")["error"]["code"] == "conversation_too_large"  # the answer is the third
    # out of band, nothing joins the conversation: the response runs
    send(small, type="response.create", response={"conversation": "none", "modalities": ["text"]})
    assert until(small, "response.done")[-1]["response"]["status"] == "completed"


def test_the_conversation_holds_at_most_max_request_bytes_of_text(small: ClientConnection) -> None:
    first = text_item(small, "x" * 600)["item"]["id"]
    refused = text_item(small, "y" * 500)["error"]
    assert refused["code"] == "conversation_too_large"
    assert "1100 characters of text, over this server's max_request_bytes of 1000" in refused["message"]
    # a call's output counts too
    send(small, type="conversation.item.create",
         item={"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"})
    assert recv(small)["type"] == "conversation.item.created"
    send(small, type="conversation.item.create",
         item={"type": "function_call_output", "call_id": "c1", "output": "z" * 500})
    assert recv(small)["error"]["code"] == "conversation_too_large"
    send(small, type="conversation.item.delete", item_id=first)
    assert recv(small)["type"] == "conversation.item.deleted"
    assert text_item(small, "y" * 500)["type"] == "conversation.item.created"


def test_a_server_vad_turn_past_the_bound_is_an_error_and_the_detector_goes_on(small: ClientConnection,
                                                                               pipeline: ScriptedPipeline) -> None:
    for i in range(3):
        text_item(small, f"turn {i}")
    send(small, type="session.update", session={"turn_detection": {"type": "server_vad", "silence_duration_ms": 300,
                                                                   "prefix_padding_ms": 100, "create_response": False}})
    assert recv(small)["type"] == "session.updated"
    pcm = _pcm(("silence", 0.5), ("speech", None), ("silence", 0.6), ("speech", None), ("silence", 0.6))
    for at in range(0, len(pcm), 4800):  # 0.1 s chunks
        send(small, type="input_audio_buffer.append", audio=base64.b64encode(pcm[at:at + 4800]).decode())
    events = until(small, "error")
    assert [e["type"] for e in events] == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                                           "error"]
    assert events[-1]["error"]["code"] == "conversation_too_large"
    assert "this turn's audio was not kept" in events[-1]["error"]["message"]
    # the second sentence is heard as its own turn (and refused the same way)
    kinds = [e["type"] for e in until(small, "error")]
    assert kinds == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped", "error"]
    assert pipeline.requests == []


def _sessions_gauge(server: RestServer) -> float:
    for line in httpx.get(f"{server.base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith("omnimesh:realtime_sessions "):
            return float(line.split()[1])
    raise AssertionError("no omnimesh:realtime_sessions on /metrics")


def test_max_realtime_sessions_refuses_one_more_handshake_with_429(shared_pipeline: ScriptedPipeline) -> None:
    app = create_app(shared_pipeline, served_model_names=("tiny-omni",), max_realtime_sessions=2)
    with RestServer(app) as server, connect(url(server), additional_headers=BETA, open_timeout=TIMEOUT_S) as first, \
            connect(url(server), additional_headers=BETA, open_timeout=TIMEOUT_S) as second:
        assert recv(first)["type"] == recv(second)["type"] == "session.created"
        assert _sessions_gauge(server) == 2
        with pytest.raises(InvalidStatus) as full:
            connect(url(server), additional_headers=BETA, open_timeout=TIMEOUT_S)
        error = refused_with(full.value, 429)
        assert full.value.response.headers["retry-after"] == "1"
        assert error["type"] == "rate_limit_error" and "--max-realtime-sessions" in error["message"]
        assert "its 2 Realtime sessions open" in error["message"]
        send(second, type="session.update", session={})  # the open sessions are not disturbed
        assert recv(second)["type"] == "session.updated"
        first.close()
        deadline = time.monotonic() + TIMEOUT_S  # the server sees the close a moment later
        while _sessions_gauge(server) != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        with connect(url(server), additional_headers=BETA, open_timeout=TIMEOUT_S) as third:
            assert recv(third)["type"] == "session.created"
        second.close()
        while _sessions_gauge(server) != 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _sessions_gauge(server) == 0


def test_the_flag_is_checked_and_reaches_the_gateway(tmp_path: Path) -> None:
    from omnimesh.launcher import MeshLauncher

    assert ServeArgs().max_realtime_sessions == 256
    with pytest.raises(ValueError, match="--max-realtime-sessions must be >= 1, got 0"):
        ServeArgs(max_realtime_sessions=0)
    argv = MeshLauncher(ServeArgs(max_realtime_sessions=8), tmp_path)._gateway_argv({})
    assert argv[argv.index("--max-realtime-sessions") + 1] == "8"
