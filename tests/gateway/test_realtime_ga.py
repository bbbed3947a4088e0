"""The Realtime API's GA interface (gateway/realtime_ga.py) against a scripted pipeline: the `openai` SDK's own
GA client (`client.realtime.connect`) holds a spoken turn with typed events (GA names, output_audio parts,
the session in the GA shape, mu-law out), a text-only response by its output_modalities, a user item
created and retrieved; mistakes come back as error events naming GA paths; a client that names no interface
speaks GA, one with the OpenAI-Beta header beta, unchanged."""

from __future__ import annotations

import base64
import json

import openai
import pytest
from gateway_harness import RestServer, ScriptedPipeline, tone
from test_realtime import BETA, audio_b64, recv, send, until, url
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from gateway.realtime_audio import OutputEncoder

GA_SESSION = {"type": "realtime", "output_modalities": ["audio"], "instructions": "Be brief.", "max_output_tokens": 64,
              "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}, "turn_detection": None,
                                  "noise_reduction": None},
                        "output": {"format": {"type": "audio/pcmu"}, "voice": "chelsie", "speed": 1.0}},
              "tracing": None, "truncation": "auto"}


def test_the_sdks_ga_client_holds_a_spoken_turn(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    client = openai.OpenAI(base_url=f"{rest_server.base_url}/v1", api_key="unused")
    with client.realtime.connect(model="tiny-omni") as conn:
        assert conn.recv().type == "session.created"
        conn.session.update(session=GA_SESSION)  # type: ignore[arg-type]
        updated = conn.recv()
        assert updated.type == "session.updated"
        session = updated.session.model_dump()
        assert session["type"] == "realtime" and session["output_modalities"] == ["audio"]
        assert session["audio"]["output"]["format"] == {"type": "audio/pcmu"}
        assert session["audio"]["output"]["voice"] == "Chelsie" and session["max_output_tokens"] == 64
        conn.input_audio_buffer.append(audio=audio_b64(0.3))
        conn.input_audio_buffer.commit()
        conn.response.create()
        events = []
        for ev in conn:
            events.append(ev)
            if ev.type == "response.done":
                break
    kinds = [e.type for e in events]
    assert kinds[:3] == ["input_audio_buffer.committed", "conversation.item.added", "conversation.item.done"]
    assert kinds[-6:] == ["response.output_audio.done", "response.output_audio_transcript.done",
                          "response.content_part.done", "response.output_item.done", "conversation.item.done",
                          "response.done"]
    transcript = "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta")
    said = b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")
    whole = OutputEncoder("g711_ulaw", 24_000)
    assert transcript == "Hello world" and said == whole(tone(0.2)) + whole.flush()
    done = events[-1].response
    assert done.status == "completed" and done.output_modalities == ["audio"]
    assert done.output[0].content[0].type == "output_audio" and done.output[0].content[0].transcript == "Hello world"
    [req] = pipeline.requests
    assert req.voice == "Chelsie" and req.sampling.max_tokens == 64 and req.messages[0].content[0].text == "Be brief."


def test_a_text_response_and_items_in_ga(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    with connect(url(rest_server), open_timeout=10) as ws:
        recv(ws)
        send(ws, type="session.update", session={"type": "realtime", "output_modalities": ["text"]})
        recv(ws)
        send(ws, type="conversation.item.create", item={"type": "message", "role": "user", "id": "u1",
                                                        "content": [{"type": "input_text", "text": "Hi."}]})
        added, done = recv(ws), recv(ws)
        assert (added["type"], done["type"]) == ("conversation.item.added", "conversation.item.done")
        send(ws, type="conversation.item.retrieve", item_id="u1")
        retrieved = recv(ws)
        assert retrieved["type"] == "conversation.item.retrieved" and retrieved["item"]["content"][0]["text"] == "Hi."
        send(ws, type="response.create", response={"output_modalities": ["text"], "max_output_tokens": 5})
        events = until(ws, "response.done")
        kinds = [e["type"] for e in events]
        assert "response.output_text.delta" in kinds and "response.output_text.done" in kinds
        part = next(e["part"] for e in events if e["type"] == "response.content_part.done")
        assert part == {"type": "output_text", "text": "Hello world"}
        assert pipeline.requests[-1].modalities == ("text",) and pipeline.requests[-1].sampling.max_tokens == 5
        send(ws, type="response.create", response={"conversation": "none", "output_modalities": ["text"]})
        kinds = [e["type"] for e in until(ws, "response.done")]  # out of band: no conversation.item.* events
        assert "response.output_item.done" in kinds and not any(k.startswith("conversation.item") for k in kinds)


@pytest.mark.parametrize(("session", "param"), [
    ({"audio": {"output": {"voice": "nobody"}}}, "session.audio.output.voice"),
    ({"audio": {"input": {"format": {"type": "audio/opus"}}}}, "session.audio.input.format"),
    ({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}, "session.audio.input.format.rate"),
    ({"output_modalities": ["video"]}, "session.output_modalities"),
    ({"audio": {"input": {"turn_detection": {"type": "semantic_vad"}}}}, "session.audio.input.turn_detection"),
    ({"audio": {"input": {"noise_reduction": {"type": "near_field"}}}}, "session.audio.input.noise_reduction"),
    ({"prompt": {"id": "pmpt_1"}}, "session.prompt"),
    ({"audio": {"output": {"speed": 3}}}, "session.audio.output.speed"),
    ({"audio": {"output": {"voice": ["x"]}}}, "session.audio.output.voice"),  # wrong types: named, not a crash
    ({"audio": {"input": {"format": {"type": ["audio/pcm"]}}}}, "session.audio.input.format"),
    ({"audio": {"output": {"format": {"type": {}}}}}, "session.audio.output.format"),
    ({"type": "bogus"}, "session.type"),  # was accepted as a realtime session
])
def test_ga_mistakes_name_ga_paths(rest_server: RestServer, session: dict, param: str) -> None:
    with connect(url(rest_server), open_timeout=10) as ws:
        recv(ws)
        send(ws, type="session.update", session={"type": "realtime", **session})
        error = recv(ws)
        assert error["type"] == "error" and error["error"]["param"] == param, error
        send(ws, type="input_audio_buffer.append", audio=audio_b64(0.1))  # the session goes on
        send(ws, type="input_audio_buffer.commit")
        assert recv(ws)["type"] == "input_audio_buffer.committed"


def test_ga_speed_is_the_sessions(rest_server: RestServer) -> None:
    with connect(url(rest_server), open_timeout=10) as ws:
        recv(ws)
        send(ws, type="session.update", session={"type": "realtime", "audio": {"output": {"speed": 0.75}}})
        assert recv(ws)["session"]["audio"]["output"]["speed"] == 0.75


def test_a_beta_session_keeps_beta_events(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    with connect(url(rest_server), additional_headers=BETA, open_timeout=10) as ws:
        recv(ws)
        send(ws, type="session.update", session={"modalities": ["text"]})
        assert "output_modalities" not in recv(ws)["session"]
        send(ws, type="conversation.item.create", item={"type": "message", "role": "user",
                                                        "content": [{"type": "input_text", "text": "Hi."}]})
        assert recv(ws)["type"] == "conversation.item.created"
        send(ws, type="response.create")
        kinds = [e["type"] for e in until(ws, "response.done")]
        assert "response.text.delta" in kinds and not any("output_text" in k for k in kinds)


def test_a_transcription_session(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    """GA's "type": "transcription": each committed turn is transcribed (delta events, then completed), nothing
    answers, response.create is refused, and the session cannot turn into one once it holds audio."""
    with connect(url(rest_server), open_timeout=10) as ws:
        recv(ws)
        send(ws, type="session.update", session={"type": "transcription", "audio": {"input": {
            "format": {"type": "audio/pcmu"}, "transcription": {"model": "any", "language": "en"}}}})
        session = recv(ws)["session"]
        assert session["type"] == "transcription" and session["audio"]["input"]["format"] == {"type": "audio/pcmu"}
        assert session["audio"]["input"]["transcription"]["language"] == "en" and "output_modalities" not in session
        send(ws, type="input_audio_buffer.append", audio=base64.b64encode(bytes([0xFF] * 2400)).decode())
        send(ws, type="input_audio_buffer.commit")
        events = until(ws, "conversation.item.input_audio_transcription.completed")
        assert [e["delta"] for e in events if e["type"].endswith("transcription.delta")] == ["Hello", " world"]
        assert events[-1]["transcript"] == "Hello world"
        [req] = pipeline.requests
        clip = req.messages[0].content[0]
        assert req.modalities == ("text",) and clip.sample_rate == 8000  # type: ignore[union-attr]
        send(ws, type="response.create")
        assert "only transcribes" in recv(ws)["error"]["message"]
        send(ws, type="session.update", session={"type": "realtime"})
        assert recv(ws)["error"]["param"] == "session.type"
        send(ws, type="session.update", session={"audio": {"input": {"transcription": {"language": "de"}}}})
        assert recv(ws)["session"]["audio"]["input"]["transcription"]["language"] == "de"  # still transcribing
        send(ws, type="session.update", session={"audio": {"input": {"transcription": None}}})
        assert recv(ws)["session"]["audio"]["input"]["transcription"] is not None  # it cannot stop
    with connect(url(rest_server), open_timeout=10) as ws:  # a plain session with audio cannot become one
        recv(ws)
        send(ws, type="input_audio_buffer.append", audio=audio_b64(0.1))
        send(ws, type="session.update", session={"type": "transcription"})
        assert recv(ws)["error"]["param"] == "session.type"


def test_intent_transcription_opens_a_transcription_session(rest_server: RestServer,
                                                             pipeline: ScriptedPipeline) -> None:
    """OpenAI's live-caption URL, `/v1/realtime?intent=transcription` (no model): a GA transcription session from
    session.created on, transcribing a committed turn with no session.update; another intent, or beta's
    transcription sessions (the OpenAI-Beta header), are refused at the handshake."""
    base = rest_server.base_url.replace("http://", "ws://") + "/v1/realtime"
    with connect(base + "?intent=transcription", open_timeout=10) as ws:
        created = recv(ws)["session"]
        assert created["type"] == "transcription" and created["audio"]["input"]["transcription"] is not None
        send(ws, type="input_audio_buffer.append", audio=audio_b64(0.2))
        send(ws, type="input_audio_buffer.commit")
        assert until(ws, "conversation.item.input_audio_transcription.completed")[-1]["transcript"] == "Hello world"
        send(ws, type="response.create")
        assert "only transcribes" in recv(ws)["error"]["message"]
    assert pipeline.requests[-1].modalities == ("text",)
    for query, headers in (("?intent=speech", {}), ("?intent=transcription", {"OpenAI-Beta": "realtime=v1"})):
        with pytest.raises(InvalidStatus) as refused:  # a 400 naming the field, as REST's
            connect(base + query, additional_headers=headers, open_timeout=10)
        assert refused.value.response.status_code == 400
        error = json.loads(bytes(refused.value.response.body))["error"]
        assert error["param"] == "intent" and "only 'transcription'" in error["message"]


def test_a_browser_says_its_interface_by_its_subprotocols(rest_server: RestServer) -> None:
    """Subprotocol "realtime" alone (OpenAI's GA browser handshake): GA from session.created on; with
    "openai-beta.realtime-v1": beta; without subprotocols or the beta header: GA, as OpenAI's server."""
    with connect(url(rest_server), subprotocols=["realtime"], open_timeout=10) as ws:  # type: ignore[list-item]
        created = recv(ws)["session"]
        assert ws.subprotocol == "realtime" and created["type"] == "realtime" and "output_modalities" in created
    with connect(url(rest_server), subprotocols=["realtime", "openai-beta.realtime-v1"],  # type: ignore[list-item]
                 open_timeout=10) as ws:
        created = recv(ws)["session"]
        assert "modalities" in created and "type" not in created
    with connect(url(rest_server), open_timeout=10) as ws:
        assert recv(ws)["session"]["type"] == "realtime"
    with connect(url(rest_server), additional_headers=BETA, open_timeout=10) as ws:
        assert "modalities" in recv(ws)["session"]


def test_a_client_that_names_no_interface_speaks_ga(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    """No OpenAI-Beta header and no subprotocol: GA from session.created on, with no session.update (OpenAI
    serves only GA since the beta's end); a beta field is refused with its GA name and the header to send."""
    with connect(url(rest_server), open_timeout=10) as ws:
        created = recv(ws)["session"]
        assert created["type"] == "realtime" and created["output_modalities"] == ["audio"]
        assert created["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 24000}
        send(ws, type="session.update", session={"modalities": ["text"]}, event_id="evt_1")
        error = recv(ws)["error"]
        assert error["param"] == "session.modalities" and error["code"] == "unknown_parameter"
        assert error["event_id"] == "evt_1"
        assert "session.output_modalities" in error["message"] and "OpenAI-Beta: realtime=v1" in error["message"]
        send(ws, type="conversation.item.create", item={"type": "message", "role": "user",
                                                        "content": [{"type": "input_text", "text": "Hi."}]})
        assert [recv(ws)["type"], recv(ws)["type"]] == ["conversation.item.added", "conversation.item.done"]
        send(ws, type="response.create")
        kinds = [e["type"] for e in until(ws, "response.done")]
        assert "response.output_audio.delta" in kinds and "response.output_audio_transcript.delta" in kinds
        assert not any(k.startswith("response.audio") for k in kinds)


@pytest.mark.parametrize("session", ["realtime", 3, [], True])
def test_a_session_that_is_not_an_object_is_named(rest_server: RestServer, session: object) -> None:
    """In a GA session too (it was an internal error there: the GA fields were read before the check)."""
    with connect(url(rest_server), subprotocols=["realtime"], open_timeout=10) as ws:  # type: ignore[list-item]
        assert recv(ws)["session"]["type"] == "realtime"
        send(ws, type="session.update", session=session, event_id="evt_1")
        error = recv(ws)["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "session", error
        assert error["message"] == "session must be an object" and error["event_id"] == "evt_1"
        send(ws, type="session.update", session={"type": "realtime", "instructions": "Be brief."})
        assert recv(ws)["session"]["instructions"] == "Be brief."  # the session goes on


def test_a_refused_update_does_not_make_a_transcription_session(rest_server: RestServer,
                                                                pipeline: ScriptedPipeline) -> None:
    with connect(url(rest_server), open_timeout=10) as ws:
        recv(ws)
        send(ws, type="session.update",
             session={"type": "transcription", "audio": {"input": {"format": {"type": "audio/opus"}}}})
        assert recv(ws)["error"]["param"] == "session.audio.input.format"
        send(ws, type="conversation.item.create", item={"type": "message", "role": "user",
                                                        "content": [{"type": "input_text", "text": "Hi."}]})
        assert recv(ws)["type"] == "conversation.item.added"  # GA names: the client spoke GA
        send(ws, type="response.create")  # still a session that answers
        done = until(ws, "response.done")[-1]["response"]
        assert done["status"] == "completed" and pipeline.requests
