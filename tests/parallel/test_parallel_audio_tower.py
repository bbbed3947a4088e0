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
    fake_tp3,
    layers_read,
    one_thread,  # noqa: F401
    param_sizes,
    run_layout,
    run_single,
    with_random_tower,
)

from omnimesh.models.qwen3_omni.parallel_audio_tower import (
    ParallelAudioTower,
    audio_output_lengths,
    audio_pipeline_step,
    check_audio_layout,
)
from omnimesh.parallel.parallel_state import ParallelState
from omnimesh.parallel.partition import partition_layers

PREFIX = "thinker.audio_tower."
LENGTHS = (930, 157)
EXACT_TOL = 1e-5
LAYOUT_TOL = 1e-4
# TP-replicated parameter-name parts: conv front-end (first pp rank), layer norms, biases of row-parallel linears
REPLICATED = ("front.", "layer_norm", "ln_post", "out_proj.bias", "fc2.bias")


def audio_config(model_dir: Path) -> Any:
    from transformers import AutoConfig  # the config classes only; the modeling module is never imported

    return AutoConfig.from_pretrained(model_dir, local_files_only=True).thinker_config.audio_config


def clips() -> tuple[torch.Tensor, torch.Tensor]:
    """Valid frames (n_mel, sum T_valid) and feature_lens (B,), taken from a padded batch with a mask."""
    gen = torch.Generator().manual_seed(3)
    padded = torch.randn(len(LENGTHS), 128, max(LENGTHS), generator=gen)  # (B, n_mel, T); padding is noise too
    mask = torch.arange(max(LENGTHS))[None, :] < torch.tensor(LENGTHS)[:, None]  # (B, T)
    valid = padded.permute(0, 2, 1)[mask].permute(1, 0)  # (n_mel, sum T_valid): what the encoder stage feeds
    return valid, mask.sum(1)


def scenario(ps: ParallelState, model_dir: Path) -> dict[str, Any]:
    config = audio_config(model_dir)
    layer_range = partition_layers(config.encoder_layers, ps.pp_size)[ps.pp_rank]
    tower = ParallelAudioTower(config, ps, layer_range)
    keys = tower.load_weights(model_dir)
    features, lens = clips()
    out = audio_pipeline_step(tower, features if ps.is_first_pp_rank else None, lens)
    return {
        "rank": ps.rank, "layer_range": layer_range, "keys": keys, "param_bytes": tower.param_bytes(),
        "sizes": param_sizes(tower),
        "out": out if ps.is_last_pp_rank else None,
    }


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

    for o in ranks:  # each rank read its own layers, the front-end only on the first, the head only on the last
        start, end = o["layer_range"]
        assert layers_read(o["keys"]) == set(range(start, end))
        assert (PREFIX + "conv2d1.weight" in o["keys"]) == (start == 0)
        assert (PREFIX + "proj2.weight" in o["keys"]) == (end == 2)


def test_tp_that_does_not_divide_the_heads_is_refused(model_dir: Path) -> None:
    config = audio_config(model_dir)
    message = (r"tensor-parallel size tp=3 must divide the audio tower's encoder_attention_heads=4 .*"
               r"valid tp values for this tower: \[1, 2, 4\]")
    with pytest.raises(ValueError, match=message):
        check_audio_layout(config, 1, 3)
    with pytest.raises(ValueError, match=message):
        ParallelAudioTower(config, fake_tp3(), (0, 2))  # fails before using the state
    with pytest.raises(ValueError, match=r"pp=3 exceeds the model's 2 layers"):
        check_audio_layout(config, 3, 1)
