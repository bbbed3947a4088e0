"""`POST /v1/audio/speech` through the shared mesh: the thinker says exactly the input (the same chat, sent as a
chat completion with the route's system turn and a one-string choice, answers the input as its text), and the
speech file is that chat's audio; the raw `pcm` stream carries the same samples, and at `speed` 1.5 a third fewer; the default mp3, streamed as it is encoded, is as long. Gateway-level shapes and
errors: tests/gateway/test_speech.py."""

from __future__ import annotations

import base64
import io
import wave

import httpx
import numpy as np

from gateway.speech_api import SYSTEM

MODEL = "tiny-qwen3-omni"
TIMEOUT_S = 120.0
PCM16_TOLERANCE = 4  # as test_api_e2e.py: the vocoder's chunking may round the last bits differently
SAID = 'Tides turn twice a day — "slowly", then fast.'


def _samples(wav_bytes: bytes) -> np.ndarray:
    with wave.open(io.BytesIO(wav_bytes)) as w:
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.int32)


def test_speech_is_the_chat_that_says_the_input(mesh):
    r = httpx.post(f"{mesh.rest}/v1/audio/speech", timeout=TIMEOUT_S,
                   json={"model": MODEL, "input": SAID, "voice": "ethan", "response_format": "wav"})
    assert r.status_code == 200, r.text
    spoken = _samples(r.content)
    chat = httpx.post(f"{mesh.rest}/v1/chat/completions", timeout=TIMEOUT_S, json={
        "model": MODEL, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": SAID}],
        "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "wav"}, "temperature": 0,
        "structured_outputs": {"choice": [SAID]}}).json()
    message = chat["choices"][0]["message"]
    assert message["content"] == SAID  # the thinker said exactly the input
    want = _samples(base64.b64decode(message["audio"]["data"]))
    assert spoken.shape == want.shape and spoken.size > 0
    assert np.abs(spoken - want).max() <= PCM16_TOLERANCE
    with httpx.stream("POST", f"{mesh.rest}/v1/audio/speech", timeout=TIMEOUT_S,
                      json={"model": MODEL, "input": SAID, "voice": "ethan", "response_format": "pcm"}) as s:
        assert s.status_code == 200
        raw = np.frombuffer(b"".join(s.iter_bytes()), dtype="<i2").astype(np.int32)
    assert raw.shape == spoken.shape and np.abs(raw - spoken).max() <= PCM16_TOLERANCE
    # speed 1.5: the same speech a third shorter (gateway/audio_tempo.py), streamed as it comes
    with httpx.stream("POST", f"{mesh.rest}/v1/audio/speech", timeout=TIMEOUT_S, json={
            "model": MODEL, "input": SAID, "voice": "ethan", "response_format": "pcm", "speed": 1.5}) as s:
        assert s.status_code == 200
        fast = np.frombuffer(b"".join(s.iter_bytes()), dtype="<i2")
    assert abs(fast.size - spoken.size / 1.5) <= 0.03 * spoken.size / 1.5 + 512
    # mp3, OpenAI's default: streamed as it is encoded (gateway/audio_file_stream.py), the same speech
    import av

    r = httpx.post(f"{mesh.rest}/v1/audio/speech", timeout=TIMEOUT_S, json={"model": MODEL, "input": SAID})
    assert r.status_code == 200 and r.headers["content-type"] == "audio/mpeg"
    with av.open(io.BytesIO(r.content)) as container:
        decoded = sum(f.samples for f in container.decode(audio=0))
    assert abs(decoded - spoken.size) <= 0.1 * 24000  # + the encoder's delay, which a streamed mp3 keeps
