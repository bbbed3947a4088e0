"""The Realtime API's G.711 formats (gateway/realtime_audio.py): mu-law and A-law equal CPython's `audioop` on
every 16-bit value and every code; the 24 -> 8 kHz decimation passes speech frequencies, stops what would
alias, and streamed in any cut equals the whole answer encoded at once; and a session with g711 in and out
(its committed clip at 8 kHz, server_vad on 8 kHz audio, the answer's deltas equal to encoding the pipeline's
pcm whole, the format refused while audio is buffered, unknown formats as error events)."""

from __future__ import annotations

import base64
import warnings

import numpy as np
import pytest
from gateway_harness import RestServer, ScriptedPipeline, tone
from test_realtime import BETA, recv, send, speech, until, url
from websockets.sync.client import connect

from gateway.events import AudioPart
from gateway.media import resample
from gateway.realtime_audio import (OutputEncoder, alaw_to_linear, decode, linear_to_alaw, linear_to_ulaw,
                                    ulaw_to_linear)

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    audioop = pytest.importorskip("audioop")  # CPython <= 3.12: the reference codecs


def test_codecs_equal_audioop() -> None:
    pcm = np.arange(-32768, 32768, dtype=np.int16)
    raw = pcm.astype("<i2").tobytes()
    assert linear_to_ulaw(pcm).tobytes() == audioop.lin2ulaw(raw, 2)
    assert linear_to_alaw(pcm).tobytes() == audioop.lin2alaw(raw, 2)
    codes = np.arange(256, dtype=np.uint8)
    assert ulaw_to_linear(codes).astype("<i2").tobytes() == audioop.ulaw2lin(codes.tobytes(), 2)
    assert alaw_to_linear(codes).astype("<i2").tobytes() == audioop.alaw2lin(codes.tobytes(), 2)


def _amplitude(y: np.ndarray, freq: float, rate: int) -> float:
    t = np.arange(y.size) / rate
    return float(2 * abs(np.dot(y, np.exp(-2j * np.pi * freq * t))) / y.size)


@pytest.mark.parametrize("fmt", ["g711_ulaw", "g711_alaw"])
def test_streamed_decimation_equals_the_whole_and_stops_aliases(fmt: str) -> None:
    t = np.arange(24_000) / 24_000
    x = (0.4 * np.sin(2 * np.pi * 1000 * t) + 0.3 * np.sin(2 * np.pi * 5000 * t)).astype(np.float32)
    whole = OutputEncoder(fmt, 24_000)
    want = whole(x) + whole.flush()
    cuts = np.sort(np.random.default_rng(0).choice(np.arange(1, 24_000), 40, replace=False))
    streamed = OutputEncoder(fmt, 24_000)
    got = b"".join(streamed(piece) for piece in np.split(x, cuts)) + streamed.flush()
    assert got == want and len(want) == -(-(24_000 + 31) // 3)  # every third sample of the signal and its tail
    y = decode(base64.b64encode(want).decode(), fmt, "x")[100:8000]
    assert abs(_amplitude(y, 1000, 8000) - 0.4) < 0.02  # the passband keeps the 1 kHz tone
    assert _amplitude(y, 3000, 8000) < 0.01  # 5 kHz, above the new Nyquist, would fold onto 3 kHz: filtered out
    with pytest.raises(ValueError, match="does not decimate to it by a whole factor"):
        OutputEncoder(fmt, 22_050)
    with pytest.raises(ValueError, match="pcm16 output is 24000 Hz"):
        OutputEncoder("pcm16", 16_000)


def _g711(samples: np.ndarray, fmt: str) -> str:
    pcm = np.clip(np.round(samples * 32768), -32768, 32767).astype(np.int16)
    return base64.b64encode((linear_to_ulaw(pcm) if fmt == "g711_ulaw" else linear_to_alaw(pcm)).tobytes()).decode()


@pytest.mark.parametrize("fmt", ["g711_ulaw", "g711_alaw"])
def test_a_telephone_session(rest_server: RestServer, pipeline: ScriptedPipeline, fmt: str) -> None:
    with connect(url(rest_server), additional_headers=BETA, open_timeout=10) as ws:
        recv(ws)
        send(ws, type="session.update", session={"input_audio_format": fmt, "output_audio_format": fmt})
        session = recv(ws)["session"]
        assert (session["input_audio_format"], session["output_audio_format"]) == (fmt, fmt)
        clip = tone(0.3, rate=8000)
        send(ws, type="input_audio_buffer.append", audio=_g711(clip, fmt))
        send(ws, type="session.update", session={"input_audio_format": "pcm16"})  # audio is buffered
        error = recv(ws)
        assert error["type"] == "error" and error["error"]["param"] == "session.input_audio_format"
        assert "commit or clear it first" in error["error"]["message"]
        send(ws, type="input_audio_buffer.commit")
        until(ws, "conversation.item.created")
        send(ws, type="response.create")
        events = until(ws, "response.done")
        [req] = pipeline.requests
        (heard,) = req.messages[-1].content
        assert isinstance(heard, AudioPart) and heard.sample_rate == 8000 and heard.waveform.size == clip.size
        assert np.abs(heard.waveform - clip).max() < 0.02  # G.711's quantization
        said = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "response.audio.delta")
        whole = OutputEncoder(fmt, 24_000)
        pcm = tone(0.2)  # what the scripted pipeline says, in two deltas
        assert said == whole(pcm) + whole.flush()
        send(ws, type="session.update", session={"output_audio_format": "opus"})
        assert recv(ws)["error"]["param"] == "session.output_audio_format"


def test_server_vad_hears_8_khz(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    """The sentence as a telephone sends it (8 kHz mu-law) between silences is one turn."""
    sentence = resample(speech(), 24_000, 8000)
    audio = np.concatenate([np.zeros(4000, np.float32), sentence, np.zeros(8000, np.float32)])
    with connect(url(rest_server), additional_headers=BETA, open_timeout=10) as ws:
        recv(ws)
        send(ws, type="session.update", session={"input_audio_format": "g711_ulaw", "turn_detection": {
            "type": "server_vad", "create_response": False}})
        recv(ws)
        for start in range(0, audio.size, 1600):  # 0.2 s chunks
            send(ws, type="input_audio_buffer.append", audio=_g711(audio[start:start + 1600], "g711_ulaw"))
        events = until(ws, "input_audio_buffer.committed")
        kinds = [e["type"] for e in events]
        assert "input_audio_buffer.speech_started" in kinds and "input_audio_buffer.speech_stopped" in kinds
        started = next(e for e in events if e["type"] == "input_audio_buffer.speech_started")
        assert 300 <= started["audio_start_ms"] <= 700  # the sentence starts at 0.5 s
