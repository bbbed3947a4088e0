"""A Qwen2.5-Omni checkpoint served by `omnimesh serve`: text out, through the encoder and thinker stages.

The tiny Qwen2.5-Omni folder (`omnimesh make-tiny --family qwen2.5-omni`, laid out like Qwen2.5-Omni-7B:
`thinker.audio_tower.*`, `thinker.visual.*`, `thinker.model.*`, talker, token2wav, spk_dict.pt) is served with
the thinker split over two pipeline ranks (gloo), the encoder on one rank:

- the launcher starts the encoder and thinker only and says why; `omnimesh stage talker` on it exits 2;
- greedy text equals `Qwen2_5OmniThinkerForConditionalGeneration.generate` on the same folder token for token,
  for a text prompt, one with an audio clip and an image, and one with a 6 s video whose soundtrack interleaves
  with its frames in 2 s chunks (`use_audio_in_video`: where Qwen2.5-Omni's placeholder layout and M-RoPE index
  differ from Qwen3-Omni's), whole and streamed, and each token's log-probability within 2e-5 of `generate`'s
  (the random tiny weights barely feel positions: Qwen3-Omni's index on the video prompt gives the same text
  but log-probabilities ~1e-4 off);
- 8 requests at once (continuous batching, mixed text and media) each equal their own `generate`;
- speech is a 400 naming the checkpoint; the stages report the family.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import torch
from mesh_harness import Mesh, refused_stage, start_mesh
from reference import chat_request, mp4_bytes, openai_content, png_bytes, sine_wav

from gateway.prompt import PromptBuilder
from omnimesh.models.qwen2_5_omni.tiny import build_tiny_qwen2_5_omni
from omnimesh.models.qwen2_5_omni.tiny_config import SPECIAL_TOKENS
from omnimesh.v1 import stage_pb2, stage_pb2_grpc

NAME = "tiny-qwen2.5-omni"
LOGPROB_TOL = 2e-5  # nats; the mesh's Qwen2.5 layers run op by op (no fused kernel: q/k/v biases)
MAX_TOKENS = 12
PROMPTS = ["Tell me about the sea.", "What do you hear and see?", "Count to ten.", "Describe a forest."]
MEDIA = ("text", "audio+image", "video+sound")


def _mp4() -> bytes:
    return mp4_bytes(n_frames=36, rate=6, sound=True)  # 6 s: 12 frames at 2 fps, 3 chunks of frames and sound


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen2_5_omni(tmp_path_factory.mktemp("q25") / NAME)


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[Mesh]:
    m = start_mesh(model_dir, "--served-model-name", NAME, "--stage-overrides", '{"thinker": {"pp": 2}}')
    yield m
    assert m.proc.stop() == 0, m.proc.output()


class Reference:
    """transformers' thinker on the same folder, greedy, stopping where the server's thinker stops."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration

        self.model_dir = model_dir
        self.thinker = Qwen2_5OmniForConditionalGeneration.from_pretrained(model_dir).thinker.eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.prompts = PromptBuilder(model_dir, max_model_len=4096)

    def text(self, prompt: str, media: str) -> str:
        return self.generate(prompt, media)[0]

    @torch.no_grad()
    def generate(self, prompt: str, media: str) -> tuple[str, list[float]]:
        """Greedy text and each generated token's log-probability under the raw logits."""
        clip, image = (sine_wav(), png_bytes()) if media == "audio+image" else (None, None)
        video = _mp4() if media == "video+sound" else None
        req = chat_request(prompt, clip, image, max_tokens=MAX_TOKENS, talker_max=0, modalities=("text",),
                           mp4=video, model_dir=self.model_dir, use_audio_in_video=video is not None)
        p = self.prompts(req)
        kwargs: dict[str, Any] = {}
        if p.input_features is not None:
            kwargs.update(input_features=p.input_features, feature_attention_mask=p.feature_attention_mask)
        if p.pixel_values is not None:
            kwargs.update(pixel_values=p.pixel_values, image_grid_thw=p.image_grid_thw)
        if p.pixel_values_videos is not None:
            kwargs.update(pixel_values_videos=p.pixel_values_videos, video_grid_thw=p.video_grid_thw,
                          video_second_per_grid=p.video_second_per_grid, use_audio_in_video=p.use_audio_in_video)
        ids = p.input_ids.view(1, -1)
        out = self.thinker.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                    do_sample=False, eos_token_id=[SPECIAL_TOKENS["<|im_end|>"],
                                                                    SPECIAL_TOKENS["<|endoftext|>"]],
                                    output_logits=True, return_dict_in_generate=True, **kwargs)
        gen = out.sequences[0, ids.shape[1]:].tolist()
        logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)  # (n, V)
        return self.tokenizer.decode(gen, skip_special_tokens=True), [float(logprobs[i, t]) for i, t in enumerate(gen)]


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Reference:
    return Reference(model_dir)


def _body(prompt: str, media: str, **extra: Any) -> dict[str, Any]:
    clip, image = (sine_wav(), png_bytes()) if media == "audio+image" else (None, None)
    video = _mp4() if media == "video+sound" else None
    content = openai_content(prompt, clip, image, video)
    body = {"model": NAME, "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
            "temperature": 0, **extra}
    if video is not None:
        body["mm_processor_kwargs"] = {"use_audio_in_video": True}
    return body


def _chat(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def test_only_the_encoder_and_thinker_run(served: Mesh, model_dir: Path) -> None:
    assert sorted(served.stages) == ["encoder", "thinker"]
    assert "is a Qwen2.5-Omni checkpoint: omnimesh serves its thinker" in served.proc.output()
    assert f"stage talker: the model {NAME} is a Qwen2.5-Omni checkpoint" in refused_stage(model_dir, "talker")
    for stage, address in served.stages.items():
        with grpc.insecure_channel(address) as ch:
            info = stage_pb2_grpc.StageStub(ch).Info(stage_pb2.InfoRequest(), timeout=30)
        assert info.family == "qwen2.5-omni", (stage, info)
        assert (info.pipeline_parallel_size, info.tensor_parallel_size) == ((2, 1) if stage == "thinker" else (1, 1))


@pytest.mark.parametrize("media", MEDIA)
def test_text_equals_generate(served: Mesh, reference: Reference, media: str) -> None:
    prompt = PROMPTS[0] if media == "text" else PROMPTS[1]
    want, logprobs = reference.generate(prompt, media)
    assert want, "the reference generated no text"
    got = _chat(served.rest, _body(prompt, media, logprobs=True))
    assert got.status_code == 200, got.text
    choice = got.json()["choices"][0]
    assert choice["message"]["content"] == want
    entries = [e["logprob"] for e in choice["logprobs"]["content"]]
    assert entries == pytest.approx(logprobs[:len(entries)], abs=LOGPROB_TOL) and len(entries) >= len(logprobs) - 1
    deltas = []
    with httpx.stream("POST", f"{served.rest}/v1/chat/completions", json=_body(prompt, media, stream=True),
                      timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                deltas += [c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"]]
    assert "".join(deltas) == want


def test_concurrent_requests_each_equal_generate(served: Mesh, reference: Reference) -> None:
    cases = [(p, MEDIA[i % 3]) for i, p in enumerate(PROMPTS * 2)]
    want = [reference.text(p, m) for p, m in cases]
    with ThreadPoolExecutor(len(cases)) as pool:
        got = list(pool.map(lambda c: _chat(served.rest, _body(*c)), cases))
    assert [g.json()["choices"][0]["message"]["content"] for g in got] == want


def test_speech_is_refused_naming_the_checkpoint(served: Mesh) -> None:
    r = _chat(served.rest, _body(PROMPTS[0], "text", modalities=["text", "audio"]))
    assert r.status_code == 400 and "is a Qwen2.5-Omni checkpoint" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "modalities"
    r = httpx.post(f"{served.rest}/v1/audio/speech", json={"model": NAME, "input": "Hello."}, timeout=60)
    assert r.status_code == 400 and "not yet its talker and token2wav" in r.json()["error"]["message"], r.text
    voices = httpx.get(f"{served.rest}/v1/audio/voices", timeout=30).json()
    assert voices["voices"] == [], voices
