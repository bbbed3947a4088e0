"""OpenAI's multi-turn audio (gateway/audio_memory.py): a spoken answer's `audio.id` named in a later chat's
assistant message stands for that answer's transcript, whole or streamed; an id the gateway never gave or
one past its expiry is a 400 naming the field; the memory is bounded and forgets the oldest first."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from gateway_harness import RestServer, ScriptedPipeline

from gateway.audio_memory import AudioMemory
from gateway.events import TextPart

SPOKEN = {"modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "wav"}}


def post(server: RestServer, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=10)


def later_turn(audio_id: str, **assistant: object) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "audio": {"id": audio_id}, **assistant},
                         {"role": "user", "content": "and then?"}]}


def test_an_earlier_spoken_answer_is_its_transcript(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    first = post(rest_server, {"messages": [{"role": "user", "content": "hi"}], **SPOKEN}).json()
    audio = first["choices"][0]["message"]["audio"]
    assert 3500 <= audio["expires_at"] - time.time() <= 3600
    r = post(rest_server, later_turn(audio["id"]))
    assert r.status_code == 200, r.text
    assert pipeline.requests[-1].messages[1].content == (TextPart("Hello world"),)
    # the client's own text wins over the reference
    post(rest_server, later_turn(audio["id"], content="my words"))
    assert pipeline.requests[-1].messages[1].content == (TextPart("my words"),)


def test_a_streamed_answer_is_remembered_at_its_end(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, **SPOKEN}
    with httpx.stream("POST", f"{rest_server.base_url}/v1/chat/completions", json=body, timeout=10) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    audio = [c["choices"][0]["delta"]["audio"] for c in chunks if c["choices"] and "audio" in c["choices"][0]["delta"]]
    assert len([a for a in audio if "data" in a]) == 2 and len({a["id"] for a in audio}) == 1
    assert "".join(a.get("transcript", "") for a in audio) == "Hello world"  # the spoken text, beside the samples
    assert "expires_at" in audio[0] and not any("expires_at" in a for a in audio[1:])  # first delta, as OpenAI's
    assert post(rest_server, later_turn(audio[0]["id"])).status_code == 200
    assert pipeline.requests[-1].messages[1].content == (TextPart("Hello world"),)


@pytest.mark.parametrize(("body", "param", "needle"), [
    (later_turn("audio_never_given"), "messages[1].audio.id", "no spoken answer 'audio_never_given' on this gateway"),
    ({"messages": [{"role": "user", "content": "hi", "audio": {"id": "audio_x"}}]}, "messages[0]",
     "only assistant messages"),
    (later_turn(""), "messages[1].audio.id", "at least 1 character"),
])
def test_references_that_cannot_be_followed_are_400s(rest_server: RestServer, pipeline: ScriptedPipeline, body: dict,
                                                    param: str, needle: str) -> None:
    r = post(rest_server, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert needle in r.json()["error"]["message"] and not pipeline.requests


def test_the_memory_expires_and_is_bounded() -> None:
    memory = AudioMemory(ttl_s=0.05, max_entries=2)
    expires = memory.remember("a", "one")
    assert expires >= int(time.time()) and memory.transcript("a") == "one"
    memory.remember("b", "two")
    memory.remember("c", "three")  # over the bound: the oldest goes
    assert memory.transcript("a") is None and memory.transcript("c") == "three"
    time.sleep(0.06)
    assert memory.transcript("b") is None and memory.transcript("c") is None
