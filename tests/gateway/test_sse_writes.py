"""The chat stream's SSE writes: every chunk one pipeline event makes leaves in one body message (one socket
write), so a spoken answer's token is not two writes (its `content` and its `audio.transcript`)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from gateway.events import AudioDelta, ChatRequest, Event, Finished, TextDelta
from gateway.rest import create_app
from tests.gateway.gateway_harness import SAMPLE_RATE, ScriptedPipeline, tone


def _bodies(app: Any, body: dict[str, Any]) -> list[bytes]:
    """POST `body` to /v1/chat/completions through the ASGI app; each `http.response.body` message's bytes."""
    raw = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"),
                                          (b"content-length", str(len(raw)).encode())],
             "client": ("127.0.0.1", 1234), "server": ("127.0.0.1", 80)}
    sent: list[bytes] = []
    received = False

    async def receive() -> dict[str, Any]:
        nonlocal received
        if not received:
            received = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await asyncio.sleep(3600)  # the client stays connected
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            assert message["status"] == 200
        elif message["type"] == "http.response.body" and message.get("body"):
            sent.append(message["body"])

    asyncio.run(asyncio.wait_for(app(scope, receive, send), 30))
    return sent


def _events(body: bytes) -> list[dict[str, Any] | str]:
    return [json.loads(e[6:]) if e.startswith("data: {") else e[6:] for e in body.decode().split("\n\n") if e]


def test_each_event_of_a_spoken_stream_is_one_write() -> None:
    pipeline = ScriptedPipeline()
    wave = tone(0.1)

    def script(request: ChatRequest) -> list[Event | BaseException]:
        return [TextDelta("Hello"), AudioDelta(wave, SAMPLE_RATE), TextDelta(" world"),
                Finished(finish_reason="stop", prompt_tokens=3, completion_tokens=2)]

    pipeline.script = script
    app = create_app(pipeline, served_model_names=("tiny-omni",))
    bodies = _bodies(app, {"model": "tiny-omni", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                           "modalities": ["text", "audio"], "audio": {"voice": "Ethan", "format": "pcm16"},
                           "stream_options": {"include_usage": True}})
    writes = [_events(b) for b in bodies]
    assert len(writes) == 6, writes  # the opening, three deltas, the finish, the usage with [DONE]
    assert writes[0][0]["choices"][0]["delta"]["role"] == "assistant"
    for w, text in ((writes[1], "Hello"), (writes[3], " world")):  # each token: its content and its transcript
        content, spoken = (e["choices"][0]["delta"] for e in w)
        assert content == {"content": text} and set(spoken) == {"audio"} and spoken["audio"]["transcript"] == text
    assert [len(w) for w in writes] == [1, 2, 1, 2, 1, 2]
    assert writes[4][0]["choices"][0]["finish_reason"] == "stop"
    assert writes[5][0]["usage"]["completion_tokens"] == 2 and writes[5][1] == "[DONE]"
