"""Audio input that is not WAV (OpenAI's `input_audio` format "mp3"; any file FFmpeg reads through vLLM's
`audio_url` and the transcription upload), decoded in a child process (gateway/video_process.py, kind
"audio"): a FLAC gives the very samples its WAV gives, MP3 and Ogg Opus the same tone at 16 kHz mono; a
WAV sent through `audio_url` is still parsed in the gateway; garbage, a file without an audio stream and
one past the audio limit are 400 / 413 naming the field; each decode is counted by outcome on /metrics;
an MP3 transcribes through a real REST server."""

from __future__ import annotations

import asyncio
import base64
import multiprocessing
import struct

import httpx
import numpy as np
import pytest
from gateway_harness import RestServer, ScriptedPipeline

pytest.importorskip("av", reason="PyAV (the av package) decodes compressed audio; pip install av")

from gateway import video_process  # noqa: E402
from gateway.audio_encoding import compressed_bytes, wav_bytes  # noqa: E402
from gateway.events import AudioPart, PipelineError  # noqa: E402
from gateway.input_limits import InputLimits  # noqa: E402
from gateway.media import MediaLoader  # noqa: E402
from test_media_video import make_video  # noqa: E402

RATE = 22_050
TONE = (0.4 * np.sin(2 * np.pi * 330 * np.arange(RATE) / RATE)).astype(np.float32)  # 1 s


def loader(**limits: object) -> MediaLoader:
    return MediaLoader(InputLimits(**limits))  # type: ignore[arg-type]


def part(fmt: str, data: bytes, **limits: object) -> AudioPart:
    return asyncio.run(loader(**limits).audio_from_base64(base64.b64encode(data).decode(), fmt, "input_audio"))


def best_correlation(got: np.ndarray, want: np.ndarray, max_lag: int = 1200) -> float:
    n = min(got.size, want.size) - max_lag
    return max(float(np.corrcoef(got[lag:lag + n], want[:n])[0, 1]) for lag in range(max_lag))


def test_flac_gives_the_samples_its_wav_gives() -> None:
    wav = part("wav", wav_bytes(TONE, RATE))
    flac = part("flac", compressed_bytes(TONE, RATE, "flac"))
    assert flac.sample_rate == wav.sample_rate == 16_000
    np.testing.assert_allclose(flac.waveform, wav.waveform, atol=1e-4)
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("fmt", ["mp3", "opus"])
def test_lossy_files_give_the_same_tone(fmt: str) -> None:
    wav = part("wav", wav_bytes(TONE, RATE))
    got = part("mp3" if fmt == "mp3" else "ogg", compressed_bytes(TONE, RATE, fmt))  # the format names the file
    assert got.sample_rate == 16_000 and abs(got.waveform.size - wav.waveform.size) <= 0.06 * 16_000
    assert best_correlation(got.waveform, wav.waveform) > 0.99


def test_audio_url_takes_any_file_and_still_parses_wav_here() -> None:
    mp3 = compressed_bytes(TONE, RATE, "mp3")
    before = dict(video_process.AUDIO_METRICS.counts)
    got = asyncio.run(loader().audio_from_url("data:audio/mpeg;base64," + base64.b64encode(mp3).decode(), "audio_url.url"))
    assert got.sample_rate == 16_000 and got.waveform.size > 15_000
    wav = asyncio.run(loader().audio_from_url("data:audio/wav;base64," + base64.b64encode(wav_bytes(TONE, RATE)).decode(),
                                              "audio_url.url"))
    assert wav.waveform.size == 16_000
    assert video_process.AUDIO_METRICS.counts["ok"] == before["ok"] + 1  # the WAV never went to a child


def test_bad_audio_files_are_refused_naming_the_field() -> None:
    before = dict(video_process.AUDIO_METRICS.counts)
    with pytest.raises(PipelineError, match="could not read the audio: .* send an audio file") as e:
        part("mp3", b"ID3 this is no mp3 at all" * 10)
    assert e.value.http_status == 400 and e.value.param == "input_audio"
    with pytest.raises(PipelineError, match="holds no audio stream"):
        part("webm", make_video(6, 4, fmt="webm", codec="libvpx"))
    with pytest.raises(PipelineError, match="longer than 0.5 s, the audio limit") as e:
        part("mp3", compressed_bytes(TONE, RATE, "mp3"), max_audio_seconds=0.5)
    assert e.value.http_status == 413
    assert video_process.AUDIO_METRICS.counts["refused"] == before["refused"] + 3
    with pytest.raises(PipelineError, match="not a WAV file"):  # "wav" says what it is: parsed as such
        part("wav", compressed_bytes(TONE, RATE, "mp3"))
    # a WAV whose format tag no decoder knows (99): FFmpeg opens it without a codec; was a decoder bug (400
    # "the audio decoder failed on this file (AttributeError)", counted as one)
    data = np.zeros(1600, "<i2").tobytes()
    odd = (b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 99, 1, 16_000,
                                                                                 32_000, 2, 16)
           + b"data" + struct.pack("<I", len(data)) + data)
    bugs = video_process.AUDIO_METRICS.counts["bug"]
    with pytest.raises(PipelineError, match="no decoder for the codec of the audio in this wav file") as e:
        part("wav", odd)
    assert e.value.http_status == 400 and video_process.AUDIO_METRICS.counts["bug"] == bugs


def test_an_mp3_transcribes_and_metrics_show_the_audio_decodes() -> None:
    from gateway.rest import create_app

    pipeline = ScriptedPipeline()
    with RestServer(create_app(pipeline, served_model_names=("tiny-omni",))) as server:
        r = httpx.post(f"{server.base_url}/v1/audio/transcriptions", data={"model": "tiny-omni"},
                       files={"file": ("speech.mp3", compressed_bytes(TONE, RATE, "mp3"), "audio/mpeg")}, timeout=30)
        assert r.status_code == 200, r.text
        audio = pipeline.requests[-1].messages[0].content[0]
        assert isinstance(audio, AudioPart) and audio.sample_rate == 16_000 and audio.waveform.size > 15_000
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    assert 'omnimesh:audio_decodes_total{outcome="ok"}' in metrics and "omnimesh:audio_decode_seconds_count" in metrics


def test_grpc_takes_any_audio_file(grpc_server, pipeline: ScriptedPipeline) -> None:  # type: ignore[no-untyped-def]
    import grpc

    from omnimesh.v1 import omni_pb2, omni_pb2_grpc

    msg = omni_pb2.ChatMessage(role="user", content=[omni_pb2.ContentPart(audio=compressed_bytes(TONE, RATE, "flac")),
                                                     omni_pb2.ContentPart(audio=wav_bytes(TONE, RATE))])
    with grpc.insecure_channel(grpc_server.target) as channel:
        out = list(omni_pb2_grpc.OmniStub(channel).Generate(omni_pb2.GenerateRequest(messages=[msg], modalities=["text"]),
                                                              timeout=30))
    assert out[-1].WhichOneof("kind") == "done"
    flac, wav = pipeline.requests[-1].messages[0].content
    assert isinstance(flac, AudioPart) and isinstance(wav, AudioPart)
    np.testing.assert_allclose(flac.waveform, wav.waveform, atol=1e-4)
    bad = omni_pb2.ChatMessage(role="user", content=[omni_pb2.ContentPart(audio=b"nothing audible")])
    with grpc.insecure_channel(grpc_server.target) as channel:
        out = list(omni_pb2_grpc.OmniStub(channel).Generate(omni_pb2.GenerateRequest(messages=[bad]), timeout=30))
    assert [r.WhichOneof("kind") for r in out] == ["error"]  # errors travel in the stream
    assert out[0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "messages[0].content[0].audio: could not read the audio" in out[0].error.message
