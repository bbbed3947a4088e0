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
import torch.distributed as dist
from gloo_harness import (
    assert_memory_split,
    build_tiny,
    free_port,
    layers_read,
    run_single,
    with_talker_routers,
)
from gloo_harness import run_layout as spawn_layout
from lm_scenario import DECODE_STEPS, scenario, text_config

from omnimesh.models.qwen3_omni.parallel_text_model import check_parallel_layout
from omnimesh.parallel.parallel_state import ParallelState, init_parallel_state

ROLES = ("thinker", "talker")
TOL = 1e-4
REPLICATED = ("norm", "router", "shared_expert_gate")  # parameter-name parts every TP rank holds whole


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
