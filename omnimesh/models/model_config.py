"""A model folder's `transformers` config, and which family it is: the light half of loading.

`omnimesh serve` / `plan` read the config to check a layout and estimate memory before any stage starts;
importing only `transformers`' configuration classes (not the modeling code that `stage_loading` needs to
build modules) keeps that check quick. Every stage loader gets its config from here too.

    load_config(dir) -> Qwen3OmniMoeConfig | Qwen2_5OmniConfig   (ValueError for any other model)
    is_qwen2_5(config) -> bool
    resolve_dtype(args) -> torch.dtype        --dtype auto: bfloat16 on CUDA, float32 on CPU
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoConfig, Qwen2_5OmniConfig
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeConfig

if TYPE_CHECKING:
    from omnimesh.config.serve_args import ServeArgs


def load_config(model_dir: Path) -> Any:
    """The folder's `Qwen3OmniMoeConfig` or `Qwen2_5OmniConfig` (ValueError for any other model)."""
    config = AutoConfig.from_pretrained(Path(model_dir), local_files_only=True)
    if not isinstance(config, Qwen3OmniMoeConfig | Qwen2_5OmniConfig):
        raise ValueError(f"{model_dir} holds a {type(config).__name__} ({config.model_type}), not a Qwen3-Omni or "
                         f"Qwen2.5-Omni model")
    return config


def is_qwen2_5(config: Any) -> bool:
    return isinstance(config, Qwen2_5OmniConfig)


def resolve_dtype(args: ServeArgs) -> torch.dtype:
    """The weights' dtype for `args`: --dtype, where auto is bfloat16 on CUDA and float32 on CPU."""
    if args.dtype == "auto":
        return torch.bfloat16 if args.device == "cuda" else torch.float32
    return getattr(torch, args.dtype)
