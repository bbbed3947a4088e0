"""The wire SamplingParams (what the caller set) over the model's defaults -> the stage's SamplingParams.

Unset fields keep the default `transformers` generate uses for this model and role; `stop_token_ids`
add to the model's own stop ids. Bad values (negative temperature, top_p outside (0, 1], ...) raise
ValueError, which travels back as INVALID_ARGUMENT.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from omnimesh.models.qwen3_omni.sampling import SamplingParams
from omnimesh.v1 import stage_pb2


def merge_sampling(defaults: SamplingParams, msg: stage_pb2.SamplingParams | None) -> SamplingParams:
    if msg is None:
        return defaults
    changes: dict[str, Any] = {}
    for name in ("temperature", "top_p", "top_k", "seed", "max_tokens", "repetition_penalty"):
        if msg.HasField(name):
            changes[name] = getattr(msg, name)
    if msg.stop_token_ids:
        changes["stop_token_ids"] = tuple(dict.fromkeys((*defaults.stop_token_ids, *msg.stop_token_ids)))
    return replace(defaults, **changes)
