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


def handler_factory(stage: str, model_dir: Path, args: ServeArgs) -> Callable[[], StageHandler]:
    module = importlib.import_module(SERVICES[stage])
    return partial(module.build_handler, model_dir, args)
