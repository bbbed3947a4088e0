"""OpenAI's Realtime API on `/v1/realtime` (gateway/realtime_api.py) against a scripted pipeline, with a real
WebSocket client: the session events, committed audio becoming a user item at 24 kHz, the chat a response runs
(instructions first, the conversation in order, the assistant's earlier transcript), the response's event
sequence (transcript and audio deltas, their done events, response.done with usage), a text-only response,
cancelling a response, the key on the handshake, and every client mistake as an `error` event that leaves the
session open; server_vad (Silero VAD) on a spoken sentence (tests/data/speech_24k.wav: espeak-ng's "What is the
weather today?", 24 kHz) against loud noise and a tone. Through a real mesh: tests/e2e/test_realtime_e2e.py."""

from __future__ import annotations

import asyncio
import base64
import gc
import json
import logging
import socket
import time
import wave
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gateway_harness import RestServer, ScriptedPipeline, tone
from websockets.exceptions import InvalidStatus
from websockets.sync.client import ClientConnection, connect

from gateway.audio_encoding import pcm16_bytes
from gateway.events import AudioPart, Finished, ImagePart, TextDelta, TextPart
from gateway.realtime_api import RealtimeSession
from gateway.rest import create_app

TIMEOUT_S = 10.0
BETA = {"OpenAI-Beta": "realtime=v1"}  # the beta interface's handshake header; without it a session speaks GA
SPEECH_WAV = Path(__file__).parent.parent / "data" / "speech_24k.wav"


def url(server: RestServer) -> str:
    return server.base_url.replace("http://", "ws://") + "/v1/realtime?model=tiny-omni"


@pytest.fixture()
def ws(rest_server: RestServer, pipeline: ScriptedPipeline) -> Iterator[ClientConnection]:
    with connect(url(rest_server), additional_headers=BETA, open_timeout=TIMEOUT_S) as conn:
        created = recv(conn)
        assert created["type"] == "session.created" and created["session"]["turn_detection"] is None
        yield conn


def recv(conn: ClientConnection) -> dict[str, Any]:
    return json.loads(conn.recv(timeout=TIMEOUT_S))


def send(conn: ClientConnection, **event: Any) -> None:
    conn.send(json.dumps(event))


def until(conn: ClientConnection, kind: str) -> list[dict[str, Any]]:
    """Every event up to and including the first of `kind`."""
    out = []
    while True:
        out.append(recv(conn))
        if out[-1]["type"] == kind:
            return out


def audio_b64(seconds: float) -> str:
    return base64.b64encode(pcm16_bytes(tone(seconds, rate=24_000))).decode()


def test_a_spoken_turn(ws: ClientConnection, pipeline: ScriptedPipeline) -> None:
    send(ws, type="session.update", session={"instructions": "Be brief.", "voice": "chelsie", "temperature": 0.3})
    updated = recv(ws)
    assert updated["type"] == "session.updated" and updated["session"]["voice"] == "Chelsie"
    send(ws, type="input_audio_buffer.append", audio=audio_b64(0.2))
    send(ws, type="input_audio_buffer.append", audio=audio_b64(0.3))
    send(ws, type="input_audio_buffer.commit", event_id="c1")
    committed, created = recv(ws), recv(ws)
    assert committed["type"] == "input_audio_buffer.committed" and created["type"] == "conversation.item.created"
    assert created["item"]["role"] == "user" and created["item"]["content"] == [{"type": "input_audio",
                                                                                 "transcript": None}]
    send(ws, type="response.create")
    events = until(ws, "response.done")
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.output_item.added", "conversation.item.created",
                         "response.content_part.added"]
    assert kinds[-5:] == ["response.audio.done", "response.audio_transcript.done", "response.content_part.done",
                          "response.output_item.done", "response.done"]
    transcript = "".join(e["delta"] for e in events if e["type"] == "response.audio_transcript.delta")
    audio = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "response.audio.delta")
    assert transcript == "Hello world" and audio == pcm16_bytes(tone(0.2))
    done = events[-1]["response"]
    assert done["status"] == "completed" and done["usage"]["input_tokens"] == 7 and done["usage"]["output_tokens"] == 2
    [req] = pipeline.requests
    assert req.modalities == ("text", "audio") and req.voice == "Chelsie" and req.sampling.temperature == 0.3
    system, user = req.messages
    assert system.content == (TextPart("Be brief."),)
    [clip] = user.content
    assert isinstance(clip, AudioPart) and clip.sample_rate == 24_000 and clip.waveform.size == int(0.5 * 24_000)
    np.testing.assert_allclose(clip.waveform[:100], tone(0.2, rate=24_000)[:100], atol=1 / 32768)
    # the next turn: a text item, a text-only response; the assistant's transcript is in the conversation
    send(ws, type="conversation.item.create", item={"type": "message", "role": "user",
                                                    "content": [{"type": "input_text", "text": "And then?"}]})
    assert recv(ws)["type"] == "conversation.item.created"
    send(ws, type="response.create", response={"modalities": ["text"], "instructions": "Answer in text."})
    events = until(ws, "response.done")
    assert "".join(e["delta"] for e in events if e["type"] == "response.text.delta") == "Hello world"
    assert not any(e["type"].startswith("response.audio") for e in events)
    second = pipeline.requests[-1]
    assert second.modalities == ("text",)
    assert [(m.role, m.content) for m in second.messages[2:]] == [("assistant", (TextPart("Hello world"),)),
                                                                   ("user", (TextPart("And then?"),))]
    assert second.messages[0].content == (TextPart("Answer in text."),)


def test_speed_plays_answers_faster(ws: ClientConnection, pipeline: ScriptedPipeline) -> None:
    """The session's `speed` (0.25 to 1.5, OpenAI's): the next answer's audio at that tempo, pitch kept
    (gateway/audio_tempo.py); truncation counts in the audio as played."""
    from gateway.audio_tempo import Tempo

    send(ws, type="session.update", session={"speed": 1.5})
    assert recv(ws)["session"]["speed"] == 1.5
    send(ws, type="session.update", session={"speed": 2})
    assert recv(ws)["error"]["param"] == "session.speed"
    send(ws, type="conversation.item.create", item={"type": "message", "role": "user",
                                                    "content": [{"type": "input_text", "text": "Hi."}]})
    recv(ws)
    send(ws, type="response.create")
    events = until(ws, "response.done")
    audio = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "response.audio.delta")
    assert audio == pcm16_bytes(Tempo(1.5, 24_000).whole(tone(0.2)))
    played_ms = len(audio) // 2 * 1000 // 24_000  # ~133 ms, not the model's 200
    item_id = events[-1]["response"]["output"][0]["id"]
    send(ws, type="conversation.item.truncate", item_id=item_id, content_index=0, audio_end_ms=played_ms + 20)
    assert recv(ws)["error"]["param"] == "audio_end_ms"


def test_pictures_in_user_items(ws: ClientConnection, pipeline: ScriptedPipeline) -> None:
    """GA's input_image (a data URI string, or the chat's {"url"} shape): the user turn carries the picture to the
    pipeline; its echo names the part without its pixels; the input limits hold (pixels, max_media_items: the
    item that breaks them is refused and the conversation stays as it was); assistants send no pictures."""
    from test_media import png

    def image(size: int) -> str:
        return "data:image/png;base64," + base64.b64encode(png((size, size // 2))).decode()

    def create(*content: dict[str, Any], role: str = "user") -> dict[str, Any]:
        send(ws, type="conversation.item.create", item={"type": "message", "role": role, "content": list(content)})
        return recv(ws)

    created = create({"type": "input_image", "image_url": image(64)}, {"type": "input_text", "text": "What?"})
    assert created["item"]["content"] == [{"type": "input_image"}, {"type": "input_text", "text": "What?"}]
    send(ws, type="response.create", response={"modalities": ["text"]})
    until(ws, "response.done")
    [msg] = pipeline.requests[-1].messages
    picture, question = msg.content
    assert isinstance(picture, ImagePart) and picture.image.size == (64, 32) and question == TextPart("What?")
    assert create({"type": "input_image", "image_url": {"url": image(32)}})["type"] == "conversation.item.created"
    for problem, param in (({"type": "input_image", "image_url": image(400)}, "item.content[0].image_url"),
                           ({"type": "input_image", "image_url": 5}, "item.content[0].image_url"),
                           ({"type": "input_image", "image_url": "file:///etc/passwd"}, "item.content[0].image_url")):
        error = create(problem)["error"]
        assert error["param"] == param, error
    assert create({"type": "input_image", "image_url": image(32)}, role="assistant")["error"]["param"] == \
        "item.content[0]"
    create({"type": "input_image", "image_url": image(32)})
    create({"type": "input_image", "image_url": image(32)})  # 4 pictures: max_media_items in the test limits
    error = create({"type": "input_image", "image_url": image(32)})["error"]
    assert error["param"] == "item.content" and "the conversation has 5 audio/image/video parts" in error["message"]
    send(ws, type="response.create", response={"modalities": ["text"]})
    until(ws, "response.done")
    assert sum(isinstance(p, ImagePart) for m in pipeline.requests[-1].messages for p in m.content) == 4


def test_items_go_after_previous_item_id(ws: ClientConnection, pipeline: ScriptedPipeline) -> None:
    """conversation.item.create puts its item after `previous_item_id` ("root": first), as OpenAI's; a client's
    own id is at most 32 characters and new to the conversation; the response reads the items in that order."""
    def create(text: str, id: str | None = None, **extra: Any) -> dict[str, Any]:
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
        send(ws, type="conversation.item.create", item=item if id is None else {**item, "id": id}, **extra)
        return recv(ws)

    assert create("three", id="c")["previous_item_id"] is None
    assert create("one", id="a", previous_item_id="root")["previous_item_id"] is None
    assert create("two", id="b", previous_item_id="a")["previous_item_id"] == "a"
    for extra, param, code in ((dict(id="a"), "item.id", "item_id_exists"), (dict(id="x" * 33), "item.id", None),
                               (dict(previous_item_id="zz"), "previous_item_id", "item_not_found")):
        error = create("no", **extra)["error"]
        assert error["param"] == param and (code is None or error["code"] == code), error
    send(ws, type="response.create", response={"modalities": ["text"]})
    until(ws, "response.done")
    assert [m.content for m in pipeline.requests[-1].messages] == [(TextPart(t),) for t in ("one", "two", "three")]


def test_cancelling_a_response(ws: ClientConnection, pipeline: ScriptedPipeline) -> None:
    pipeline.event_delay_s = 0.5
    send(ws, type="conversation.item.create", item={"type": "message", "role": "user",
                                                    "content": [{"type": "input_text", "text": "Talk."}]})
    recv(ws)
    send(ws, type="response.create")
    assert recv(ws)["type"] == "response.created"
    send(ws, type="response.create")  # one at a time
    errors = [e for e in until(ws, "error")]
    assert errors[-1]["error"]["code"] == "conversation_already_has_active_response"
    send(ws, type="response.cancel")
    send(ws, type="response.create")  # at once: the cancelled one is done before this is read (it was refused)
    done = until(ws, "response.done")[-1]["response"]
    assert done["status"] == "cancelled" and done["status_details"]["reason"] == "client_cancelled"
    assert pipeline.closed  # the run was closed in the stages
    assert recv(ws)["type"] == "response.created"  # the second response
    send(ws, type="response.cancel")
    assert until(ws, "response.done")[-1]["response"]["status"] == "cancelled"


@pytest.mark.parametrize(("event", "code", "param"), [
    ({"type": "session.update", "session": {"turn_detection": {"type": "semantic_vad"}}}, "invalid_value",
     "session.turn_detection"),
    ({"type": "session.update", "session": {"turn_detection": {"type": "server_vad", "threshold": 2}}},
     "invalid_value", "session.turn_detection.threshold"),
    ({"type": "session.update", "session": {"turn_detection": {"type": "server_vad", "eagerness": "low"}}},
     "invalid_value", "session.turn_detection.eagerness"),
    # unbounded, the padding kept every appended second between turns (10**9 ms was accepted)
    ({"type": "session.update", "session": {"turn_detection": {"type": "server_vad", "prefix_padding_ms": 10**9}}},
     "invalid_value", "session.turn_detection.prefix_padding_ms"),
    ({"type": "session.update", "session": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 1e300}}},
     "invalid_value", "session.turn_detection.silence_duration_ms"),
    ({"type": "session.update", "session": {"input_audio_format": "opus"}}, "invalid_value",
     "session.input_audio_format"),
    ({"type": "session.update", "session": {"voice": "alloy"}}, "invalid_value", "session.voice"),
    ({"type": "session.update", "session": {"voice": 7}}, "invalid_value", "session.voice"),  # wrong types too
    ({"type": "session.update", "session": {"voice": {"name": "x"}}}, "invalid_value", "session.voice"),
    ({"type": "session.update", "session": {"input_audio_format": ["pcm16"]}}, "invalid_value",
     "session.input_audio_format"),
    ({"type": "session.update", "session": {"modalities": [["text"], "audio"]}}, "invalid_value",
     "session.modalities"),
    ({"type": "response.create", "response": {"voice": True}}, "invalid_value", "response.voice"),
    ({"type": "response.create", "response": {"modalities": [{}]}}, "invalid_value", "response.modalities"),
    ({"type": "session.update", "session": {"temperature": 3}}, "invalid_value", "session.temperature"),
    ({"type": "session.update", "session": {"tools": [{"type": "function", "name": "f"}]}}, "invalid_value",
     "tool_choice"),  # "auto" needs --enable-auto-tool-choice
    ({"type": "session.update", "session": {"tools": [{"type": "web_search"}]}}, "invalid_value",
     "session.tools[0].type"),
    ({"type": "session.update", "session": {"tools": [{"type": "function", "name": "f"}], "tool_choice": "required"}},
     "invalid_value", "tool_choice"),  # a forced call with speech (the session's modalities)
    ({"type": "session.update", "session": {"tools": {"f": 1}}}, "invalid_value", "session.tools"),
    ({"type": "conversation.item.create", "item": {"type": "function_call_output", "call_id": "c9", "output": "x"}},
     "invalid_value", "item.call_id"),
    ({"type": "conversation.item.create", "item": {"type": "function_call", "call_id": "c9"}}, "invalid_value",
     "item.name"),
    ({"type": "conversation.item.create", "item": {"type": "function_call", "name": "f"}}, "invalid_value",
     "item.call_id"),
    ({"type": "input_audio_buffer.append", "audio": "%%%"}, "invalid_value", "audio"),
    ({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"abc").decode()}, "invalid_value", "audio"),
    ({"type": "input_audio_buffer.commit"}, "input_audio_buffer_commit_empty", None),
    ({"type": "conversation.item.create", "item": {"type": "message", "role": "tool", "content": []}},
     "invalid_value", "item.role"),
    ({"type": "conversation.item.delete", "item_id": "nope"}, "item_not_found", "item_id"),
    ({"type": "response.create"}, "conversation_empty", None),
    ({"type": "response.cancel"}, "response_cancel_not_active", None),
    ({"type": "dance"}, "unknown_event", "type"),
])
def test_mistakes_are_error_events(ws: ClientConnection, pipeline: ScriptedPipeline, event: dict, code: str,
                                   param: str | None) -> None:
    send(ws, event_id="e1", **event)
    err = recv(ws)
    assert err["type"] == "error" and err["error"]["code"] == code and err["error"]["param"] == param, err
    assert err["error"]["event_id"] == "e1"
    ws.send("not json")
    assert recv(ws)["error"]["code"] == "invalid_json"
    ws.send("[" * 100_000 + "]" * 100_000)  # deeper than json.loads follows: was a server_error (RecursionError)
    deep = recv(ws)["error"]
    assert deep["code"] == "invalid_json" and "nest too deeply" in deep["message"], deep
    # a lone surrogate escape: accepted, then the tokenizer failed on it in the response (a server_error)
    ws.send('{"type": "conversation.item.create", "item": {"type": "message", "role": "user", '
            '"content": [{"type": "input_text", "text": "hi \\ud800"}]}}')
    lone = recv(ws)["error"]
    assert lone["code"] == "invalid_json" and "unpaired UTF-16 surrogate" in lone["message"], lone
    ws.send(b"\x00\x01")  # a binary frame: an error event, not a dropped connection
    assert recv(ws)["error"]["code"] == "invalid_event"
    send(ws, type="session.update", session={})  # the session goes on
    assert recv(ws)["type"] == "session.updated"
    assert pipeline.requests == []


def test_a_failing_event_is_a_server_error_event_and_the_session_goes_on(
        ws: ClientConnection, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any) -> None:
        raise KeyError("a bug")

    monkeypatch.setattr(RealtimeSession, "_insert_at", broken)  # conversation.item.create's first step
    send(ws, event_id="e7", type="conversation.item.create",
         item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]})
    error = recv(ws)["error"]
    assert error["type"] == "server_error" and error["code"] == "internal_error" and error["event_id"] == "e7"
    assert error["message"] == "internal error: KeyError: 'a bug'"
    send(ws, type="session.update", session={})  # the connection and the session are still there
    assert recv(ws)["type"] == "session.updated"


def test_too_much_audio_is_refused_and_the_buffer_cleared(shared_pipeline: ScriptedPipeline) -> None:
    from tests.gateway.conftest import TEST_LIMITS  # max_audio_seconds 5

    with RestServer(create_app(shared_pipeline, served_model_names=("tiny-omni",), limits=TEST_LIMITS)) as server, \
            connect(url(server), additional_headers=BETA, open_timeout=TIMEOUT_S) as conn:
        recv(conn)
        for _ in range(3):
            send(conn, type="input_audio_buffer.append", audio=audio_b64(2.0))
        err = recv(conn)
        assert err["error"]["code"] == "audio_too_long" and "max_audio_seconds of 5 s" in err["error"]["message"]
        send(conn, type="input_audio_buffer.commit")
        assert recv(conn)["error"]["code"] == "input_audio_buffer_commit_empty"  # cleared


def refused_with(refusal: InvalidStatus, status: int) -> dict:
    """The OpenAI error object of a refused handshake, after checking its HTTP status."""
    assert refusal.response.status_code == status, refusal.response
    assert refusal.response.headers["content-type"] == "application/json"
    return json.loads(bytes(refusal.response.body))["error"]


def test_the_handshake_needs_the_key_and_a_served_model(shared_pipeline: ScriptedPipeline) -> None:
    with RestServer(create_app(shared_pipeline, served_model_names=("tiny-omni",), api_keys=("sk-1",))) as server:
        with pytest.raises(InvalidStatus) as refused:  # REST's 401 and body, not a bare 403
            connect(url(server), additional_headers=BETA, open_timeout=TIMEOUT_S)
        assert refused_with(refused.value, 401)["code"] == "invalid_api_key"
        assert refused.value.response.headers["www-authenticate"] == "Bearer"
        with connect(url(server), additional_headers={"Authorization": "Bearer sk-1", **BETA},
                     open_timeout=TIMEOUT_S) as conn:
            assert recv(conn)["type"] == "session.created"
        with pytest.raises(InvalidStatus) as unknown:
            connect(url(server).replace("tiny-omni", "gpt-4o-realtime"),
                    additional_headers={"Authorization": "Bearer sk-1"}, open_timeout=TIMEOUT_S)
        error = refused_with(unknown.value, 404)
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert error["message"] == "The model 'gpt-4o-realtime' does not exist; served models: tiny-omni"
        # a browser cannot set headers: OpenAI's subprotocols carry the key, and "realtime" is chosen, never the key
        with connect(url(server), subprotocols=["realtime", "openai-insecure-api-key.sk-1"],  # type: ignore[list-item]
                     open_timeout=TIMEOUT_S) as conn:
            assert conn.subprotocol == "realtime" and recv(conn)["type"] == "session.created"
        with pytest.raises(InvalidStatus) as wrong:
            connect(url(server), subprotocols=["realtime", "openai-insecure-api-key.sk-2"],  # type: ignore[list-item]
                    open_timeout=TIMEOUT_S)
        assert refused_with(wrong.value, 401)["message"] == "invalid API key"


def speech(seconds: float | None = None) -> np.ndarray:
    """The spoken sentence (1.25 s at 24 kHz), or its first `seconds`."""
    with wave.open(str(SPEECH_WAV)) as w:
        x = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768
    return x if seconds is None else x[:int(seconds * 24_000)]


def _pcm(*segments: tuple[str, float | None]) -> bytes:
    """Silence and speech segments at 24 kHz, as pcm16 (speech None: the whole sentence)."""
    parts = [speech(s) if kind == "speech" else np.zeros(int((s or 0) * 24_000), np.float32) for kind, s in segments]
    return pcm16_bytes(np.concatenate(parts))


def test_server_vad_cuts_turns_and_answers_them(ws: ClientConnection, pipeline: ScriptedPipeline) -> None:
    send(ws, type="session.update", session={"turn_detection": {"type": "server_vad", "silence_duration_ms": 300,
                                                                "prefix_padding_ms": 100}})
    assert recv(ws)["session"]["turn_detection"] == {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 100,
                                                     "silence_duration_ms": 300, "create_response": True,
                                                     "interrupt_response": True}
    pcm = _pcm(("silence", 0.512), ("speech", None), ("silence", 0.6))
    for at in range(0, len(pcm), 4800):  # 0.1 s chunks
        send(ws, type="input_audio_buffer.append", audio=base64.b64encode(pcm[at:at + 4800]).decode())
    events = until(ws, "response.done")
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                         "input_audio_buffer.committed", "conversation.item.created"]
    start, end = events[0]["audio_start_ms"], events[1]["audio_end_ms"]
    assert 512 <= start <= 576 and 1760 - 96 <= end <= 1760 + 32, (start, end)  # the sentence: 512 .. 1758 ms
    assert events[0]["item_id"] == events[1]["item_id"] == events[2]["item_id"]
    assert "response.created" in kinds and events[-1]["response"]["status"] == "completed"
    [clip] = pipeline.requests[-1].messages[-1].content
    assert isinstance(clip, AudioPart) and clip.waveform.size == 2400 + (end - start) * 24  # 0.1 s padding + speech
    send(ws, type="input_audio_buffer.append", audio=base64.b64encode(_pcm(("silence", 0.3))).decode())
    send(ws, type="input_audio_buffer.commit")  # nothing but silence since the turn: why the buffer is empty
    error = recv(ws)["error"]
    assert error["code"] == "input_audio_buffer_commit_empty" and "server VAD heard no speech" in error["message"]


def test_speech_interrupts_a_response(ws: ClientConnection, pipeline: ScriptedPipeline) -> None:
    pipeline.event_delay_s = 0.5
    send(ws, type="session.update", session={"turn_detection": {"type": "server_vad", "silence_duration_ms": 200}})
    recv(ws)
    send(ws, type="input_audio_buffer.append", audio=base64.b64encode(_pcm(("speech", 0.6), ("silence", 0.3))).decode())
    assert "response.created" in [e["type"] for e in until(ws, "response.created")]
    send(ws, type="input_audio_buffer.append", audio=base64.b64encode(_pcm(("speech", 0.3))).decode())  # talks over it
    events = until(ws, "response.done")
    assert "input_audio_buffer.speech_started" in [e["type"] for e in events]
    assert events[-1]["response"]["status"] == "cancelled"
    assert events[-1]["response"]["status_details"]["reason"] == "turn_detected"  # OpenAI's: not the client's cancel


def test_the_detector_hears_voices_not_loudness() -> None:
    """Silero VAD: loud white noise (-20 dBFS RMS) and a tone are not speech, where an energy detector would
    call both speech; the sentence at -44 dBFS RMS, far quieter than that noise, is. Turn bounds land on 32 ms
    frames."""
    from gateway.realtime_vad import FRAME_MS, ServerVAD, Started, Stopped

    rng = np.random.default_rng(0)
    vad = ServerVAD(threshold=0.5, prefix_padding_ms=192, silence_duration_ms=320)
    assert vad.push((rng.standard_normal(24_000) * 0.1).astype(np.float32)) == []
    assert vad.push(tone(1.0, rate=24_000)) == [] and vad.buffered_seconds == pytest.approx(0.192, abs=0.04)
    vad = ServerVAD(threshold=0.5, prefix_padding_ms=192, silence_duration_ms=320)
    events = vad.push(np.concatenate([np.zeros(48_000, np.float32), speech() * 0.1, np.zeros(12_000, np.float32)]))
    assert [type(e) for e in events] == [Started, Stopped]
    assert 2000 <= events[0].ms <= 2100 and 3200 <= events[1].ms <= 3360, events  # the sentence: 2000 .. 3246 ms
    assert events[0].ms % FRAME_MS == 0 and events[1].ms % FRAME_MS == 0
    assert events[1].audio.size == 192 * 24 + (events[1].ms - events[0].ms) * 24  # the padding + the speech
    assert ServerVAD(threshold=0.0).push(np.zeros(768, np.float32)) == [Started(0)]  # every frame scores >= 0
    vad.push(speech(0.5))
    assert vad.flush() is not None and vad.flush() is None  # a commit ends the turn in progress
    with pytest.raises(ValueError, match="threshold"):
        ServerVAD(threshold=1.5)


def test_each_session_has_its_own_model_state() -> None:
    """The model is recurrent: two detectors fed in turns score exactly as each fed alone."""
    from gateway.realtime_vad import SpeechProbability

    clip, noise = speech(), (np.random.default_rng(1).standard_normal(30_000) * 0.05).astype(np.float32)
    alone = [SpeechProbability(24_000), SpeechProbability(24_000)]
    want = [[alone[0](clip[i:i + 768]) for i in range(0, 768 * 20, 768)],
            [alone[1](noise[i:i + 768]) for i in range(0, 768 * 20, 768)]]
    a, b = SpeechProbability(24_000), SpeechProbability(24_000)
    got: list[list[float]] = [[], []]
    for i in range(0, 768 * 20, 768):
        got[0].append(a(clip[i:i + 768]))
        got[1].append(b(noise[i:i + 768]))
    assert got == want and max(want[0]) > 0.9 and max(want[1]) < 0.5
    assert a.network is b.network  # one network per process: a session holds only its state
    streams = [clip, noise] * 4  # and sessions scored at once on threads (as the gateway's pushes run) agree too

    def score(x: np.ndarray) -> list[float]:
        detector = SpeechProbability(24_000)
        return [detector(x[i:i + 768]) for i in range(0, 768 * 20, 768)]

    with ThreadPoolExecutor(8) as pool:
        scored = list(pool.map(score, streams))
    assert scored == want * 4


def test_the_shared_network_scores_as_the_wheels_model() -> None:
    """The detector's stateless call of the shared network gives the wheel's own stateful TorchScript model's
    probabilities bit for bit, frame after frame (state and context carried the same way)."""
    import importlib.util
    import warnings
    from pathlib import Path

    import torch

    from gateway.media import resample
    from gateway.realtime_vad import CONTEXT, MODEL_FRAME, MODEL_RATE, SpeechProbability

    origin = importlib.util.find_spec("silero_vad").origin  # type: ignore[union-attr]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        wheel = torch.jit.load(str(Path(origin).parent / "data" / "silero_vad.jit"), map_location="cpu").eval()
    audio = np.concatenate([speech(), (np.random.default_rng(2).standard_normal(20_000) * 0.05).astype(np.float32)])
    ours, tail, want, got = SpeechProbability(24_000), np.zeros(CONTEXT, np.float32), [], []
    skip = CONTEXT * MODEL_RATE // 24_000
    with torch.inference_mode():
        for at in range(0, audio.size - 768, 768):
            frame = audio[at:at + 768]
            x = resample(np.concatenate([tail, frame]), 24_000, MODEL_RATE)[skip:skip + MODEL_FRAME]
            tail = frame[-CONTEXT:]
            want.append(float(wheel(torch.from_numpy(np.ascontiguousarray(x))[None], MODEL_RATE)))
            got.append(ours(frame))
    assert got == want and max(want) > 0.9 and min(want) < 0.1


def test_input_audio_transcription(ws: ClientConnection, pipeline: ScriptedPipeline) -> None:
    """Each committed clip is also transcribed (the thinker, greedy, as /v1/audio/transcriptions asks it)."""
    send(ws, type="session.update", session={"input_audio_transcription": {"model": "whisper-1", "language": "en"}})
    assert recv(ws)["session"]["input_audio_transcription"] == {"model": "whisper-1", "language": "en",
                                                                "prompt": None}
    send(ws, type="input_audio_buffer.append", audio=audio_b64(0.3))
    send(ws, type="input_audio_buffer.commit")
    events = until(ws, "conversation.item.input_audio_transcription.completed")
    item_id = next(e["item_id"] for e in events if e["type"] == "input_audio_buffer.committed")
    assert events[-1]["item_id"] == item_id and events[-1]["transcript"] == "Hello world"
    deltas = [e for e in events if e["type"] == "conversation.item.input_audio_transcription.delta"]
    assert [d["delta"] for d in deltas] == ["Hello", " world"] and {d["item_id"] for d in deltas} == {item_id}
    assert events[-1]["usage"] == {"type": "tokens", "input_tokens": 7, "output_tokens": 2, "total_tokens": 9}
    [req] = pipeline.requests
    clip, ask = req.messages[0].content
    assert isinstance(clip, AudioPart) and isinstance(ask, TextPart) and "Transcribe the audio" in ask.text
    assert "in English." in ask.text and req.sampling.temperature == 0 and req.modalities == ("text",)
    send(ws, type="session.update", session={"input_audio_transcription": {"model": 5}})
    assert recv(ws)["error"]["param"] == "session.input_audio_transcription.model"
    send(ws, type="session.update", session={"input_audio_transcription": {"language": "xx"}})
    error = recv(ws)["error"]
    assert error["param"] == "session.input_audio_transcription.language" and "ISO-639-1" in error["message"]


def test_truncating_an_answer_keeps_the_heard_part(ws: ClientConnection, pipeline: ScriptedPipeline) -> None:
    """conversation.item.truncate: the user heard 0.1 s of the 0.2 s answer, so the next turn's conversation keeps
    half its transcript (in proportion: there are no word timings)."""
    send(ws, type="conversation.item.create", item={"type": "message", "role": "user",
                                                    "content": [{"type": "input_text", "text": "Talk."}]})
    recv(ws)
    send(ws, type="response.create")
    events = until(ws, "response.done")
    item_id = next(e["item"]["id"] for e in events if e["type"] == "response.output_item.added")
    send(ws, type="conversation.item.truncate", item_id=item_id, content_index=0, audio_end_ms=100)
    truncated = recv(ws)
    del truncated["event_id"]
    assert truncated == {"type": "conversation.item.truncated", "item_id": item_id, "content_index": 0,
                         "audio_end_ms": 100}
    send(ws, type="conversation.item.truncate", item_id=item_id, content_index=0, audio_end_ms=150)
    assert recv(ws)["error"]["param"] == "audio_end_ms"  # past what is left of it
    for index in (5, "x"):  # the item has one part (5 was accepted, "x" blamed audio_end_ms)
        send(ws, type="conversation.item.truncate", item_id=item_id, content_index=index, audio_end_ms=50)
        error = recv(ws)["error"]
        assert error["param"] == "content_index" and "must be 0" in error["message"], error
    send(ws, type="response.create", response={"modalities": ["text"]})
    until(ws, "response.done")
    assert [(m.role, m.content) for m in pipeline.requests[-1].messages] == [
        ("user", (TextPart("Talk."),)), ("assistant", (TextPart("Hello "),))]  # 11 characters x 100 / 200 ms


def test_a_client_gone_mid_response_leaves_nothing_running(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    """The socket closes during a response: its run is closed in the stages and /load falls back to 0."""
    import time

    import httpx

    pipeline.event_delay_s = 0.3
    with connect(url(rest_server), additional_headers=BETA, open_timeout=TIMEOUT_S) as conn:
        recv(conn)
        send(conn, type="conversation.item.create", item={"type": "message", "role": "user",
                                                          "content": [{"type": "input_text", "text": "Talk."}]})
        recv(conn)
        send(conn, type="response.create")
        assert recv(conn)["type"] == "response.created"
        assert httpx.get(f"{rest_server.base_url}/load", timeout=TIMEOUT_S).json() == {"server_load": 1}
    deadline = time.monotonic() + TIMEOUT_S
    while httpx.get(f"{rest_server.base_url}/load", timeout=TIMEOUT_S).json() != {"server_load": 0}:
        assert time.monotonic() < deadline, "the response kept running after the client left"
        time.sleep(0.02)
    assert pipeline.closed == [pipeline.requests[0].request_id]


def test_a_refused_response_says_why_and_counts_as_its_status(rest_server: RestServer, ws: ClientConnection,
                                                              pipeline: ScriptedPipeline) -> None:
    """A full stage (429) fails a response as REST would refuse the request: the error event and response.done's
    status_details.error say so (a client can tell it from a bad request and retry), and /metrics counts a 429,
    not the 500 it counted every failed response as."""
    import re

    import httpx

    from gateway.events import PipelineError

    def count(status: int) -> float:
        text = httpx.get(f"{rest_server.base_url}/metrics", timeout=TIMEOUT_S).text
        found = re.search(rf'requests_total{{endpoint="realtime",status="{status}"}} (\S+)', text)
        return float(found.group(1)) if found else 0.0

    full, failed = count(429), count(500)
    pipeline.script = lambda request: [PipelineError("4 requests already waiting in thinker", http_status=429,
                                                     grpc_code=8, kind="rate_limit_error")]
    send(ws, type="conversation.item.create", item={"type": "message", "role": "user",
                                                     "content": [{"type": "input_text", "text": "Talk."}]})
    recv(ws)
    send(ws, type="response.create", response={"modalities": ["text"]})
    events = []
    while not events or events[-1]["type"] != "response.done":
        events.append(recv(ws))
    (error,) = [e["error"] for e in events if e["type"] == "error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded"), error
    done = events[-1]["response"]
    assert done["status"] == "failed" and done["status_details"] == {
        "type": "failed", "error": {"type": "rate_limit_error", "code": "rate_limit_exceeded",
                                    "message": "4 requests already waiting in thinker"}}, done
    assert (count(429), count(500)) == (full + 1, failed)


def test_a_failed_transcription_is_its_own_event(ws: ClientConnection, pipeline: ScriptedPipeline) -> None:
    from gateway.events import PipelineError

    pipeline.script = lambda request: [PipelineError("thinker is full", http_status=429, grpc_code=8,
                                                     kind="rate_limit_error")]
    send(ws, type="session.update", session={"input_audio_transcription": {"model": "whisper-1"}})
    recv(ws)
    send(ws, type="input_audio_buffer.append", audio=audio_b64(0.2))
    send(ws, type="input_audio_buffer.commit")
    failed = until(ws, "conversation.item.input_audio_transcription.failed")[-1]
    assert failed["error"]["message"] == "thinker is full" and failed["content_index"] == 0
    send(ws, type="session.update", session={})  # the session goes on
    assert recv(ws)["type"] == "session.updated"


def test_a_transcription_that_fails_on_a_bug_is_still_its_own_event(ws: ClientConnection,
                                                                     pipeline: ScriptedPipeline) -> None:
    """Not only a PipelineError: anything that fails the transcription reaches the client (it was only logged,
    and the client waited for a transcript that never came)."""
    pipeline.script = lambda request: [RuntimeError("a bug")]
    send(ws, type="session.update", session={"input_audio_transcription": {"model": "whisper-1"}})
    recv(ws)
    send(ws, type="input_audio_buffer.append", audio=audio_b64(0.2))
    send(ws, type="input_audio_buffer.commit")
    failed = until(ws, "conversation.item.input_audio_transcription.failed")[-1]
    assert failed["error"]["message"] == "internal error: RuntimeError: a bug", failed


def test_a_clip_shorter_than_one_feature_window_is_refused_up_front(ws: ClientConnection,
                                                                    pipeline: ScriptedPipeline) -> None:
    """Under 25 ms (one Whisper window) the audio tower cannot read a clip: a commit of less is an error event,
    the buffer keeping its audio for more; an item's input_audio likewise, naming the part (each failed later
    as a server_error of every response that read it)."""
    tiny = base64.b64encode(pcm16_bytes(tone(0.005, rate=24_000))).decode()  # 120 samples: 5 ms
    send(ws, type="input_audio_buffer.append", audio=tiny)
    send(ws, event_id="c1", type="input_audio_buffer.commit")
    err = recv(ws)["error"]
    assert err["code"] == "input_audio_buffer_commit_empty" and err["event_id"] == "c1", err
    assert "holds 5.0 ms of audio; at least 25 ms is needed" in err["message"], err
    send(ws, type="input_audio_buffer.append", audio=audio_b64(0.03))  # the 5 ms are still there: 35 ms in all
    send(ws, type="input_audio_buffer.commit")
    assert recv(ws)["type"] == "input_audio_buffer.committed"
    assert recv(ws)["item"]["content"][0]["type"] == "input_audio"
    send(ws, type="conversation.item.create", item={"type": "message", "role": "user",
                                                     "content": [{"type": "input_audio", "audio": tiny}]})
    err = recv(ws)["error"]
    assert err["code"] == "invalid_value" and err["param"] == "item.content[0].audio", err
    assert pipeline.requests == []


def test_a_server_without_speech_defaults_sessions_to_text() -> None:
    """A thinker-only model's gateway (no voices): the session starts text-only and answers; asking for audio
    is an error event naming why, and the session goes on."""
    pipeline = ScriptedPipeline()
    pipeline.voices = ()
    pipeline.no_audio = "the model m has no audio output"
    with RestServer(create_app(pipeline, served_model_names=("tiny-omni",))) as server, \
            connect(url(server), additional_headers=BETA, open_timeout=TIMEOUT_S) as conn:
        assert recv(conn)["session"]["modalities"] == ["text"]
        send(conn, type="conversation.item.create",
             item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]})
        assert recv(conn)["type"] == "conversation.item.created"
        send(conn, type="response.create", response={"modalities": ["text", "audio"]})
        error = recv(conn)
        assert error["type"] == "error" and "the model m has no audio output" in error["error"]["message"]
        send(conn, type="response.create")
        events = until(conn, "response.done")
        assert events[-1]["response"]["status"] == "completed"
        assert pipeline.requests[-1].modalities == ("text",)


def test_a_reasoning_models_thought_is_not_said() -> None:
    """--reasoning-parser: a text response sends (and remembers) the answer alone; speech is an error event."""
    from gateway.reasoning import ReasoningParser

    pipeline = ScriptedPipeline()
    pipeline.script = lambda request: [TextDelta("<think>\nHmm, a gre"), TextDelta("eting.</th"), TextDelta("ink>\n\nHi"),
                                       TextDelta(" there."), Finished("stop", 9, 12)]
    app = create_app(pipeline, served_model_names=("tiny-omni",), reasoning=ReasoningParser("qwen3"))
    with RestServer(app) as server, connect(url(server), additional_headers=BETA, open_timeout=TIMEOUT_S) as conn:
        recv(conn)
        send(conn, type="conversation.item.create",
             item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]})
        recv(conn)
        send(conn, type="response.create")  # the session default: text and audio
        error = recv(conn)
        assert error["type"] == "error" and "--reasoning-parser qwen3" in error["error"]["message"]
        send(conn, type="response.create", response={"modalities": ["text"]})
        events = until(conn, "response.done")
        assert "".join(e["delta"] for e in events if e["type"] == "response.text.delta") == "\n\nHi there."
        assert [e["text"] for e in events if e["type"] == "response.text.done"] == ["\n\nHi there."]
        assert pipeline.requests[-1].reasoning_end == "</think>"
        send(conn, type="response.create", response={"modalities": ["text"]})
        until(conn, "response.done")
    said = [m for m in pipeline.requests[-1].messages if m.role == "assistant"]
    assert [p.text for p in said[0].content] == ["\n\nHi there."]  # the next turn hears the answer alone


def test_an_out_of_band_response(ws: ClientConnection, pipeline: ScriptedPipeline) -> None:
    """response.create with conversation "none" and its own input (new items and item_references): its context is
    that input alone, its answer never joins the conversation, metadata comes back; mistakes name the field."""
    send(ws, type="conversation.item.create", item={"type": "message", "role": "user", "id": "u1",
                                                    "content": [{"type": "input_text", "text": "I like tea."}]})
    recv(ws)
    send(ws, type="response.create", response={
        "conversation": "none", "modalities": ["text"], "metadata": {"topic": "classify"},
        "input": [{"type": "item_reference", "id": "u1"},
                  {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tea or coffee?"}]}]})
    events = until(ws, "response.done")
    assert "conversation.item.created" not in [e["type"] for e in events]
    done = events[-1]["response"]
    assert done["conversation_id"] is None and done["metadata"] == {"topic": "classify"}
    assert done["output"][0]["content"][0]["text"] == "Hello world"
    [req] = pipeline.requests
    assert [m.content[0].text for m in req.messages] == ["I like tea.", "Tea or coffee?"]  # type: ignore[union-attr]
    send(ws, type="response.create", response={"modalities": ["text"]})  # the conversation: only u1 still
    until(ws, "response.done")
    assert [m.content[0].text for m in pipeline.requests[-1].messages] == ["I like tea."]  # type: ignore[union-attr]
    for bad, param in (({"conversation": "other"}, "response.conversation"),
                       ({"input": [{"type": "item_reference", "id": "nope"}]}, "response.input[0].id"),
                       ({"metadata": {"k": 1}}, "response.metadata"), ({"input": "x"}, "response.input")):
        send(ws, type="response.create", response=bad)
        assert recv(ws)["error"]["param"] == param, bad


@pytest.mark.parametrize("when", ["response.created", "response.audio.delta"])
def test_a_client_that_hangs_up_mid_answer_is_no_error(rest_server: RestServer, pipeline: ScriptedPipeline,
                                                      caplog: pytest.LogCaptureFixture,
                                                      monkeypatch: pytest.MonkeyPatch, when: str) -> None:
    """A hang-up is a cancel: it logged an ERROR with a traceback ("realtime response ... failed") when the
    answer's next event found the socket closed, or asyncio's "Task exception was never retrieved" when the
    closing events did (both under random Realtime hang-ups on a real mesh)."""
    receive = RealtimeSession._receive

    async def late(self: RealtimeSession, deadline: float | None) -> Any:  # the session hears of it last
        message = await receive(self, deadline)
        if message["type"] == "websocket.disconnect":
            await asyncio.sleep(0.8)
        return message

    monkeypatch.setattr(RealtimeSession, "_receive", late)
    pipeline.event_delay_s = 0.2
    with connect(url(rest_server), additional_headers=BETA, open_timeout=TIMEOUT_S) as conn:
        recv(conn)
        send(conn, type="conversation.item.create",
             item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]})
        recv(conn)
        send(conn, type="response.create")
        until(conn, when)
        conn.socket.shutdown(socket.SHUT_RDWR)  # gone without a close frame, as a dropped network or a killed app
    time.sleep(1.5)  # the answer's next event (0.2 s apart), or its closing events, meet the closed socket
    gc.collect()
    # the server's records only: this test's own client, cut off mid-read by its shutdown, may log that its
    # stream ended ("unexpected internal error", websockets.client: seen once in CI)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and not r.name.startswith("websockets.client")]
    assert errors == [], [r.getMessage() for r in errors]
