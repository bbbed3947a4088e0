"""OpenAI's Realtime API through the shared mesh, over a real WebSocket: a spoken turn (24 kHz pcm16 appended in
chunks and committed) answers with exactly the text and audio of the same conversation sent as a chat
completion (the instructions as its system turn, the clip as a WAV), and a second, text-only turn sees the
first answer in the conversation; a telephone turn (G.711 mu-law in and out) and the openai SDK's GA client
likewise; a picture in a user item (GA's input_image) answers as the chat does; a GA transcription session transcribes as /v1/audio/transcriptions does;
a conversation past the context is answered from its latest items (truncation). Gateway-level events and errors: tests/gateway/test_realtime.py, test_realtime_audio.py and
test_realtime_ga.py."""

from __future__ import annotations

import base64
import io
import json
import wave
from pathlib import Path

import httpx
import numpy as np
from mesh_harness import REALTIME_BETA
from reference import sine_wav
from websockets.sync.client import connect

MODEL = "tiny-qwen3-omni"
TIMEOUT_S = 120.0
PCM16_TOLERANCE = 4  # as test_api_e2e.py: the vocoder's chunking may round the last bits differently
INSTRUCTIONS = "You are a friendly voice."


def _until(conn, kind: str) -> list[dict]:
    out = []
    while not out or out[-1]["type"] != kind:
        out.append(json.loads(conn.recv(timeout=TIMEOUT_S)))
        assert out[-1]["type"] != "error", out[-1]
    return out


def test_a_spoken_turn_is_the_same_chat(mesh):
    clip = sine_wav(1.0, rate=24_000)
    with wave.open(io.BytesIO(clip)) as w:
        pcm = w.readframes(w.getnframes())
    with connect(mesh.rest.replace("http://", "ws://") + f"/v1/realtime?model={MODEL}",
                 additional_headers=REALTIME_BETA, open_timeout=30) as ws:
        _until(ws, "session.created")
        ws.send(json.dumps({"type": "session.update", "session": {
            "instructions": INSTRUCTIONS, "voice": "ethan", "temperature": 0, "max_response_output_tokens": 8}}))
        _until(ws, "session.updated")
        for at in range(0, len(pcm), 9600):  # 0.2 s chunks
            ws.send(json.dumps({"type": "input_audio_buffer.append",
                                "audio": base64.b64encode(pcm[at:at + 9600]).decode()}))
        ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        _until(ws, "conversation.item.created")
        ws.send(json.dumps({"type": "response.create"}))
        events = _until(ws, "response.done")
        transcript = "".join(e["delta"] for e in events if e["type"] == "response.audio_transcript.delta")
        audio = np.frombuffer(b"".join(base64.b64decode(e["delta"]) for e in events
                                       if e["type"] == "response.audio.delta"), dtype="<i2").astype(np.int32)
        ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say it again."}]}}))
        _until(ws, "conversation.item.created")
        ws.send(json.dumps({"type": "response.create", "response": {"modalities": ["text"]}}))
        second = "".join(e["delta"] for e in _until(ws, "response.done") if e["type"] == "response.text.delta")
    user_audio = {"type": "input_audio", "input_audio": {"data": base64.b64encode(clip).decode(), "format": "wav"}}
    first_turn = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": [user_audio]}]
    chat = httpx.post(f"{mesh.rest}/v1/chat/completions", timeout=TIMEOUT_S, json={
        "model": MODEL, "messages": first_turn, "modalities": ["text", "audio"],
        "audio": {"voice": "ethan", "format": "wav"}, "temperature": 0, "max_tokens": 8}).json()
    message = chat["choices"][0]["message"]
    assert transcript == message["content"] and transcript
    with wave.open(io.BytesIO(base64.b64decode(message["audio"]["data"]))) as w:
        want = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.int32)
    assert audio.shape == want.shape and audio.size > 0
    assert np.abs(audio - want).max() <= PCM16_TOLERANCE
    again = httpx.post(f"{mesh.rest}/v1/chat/completions", timeout=TIMEOUT_S, json={
        "model": MODEL, "temperature": 0, "max_tokens": 8, "messages": [
            *first_turn, {"role": "assistant", "content": transcript},
            {"role": "user", "content": "Say it again."}]}).json()
    assert second == again["choices"][0]["message"]["content"]


def test_server_vad_turns_are_the_same_chat(mesh):
    """server_vad (Silero VAD) on a spoken sentence between silences: the turn it cuts (its padding + the
    speech) is answered as the chat answers that clip."""
    with wave.open(str(Path(__file__).parent.parent / "data" / "speech_24k.wav")) as w:
        sentence = w.readframes(w.getnframes())
    silence = bytes(2 * 12_288)  # 0.512 s of pcm16 at 24 kHz
    pcm = silence + sentence + silence
    with connect(mesh.rest.replace("http://", "ws://") + f"/v1/realtime?model={MODEL}",
                 additional_headers=REALTIME_BETA, open_timeout=30) as ws:
        _until(ws, "session.created")
        ws.send(json.dumps({"type": "session.update", "session": {
            "modalities": ["text"], "temperature": 0, "max_response_output_tokens": 6,
            "turn_detection": {"type": "server_vad", "prefix_padding_ms": 96, "silence_duration_ms": 320}}}))
        _until(ws, "session.updated")
        for at in range(0, len(pcm), 4800):  # 0.1 s chunks, as a microphone sends them
            ws.send(json.dumps({"type": "input_audio_buffer.append",
                                "audio": base64.b64encode(pcm[at:at + 4800]).decode()}))
        events = _until(ws, "response.done")
    start = next(e["audio_start_ms"] for e in events if e["type"] == "input_audio_buffer.speech_started")
    end = next(e["audio_end_ms"] for e in events if e["type"] == "input_audio_buffer.speech_stopped")
    assert 512 <= start <= 576 and 1664 <= end <= 1792, (start, end)
    text = "".join(e["delta"] for e in events if e["type"] == "response.text.delta")
    turn = pcm[2 * 24 * (start - 96):2 * 24 * end]
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(24_000), w.writeframes(turn)
    chat = httpx.post(f"{mesh.rest}/v1/chat/completions", timeout=TIMEOUT_S, json={
        "model": MODEL, "temperature": 0, "max_tokens": 6, "messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": base64.b64encode(out.getvalue()).decode(),
                                                    "format": "wav"}}]}]}).json()
    assert text == chat["choices"][0]["message"]["content"] and text


def test_a_function_call_and_its_result_are_the_chats(mesh):
    """A forced call (no flag needed) in a text response is the chat's forced call on the same conversation, and
    after the client's function_call_output the next response answers as the chat answers that conversation."""
    params = {"type": "object", "properties": {"mode": {"enum": ["calm", "storm"]}}, "required": ["mode"],
              "additionalProperties": False}
    tool = {"type": "function", "name": "set_mode", "parameters": params}
    with connect(mesh.rest.replace("http://", "ws://") + f"/v1/realtime?model={MODEL}",
                 additional_headers=REALTIME_BETA, open_timeout=30) as ws:
        _until(ws, "session.created")
        ws.send(json.dumps({"type": "session.update", "session": {
            "modalities": ["text"], "temperature": 0, "max_response_output_tokens": 40, "tools": [tool],
            "tool_choice": {"type": "function", "name": "set_mode"}}}))
        _until(ws, "session.updated")
        ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Set the mode."}]}}))
        _until(ws, "conversation.item.created")
        ws.send(json.dumps({"type": "response.create"}))
        [call] = [e["item"] for e in _until(ws, "response.done")
                  if e["type"] == "response.output_item.done" and e["item"]["type"] == "function_call"]
        ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "function_call_output", "call_id": call["call_id"], "output": "done"}}))
        _until(ws, "conversation.item.created")
        ws.send(json.dumps({"type": "response.create", "response": {"tool_choice": "none", "tools": [tool],
                                                                    "max_output_tokens": 6}}))
        answer = "".join(e["delta"] for e in _until(ws, "response.done") if e["type"] == "response.text.delta")
    chat_tools = [{"type": "function", "function": {"name": "set_mode", "parameters": params}}]
    ask = [{"role": "user", "content": "Set the mode."}]
    chat = httpx.post(f"{mesh.rest}/v1/chat/completions", timeout=TIMEOUT_S, json={
        "model": MODEL, "messages": ask, "max_tokens": 40, "temperature": 0, "tools": chat_tools,
        "tool_choice": {"type": "function", "function": {"name": "set_mode"}}}).json()
    chat_call = chat["choices"][0]["message"]["tool_calls"][0]
    assert call["name"] == "set_mode" and call["arguments"] == chat_call["function"]["arguments"]
    again = httpx.post(f"{mesh.rest}/v1/chat/completions", timeout=TIMEOUT_S, json={
        "model": MODEL, "max_tokens": 6, "temperature": 0, "tool_choice": "none", "tools": chat_tools,
        "messages": [*ask, {"role": "assistant", "content": None, "tool_calls": [chat_call]},
                     {"role": "tool", "tool_call_id": chat_call["id"], "content": "done"}]}).json()
    assert answer == again["choices"][0]["message"]["content"] and answer


def test_a_telephone_turn_is_the_same_chat(mesh):
    """g711_ulaw in and out: the 8 kHz clip is answered as the chat answers it (as an 8 kHz WAV), and the spoken
    answer is the chat's audio decimated and mu-law encoded (gateway/realtime_audio.py)."""
    from gateway.audio_encoding import wav_bytes
    from gateway.realtime_audio import OutputEncoder, linear_to_ulaw, ulaw_to_linear

    t = np.arange(8000) / 8000
    pcm = np.round(0.3 * np.sin(2 * np.pi * 440 * t) * 32767).astype(np.int16)
    heard = ulaw_to_linear(linear_to_ulaw(pcm)).astype(np.float32) / 32768  # what the gateway decodes
    with connect(mesh.rest.replace("http://", "ws://") + f"/v1/realtime?model={MODEL}",
                 additional_headers=REALTIME_BETA, open_timeout=30) as ws:
        _until(ws, "session.created")
        ws.send(json.dumps({"type": "session.update", "session": {
            "instructions": INSTRUCTIONS, "voice": "ethan", "temperature": 0, "max_response_output_tokens": 8,
            "input_audio_format": "g711_ulaw", "output_audio_format": "g711_ulaw"}}))
        _until(ws, "session.updated")
        ws.send(json.dumps({"type": "input_audio_buffer.append",
                            "audio": base64.b64encode(linear_to_ulaw(pcm).tobytes()).decode()}))
        ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        _until(ws, "conversation.item.created")
        ws.send(json.dumps({"type": "response.create"}))
        events = _until(ws, "response.done")
    transcript = "".join(e["delta"] for e in events if e["type"] == "response.audio_transcript.delta")
    said = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "response.audio.delta")
    user_audio = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav_bytes(heard, 8000)).decode(),
                                                         "format": "wav"}}
    chat = httpx.post(f"{mesh.rest}/v1/chat/completions", timeout=TIMEOUT_S, json={
        "model": MODEL, "messages": [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": [user_audio]}],
        "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "wav"}, "temperature": 0,
        "max_tokens": 8}).json()
    message = chat["choices"][0]["message"]
    assert transcript == message["content"] and transcript
    with wave.open(io.BytesIO(base64.b64decode(message["audio"]["data"]))) as w:
        want = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.float32) / 32768
    encoder = OutputEncoder("g711_ulaw", 24_000)
    expected = np.frombuffer(encoder(want) + encoder.flush(), np.uint8)
    got = np.frombuffer(said, np.uint8)
    assert got.size == expected.size > 0
    # the chat's WAV and the realtime deltas differ by the vocoder's last-bit rounding (PCM16_TOLERANCE), which
    # moves a few samples across a mu-law step: nearly every code equal, the rest one step off
    diff = np.abs(ulaw_to_linear(got).astype(np.int32) - ulaw_to_linear(expected).astype(np.int32))
    assert np.mean(diff == 0) > 0.95 and diff.max() <= 256


def test_the_sdks_ga_client_gets_the_same_chat(mesh):
    """The openai SDK's GA Realtime client (client.realtime.connect): a spoken turn answers with the same text and
    audio as the chat completion of that conversation."""
    import openai

    clip = sine_wav(1.0, rate=24_000)
    with wave.open(io.BytesIO(clip)) as w:
        pcm = w.readframes(w.getnframes())
    client = openai.OpenAI(base_url=f"{mesh.rest}/v1", api_key="unused")
    with client.realtime.connect(model=MODEL) as conn:
        conn.session.update(session={"type": "realtime", "output_modalities": ["audio"],  # type: ignore[typeddict-unknown-key]
                                     "instructions": INSTRUCTIONS, "max_output_tokens": 8, "temperature": 0,
                                     "audio": {"output": {"voice": "ethan"}}})
        conn.input_audio_buffer.append(audio=base64.b64encode(pcm).decode())
        conn.input_audio_buffer.commit()
        conn.response.create()
        events = []
        for ev in conn:
            assert ev.type != "error", ev
            events.append(ev)
            if ev.type == "response.done":
                break
    transcript = "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta")
    audio = np.frombuffer(b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta"),
                          dtype="<i2").astype(np.int32)
    user_audio = {"type": "input_audio", "input_audio": {"data": base64.b64encode(clip).decode(), "format": "wav"}}
    chat = httpx.post(f"{mesh.rest}/v1/chat/completions", timeout=TIMEOUT_S, json={
        "model": MODEL, "messages": [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": [user_audio]}],
        "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "wav"}, "temperature": 0,
        "max_tokens": 8})
    assert chat.status_code == 200, chat.text
    message = chat.json()["choices"][0]["message"]
    assert transcript == message["content"] and transcript
    with wave.open(io.BytesIO(base64.b64decode(message["audio"]["data"]))) as w:
        want = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.int32)
    assert audio.shape == want.shape and audio.size > 0 and np.abs(audio - want).max() <= PCM16_TOLERANCE


def test_a_transcription_session_is_the_transcriptions_endpoint(mesh):
    """A GA transcription session ("type": "transcription"): a committed clip's transcript (its deltas too) is
    what /v1/audio/transcriptions answers for the same clip, and nothing answers it."""
    clip = sine_wav(1.0, rate=24_000)
    with wave.open(io.BytesIO(clip)) as w:
        pcm = w.readframes(w.getnframes())
    with connect(mesh.rest.replace("http://", "ws://") + f"/v1/realtime?model={MODEL}",
                 additional_headers=REALTIME_BETA, open_timeout=30) as ws:
        _until(ws, "session.created")
        ws.send(json.dumps({"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
            "format": {"type": "audio/pcm", "rate": 24000}, "transcription": {"model": MODEL, "language": "en"}}}}}))
        _until(ws, "session.updated")
        ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()}))
        ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        events = _until(ws, "conversation.item.input_audio_transcription.completed")
    deltas = "".join(e["delta"] for e in events if e["type"] == "conversation.item.input_audio_transcription.delta")
    assert not any(e["type"].startswith("response.") for e in events)
    r = httpx.post(f"{mesh.rest}/v1/audio/transcriptions", timeout=TIMEOUT_S,
                   data={"model": MODEL, "language": "en"}, files={"file": ("a.wav", clip, "audio/wav")})
    assert r.status_code == 200, r.text
    assert events[-1]["transcript"] == deltas == r.json()["text"] != ""


def test_a_picture_in_the_conversation_is_the_same_chat(mesh):
    """GA's input_image in a user item: the text answer is the chat's for the same picture and question."""
    from reference import png_bytes

    uri = "data:image/png;base64," + base64.b64encode(png_bytes(40, seed=905)).decode()
    with connect(mesh.rest.replace("http://", "ws://") + f"/v1/realtime?model={MODEL}",
                 additional_headers=REALTIME_BETA, open_timeout=30) as ws:
        _until(ws, "session.created")
        ws.send(json.dumps({"type": "session.update", "session": {"temperature": 0, "max_response_output_tokens": 8,
                                                                  "modalities": ["text"]}}))
        _until(ws, "session.updated")
        ws.send(json.dumps({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
            {"type": "input_image", "image_url": uri}, {"type": "input_text", "text": "What is in it?"}]}}))
        created = _until(ws, "conversation.item.created")[-1]
        assert created["item"]["content"][0] == {"type": "input_image"}
        ws.send(json.dumps({"type": "response.create"}))
        answer = "".join(e["delta"] for e in _until(ws, "response.done") if e["type"] == "response.text.delta")
    chat = httpx.post(f"{mesh.rest}/v1/chat/completions", timeout=TIMEOUT_S, json={
        "model": MODEL, "temperature": 0, "max_tokens": 8, "modalities": ["text"], "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": "What is in it?"}]}]}).json()
    assert answer == chat["choices"][0]["message"]["content"] and answer


def test_a_conversation_past_the_context_is_still_answered(mesh):
    """truncation through the real pipeline: user items summing to more than the thinker's 4096-token context
    are answered ("auto", the default) from a prompt that fits, the oldest left out (the items stay: the oldest
    is still retrievable); with "disabled" the same conversation fails with the prompt-length error."""
    with connect(mesh.rest.replace("http://", "ws://") + f"/v1/realtime?model={MODEL}",
                 additional_headers=REALTIME_BETA, open_timeout=30) as ws:
        _until(ws, "session.created")
        ws.send(json.dumps({"type": "session.update", "session": {
            "modalities": ["text"], "instructions": INSTRUCTIONS, "max_response_output_tokens": 4}}))
        _until(ws, "session.updated")
        ids = []
        for i in range(5):
            text = f"part {i}: " + "the sea was calm and the sky was clear " * 100  # ~1,000 tokens each
            ws.send(json.dumps({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}}))
            ids.append(_until(ws, "conversation.item.created")[-1]["item"]["id"])
        ws.send(json.dumps({"type": "response.create"}))
        done = _until(ws, "response.done")[-1]["response"]
        assert done["status"] == "incomplete" and done["status_details"]["reason"] == "max_output_tokens", done
        assert 2000 < done["usage"]["input_tokens"] <= 4096 - 4, done["usage"]  # cut, not emptied
        ws.send(json.dumps({"type": "conversation.item.retrieve", "item_id": ids[0]}))
        assert _until(ws, "conversation.item.retrieved")[-1]["item"]["id"] == ids[0]
        ws.send(json.dumps({"type": "session.update", "session": {"truncation": "disabled"}}))
        _until(ws, "session.updated")
        ws.send(json.dumps({"type": "response.create"}))
        events = []
        while not events or events[-1]["type"] != "response.done":
            events.append(json.loads(ws.recv(timeout=TIMEOUT_S)))
        assert events[-1]["response"]["status"] == "failed"
        assert any(e["type"] == "error" and "maximum context length" in e["error"]["message"] for e in events)
