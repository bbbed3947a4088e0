"""ParallelAudioTower2_5 equals transformers' Qwen2.5-Omni audio tower (pp = tp = 1), and every gloo layout
equals pp = tp = 1.

The tiny Qwen2.5-Omni folder's audio tower is re-drawn first (`with_random_tower`) so that outputs are O(1)
and a misplaced bias or norm shows. Its audio config (2 layers, 4 heads, ffn 64, d_model 32, n_window 100)
already admits pp = 2 and tp = 2, so the shared tiny builder is used as is. Input: two clips of 1033 and 157
mel frames, padded to 1033 with a feature_attention_mask (the padding is noise). The long clip spans 5 full
200-frame chunks + a 33-frame tail (517 tokens after the convs: odd, so per-clip pooling drops its last token
and must not pair it with the short clip's first); the short one is a single 157-frame chunk (79 tokens).
Out: 258 + 39 = 297 tokens.

Checks: pp = tp = 1 vs transformers' `Qwen2_5OmniAudioEncoder` (its weights alone, called as the thinker's
`get_audio_features` calls it) within 1e-5. Layouts (pp, tp) in {(2,1), (1,2), (2,2)}, as gloo ranks spawned by
tests/parallel/gloo_harness.py, equal pp = tp = 1 within 1e-4 on every TP rank of the last pipeline rank.
Each rank's parameter bytes are <= 1.1 x total / (pp*tp) + its named replicated parts, and each rank reads
only its own layers' tensors. A tp that does not divide the heads is a ValueError naming the numbers.

Run: python -m pytest tests/parallel/test_qwen2_5_audio_tower.py -q
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from gloo_harness import (  # one_thread: autouse here
    assert_memory_split,
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

from omnimesh.models.qwen2_5_omni.parallel_audio_tower import (
    ParallelAudioTower2_5,
    audio_output_lengths_2_5,
    check_audio_layout,
)
from omnimesh.models.qwen3_omni.parallel_audio_tower import audio_pipeline_step  # both families' towers
from omnimesh.parallel.parallel_state import ParallelState

PREFIX = "thinker.audio_tower."
LENGTHS = (1033, 157)
EXACT_TOL = 1e-5
LAYOUT_TOL = 1e-4
# TP-replicated parameter-name parts: conv front-end (first pp rank), layer norms, biases of row-parallel
# linears, the head's proj (last pp rank)
REPLICATED = ("front.", "layer_norm", "ln_post", "out_proj.bias", "fc2.bias", "head.")


def audio_config(model_dir: Path) -> Any:
    return thinker_sub_config(model_dir, "audio_config")


def clips() -> tuple[torch.Tensor, torch.Tensor]:
    return masked_clips(LENGTHS)


def scenario(ps: ParallelState, model_dir: Path) -> dict[str, Any]:
    config = audio_config(model_dir)
    tower, layer_range, keys = load_tower_rank(ParallelAudioTower2_5, config, config.encoder_layers, ps, model_dir)
    features, lens = clips()
    out = audio_pipeline_step(tower, features if ps.is_first_pp_rank else None, lens)
    return tower_result(ps, tower, layer_range, keys, out=out if ps.is_last_pp_rank else None)


# ---- fixtures and tests ----

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omnimesh.models.qwen2_5_omni.tiny import build_tiny_qwen2_5_omni  # lazily: spawned ranks import this module

    tiny = build_tiny_qwen2_5_omni(tmp_path_factory.mktemp("tiny25") / "qwen2.5-omni")
    return with_random_tower(tiny, tmp_path_factory.mktemp("audio25") / "qwen2.5-omni", PREFIX)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> dict[str, Any]:
    return run_single(scenario, model_dir)


def test_single_rank_matches_transformers(model_dir: Path, reference: dict[str, Any]) -> None:
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniAudioEncoder

    from omnimesh.models.loader import build_submodule

    module: Any = build_submodule(model_dir, config_path="thinker_config.audio_config",
                                  factory=Qwen2_5OmniAudioEncoder, prefix=PREFIX, dtype=torch.float32)
    features, lens = clips()
    aftercnn_lens, output_lens = module._get_feat_extract_output_lengths(lens.long())
    with torch.no_grad():  # (n_audio_tokens, output_dim)
        expected = module(features, feature_lens=lens.long(), aftercnn_lens=aftercnn_lens).last_hidden_state
    counts = audio_output_lengths_2_5(lens)
    assert counts.tolist() == output_lens.tolist() == [258, 39]
    ours = reference["out"]
    assert ours.shape == expected.shape == (int(counts.sum()), 64)
    assert expected.abs().max() > 0.5, "outputs too small for the tolerance to mean anything"
    assert (ours - expected).abs().max() < EXACT_TOL
    # every parameter of transformers' tower the forward uses is read once; ours adds the zero k-bias slices
    used = {n: p for n, p in module.named_parameters() if n != "audio_bos_eos_token.weight"}
    assert set(reference["keys"]) == {PREFIX + n for n in used}
    config = module.config
    zero_k_bias = config.encoder_layers * config.d_model
    assert reference["param_bytes"] == 4 * (sum(p.numel() for p in used.values()) + zero_k_bias)


@pytest.mark.parametrize(("pp", "tp"), [(2, 1), (1, 2), (2, 2)])
def test_layout_matches_single_rank(pp: int, tp: int, model_dir: Path, reference: dict[str, Any]) -> None:
    check_audio_layout(audio_config(model_dir), pp, tp)  # sizes checked before any process exists
    ranks = run_layout(pp, tp, scenario, model_dir)
    for o in ranks[(pp - 1) * tp:]:  # every TP rank of the last pp rank holds the whole output
        assert (o["out"] - reference["out"]).abs().max() < LAYOUT_TOL, f"rank {o['rank']}"

    assert_memory_split(ranks, reference, pp, tp, REPLICATED)

    assert_reads_own_blocks(ranks, "layers", PREFIX + "conv1.weight", PREFIX + "proj.weight", 2)
    assert not any(k.endswith("k_proj.bias") or "audio_bos_eos_token" in k for o in ranks for k in o["keys"])


def test_tp_that_does_not_divide_the_heads_is_refused(model_dir: Path) -> None:
    assert_tp3_refused(check_audio_layout, ParallelAudioTower2_5, audio_config(model_dir), "audio tower's encoder_attention_heads")
