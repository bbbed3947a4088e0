"""Builder of the built-in tiny Qwen2.5-Omni model folder (random weights, fixed seed, offline).

Role: write a complete Hugging Face folder for the config in `tiny_config.py`, laid out like the real
Qwen2.5-Omni-7B checkpoint, so tests exercise the loading path a real model takes. Two builds with the
same seed are byte-identical.

Data flow:
    tiny_qwen2_5_omni_config() --(seeded construction, biases drawn)--> model
      --save_pretrained--> config.json, generation_config.json, model.safetensors
      (keys `thinker.model.*`, `thinker.lm_head.*`, `thinker.audio_tower.*`, `thinker.visual.*`, `talker.*`,
      `token2wav.code2wav_dit_model.*`, `token2wav.code2wav_bigvgan_model.*`, as the real checkpoint)
    speakers -> spk_dict.pt ({name: {"bos_token", "cond", "ref_mel"}}: what `from_pretrained` loads)
    the tiny Qwen3-Omni tokenizer layout under Qwen2.5-Omni's token names -> tokenizer.json,
      tokenizer_config.json, chat_template.jinja
    Whisper feature extractor + Qwen2-VL image processor (patch 14) -> preprocessor_config.json
    video sizes and sampling -> video_preprocessor_config.json (read by video_processor.video_settings)

Run: python -c "from pathlib import Path; from omnimesh.models.qwen2_5_omni.tiny import build_tiny_qwen2_5_omni; \
print(build_tiny_qwen2_5_omni(Path('/tmp/tiny-qwen2.5-omni')))"
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2_5OmniForConditionalGeneration, Qwen2VLImageProcessorPil

from omnimesh.models.qwen2_5_omni.tiny_config import (
    ORDINARY_VOCAB_LIMIT,
    RENAMED,
    ROLE_TOKENS,
    SPECIAL_TOKENS,
    THINKER_VOCAB,
    tiny_qwen2_5_omni_config,
)
from omnimesh.models.qwen3_omni import tiny as qwen3_tiny
from omnimesh.models.qwen3_omni.tiny import QWEN3_OMNI_CHAT_TEMPLATE, tiny_feature_extractor
from omnimesh.models.tokenizer_build import TinyTokenizerSpec, build_tokenizer

def _renamed(text: str) -> str:
    """Qwen3-Omni's token names in `text` -> Qwen2.5-Omni's (the two chat templates differ only there)."""
    for old, new in RENAMED.items():
        text = text.replace(old, new)
    return text


QWEN2_5_OMNI_CHAT_TEMPLATE = _renamed(QWEN3_OMNI_CHAT_TEMPLATE)
MEDIA_TOKENS: dict[str, str] = {
    "image_token": "<|IMAGE|>", "audio_token": "<|AUDIO|>", "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
    "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>",
}
# the speakers of the real checkpoint's spk_dict.pt; "bos_token" is the thinker-vocab id the talker's text starts with
SPEAKERS: dict[str, int] = {"Chelsie": 418, "Ethan": 419}
# images resize to a multiple of patch 14 x merge 2 = 28, area in [MIN, MAX]: 56x56 -> 4x4 patches -> 4 tokens
IMAGE_MIN_PIXELS = 28 * 28
IMAGE_MAX_PIXELS = 224 * 224
# video frames: one size per video, area in [MIN, MAX] (a 56x56 frame keeps its size: 4 tokens per pair of
# frames); 2 frames a second, 4 to 16 frames (the tiny Qwen3-Omni's sampling)
VIDEO_MIN_PIXELS = 28 * 28
VIDEO_MAX_PIXELS = 56 * 56
BIAS_STD = 0.02  # the LMs' q/k/v biases start at zero; drawn so that a model ignoring them shows
FOLDER_FILES = ("config.json", "generation_config.json", "model.safetensors", "spk_dict.pt", "tokenizer.json",
                "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json",
                "video_preprocessor_config.json")


def tiny_tokenizer_spec() -> TinyTokenizerSpec:
    return TinyTokenizerSpec(
        vocab_size=THINKER_VOCAB, ordinary_limit=ORDINARY_VOCAB_LIMIT, special_tokens=dict(SPECIAL_TOKENS),
        word_tokens=dict(ROLE_TOKENS), eos_token="<|im_end|>", pad_token="<|endoftext|>",
        named_tokens=dict(MEDIA_TOKENS), chat_template=QWEN2_5_OMNI_CHAT_TEMPLATE,
    )


def tiny_image_processor() -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(
        patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=IMAGE_MIN_PIXELS, max_pixels=IMAGE_MAX_PIXELS,
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    )


def preprocessor_config() -> dict[str, Any]:
    merged = {**tiny_feature_extractor().to_dict(), **tiny_image_processor().to_dict()}
    merged.pop("mel_filters", None)
    merged["min_pixels"], merged["max_pixels"] = IMAGE_MIN_PIXELS, IMAGE_MAX_PIXELS
    merged["processor_class"] = "Qwen2_5OmniProcessor"
    return merged


def video_preprocessor_config() -> dict[str, Any]:
    """The video processor's settings: the tiny Qwen3-Omni's layout with patch 14 and this model's frame area."""
    return qwen3_tiny.video_preprocessor_config("Qwen2_5OmniProcessor", 14, VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS)


def speaker_dict(config: Any, seed: int) -> dict[str, dict[str, Any]]:
    """{name: {"bos_token": id, "cond": (1, enc_emb_dim), "ref_mel": (1, 30, mel_dim)}}, drawn from `seed`."""
    dit = config.token2wav_config.dit_config
    gen = torch.Generator().manual_seed(seed + 2)
    return {name: {"bos_token": bos, "cond": torch.randn(1, dit.enc_emb_dim, generator=gen),
                   "ref_mel": torch.randn(1, 30, dit.mel_dim, generator=gen)} for name, bos in SPEAKERS.items()}


def build_tiny_model(seed: int = 0, audio_output: bool = True) -> Qwen2_5OmniForConditionalGeneration:
    """The tiny model in float32, every weight a function of `seed`; the caller's RNG is left untouched."""
    config = tiny_qwen2_5_omni_config(audio_output)
    previous = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        torch.set_default_dtype(torch.float32)
        try:
            model = Qwen2_5OmniForConditionalGeneration(config)
        finally:
            torch.set_default_dtype(previous)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")) and ".layers." in name:
                param.normal_(0.0, BIAS_STD, generator=gen)
    if audio_output:
        make_bigvgan_audible(model, seed)
    model.generation_config = qwen3_tiny.tiny_generation_config()  # the same end ids, by construction
    return model.eval()


def make_bigvgan_audible(model: Qwen2_5OmniForConditionalGeneration, seed: int, gain: float = 0.7) -> None:
    """Re-draw BigVGAN's conv weights with std gain / sqrt(fan_in): the default init gives a waveform of ~1e-7
    (silence after pcm16), which would make every audio check in the tests vacuous."""
    qwen3_tiny.redraw_convs(list(model.token2wav.code2wav_bigvgan_model.modules()), seed + 3, gain)


def build_tiny_qwen2_5_omni(out_dir: Path, seed: int = 0, audio_output: bool = True) -> Path:
    """Write the tiny Qwen2.5-Omni folder to `out_dir` (new or empty) and return it."""
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"{out_dir} is not empty; pass a new or empty directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(seed, audio_output)
    model.save_pretrained(out_dir)
    torch.save(speaker_dict(model.config, seed), out_dir / "spk_dict.pt")
    build_tokenizer(tiny_tokenizer_spec()).save_pretrained(out_dir)
    text = json.dumps(preprocessor_config(), indent=2, sort_keys=True) + "\n"
    (out_dir / "preprocessor_config.json").write_text(text, encoding="utf-8")
    text = json.dumps(video_preprocessor_config(), indent=2, sort_keys=True) + "\n"
    (out_dir / "video_preprocessor_config.json").write_text(text, encoding="utf-8")
    written = sorted(p.name for p in out_dir.iterdir())
    if written != sorted(FOLDER_FILES):
        raise ValueError(f"tiny build wrote {written}, expected {sorted(FOLDER_FILES)}; update FOLDER_FILES")
    return out_dir
