"""Qwen2.5-Omni's token2wav, loaded alone from the checkpoint, equals `generate`'s waveform under the same seed.

`Qwen2_5OmniForConditionalGeneration.generate` (greedy thinker and talker, so nothing but the DiT's noise draws
from torch's generator) after `torch.manual_seed(s)` gives the same samples as `load_token2wav(folder)` on the
codes `generate` decoded with seed s; two seeds give two waveforms, a seed repeated the same one, whatever ran
before, and two decoding at once on two threads give what each gives alone; 480 samples per code; a missing
`token2wav.*` key, a missing spk_dict.pt and an unknown speaker are refused by name.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from omnimesh.models.qwen2_5_omni.tiny import build_tiny_qwen2_5_omni
from omnimesh.models.qwen2_5_omni.tiny_config import CODEC_IDS, SPECIAL_TOKENS
from omnimesh.models.qwen2_5_omni.token2wav import SAMPLES_PER_CODE, load_token2wav


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
    assert torch.equal(got, wav.float())
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
