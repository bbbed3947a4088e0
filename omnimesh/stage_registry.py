"""Stage name -> the service module that builds its handler (imported lazily, so a stage process
imports only its own service and model code).

Each service module exposes `build_handler(model_dir: Path, args: ServeArgs) -> StageHandler`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from omnimesh.config.serve_args import ServeArgs
from omnimesh.models.qwen3_omni.stage_loading import LMLayout
from omnimesh.server.stage_failure import StageFailure
from omnimesh.server.stage_servicer import StageHandler

SERVICES: dict[str, str] = {
    "encoder": "services.encoder.handler",
    "thinker": "services.llm.thinker_handler",
    "talker": "services.llm.talker_handler",
    "vocoder": "services.vocoder.handler",
}


def resolve_dtype(args: ServeArgs) -> torch.dtype:
    if args.dtype == "auto":
        return torch.bfloat16 if args.device == "cuda" else torch.float32
    return getattr(torch, args.dtype)


def lm_layout(args: ServeArgs, stage: str, failure: StageFailure) -> LMLayout:
    """The stage's pp x tp ranks from the flags (-tp/-pp, --stage-overrides, --master-*)."""
    cfg = args.stage_configs()[stage]
    cuda = args.device == "cuda"
    return LMLayout(pp=cfg.pp, tp=cfg.tp, partition=cfg.pp_layer_partition,
                    backend="nccl" if cuda else "gloo", master_addr=args.master_addr,
                    master_port=args.master_port, on_failure=failure.report,
                    devices=tuple(f"cuda:{d}" for d in cfg.device_list()) if cuda else ())


def handler_factory(stage: str, model_dir: Path, args: ServeArgs) -> Callable[[], StageHandler]:
    module = importlib.import_module(SERVICES[stage])
    return partial(module.build_handler, model_dir, args)
