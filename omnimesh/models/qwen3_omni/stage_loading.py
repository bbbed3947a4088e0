"""Which weights each Qwen3-Omni stage loads, and from where in the checkpoint.

Role: the family adapter's loading half. Each stage process calls exactly one of these and so holds
only its own part of the model (the encoder never loads the LLMs, the vocoder never loads the talker).
Every load goes through `omnimesh.models.loader`, which fails on any missing key (a sub-model
`from_pretrained` would silently keep random weights). Works the same for the tiny built-in folder
and a real Qwen3-Omni checkpoint (the prefixes are the real checkpoint's key layout).

    load_encoder(dir)  -> Qwen3OmniEncoder       thinker.audio_tower.*, thinker.visual.*
    load_thinker(dir)  -> Qwen3OmniThinker       thinker.model.*, thinker.lm_head.*
    load_talker(dir)   -> Qwen3OmniTalker        talker.*
    load_code2wav(dir) -> Qwen3OmniMoeCode2Wav   code2wav.*
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeAudioEncoder,
    Qwen3OmniMoeCode2Wav,
    Qwen3OmniMoeTalkerForConditionalGeneration,
    Qwen3OmniMoeThinkerTextModel,
    Qwen3OmniMoeVisionEncoder,
)

from omnimesh.models.loader import HF_PER_EXPERT_MOE, build_submodule
from omnimesh.models.qwen3_omni.encoder import Qwen3OmniEncoder
from omnimesh.models.qwen3_omni.talker import Qwen3OmniTalker
from omnimesh.models.qwen3_omni.thinker import Qwen3OmniThinker

log = logging.getLogger(__name__)


def load_config(model_dir: Path) -> Qwen3OmniMoeConfig:
    config = AutoConfig.from_pretrained(Path(model_dir), local_files_only=True)
    if not isinstance(config, Qwen3OmniMoeConfig):
        raise ValueError(f"{model_dir} holds a {type(config).__name__} ({config.model_type}), not a Qwen3-Omni model")
    return config


def _timed(what: str, model_dir: Path, fn):  # noqa: ANN001, ANN202
    t0 = time.monotonic()
    log.info("loading %s from %s", what, model_dir)
    module = fn()
    n = sum(p.numel() for p in module.parameters()) if isinstance(module, nn.Module) else 0
    log.info("loaded %s: %.2f M parameters in %.1fs", what, n / 1e6, time.monotonic() - t0)
    return module


def load_encoder(model_dir: Path, dtype: torch.dtype = torch.float32) -> Qwen3OmniEncoder:
    audio = _timed("audio tower", model_dir, lambda: build_submodule(
        model_dir, config_path="thinker_config.audio_config", factory=Qwen3OmniMoeAudioEncoder,
        prefix="thinker.audio_tower.", dtype=dtype))
    visual = _timed("vision tower", model_dir, lambda: build_submodule(
        model_dir, config_path="thinker_config.vision_config", factory=Qwen3OmniMoeVisionEncoder,
        prefix="thinker.visual.", dtype=dtype))
    return Qwen3OmniEncoder(audio, visual)


def load_thinker(model_dir: Path, dtype: torch.dtype = torch.float32) -> Qwen3OmniThinker:
    config = load_config(model_dir)
    text_model = _timed("thinker language model", model_dir, lambda: build_submodule(
        model_dir, config_path="thinker_config.text_config", factory=Qwen3OmniMoeThinkerTextModel,
        prefix="thinker.model.", stacked=HF_PER_EXPERT_MOE, dtype=dtype))
    text_cfg = config.get_text_config()
    lm_head = build_submodule(
        model_dir, config_path="thinker_config.text_config",
        factory=lambda c: nn.Linear(c.hidden_size, c.vocab_size, bias=False), prefix="thinker.lm_head.", dtype=dtype)
    shape = tuple(lm_head.get_parameter("weight").shape)
    if shape != (text_cfg.vocab_size, text_cfg.hidden_size):
        raise ValueError(f"thinker.lm_head has shape {shape}, expected ({text_cfg.vocab_size}, {text_cfg.hidden_size})")
    return Qwen3OmniThinker(text_model, lm_head, config)


def load_talker(model_dir: Path, dtype: torch.dtype = torch.float32) -> Qwen3OmniTalker:
    config = load_config(model_dir)
    talker = _timed("talker", model_dir, lambda: build_submodule(
        model_dir, config_path="talker_config", factory=Qwen3OmniMoeTalkerForConditionalGeneration,
        prefix="talker.", stacked=HF_PER_EXPERT_MOE, dtype=dtype))
    return Qwen3OmniTalker(talker, config)


def load_code2wav(model_dir: Path, dtype: torch.dtype = torch.float32) -> Qwen3OmniMoeCode2Wav:
    return _timed("code2wav", model_dir, lambda: build_submodule(
        model_dir, config_path="code2wav_config", factory=Qwen3OmniMoeCode2Wav, prefix="code2wav.", dtype=dtype))
