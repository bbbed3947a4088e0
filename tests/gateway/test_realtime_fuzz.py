"""Random Realtime events of every client type, with fields of every JSON type, beta and GA (gateway/realtime_api.py):
each mistake is an `invalid_request_error` event and the session stays open; none is a `server_error` (a crash
in the gateway, as a GA session.update whose session was not an object was). Seeded, so a failure replays.
Against a scripted pipeline, with a real WebSocket client."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from gateway_harness import RestServer, ScriptedPipeline
from test_realtime import BETA, TIMEOUT_S, audio_b64, url
from websockets.sync.client import connect

from gateway.rest import create_app

VALUES: list[Any] = [None, 0, -1, 1.5, 10**12, True, "", "x", "auto", "none", "realtime", "transcription", "pcm16",
                     "g711_ulaw", "item_1", [], [1], {}, {"a": 1}, {"type": "server_vad"},
                     {"type": "audio/pcma"}, [{"type": "input_text", "text": "hi"}],
                     {"input": {"format": {"type": "audio/pcm", "rate": 24000}, "turn_detection": None},
                      "output": {"voice": "Ethan"}}]
EVENTS = ["session.update", "input_audio_buffer.append", "input_audio_buffer.commit", "input_audio_buffer.clear",
          "conversation.item.create", "conversation.item.truncate", "conversation.item.retrieve",
          "conversation.item.delete", "response.create", "response.cancel"]
EVENT_FIELDS = ["session", "audio", "item", "item_id", "content_index", "audio_end_ms", "response",
                "previous_item_id"]
OBJECT_FIELDS = ["type", "modalities", "output_modalities", "instructions", "voice", "input_audio_format",
                 "output_audio_format", "turn_detection", "tools", "tool_choice", "temperature", "speed",
                 "max_response_output_tokens", "max_output_tokens", "input_audio_transcription", "truncation", "audio",
                 "role", "content", "id", "call_id", "output", "name", "arguments", "conversation", "input",
                 "metadata", "prompt", "include"]
PART_TYPES = ["input_text", "input_audio", "input_image", "text", "audio", "output_text", "bogus", None]


def _value(rng: random.Random) -> Any:
    return json.loads(json.dumps(rng.choice(VALUES)))  # a copy: events never share an object


def _object(rng: random.Random) -> dict[str, Any]:
    return {k: _value(rng) for k in rng.sample(OBJECT_FIELDS, rng.randint(0, 5))}


def _item(rng: random.Random) -> dict[str, Any]:
    item: dict[str, Any] = {"type": rng.choice(["message", "function_call", "function_call_output", "bogus", None]),
                            "role": rng.choice(["user", "assistant", "system", "tool", None, 1])}
    item["content"] = [{"type": rng.choice(PART_TYPES),
                        **{k: _value(rng) for k in rng.sample(["text", "audio", "image_url", "transcript"], 2)}}
                       for _ in range(rng.randint(0, 3))]
    for key in rng.sample(["id", "call_id", "output", "name", "arguments"], rng.randint(0, 3)):
        item[key] = _value(rng)
    return item


def _event(rng: random.Random) -> dict[str, Any]:
    event: dict[str, Any] = {"type": rng.choice(EVENTS)}
    for key in rng.sample(EVENT_FIELDS, rng.randint(0, 3)):
        event[key] = _object(rng) if rng.random() < 0.5 else _value(rng)
    if event["type"] == "conversation.item.create" and rng.random() < 0.7:
        event["item"] = _item(rng)
    elif event["type"] == "input_audio_buffer.append" and rng.random() < 0.5:
        event["audio"] = audio_b64(0.05)
    elif event["type"] == "response.create" and rng.random() < 0.5:
        event["response"] = {"input": [_item(rng) for _ in range(rng.randint(0, 2))],
                             "conversation": rng.choice(["none", "auto", None, 3])}
    return event


@pytest.mark.parametrize("ga", [False, True], ids=["beta", "ga"])
@pytest.mark.parametrize("seed", [1, 2])
def test_random_events_are_named_mistakes_never_crashes(pipeline: ScriptedPipeline, ga: bool, seed: int) -> None:
    rng = random.Random(seed)
    subprotocols, headers = (["realtime"], None) if ga else (None, BETA)
    with RestServer(create_app(pipeline, served_model_names=("tiny-omni",))) as server:
        for _ in range(8):
            with connect(url(server), subprotocols=subprotocols,  # type: ignore[arg-type]
                         additional_headers=headers, open_timeout=TIMEOUT_S) as conn:
                conn.recv(timeout=TIMEOUT_S)
                sent = [_event(rng) for _ in range(40)]
                for event in sent:
                    conn.send(json.dumps(event))
                conn.send(json.dumps({"type": "end.of.round", "event_id": "evt_end"}))  # an unknown type: its error
                while True:  # every event answered, the session still open
                    got = json.loads(conn.recv(timeout=TIMEOUT_S))
                    error = got.get("error") or {}
                    assert error.get("type") != "server_error", (got, sent)
                    if error.get("event_id") == "evt_end":
                        assert error["code"] == "unknown_event"
                        break
