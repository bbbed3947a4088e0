"""A Qwen2.5-Omni checkpoint served by `omnimesh serve`: text and speech out, through all four stages.

The tiny Qwen2.5-Omni folder (`omnimesh make-tiny --family qwen2.5-omni`, laid out like Qwen2.5-Omni-7B:
`thinker.audio_tower.*`, `thinker.visual.*`, `thinker.model.*`, `talker.*`, `token2wav.*`, spk_dict.pt) is served
with the encoder and the thinker split over two pipeline ranks each, the talker and the vocoder (token2wav's DiT
layers) over two tensor-parallel ranks each (gloo). Against `transformers` on the same folder (tests/e2e/reference_qwen2_5.py):

- greedy text equals the thinker's `generate` token for token with each token's logprob within 2e-5, for a text
  prompt, one with an audio clip and an image, and one with a 6 s video whose soundtrack interleaves with its
  frames in 2 s chunks (`use_audio_in_video`: where Qwen2.5-Omni's placeholder layout and M-RoPE index differ
  from Qwen3-Omni's; the random tiny weights barely feel positions, so the logprobs are what tells), whole
  and streamed;
- speech (`modalities: ["text", "audio"]`) equals transformers' talker stepped greedily and its token2wav under
  the same seed: the codes' count, and the WAV's samples within 4 LSB of pcm16, for a text prompt and for one
  with an audio clip and an image; a request's `seed` changes only the token2wav noise; streamed, the audio
  arrives whole at the end (this token2wav is not streamed yet);
- 8 requests at once (continuous batching, mixed media, some speaking) each equal their own reference;
- the stages report the family and their layouts; voices are the checkpoint's speakers, Chelsie first (the
  default voice of its `generate`), and `/v1/audio/speech` speaks with them; a Realtime spoken turn answers with
  the text and audio of the same conversation sent as a chat completion.
"""

from __future__ import annotations

import base64
import io
import json
import wave
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import torch
from mesh_harness import REALTIME_BETA, Mesh, start_mesh
from reference import chat_request, mp4_bytes, openai_content, png_bytes, sine_wav
from reference_qwen2_5 import Qwen2_5Reference

from omnimesh.models.qwen2_5_omni.tiny import build_tiny_qwen2_5_omni
from omnimesh.v1 import stage_pb2, stage_pb2_grpc

NAME = "tiny-qwen2.5-omni"
MAX_TOKENS = 12
TALKER_MAX = 40
LOGPROB_TOL = 2e-5  # nats: the mesh's fused CPU kernels against transformers' modules
PROMPTS = ["Tell me about the sea.", "What do you hear and see?", "Count to ten.", "Describe a forest."]
MEDIA = ("text", "audio+image", "video+sound")
SPEAK = {"modalities": ["text", "audio"], "stage_params": {"talker": {"temperature": 0, "max_tokens": TALKER_MAX}}}


def _mp4() -> bytes:
    return mp4_bytes(n_frames=36, rate=6, sound=True)  # 6 s: 12 frames at 2 fps, 3 chunks of frames and sound


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen2_5_omni(tmp_path_factory.mktemp("q25") / NAME)


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[Mesh]:
    # the random talker never says its codec end: an operator default bounds what /v1/audio/speech gets
    overrides = {"encoder": {"pp": 2}, "thinker": {"pp": 2},
                 "talker": {"tp": 2, "default_sampling_params": {"max_tokens": 60}}, "vocoder": {"tp": 2}}
    # prefix caching on: every parity test below holds with it, and one of them (speech through the cache) needs it
    m = start_mesh(model_dir, "--served-model-name", NAME, "--stage-overrides", json.dumps(overrides),
                   "--enable-prefix-caching", "--enable-prompt-tokens-details")
    yield m
    assert m.proc.stop() == 0, m.proc.output()


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Qwen2_5Reference:
    return Qwen2_5Reference(model_dir)


def _request(model_dir: Path, prompt: str, media: str) -> Any:
    clip, image = (sine_wav(), png_bytes()) if media == "audio+image" else (None, None)
    video = _mp4() if media == "video+sound" else None
    return chat_request(prompt, clip, image, max_tokens=MAX_TOKENS, talker_max=TALKER_MAX, mp4=video,
                        model_dir=model_dir, use_audio_in_video=video is not None)


def _body(prompt: str, media: str, **extra: Any) -> dict[str, Any]:
    clip, image = (sine_wav(), png_bytes()) if media == "audio+image" else (None, None)
    video = _mp4() if media == "video+sound" else None
    body = {"model": NAME, "messages": [{"role": "user", "content": openai_content(prompt, clip, image, video)}],
            "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    if video is not None:
        body["mm_processor_kwargs"] = {"use_audio_in_video": True}
    return body


def _chat(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=180)


def _pcm(message: dict[str, Any]) -> np.ndarray:
    with wave.open(io.BytesIO(base64.b64decode(message["audio"]["data"]))) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")


def _pcm16(x: np.ndarray) -> np.ndarray:
    return np.round(np.clip(x, -1, 1) * 32767).astype(np.int16)


def test_the_four_stages_run_split_as_asked(served: Mesh) -> None:
    assert sorted(served.stages) == ["encoder", "talker", "thinker", "vocoder"]
    layouts = {"encoder": (2, 1), "thinker": (2, 1), "talker": (1, 2), "vocoder": (1, 2)}
    for stage, address in served.stages.items():
        with grpc.insecure_channel(address) as ch:
            info = stage_pb2_grpc.StageStub(ch).Info(stage_pb2.InfoRequest(), timeout=30)
        assert info.family == "qwen2.5-omni", (stage, info)
        assert (info.pipeline_parallel_size, info.tensor_parallel_size) == layouts[stage], stage
    voices = httpx.get(f"{served.rest}/v1/audio/voices", timeout=30).json()
    assert voices["voices"] == ["chelsie", "ethan"] and voices["default"] == "chelsie", voices


@pytest.mark.parametrize("media", MEDIA)
def test_text_equals_generate(served: Mesh, model_dir: Path, reference: Qwen2_5Reference, media: str) -> None:
    prompt = PROMPTS[0] if media == "text" else PROMPTS[1]
    want = reference.thinker(reference.prompts(_request(model_dir, prompt, media)), MAX_TOKENS)
    assert want.text, "the reference generated no text"
    got = _chat(served.rest, _body(prompt, media, logprobs=True))
    assert got.status_code == 200, got.text
    choice = got.json()["choices"][0]
    assert choice["message"]["content"] == want.text
    entries = [e["logprob"] for e in choice["logprobs"]["content"]]
    assert entries == pytest.approx(want.logprobs[:len(entries)], abs=LOGPROB_TOL)
    assert len(entries) >= len(want.logprobs) - 1
    deltas = []
    with httpx.stream("POST", f"{served.rest}/v1/chat/completions", json=_body(prompt, media, stream=True),
                      timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                deltas += [c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"]]
    assert "".join(deltas) == want.text


@pytest.mark.parametrize("media", ["text", "audio+image"])
def test_speech_equals_transformers(served: Mesh, model_dir: Path, reference: Qwen2_5Reference, media: str) -> None:
    prompt = PROMPTS[0] if media == "text" else PROMPTS[1]
    thinker, codes, wav = reference.speech(_request(model_dir, prompt, media), max_tokens=MAX_TOKENS,
                                           talker_max=TALKER_MAX, speaker="chelsie", seed=0)
    assert len(codes) >= 5 and float(wav.abs().max()) > 1e-2, "the reference should speak audibly"
    got = _chat(served.rest, _body(prompt, media, **SPEAK))
    assert got.status_code == 200, got.text
    message = got.json()["choices"][0]["message"]
    assert message["content"] == thinker.text and message["audio"]["transcript"] == thinker.text
    pcm = _pcm(message)
    assert pcm.shape == (len(codes) * 480,)
    assert np.abs(pcm.astype(np.int32) - _pcm16(wav.numpy())).max() <= 4  # within 1e-4 before quantising
    seeded = _chat(served.rest, _body(prompt, media, seed=7, **SPEAK)).json()["choices"][0]["message"]
    other = reference.waveform(codes, "chelsie", seed=7).numpy()
    assert seeded["content"] == thinker.text and np.abs(_pcm(seeded).astype(np.int32) - _pcm16(other)).max() <= 4
    assert not np.array_equal(_pcm(seeded), pcm)


def test_streamed_speech_arrives_whole_at_the_end(served: Mesh, model_dir: Path, reference: Qwen2_5Reference) -> None:
    thinker, codes, wav = reference.speech(_request(model_dir, PROMPTS[0], "text"), max_tokens=MAX_TOKENS,
                                           talker_max=TALKER_MAX, speaker="ethan", seed=0)
    body = _body(PROMPTS[0], "text", stream=True, audio={"voice": "ethan", "format": "pcm16"}, **SPEAK)
    text, audio = [], []
    with httpx.stream("POST", f"{served.rest}/v1/chat/completions", json=body, timeout=180) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    text.append(choice["delta"].get("content") or "")
                    if choice["delta"].get("audio", {}).get("data"):
                        audio.append(np.frombuffer(base64.b64decode(choice["delta"]["audio"]["data"]), dtype="<i2"))
    assert "".join(text) == thinker.text
    assert len(audio) == 1  # token2wav decodes the whole stream at its end
    assert np.abs(audio[0].astype(np.int32) - _pcm16(wav.numpy())).max() <= 4


def test_a_continued_assistant_message_is_spoken_from_its_start(served: Mesh, model_dir: Path,
                                                                reference: Qwen2_5Reference) -> None:
    """continue_final_message with speech: the thinker continues the client's start, and the talker speaks the
    start and then the continuation, exactly as transformers' talker speaks that whole message when its thinker
    writes it itself (the talker's prompt ending at the assistant's turn start, the start's rows the first
    reply rows: a causal thinker gives those rows the same hidden either way)."""
    from dataclasses import replace

    from gateway.events import ChatMessage, TemplateOptions, TextPart
    from reference_qwen2_5 import ThinkerOutput

    start = "The sea is"
    base = chat_request(PROMPTS[0], None, None, max_tokens=MAX_TOKENS, talker_max=TALKER_MAX)
    cont = replace(base, messages=(*base.messages, ChatMessage("assistant", (TextPart(start),))),
                   template=TemplateOptions(add_generation_prompt=False, continue_final_message=True))
    plain, full = reference.prompts(base), reference.prompts(cont)
    end = plain.input_ids.numel()
    assert full.input_ids.view(-1)[:end].tolist() == plain.input_ids.view(-1).tolist()
    lead = full.input_ids.view(-1)[end:].tolist()
    assert reference.tokenizer.decode(lead) == start
    thinker = reference.thinker(full, MAX_TOKENS)  # the continuation
    written = ThinkerOutput(text=thinker.text, generated=lead + thinker.generated, logprobs=[],
                            prompt_rows=thinker.prompt_rows[:end],
                            replies=[*thinker.prompt_rows[end:].unbind(0), *thinker.replies])
    codes = reference.codes(plain, written, "chelsie", TALKER_MAX)
    wav = reference.waveform(codes, "chelsie", seed=0)
    assert len(codes) >= 5 and float(wav.abs().max()) > 1e-2, "the reference should speak audibly"
    body = {"model": NAME, "messages": [{"role": "user", "content": PROMPTS[0]},
                                        {"role": "assistant", "content": start}],
            "add_generation_prompt": False, "continue_final_message": True, "max_tokens": MAX_TOKENS,
            "temperature": 0, **SPEAK}
    got = _chat(served.rest, body)
    assert got.status_code == 200, got.text
    message = got.json()["choices"][0]["message"]
    assert message["content"] == thinker.text and message["audio"]["transcript"] == start + thinker.text
    pcm = _pcm(message)
    assert pcm.shape == (len(codes) * 480,)
    assert np.abs(pcm.astype(np.int32) - _pcm16(wav.numpy())).max() <= 4
    # not what the continuation alone would say: the start is spoken
    alone = reference.codes(full, thinker, "chelsie", TALKER_MAX)
    assert alone != codes


def test_speech_through_the_prefix_cache_equals_transformers(served: Mesh, reference: Qwen2_5Reference) -> None:
    """`--enable-prefix-caching`: spoken answers that share a long system prompt; the second one's prompt comes
    from the cache (its talker reads every prompt row's final hidden, which the blocks of a speech request keep)
    and both equal transformers' talker and token2wav on the request, within 4 LSB of pcm16 (through the pp = 2
    thinker and the tp = 2 talker and vocoder)."""
    from dataclasses import replace

    from gateway.events import ChatMessage, TextPart

    system = ("You are a careful assistant for sailors. Answer in short plain sentences, name the sources you "
              "use, and say so when you do not know. Never guess a tide table or a weather report.")
    for question, cached in ((PROMPTS[0], False), (PROMPTS[0], True), (PROMPTS[2], True)):
        req = chat_request(question, None, None, max_tokens=MAX_TOKENS, talker_max=TALKER_MAX)
        req = replace(req, messages=(ChatMessage("system", (TextPart(system),)), *req.messages))
        thinker, codes, wav = reference.speech(req, max_tokens=MAX_TOKENS, talker_max=TALKER_MAX,
                                               speaker="chelsie", seed=0)
        body = {"model": NAME, "messages": [{"role": "system", "content": system},
                                            {"role": "user", "content": question}],
                "max_tokens": MAX_TOKENS, "temperature": 0, **SPEAK}
        got = _chat(served.rest, body)
        assert got.status_code == 200, got.text
        answer = got.json()
        hits = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert (hits >= 16) == cached, (question, hits)
        message = answer["choices"][0]["message"]
        assert message["content"] == thinker.text
        pcm = _pcm(message)
        assert len(codes) >= 5 and pcm.shape == (len(codes) * 480,), (question, len(codes))
        assert np.abs(pcm.astype(np.int32) - _pcm16(wav.numpy())).max() <= 4


def test_concurrent_requests_each_equal_their_reference(served: Mesh, model_dir: Path,
                                                        reference: Qwen2_5Reference) -> None:
    cases = [(p, MEDIA[i % 3], i % 2 == 0) for i, p in enumerate(PROMPTS * 2)]  # 4 speak: token2wav batches
    want = [reference.speech(_request(model_dir, p, m), max_tokens=MAX_TOKENS, talker_max=TALKER_MAX,
                             speaker="chelsie", seed=0) if speak else
            (reference.thinker(reference.prompts(_request(model_dir, p, m)), MAX_TOKENS), None, None)
            for p, m, speak in cases]
    with ThreadPoolExecutor(len(cases)) as pool:
        got = list(pool.map(lambda c: _chat(served.rest, _body(c[0], c[1], **(SPEAK if c[2] else {}))), cases))
    for (thinker, codes, wav), response in zip(want, got):
        message = response.json()["choices"][0]["message"]
        assert message["content"] == thinker.text
        if wav is not None:  # (the random talker may stop at once: no codes, no samples, on both sides)
            assert _pcm(message).shape == wav.shape
            assert np.abs(_pcm(message).astype(np.int32) - _pcm16(wav.numpy())).max(initial=0) <= 4
    assert sum(wav is not None and wav.numel() > 0 for _, _, wav in want) >= 3  # several decode in one step


def test_a_realtime_spoken_turn_is_the_same_chat(served: Mesh) -> None:
    from websockets.sync.client import connect

    clip = sine_wav(1.0, rate=24_000)
    with wave.open(io.BytesIO(clip)) as w:
        pcm = w.readframes(w.getnframes())
    with connect(served.rest.replace("http://", "ws://") + f"/v1/realtime?model={NAME}",
                 additional_headers=REALTIME_BETA, open_timeout=30) as ws:
        def until(kind: str) -> list[dict]:
            out: list[dict] = []
            while not out or out[-1]["type"] != kind:
                out.append(json.loads(ws.recv(timeout=120)))
                assert out[-1]["type"] != "error", out[-1]
            return out

        until("session.created")
        ws.send(json.dumps({"type": "session.update", "session": {"temperature": 0, "max_response_output_tokens": 8}}))
        until("session.updated")
        ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()}))
        ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        until("conversation.item.created")
        ws.send(json.dumps({"type": "response.create"}))
        events = until("response.done")
    transcript = "".join(e["delta"] for e in events if e["type"] == "response.audio_transcript.delta")
    audio = np.frombuffer(b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "response.audio.delta"),
                          dtype="<i2")
    user = {"type": "input_audio", "input_audio": {"data": base64.b64encode(clip).decode(), "format": "wav"}}
    chat = _chat(served.rest, {"model": NAME, "messages": [{"role": "user", "content": [user]}], "temperature": 0,
                               "max_tokens": 8, "modalities": ["text", "audio"]}).json()["choices"][0]["message"]
    assert transcript == chat["content"] and transcript
    want = _pcm(chat)  # the talker's operator default (60 codes) bounds both
    assert audio.shape == want.shape == (60 * 480,)
    assert np.abs(audio.astype(np.int32) - want.astype(np.int32)).max() <= 4


def test_the_speech_endpoint_speaks(served: Mesh) -> None:
    r = httpx.post(f"{served.rest}/v1/audio/speech", json={"model": NAME, "input": "Hello there.", "voice": "ethan",
                                                           "response_format": "wav"}, timeout=180)
    assert r.status_code == 200, r.text
    with wave.open(io.BytesIO(r.content)) as w:
        assert w.getframerate() == 24000 and w.getnframes() == 60 * 480  # the talker's operator default: 60 codes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_it_speaks_on_cuda(model_dir: Path) -> None:
    """`--device cuda` (bf16): the towers and token2wav on the stage's GPU, the thinker and talker ranks on NCCL;
    a spoken answer comes back whole (no parity: bf16 rounds differently from the float32 reference)."""
    m = start_mesh(model_dir, "--served-model-name", NAME, "--device", "cuda")
    try:
        with ThreadPoolExecutor(3) as pool:  # at once: token2wav's batched DiT and BigVGAN on the GPU
            answers = list(pool.map(lambda p: _chat(m.rest, _body(p, "audio+image", **SPEAK)), PROMPTS[:3]))
        for got in answers:
            assert got.status_code == 200, got.text
            message = got.json()["choices"][0]["message"]
            assert message["content"] and _pcm(message).size % 480 == 0 and _pcm(message).size > 0
    finally:
        assert m.proc.stop() == 0, m.proc.output()
