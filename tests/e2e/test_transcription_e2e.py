"""/v1/audio/transcriptions through the shared mesh: its text is exactly what a greedy, text-only chat
completion with the same user message (the WAV as input_audio, then the instruction) answers, and
`usage` counts the same tokens; the openai SDK gets that text too, and streamed (stream=True) its deltas
add up to it, in more than one piece; include[]=logprobs gives the tokens and log-probabilities the chat
gives with logprobs. A client of vLLM's own /v1/realtime dialect gets the same text."""

from __future__ import annotations

import base64

import httpx
import openai
from reference import sine_wav

from gateway.transcription_api import instruction


def test_transcription_equals_the_chat_with_that_message(mesh) -> None:
    wav = sine_wav(1.0)
    r = httpx.post(f"{mesh.rest}/v1/audio/transcriptions", timeout=120,
                   data={"model": "tiny-qwen3-omni", "language": "en"}, files={"file": ("a.wav", wav, "audio/wav")})
    assert r.status_code == 200, r.text
    content = [{"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}},
               {"type": "text", "text": instruction("transcribe", "en", None)}]
    chat = httpx.post(f"{mesh.rest}/v1/chat/completions", timeout=120, json={
        "model": "tiny-qwen3-omni", "messages": [{"role": "user", "content": content}], "temperature": 0})
    assert chat.status_code == 200, chat.text
    assert r.json()["text"] == chat.json()["choices"][0]["message"]["content"] != ""
    assert r.json()["usage"]["input_tokens"] == chat.json()["usage"]["prompt_tokens"]
    assert r.json()["usage"]["output_tokens"] == chat.json()["usage"]["completion_tokens"]
    client = openai.OpenAI(base_url=f"{mesh.rest}/v1", api_key="unused", max_retries=0, timeout=120)
    assert client.audio.transcriptions.create(model="tiny-qwen3-omni", file=("a.wav", wav),
                                              language="en").text == r.json()["text"]
    events = list(client.audio.transcriptions.create(model="tiny-qwen3-omni", file=("a.wav", wav), language="en",
                                                     stream=True))
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    assert events[-1].type == "transcript.text.done" and len(deltas) > 1
    assert "".join(deltas) == events[-1].text == r.json()["text"]
    assert events[-1].usage.output_tokens == r.json()["usage"]["output_tokens"]  # type: ignore[union-attr]


def test_transcription_logprobs_are_the_chats(mesh) -> None:
    """include[]=logprobs: the same tokens and log-probabilities as the chat asked for logprobs."""
    wav = sine_wav(1.0)
    r = httpx.post(f"{mesh.rest}/v1/audio/transcriptions", timeout=120, files={"file": ("a.wav", wav, "audio/wav")},
                   data={"model": "tiny-qwen3-omni", "include[]": "logprobs", "max_completion_tokens": "6"})
    assert r.status_code == 200, r.text
    content = [{"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}},
               {"type": "text", "text": instruction("transcribe", None, None)}]
    chat = httpx.post(f"{mesh.rest}/v1/chat/completions", timeout=120, json={
        "model": "tiny-qwen3-omni", "messages": [{"role": "user", "content": content}], "temperature": 0,
        "max_tokens": 6, "logprobs": True}).json()
    want = chat["choices"][0]["logprobs"]["content"]
    got = r.json()["logprobs"]
    assert len(got) == len(want) == r.json()["usage"]["output_tokens"] == 6
    assert [(g["token"], g["bytes"]) for g in got] == [(w["token"], w["bytes"]) for w in want]
    assert all(abs(g["logprob"] - w["logprob"]) < 1e-4 for g, w in zip(got, want))


def test_vllms_realtime_dialect_transcribes_as_the_endpoint(mesh) -> None:
    """A client of vLLM's own /v1/realtime (gateway/realtime_vllm.py: model in session.update, 16 kHz pcm16,
    commit ... commit final) gets the endpoint's text for the same clip as deltas and transcription.done."""
    import io
    import json
    import wave

    from websockets.sync.client import connect

    wav = sine_wav(1.0)  # 16 kHz, a tone: no pause for the VAD to cut at, one clip
    with wave.open(io.BytesIO(wav)) as w:
        pcm = w.readframes(w.getnframes())
    want = httpx.post(f"{mesh.rest}/v1/audio/transcriptions", timeout=120, data={"model": "tiny-qwen3-omni"},
                      files={"file": ("a.wav", wav, "audio/wav")}).json()
    with connect(mesh.rest.replace("http://", "ws://") + "/v1/realtime", open_timeout=30) as ws:
        assert json.loads(ws.recv(timeout=30))["type"] == "session.created"
        ws.send(json.dumps({"type": "session.update", "model": "tiny-qwen3-omni"}))
        ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        for at in range(0, len(pcm), 6400):  # 0.2 s chunks
            chunk = base64.b64encode(pcm[at:at + 6400]).decode()
            ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
        ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
        events = [json.loads(ws.recv(timeout=120))]
        while events[-1]["type"] != "transcription.done":
            assert events[-1]["type"] == "transcription.delta", events[-1]
            events.append(json.loads(ws.recv(timeout=120)))
    assert events[-1]["text"] == "".join(e["delta"] for e in events[:-1]) == want["text"] != ""
    assert events[-1]["usage"]["completion_tokens"] == want["usage"]["output_tokens"]
