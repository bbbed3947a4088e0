"""The thinker and talker LMs split over gloo ranks (pp, tp) in {(2,1), (1,2), (2,2)} equal the (1,1) model.

Each layout spawns pp*tp processes (free TCP port, bounded rendezvous, killed if they overrun), which run
`init_parallel_state`, load ONLY their layers / shards from the tiny folder (talker routers made non-zero,
see `with_talker_routers`), and drive `pipeline_step`
for a prefill (M-RoPE image block, 3 deepstack adds, a captured layer) plus 5 greedy decode steps with the
real vocab-parallel lm_head / codec_head; the sampled id is broadcast from the last pipeline rank.
Checked against `ParallelState.single()` in this process (itself checked against transformers in
test_parallel_text_model.py): same greedy tokens, logits and captured hidden within 1e-4, and each
rank's parameter bytes <= 1.1 x total / (pp*tp) + its named replicated parts (norms, routers, the talker's
shared-expert gate) + its embedding / head shard.

Run: python -m pytest tests/parallel/test_tp_pp_gloo.py -q
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from gloo_harness import (
    assert_memory_split,
    build_tiny,
    free_port,
    layers_read,
    param_sizes,
    run_single,
    with_talker_routers,
)
from gloo_harness import run_layout as spawn_layout

from omnimesh.models.qwen3_omni.parallel_text_model import ParallelTextModel, check_parallel_layout, pipeline_step
from omnimesh.parallel.parallel_state import ParallelState, init_parallel_state
from omnimesh.parallel.partition import partition_layers

ROLES = ("thinker", "talker")
CAPTURE = {"thinker": 2, "talker": 1}  # both owned by pipeline rank 0 when pp = 2: relayed to the last rank
DECODE_STEPS = 5
TOL = 1e-4
REPLICATED = ("norm", "router", "shared_expert_gate")  # parameter-name parts every TP rank holds whole


def text_config(model_dir: Path, role: str) -> Any:
    from transformers import AutoConfig  # the config classes only; the modeling module is never imported

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    return (config.talker_config if role == "talker" else config.thinker_config).text_config


def prompt(T: int = 12) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor, list[torch.Tensor]]:
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


def scenario(ps: ParallelState, model_dir: Path, role: str) -> dict[str, Any]:
    """Prefill + greedy decode on this rank; returns what the test compares (logits only on the last pp rank)."""
    config = text_config(model_dir, role)
    layer_range = partition_layers(config.num_hidden_layers, ps.pp_size)[ps.pp_rank]
    model = ParallelTextModel(config, ps, layer_range, is_talker=role == "talker")
    keys = model.load_weights(model_dir)
    ids, positions, delta, mask, deepstack = prompt()
    cache = model.new_cache()
    deep = deepstack if role == "thinker" else None
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
        pos = torch.tensor([seq] + [seq + delta] * 3, dtype=torch.float32).view(4, 1, 1)
        x = model.embed_ids(token.view(1, 1)) if ps.is_first_pp_rank else None
        out = pipeline_step(model, x, pos, cache)
        seq += 1
    return {
        "rank": ps.rank, "pp_rank": ps.pp_rank, "layer_range": layer_range, "keys": keys, "tokens": tokens,
        "logits": torch.stack(logits_seen) if logits_seen else None,
        "captured": captured if ps.is_last_pp_rank else None,
        "param_bytes": model.param_bytes(),
        "sizes": param_sizes(model),
        "cache_len": cache.get_seq_length(),
    }


def both_roles(ps: ParallelState, model_dir: Path) -> dict[str, dict[str, Any]]:
    return {role: scenario(ps, model_dir, role) for role in ROLES}


def run_layout(pp: int, tp: int, model_dir: Path) -> list[dict[str, dict[str, Any]]]:
    """Spawn pp*tp gloo ranks (gloo_harness: bounded rendezvous, deadline, then kill); results by rank."""
    for role in ROLES:  # sizes are checked before any process or process group exists
        check_parallel_layout(text_config(model_dir, role), pp, tp)
    return spawn_layout(pp, tp, both_roles, model_dir)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_talker_routers(build_tiny(tmp_path_factory), tmp_path_factory.mktemp("routed") / "qwen3-omni")


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> dict[str, dict[str, Any]]:
    return run_single(both_roles, model_dir)


@pytest.mark.parametrize(("pp", "tp"), [(2, 1), (1, 2), (2, 2)])
def test_layout_matches_single_rank(pp: int, tp: int, model_dir: Path, reference: dict[str, dict[str, Any]]) -> None:
    ranks = run_layout(pp, tp, model_dir)
    for role in ROLES:
        ref = reference[role]
        outs = [r[role] for r in ranks]
        last = outs[(pp - 1) * tp]
        for o in outs:
            assert o["tokens"] == ref["tokens"], f"{role} rank {o['rank']}: greedy tokens differ"
            assert o["cache_len"] == 12 + DECODE_STEPS
        for o in outs[(pp - 1) * tp:]:  # every TP rank of the last pp rank has the gathered logits
            assert (o["logits"] - ref["logits"]).abs().max() < TOL, f"{role}: logits differ"
        assert (last["captured"] - ref["captured"]).abs().max() < TOL, f"{role}: captured hidden differs"

        assert_memory_split(outs, ref, pp, tp, REPLICATED, sharded_whole=("embed.", "head."))

        # every rank read only its own layers' tensors (and the embedding / norm / head only where they live)
        n_layers = ref["layer_range"][1]
        for o in outs:
            start, end = o["layer_range"]
            assert layers_read(o["keys"]) == set(range(start, end))
            head = "talker.codec_head.weight" if role == "talker" else "thinker.lm_head.weight"
            assert (head in o["keys"]) == (end == n_layers)
            assert any(k.endswith(("embed_tokens.weight", "codec_embedding.weight")) for k in o["keys"]) == (start == 0)


def test_tp_that_does_not_divide_the_heads_fails_before_any_process_group(model_dir: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"tp=3 must divide num_attention_heads=4 and num_key_value_heads=2; "
                                         r"valid tp values for this model: \[1, 2\]"):
        run_layout(1, 3, model_dir)
    assert not dist.is_initialized()
    assert time.monotonic() - t0 < 10
    with pytest.raises(ValueError, match=r"pp=5 exceeds the model's 4 layers"):
        check_parallel_layout(text_config(model_dir, "thinker"), 5, 1)


def test_unreachable_master_fails_within_the_timeout() -> None:
    port = free_port()  # nobody listens there
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"rank 1 of 2 .* could not join the process group at "
                                           rf"tcp://127.0.0.1:{port} within 2s"):
        init_parallel_state(2, 1, 1, "127.0.0.1", port, "gloo", timeout_s=2.0)
    assert time.monotonic() - t0 < 20
    assert not dist.is_initialized()
