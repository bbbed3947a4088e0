"""Stage handlers and tasks in-process on the tiny model folder: what each stage accepts, what it refuses
(with a message naming the problem), and that its outputs have the shapes the next stage expects."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnimesh.config.serve_args import ServeArgs
from omnimesh.transport.frames import StageChunk
from omnimesh.v1 import stage_pb2
from services.encoder.handler import build_handler as encoder_handler
from services.llm.talker_handler import build_handler as talker_handler
from services.llm.thinker_handler import build_handler as thinker_handler
from services.vocoder.handler import build_handler as vocoder_handler


@pytest.fixture(scope="module")
def handlers(model_dir: Path) -> dict:
    args = ServeArgs(max_model_len=64)
    return {
        "encoder": encoder_handler(model_dir, args),
        "thinker": thinker_handler(model_dir, args),
        "talker": talker_handler(model_dir, args),
        "vocoder": vocoder_handler(model_dir, args),
    }


def _open(handler, rid: str = "r", **kwargs) -> object:
    return handler.open(stage_pb2.Open(request_id=rid, **kwargs))


def _run(task, max_steps: int = 10_000) -> list[StageChunk]:
    out = []
    for _ in range(max_steps):
        if task.finished or not task.ready():
            break
        out += task.step()
    return out


def test_info_describes_each_stage(handlers: dict) -> None:
    assert handlers["talker"].info().speakers[0] == "ethan"  # generate's default voice comes first
    assert handlers["vocoder"].info().sample_rate == 24000
    assert {h.info().stage for h in handlers.values()} == {"encoder", "thinker", "talker", "vocoder"}


def test_thinker_rejects_bad_prompts(handlers: dict) -> None:
    th = handlers["thinker"]
    with pytest.raises(ValueError, match="tensor 'input_ids' is missing"):
        _open(th).feed(StageChunk(tensors={"x": torch.ones(1)}, final=True))
    with pytest.raises(ValueError, match=r"input_ids must be in \[0, 512\)"):
        _open(th).feed(StageChunk(tensors={"input_ids": torch.tensor([1, 600])}, final=True))
    with pytest.raises(ValueError, match="prompt has 80 tokens; the thinker's max_model_len is 64"):
        _open(th).feed(StageChunk(tensors={"input_ids": torch.ones(80, dtype=torch.long)}, final=True))
    with pytest.raises(ValueError, match="one final chunk"):
        _open(th).feed(StageChunk(tensors={"input_ids": torch.ones(3, dtype=torch.long)}, final=False))
    bad = stage_pb2.SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="top_p must be in"):
        _open(th, sampling=bad)
    with pytest.raises(ValueError, match="input_ids must be integer ids, got float32"):
        _open(th).feed(StageChunk(tensors={"input_ids": torch.ones(1, 3)}, final=True))
    for shape in ((2, 3), (1, 1, 3)):  # a batch of prompts, or one with an extra axis, is not one request
        with pytest.raises(ValueError, match=r"input_ids must be one sequence, \(n,\) or \(1, n\)"):
            _open(th).feed(StageChunk(tensors={"input_ids": torch.ones(shape, dtype=torch.long)}, final=True))
    for field in ("temperature", "top_p", "repetition_penalty"):  # NaN passes every < / > range check
        with pytest.raises(ValueError, match=f"{field} must be a finite number, got nan"):
            _open(th, sampling=stage_pb2.SamplingParams(**{field: float("nan")}))


def test_thinker_caps_output_at_max_model_len(handlers: dict, model_dir: Path) -> None:
    ids = torch.tensor([400, 413, 10] + [20] * 50 + [401, 10, 400, 414, 10])  # 58 tokens, 6 left of 64
    task = _open(handlers["thinker"], sampling=stage_pb2.SamplingParams(temperature=0, max_tokens=1000),
                 options={"talker_inputs": "1"})
    task.feed(StageChunk(tensors={"input_ids": ids}, final=True))
    out = _run(task)
    assert task.finished and task.completion_tokens <= 64 - 58
    assert "prompt_embeds" in out[0].tensors and out[0].tensors["prompt_embeds"].shape == (58, 64)
    assert all("token_embeds" in c.tensors for c in out[:-1])


def test_talker_refuses_unknown_voice_and_incomplete_prompt(handlers: dict) -> None:
    with pytest.raises(ValueError, match="unknown speaker 'nobody'; valid speakers: aiden, chelsie, ethan"):
        _open(handlers["talker"], options={"speaker": "nobody"})
    task = _open(handlers["talker"])
    with pytest.raises(ValueError, match="tensor 'prompt_ids' is missing"):
        task.feed(StageChunk(tensors={"token_embeds": torch.zeros(1, 64)}))


def test_talker_with_no_text_ends_without_audio(handlers: dict) -> None:
    """The thinker's first token was final: nothing to speak (generate itself crashes here)."""
    prompt = {"prompt_ids": torch.tensor([400, 413, 10, 401, 10, 400, 414, 10]),
              "prompt_embeds": torch.zeros(8, 64), "multimodal_hidden": torch.zeros(0, 64),
              "tts_embeds": torch.zeros(3, 64)}
    task = _open(handlers["talker"])
    task.feed(StageChunk(tensors=prompt, final=True))
    assert _run(task) == [] and task.finished


def test_vocoder_checks_codes_and_streams_windows(handlers: dict, model_dir: Path) -> None:
    voc = handlers["vocoder"]
    with pytest.raises(ValueError, match=r"codes must be in \[0, 256\)"):
        _open(voc).feed(StageChunk(tensors={"codes": torch.full((4, 2), 300)}))
    with pytest.raises(ValueError, match="codes must be integer ids, got float32"):
        _open(voc).feed(StageChunk(tensors={"codes": torch.zeros(4, 2)}))
    with pytest.raises(ValueError, match=r"codes must be \(4, n\)"):
        _open(voc).feed(StageChunk(tensors={"codes": torch.zeros(3, 2, dtype=torch.long)}))
    with pytest.raises(ValueError, match="window must be a whole number"):
        _open(voc, options={"window": "0"})
    with pytest.raises(ValueError, match="first_window must be a whole number"):
        _open(voc, options={"first_window": "x"})
    codes = torch.randint(0, 256, (4, 30), generator=torch.Generator().manual_seed(0))
    task = _open(voc, options={"window": "10", "first_window": "3"})
    pieces, taken = [], []
    for i in range(0, 30, 5):
        task.feed(StageChunk(tensors={"codes": codes[:, i:i + 5]}, final=i == 25))
        while task.ready() and not task.finished:
            taken.append(task.next_window_size())
            pieces += [c.tensors["pcm"] for c in task.step()]
    assert task.finished and taken[:3] == [3, 10, 10], taken  # the first window is short, the rest full
    assert _open(voc, options={"window": "4"}).windows == (4, 4)  # the first never longer than the window
    assert _open(voc).windows == (5, 25)  # the stage's --audio-windows
    with pytest.raises(ValueError, match="option windows must be 1 to 32 comma-separated whole numbers"):
        _open(voc, options={"windows": "3,0"})
    doubling, taken2, pieces2 = _open(voc, options={"windows": "3,6,12"}), [], []
    doubling.feed(StageChunk(tensors={"codes": codes}, final=True))
    while not doubling.finished:
        taken2.append(doubling.next_window_size())
        pieces2 += [c.tensors["pcm"] for c in doubling.step()]
    assert taken2 == [3, 6, 12, 9], taken2  # the schedule, its last entry repeating, then what is left
    from transformers import Qwen3OmniMoeForConditionalGeneration

    reference = Qwen3OmniMoeForConditionalGeneration.from_pretrained(model_dir).code2wav.eval()
    with torch.no_grad():
        whole = reference(codes.unsqueeze(0)).view(-1)
    torch.testing.assert_close(torch.cat(pieces), whole, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat(pieces2), whole, atol=1e-5, rtol=0)


def test_encoder_requires_masks_and_grids(handlers: dict) -> None:
    enc = handlers["encoder"]
    with pytest.raises(ValueError, match="nothing to encode"):
        _open(enc).feed(StageChunk(tensors={"input_ids": torch.ones(1)}, final=True))
    with pytest.raises(ValueError, match="tensor 'feature_attention_mask' is missing"):
        _open(enc).feed(StageChunk(tensors={"input_features": torch.zeros(1, 128, 100)}, final=True))
    with pytest.raises(ValueError, match="tensor 'image_grid_thw' is missing"):
        _open(enc).feed(StageChunk(tensors={"pixel_values": torch.zeros(16, 1536)}, final=True))
    task = _open(enc)
    task.feed(StageChunk(tensors={"input_features": torch.randn(1, 128, 200),
                                  "feature_attention_mask": torch.ones(1, 200, dtype=torch.long),
                                  "pixel_values": torch.randn(16, 1536),
                                  "image_grid_thw": torch.tensor([[1, 4, 4]])}, final=True))
    (out,) = _run(task)
    assert out.tensors["audio_embeds"].shape[1] == 64 and out.tensors["audio_feature_lengths"].tolist() == [200]
    assert out.tensors["image_embeds"].shape == (4, 64) and out.tensors["deepstack_embeds"].shape == (1, 4, 64)
