"""Parity: the mesh's greedy output equals `Qwen3OmniMoeForConditionalGeneration.generate` on the same
folder — text token for token, waveform within 1e-4 — with and without async chunking, for a text
prompt and for a prompt with an audio clip and an image.

The float waveform is read through the gateway's own `StagePipeline` (the chain the REST API runs),
pointed at the running mesh's stages; the REST API itself is checked against the same reference
after pcm16 quantisation."""

from __future__ import annotations

import asyncio
import base64
import io
import wave

import httpx
import numpy as np
import pytest
from reference import chat_request, mp4_bytes, openai_content, png_bytes, sine_wav

from gateway.events import AudioDelta, Finished, TextDelta
from gateway.pipeline import StagePipeline
from gateway.prompt import PromptBuilder
from omnimesh.transport.stage_client import StageClient

MAX_TOKENS = 12
TALKER_MAX = 40

CASES = {
    "text": ("Tell me about the sea.", False, False),
    "audio+image": ("What do you hear and see?", True, True),
}


def run_pipeline(mesh, model_dir, request, async_chunk: bool):
    async def go():
        clients = {name: StageClient(name, addr) for name, addr in mesh.stages.items()}
        pipe = StagePipeline(clients, PromptBuilder(model_dir, max_model_len=4096), served_models=("tiny",),
                             async_chunk=async_chunk)
        await pipe.connect(timeout_s=30)
        text, audio, finished = [], [], None
        async for ev in pipe.run(request):
            if isinstance(ev, TextDelta):
                text.append(ev.text)
            elif isinstance(ev, AudioDelta):
                audio.append(ev.pcm)
            elif isinstance(ev, Finished):
                finished = ev
        for c in clients.values():
            await c.close()
        return "".join(text), np.concatenate(audio) if audio else np.zeros(0, np.float32), finished

    return asyncio.run(go())


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("async_chunk", [True, False], ids=["async-chunk", "no-async-chunk"])
def test_mesh_equals_generate(mesh, tiny_model_dir, reference, case, async_chunk):
    text, with_audio, with_image = CASES[case]
    wav = sine_wav() if with_audio else None
    png = png_bytes() if with_image else None
    req = chat_request(text, wav, png, max_tokens=MAX_TOKENS, talker_max=TALKER_MAX)
    ref = reference.generate(req, max_tokens=MAX_TOKENS, talker_max=TALKER_MAX)
    got_text, got_audio, finished = run_pipeline(mesh, tiny_model_dir, req, async_chunk)
    assert got_text == ref.text
    assert finished.completion_tokens == len(ref.token_ids)
    assert ref.audio.size > 0 and np.abs(ref.audio).max() > 1e-2, "reference audio should be audible"
    assert got_audio.shape == ref.audio.shape
    np.testing.assert_allclose(got_audio, ref.audio, atol=1e-4, rtol=0)


CONCURRENT_PROMPTS = ["Tell me about the sea.", "What is 2+2?", "Count to ten.", "Describe a forest.",
                      "Why is the sky blue?", "Explain gravity.", "Read me a poem.", "Who are you?",
                      "Name a color.", "Sing a song.", "What is rain?", "Say hello.", "What do you hear and see?",
                      "Tell a joke.", "What time is it?", "Describe the moon."]


def test_sixteen_concurrent_requests_equal_generate(mesh, tiny_model_dir, reference):
    """Continuous batching on: 16 requests in flight at once (text, and some with an audio clip and an
    image) each give exactly their own `generate` output — tokens equal, audio within 1e-4."""
    import dataclasses

    wav, png = sine_wav(), png_bytes()
    reqs = [dataclasses.replace(chat_request(text, wav if i % 4 == 0 else None, png if i % 4 == 0 else None,
                                             max_tokens=MAX_TOKENS, talker_max=TALKER_MAX), request_id=f"c{i}")
            for i, text in enumerate(CONCURRENT_PROMPTS)]
    refs = [reference.generate(r, max_tokens=MAX_TOKENS, talker_max=TALKER_MAX) for r in reqs]

    async def all_at_once():
        return await asyncio.gather(*(asyncio.to_thread(run_pipeline, mesh, tiny_model_dir, r, True) for r in reqs))

    results = asyncio.run(all_at_once())
    for req, ref, (got_text, got_audio, finished) in zip(reqs, refs, results):
        assert got_text == ref.text, req.request_id
        assert finished.completion_tokens == len(ref.token_ids), req.request_id
        assert got_audio.shape == ref.audio.shape, req.request_id
        np.testing.assert_allclose(got_audio, ref.audio, atol=1e-4, rtol=0, err_msg=req.request_id)


def test_text_only_stops_at_the_thinker(mesh, tiny_model_dir, reference):
    req = chat_request("Just text, please.", None, None, max_tokens=MAX_TOKENS, talker_max=TALKER_MAX,
                       modalities=("text",))
    ref = reference.generate(req, max_tokens=MAX_TOKENS, talker_max=TALKER_MAX, audio=False)
    got_text, got_audio, _ = run_pipeline(mesh, tiny_model_dir, req, True)
    assert got_text == ref.text and got_audio.size == 0


def _rest_body(text: str, wav: bytes | None, png: bytes | None, stream: bool, mp4: bytes | None = None) -> dict:
    return {
        "model": "tiny-qwen3-omni",
        "messages": [{"role": "user", "content": openai_content(text, wav, png, mp4)}],
        "modalities": ["text", "audio"],
        "audio": {"voice": "ethan", "format": "wav"},
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": stream,
        "stage_params": {"talker": {"max_tokens": TALKER_MAX}},
    }


def _pcm16(x: np.ndarray) -> np.ndarray:
    return np.round(np.clip(x, -1, 1) * 32767).astype(np.int16)


@pytest.mark.parametrize("video", ["", "video", "video+sound"])
def test_rest_non_streaming_matches_reference(mesh, tiny_model_dir, reference, video):
    """The REST API end to end, with an audio clip and an image; with a `video_url` MP4 the gateway decodes
    and samples it (PyAV), the encoder runs its frames through the vision tower beside the image, the
    thinker and talker position them; with `use_audio_in_video` its soundtrack is decoded too and
    interleaved with the frames in time (`generate(use_audio_in_video=True)` on the same inputs)."""
    sound = video == "video+sound"
    wav, png, mp4 = sine_wav(), png_bytes(), mp4_bytes(sound=sound) if video else None
    req = chat_request("What do you hear and see?", wav, png, max_tokens=MAX_TOKENS, talker_max=TALKER_MAX,
                       mp4=mp4, model_dir=tiny_model_dir, use_audio_in_video=sound)
    ref = reference.generate(req, max_tokens=MAX_TOKENS, talker_max=TALKER_MAX)
    body = _rest_body("What do you hear and see?", wav, png, False, mp4)
    if sound:
        body["mm_processor_kwargs"] = {"use_audio_in_video": True}
    r = httpx.post(f"{mesh.rest}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert msg["content"] == ref.text and msg["audio"]["transcript"] == ref.text
    with wave.open(io.BytesIO(base64.b64decode(msg["audio"]["data"]))) as w:
        assert w.getframerate() == 24000 and w.getnchannels() == 1 and w.getsampwidth() == 2
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    assert pcm.shape == ref.audio.shape
    # within 1e-4 before quantisation -> at most 4 LSB after it
    assert np.abs(pcm.astype(np.int32) - _pcm16(ref.audio)).max() <= 4


def test_rest_streaming_matches_reference(mesh, reference):
    req = chat_request("Tell me about the sea.", None, None, max_tokens=MAX_TOKENS, talker_max=TALKER_MAX)
    ref = reference.generate(req, max_tokens=MAX_TOKENS, talker_max=TALKER_MAX)
    text, chunks = [], []
    with httpx.stream("POST", f"{mesh.rest}/v1/chat/completions", json=_rest_body("Tell me about the sea.", None, None, True), timeout=120) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    import json

    for line in lines[:-1]:
        delta = json.loads(line[6:])["choices"][0]["delta"]
        text.append(delta.get("content") or "")
        if (delta.get("audio") or {}).get("data"):  # (the transcript comes in audio deltas of its own)
            chunks.append(np.frombuffer(base64.b64decode(delta["audio"]["data"]), dtype="<i2"))
    assert "".join(text) == ref.text
    assert len(chunks) >= 2, "audio must stream in several chunks (vocoder window 25 codes, 39 codes here)"
    pcm = np.concatenate(chunks)
    assert pcm.shape == ref.audio.shape
    assert np.abs(pcm.astype(np.int32) - _pcm16(ref.audio)).max() <= 4
