"""ParallelAudioTower equals transformers' audio tower (pp = tp = 1), and every gloo layout equals pp = tp = 1.

The tiny folder's audio tower is re-drawn first (`with_random_tower`): the tiny build stores zero biases,
unit norms and 0.02-std weights, so a misplaced bias or norm would go unnoticed and outputs would be ~1e-2.
The re-drawn tower gives O(1) outputs. Input: two clips of 930 and 157 mel frames, padded to 930 with a
feature_attention_mask (the padding is noise). The long clip spans 9 full chunks + a tail (121 tokens, so
two attention windows, 104 + 17); the short one spans 1 chunk + a tail (21 tokens).

Checks: pp = tp = 1 vs `Qwen3OmniMoeForConditionalGeneration.from_pretrained(...)`'s audio tower within
1e-5. Layouts (pp, tp) in {(2,1), (1,2), (2,2)}, as gloo ranks spawned by tests/parallel/gloo_harness.py,
equal pp = tp = 1 within 1e-4 on every TP rank of the last pipeline rank. Each rank's parameter bytes are
<= 1.1 x total / (pp*tp) + its named replicated parts, and each rank reads only its own layers' tensors.
A tp that does not divide the heads is a ValueError naming the numbers.

Run: python -m pytest tests/parallel/test_parallel_audio_tower.py -q
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from gloo_harness import (  # one_thread: autouse here
    assert_memory_split,
    build_tiny,
    assert_reads_own_blocks,
    assert_tp3_refused,
    load_tower_rank,
    masked_clips,
    one_thread,  # noqa: F401
    run_layout,
    run_single,
    thinker_sub_config,
    tower_result,
    with_random_tower,
)

from omnimesh.models.qwen3_omni.parallel_audio_tower import (
    ParallelAudioTower,
    audio_output_lengths,
    audio_pipeline_step,
    check_audio_layout,
)
from omnimesh.parallel.parallel_state import ParallelState

PREFIX = "thinker.audio_tower."
LENGTHS = (930, 157)
EXACT_TOL = 1e-5
LAYOUT_TOL = 1e-4
# TP-replicated parameter-name parts: conv front-end (first pp rank), layer norms, biases of row-parallel linears
REPLICATED = ("front.", "layer_norm", "ln_post", "out_proj.bias", "fc2.bias")


def audio_config(model_dir: Path) -> Any:
    return thinker_sub_config(model_dir, "audio_config")


def clips() -> tuple[torch.Tensor, torch.Tensor]:
    return masked_clips(LENGTHS)


def scenario(ps: ParallelState, model_dir: Path) -> dict[str, Any]:
    config = audio_config(model_dir)
    tower, layer_range, keys = load_tower_rank(ParallelAudioTower, config, config.encoder_layers, ps, model_dir)
    features, lens = clips()
    out = audio_pipeline_step(tower, features if ps.is_first_pp_rank else None, lens)
    return tower_result(ps, tower, layer_range, keys, out=out if ps.is_last_pp_rank else None)


# ---- fixtures and tests ----

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_random_tower(build_tiny(tmp_path_factory), tmp_path_factory.mktemp("audio") / "qwen3-omni", PREFIX)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> dict[str, Any]:
    return run_single(scenario, model_dir)


def test_single_rank_matches_transformers(model_dir: Path, reference: dict[str, Any]) -> None:
    from transformers import Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(model_dir)
    features, lens = clips()
    with torch.no_grad():
        expected = model.thinker.model.audio_tower(features, feature_lens=lens).last_hidden_state  # (N, out)
    ours = reference["out"]
    assert ours.shape == expected.shape == (int(audio_output_lengths(lens, 50).sum()), 64) == (142, 64)
    assert expected.abs().max() > 0.5, "outputs too small for the tolerance to mean anything"
    assert (ours - expected).abs().max() < EXACT_TOL
    # every parameter of transformers' tower is accounted for, nothing twice
    assert reference["param_bytes"] == sum(p.numel() * 4 for p in model.thinker.model.audio_tower.parameters())
    assert set(reference["keys"]) == {PREFIX + n for n, _ in model.thinker.model.audio_tower.named_parameters()}


@pytest.mark.parametrize(("pp", "tp"), [(2, 1), (1, 2), (2, 2)])
def test_layout_matches_single_rank(pp: int, tp: int, model_dir: Path, reference: dict[str, Any]) -> None:
    check_audio_layout(audio_config(model_dir), pp, tp)  # sizes checked before any process exists
    ranks = run_layout(pp, tp, scenario, model_dir)
    for o in ranks[(pp - 1) * tp:]:  # every TP rank of the last pp rank holds the all-reduced output
        assert (o["out"] - reference["out"]).abs().max() < LAYOUT_TOL, f"rank {o['rank']}"

    assert_memory_split(ranks, reference, pp, tp, REPLICATED)

    assert_reads_own_blocks(ranks, "layers", PREFIX + "conv2d1.weight", PREFIX + "proj2.weight", 2)


def test_tp_that_does_not_divide_the_heads_is_refused(model_dir: Path) -> None:
    assert_tp3_refused(check_audio_layout, ParallelAudioTower, audio_config(model_dir), "audio tower's encoder_attention_heads")
