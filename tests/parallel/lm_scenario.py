"""One LM's prefill + greedy decode on one rank of a pp x tp layout: the scenario the gloo layout tests run.

Shared by test_tp_pp_gloo.py (the tiny Qwen3-Omni's thinker and talker) and test_qwen2_5_text_model.py (the
tiny Qwen2.5-Omni's thinker): `text_config` picks the role's config (a Qwen2.5-Omni talker config is its LM's
own), `prompt` is a 12-token prompt with a 2 x 3 image block whose t, h and w positions all differ (plus its
visual mask and 3 deepstack tensors, for a model that has them), and `scenario` runs it with `pipeline_step`
on this rank's layers only, the sampled id broadcast from the last pipeline rank as the executor's driver does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from gloo_harness import param_sizes

from omnimesh.models.qwen3_omni.parallel_text_model import ParallelTextModel, pipeline_step
from omnimesh.parallel.parallel_state import ParallelState
from omnimesh.parallel.partition import partition_layers

T = 12
DECODE_STEPS = 5
CAPTURE = {"thinker": 2, "talker": 1}  # both owned by pipeline rank 0 when pp = 2: relayed to the last rank


def text_config(model_dir: Path, role: str) -> Any:
    from transformers import AutoConfig  # the config classes only; the modeling module is never imported

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    sub = config.talker_config if role == "talker" else config.thinker_config
    return getattr(sub, "text_config", None) or sub


def prompt() -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor, list[torch.Tensor]]:
    """ids (1, T), positions (4, 1, T) with a 2 x 3 image block at 3..8, rope delta, visual mask, deepstack."""
    ids = torch.randint(0, 300, (1, T), generator=torch.Generator().manual_seed(1))
    t = torch.tensor([0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7, 8], dtype=torch.float32)
    h = torch.tensor([0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7, 8], dtype=torch.float32)
    w = torch.tensor([0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8], dtype=torch.float32)
    positions = torch.stack([torch.arange(T, dtype=torch.float32), t, h, w]).view(4, 1, T)
    mask = torch.zeros(1, T, dtype=torch.bool)
    mask[0, 3:9] = True
    gen = torch.Generator().manual_seed(2)
    deepstack = [torch.randn(6, 64, generator=gen) * 0.5 for _ in range(3)]  # adds after layers 0, 1, 2
    return ids, positions, 9 - T, mask, deepstack


def decode_pos(seq: int, delta: int) -> torch.Tensor:
    """Positions (4, 1, 1) of the token appended at cache length `seq`."""
    return torch.tensor([seq] + [seq + delta] * 3, dtype=torch.float32).view(4, 1, 1)


def scenario(ps: ParallelState, model_dir: Path, role: str, deepstack: bool = True) -> dict[str, Any]:
    """Prefill + greedy decode on this rank; returns what the tests compare (logits only on the last pp rank).
    `deepstack`: the thinker gets the prompt's deepstack adds (Qwen3-Omni's; Qwen2.5-Omni has none)."""
    config = text_config(model_dir, role)
    layer_range = partition_layers(config.num_hidden_layers, ps.pp_size)[ps.pp_rank]
    model = ParallelTextModel(config, ps, layer_range, is_talker=role == "talker")
    keys = model.load_weights(model_dir)
    ids, positions, delta, mask, deep_features = prompt()
    cache = model.new_cache()
    deep = deep_features if role == "thinker" and deepstack else None
    out = pipeline_step(model, model.embed_ids(ids) if ps.is_first_pp_rank else None, positions, cache,
                        visual_pos_mask=mask if deep else None, deepstack=deep, capture_layer=CAPTURE[role])
    captured = out.captured
    tokens: list[int] = []
    logits_seen: list[torch.Tensor] = []
    seq = ids.shape[1]
    for step in range(DECODE_STEPS + 1):
        token = torch.zeros(1, dtype=torch.long)
        if ps.is_last_pp_rank:
            logits = model.compute_logits(out.hidden[:, -1])  # (1, V), gathered over TP
            logits_seen.append(logits[0])
            token[0] = logits.argmax(-1)[0]
        if ps.world_size > 1:  # the driver's job in the executor: sampled id from the last pp rank to all
            dist.broadcast(token, src=ps.last_pp_rank_driver, group=ps.cpu_group)
        tokens.append(int(token))
        if step == DECODE_STEPS:
            break
        x = model.embed_ids(token.view(1, 1)) if ps.is_first_pp_rank else None
        out = pipeline_step(model, x, decode_pos(seq, delta), cache)
        seq += 1
    return {
        "rank": ps.rank, "pp_rank": ps.pp_rank, "layer_range": layer_range, "keys": keys, "tokens": tokens,
        "logits": torch.stack(logits_seen) if logits_seen else None,
        "captured": captured if ps.is_last_pp_rank else None,
        "param_bytes": model.param_bytes(),
        "sizes": param_sizes(model),
        "cache_len": cache.get_seq_length(),
    }
