"""Qwen2.5-Omni's token2wav, loaded alone from the checkpoint, equals `generate`'s waveform under the same seed.

`Qwen2_5OmniForConditionalGeneration.generate` (greedy thinker and talker, so nothing but the DiT's noise draws from
torch's generator) after `torch.manual_seed(s)` gives the samples `load_token2wav(folder)` gives on the codes `generate`
decoded with seed s, to float rounding (our DiT attends block-locally, transformers over the whole (T, T) mask; the
utterance spans several DiT blocks, so that path runs); two seeds give two waveforms, a seed repeated the same one,
whatever ran before, and two decoding at once on two threads give what each gives alone; 480 samples per code; a missing
`token2wav.*` key, a missing spk_dict.pt and an unknown speaker are refused by name. Several utterances of different
lengths, speakers and seeds decoded in one batch each equal their solo decode (the DiT's mel and the waveform, to float
rounding); without the per-row attention masks of the padded batch they would not.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from omnimesh.models.qwen2_5_omni.tiny import build_tiny_qwen2_5_omni
from omnimesh.models.qwen2_5_omni.tiny_config import CODEC_IDS, SPECIAL_TOKENS
from omnimesh.models.qwen2_5_omni import dit_batch, parallel_dit
from omnimesh.models.qwen2_5_omni.token2wav import SAMPLES_PER_CODE, Utterance, load_token2wav


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen2_5_omni(tmp_path_factory.mktemp("q25") / "model")


@torch.no_grad()
def test_equals_generate_under_the_same_seed(folder: Path) -> None:
    from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration

    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(folder).eval()
    caught: list[torch.Tensor] = []
    hook = model.token2wav.register_forward_pre_hook(lambda module, args: caught.append(args[0][0].clone()))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Say hello."}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    torch.manual_seed(1234)
    _, wav = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), speaker="Ethan",
                            thinker_max_new_tokens=6, thinker_do_sample=False,
                            thinker_eos_token_id=[SPECIAL_TOKENS["<|im_end|>"]], talker_do_sample=False,
                            talker_max_new_tokens=30,
                            talker_eos_token_id=[CODEC_IDS["tts_codec_pad_token_id"], CODEC_IDS["tts_codec_end_token_id"]])
    hook.remove()
    codes = caught[0]
    assert codes.numel() >= 5
    ours = load_token2wav(folder)
    torch.randn(100)  # what ran before does not matter
    got = ours(codes, "ethan", seed=1234)
    assert got.shape == wav.shape == (codes.numel() * SAMPLES_PER_CODE,)
    assert (got - wav.float()).abs().max() < 1e-5, (got - wav.float()).abs().max()
    assert codes.numel() * 2 > 2 * 24  # more mel frames than a layer's window of two DiT blocks
    assert wav.abs().max() > 1e-2  # audible: the tiny builder redraws BigVGAN's convs
    assert torch.equal(ours(codes, "Ethan", seed=1234), got)
    assert not torch.equal(ours(codes, "ethan", seed=1235), got)
    assert not torch.equal(ours(codes, "chelsie", seed=1234), got)
    assert ours(codes[:0], "ethan", seed=1).numel() == 0
    # two decodes at once on two threads (the vocoder stage runs two): each gives what it gives alone
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        both = list(pool.map(lambda s: ours(codes, "ethan", seed=s), [1234, 99] * 2))
    assert torch.equal(both[0], got) and torch.equal(both[2], got) and torch.equal(both[1], both[3])


def test_refusals_name_what_is_missing(folder: Path, tmp_path: Path) -> None:
    ours = load_token2wav(folder)
    with pytest.raises(ValueError, match=r"unknown speaker 'nobody'; valid speakers: \['chelsie', 'ethan'\]"):
        ours(torch.tensor([1, 2, 3]), "nobody", seed=0)
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare)
    (bare / "spk_dict.pt").unlink()
    with pytest.raises(ValueError, match="has no spk_dict.pt"):
        load_token2wav(bare)
    from safetensors.torch import load_file, save_file

    cut = tmp_path / "cut"
    shutil.copytree(folder, cut)
    tensors: dict[str, Any] = load_file(cut / "model.safetensors")
    key = next(k for k in sorted(tensors) if k.startswith("token2wav.code2wav_bigvgan_model."))
    del tensors[key]
    save_file(tensors, cut / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=key.removeprefix("token2wav.").split(".")[0]):
        load_token2wav(cut)


def _mels(ours: Any, utterances: list[Utterance]) -> list[torch.Tensor]:
    voices = [ours.voices[u.speaker] for u in utterances]
    return dit_batch.sample_mels(ours.module.code2wav_dit_model, ours.layers, [u.codes for u in utterances],
                                 [v[0] for v in voices], [v[1] for v in voices],
                                 [torch.Generator().manual_seed(u.seed) for u in utterances])


def test_a_batch_equals_each_utterance_alone(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ours = load_token2wav(folder)
    draw = torch.Generator().manual_seed(3)
    # 13 codes = 26 mel frames: the padded batch's last DiT block (24 frames) is part real, part padding
    batch = [Utterance(torch.randint(0, 500, (n,), generator=draw), speaker, seed)
             for n, speaker, seed in [(13, "ethan", 1), (40, "chelsie", 2), (1, "ethan", 3), (0, "ethan", 4),
                                      (27, "chelsie", 1)]]
    alone = [ours.decode([u])[0] for u in batch]
    together = ours.decode(batch)
    for u, a, t in zip(batch, alone, together):
        assert a.shape == t.shape == (u.codes.numel() * SAMPLES_PER_CODE,)
        assert torch.allclose(a, t, atol=1e-5, rtol=0), (u.codes.numel(), (a - t).abs().max())
    assert together[1].abs().max() > 1e-2  # audible, so the tolerance says something
    assert torch.equal(ours.decode(batch)[0], together[0])  # the same batch, the same samples
    ours.bigvgan_window = 16  # BigVGAN in pieces of 16 mel frames (8 codes) with their context: the same samples
    for a, t in zip(ours.decode(batch), together):
        assert a.shape == t.shape and (a.numel() == 0 or (a - t).abs().max() < 1e-6)
    # the mels (batched: ~2e-7 off solo), and the guard: with one plain block-distance table for every row (what
    # transformers builds) a short row's real frames attend its padding and its mel moves (~5e-5 on the tiny
    # DiT, whose random attention gates are small)
    live = [u for u in batch if u.codes.numel()]
    solo = [_mels(ours, [u])[0] for u in live]
    assert all(torch.allclose(s, b, atol=2e-6, rtol=0) for s, b in zip(solo, _mels(ours, live)))
    plain = parallel_dit.window_mask

    def unmasked(block_size: int, frames: list[int], total: int, *window_and_device: Any) -> torch.Tensor:
        return plain(block_size, [total] * len(frames), total, *window_and_device)

    monkeypatch.setattr(parallel_dit, "window_mask", unmasked)  # where the DiT's rank builds its masks
    naive = _mels(load_token2wav(folder), live)  # a fresh rank: none of the masks above kept
    assert (solo[0] - naive[0]).abs().max() > 2e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_batch_on_cuda_equals_each_alone(folder: Path) -> None:
    """On CUDA BigVGAN decodes the batch in one call too (on CPU it runs per request). TF32 off: what is checked
    is the padding's exactness, not TF32's rounding (cuDNN convolutions round differently per batch size)."""
    ours = load_token2wav(folder, "cuda")
    draw = torch.Generator().manual_seed(5)
    batch = [Utterance(torch.randint(0, 500, (n,), generator=draw), speaker, 1)
             for n, speaker in [(13, "ethan"), (40, "chelsie"), (3, "ethan")]]
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        alone = [ours.decode([u])[0] for u in batch]
        together = ours.decode(batch)
    for u, a, t in zip(batch, alone, together):
        assert a.shape == t.shape == (u.codes.numel() * SAMPLES_PER_CODE,) and t.device.type == "cpu"
        assert torch.allclose(a, t, atol=1e-4, rtol=0), (u.codes.numel(), (a - t).abs().max())
    assert together[1].abs().max() > 1e-2
