"""ParallelVisionTower2_5 equals transformers' Qwen2.5-Omni vision tower (pp = tp = 1), and every gloo layout
equals pp = tp = 1.

The tiny Qwen2.5-Omni folder's vision tower is re-drawn first (`with_random_tower`): the tiny build stores
zero biases and unit norms, which would hide a misplaced bias or norm. The tiny tower has 2 blocks, 4 heads,
window_size 112 px = 4 x 4 merged tokens, and `fullatt_block_indexes` [1]: block 0 attends within windows,
block 1 within frames, so at pp = 2 each rank runs one kind. Input: two images with grids [1, 12, 20]
(6 x 10 merged tokens: 6 windows of three sizes) and [1, 4, 6] (one window), plus a 2-frame clip [2, 8, 12]
(two windows per frame): 456 patches -> 114 tokens. The test checks that window and full attention give
different outputs on this input, so both kinds of block are exercised.

Checks: the window order and boundaries equal transformers' `get_vision_window_index`; pp = tp = 1 vs
`Qwen2_5OmniForConditionalGeneration.from_pretrained(...)`'s vision tower within 1e-5 (every parameter read
once); layouts (pp, tp) in {(2,1), (1,2), (2,2)}, as gloo ranks spawned by tests/parallel/gloo_harness.py,
equal pp = tp = 1 within 1e-4 on every TP rank of the last pipeline rank; each rank's parameter bytes are
<= 1.1 x total / (pp*tp) + its replicated parts, and each rank reads only its own blocks (patch embedding
on the first rank, merger on the last); a tp that does not divide the heads is a ValueError naming the
numbers; a batch of images gives each image, bit for bit, what it gets alone.

Run: python -m pytest tests/parallel/test_qwen2_5_vision_tower.py -q
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from gloo_harness import (  # one_thread: autouse here
    assert_memory_split,
    assert_reads_own_blocks,
    assert_tp3_refused,
    load_tower_rank,
    one_thread,  # noqa: F401
    run_layout,
    run_single,
    thinker_sub_config,
    tower_result,
    with_random_tower,
)

from omnimesh.models.qwen2_5_omni.parallel_vision_tower import (
    ParallelVisionTower2_5,
    check_vision_layout_2_5,
    window_index,
)
from omnimesh.models.qwen3_omni.parallel_vision_tower import vision_pipeline_step  # both families' towers
from omnimesh.parallel.parallel_state import ParallelState

PREFIX = "thinker.visual."
GRIDS = ((1, 12, 20), (1, 4, 6), (2, 8, 12))
PATCH_DIM = 3 * 2 * 14 * 14  # C * temporal_patch * patch**2
EXACT_TOL = 1e-5
LAYOUT_TOL = 1e-4
# TP-replicated parameter-name parts: patch embedding (first pp rank), RMSNorm weights (norm1/2, ln_q),
# biases of row-parallel linears (attn.proj, mlp.down_proj, the merger's fc2)
REPLICATED = ("patch_", "norm", "ln_q", "attn.proj.bias", "down_proj.bias", "fc2.bias")


def vision_config(model_dir: Path) -> Any:
    return thinker_sub_config(model_dir, "vision_config")


def images(grids: tuple[tuple[int, int, int], ...] = GRIDS, seed: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """pixel_values (N, C*T*P*P) and grid_thw (n, 3)."""
    grid = torch.tensor(grids)
    return torch.randn(int(grid.prod(-1).sum()), PATCH_DIM, generator=torch.Generator().manual_seed(seed)), grid


def scenario(ps: ParallelState, model_dir: Path) -> dict[str, Any]:
    config = vision_config(model_dir)
    tower, layer_range, keys = load_tower_rank(ParallelVisionTower2_5, config, config.depth, ps, model_dir)
    pixels, grid = images()
    out = vision_pipeline_step(tower, pixels if ps.is_first_pp_rank else None, grid)
    assert out.deepstack == []
    return tower_result(ps, tower, layer_range, keys, embeds=out.image_embeds)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omnimesh.models.qwen2_5_omni.tiny import build_tiny_qwen2_5_omni  # here: spawned ranks import this module

    tiny = build_tiny_qwen2_5_omni(tmp_path_factory.mktemp("tiny25") / "qwen2.5-omni")
    out = with_random_tower(tiny, tmp_path_factory.mktemp("vision25") / "qwen2.5-omni", PREFIX)
    shutil.copy(tiny / "spk_dict.pt", out / "spk_dict.pt")  # transformers' from_pretrained wants the speakers
    return out


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> dict[str, Any]:
    return run_single(scenario, model_dir)


def test_windows_match_transformers(model_dir: Path) -> None:
    from transformers.vision_utils import get_vision_window_index

    config = vision_config(model_dir)
    assert config.depth == 2 and config.fullatt_block_indexes == [1] and config.num_heads == 4
    window = config.window_size // config.spatial_merge_size // config.patch_size
    for grids in (GRIDS, ((1, 8, 8),), ((1, 16, 16), (1, 2, 2)), ((3, 10, 4),)):
        grid = torch.tensor(grids)
        order, cu = window_index(grid, config.spatial_merge_size, window)
        expected_order, expected_cu = get_vision_window_index(grid, config.spatial_merge_size, config.window_size,
                                                              config.patch_size)
        assert torch.equal(order, expected_order) and torch.equal(cu, expected_cu), grids
    _, cu = window_index(torch.tensor(GRIDS), config.spatial_merge_size, window)
    assert cu.tolist() == [0, 64, 128, 160, 192, 224, 240, 264, 328, 360, 424, 456]  # 11 windows, 4 frames


def test_single_rank_matches_transformers(model_dir: Path, reference: dict[str, Any]) -> None:
    from transformers import Qwen2_5OmniForConditionalGeneration

    visual = Qwen2_5OmniForConditionalGeneration.from_pretrained(model_dir).thinker.model.visual
    pixels, grid = images()
    with torch.no_grad():
        expected = visual(pixels, grid_thw=grid).pooler_output
    assert reference["embeds"].shape == expected.shape == (114, 64)
    assert expected.abs().max() > 0.5, "outputs too small for the tolerance to mean anything"
    assert (reference["embeds"] - expected).abs().max() < EXACT_TOL
    # every parameter of transformers' tower is accounted for, nothing twice
    assert reference["param_bytes"] == sum(p.numel() * 4 for p in visual.parameters())
    assert set(reference["keys"]) == {PREFIX + n for n, _ in visual.named_parameters()}


def test_both_kinds_of_attention_matter(model_dir: Path, reference: dict[str, Any]) -> None:
    """Were every block full-attention, or every block windowed, the output would change: the input has
    several windows per frame and each kind of block runs."""
    config = vision_config(model_dir)
    tower = ParallelVisionTower2_5(config, ParallelState.single(), (0, config.depth))
    tower.load_weights(model_dir)
    pixels, grid = images()
    for full in ({0, 1}, set()):
        tower.full_attention = full
        out = vision_pipeline_step(tower, pixels, grid).image_embeds
        assert out is not None and (out - reference["embeds"]).abs().max() > 100 * LAYOUT_TOL, full


@pytest.mark.parametrize(("pp", "tp"), [(2, 1), (1, 2), (2, 2)])
def test_layout_matches_single_rank(pp: int, tp: int, model_dir: Path, reference: dict[str, Any]) -> None:
    check_vision_layout_2_5(vision_config(model_dir), pp, tp)  # sizes checked before any process exists
    ranks = run_layout(pp, tp, scenario, model_dir)
    for o in ranks[(pp - 1) * tp:]:  # every TP rank of the last pp rank
        assert (o["embeds"] - reference["embeds"]).abs().max() < LAYOUT_TOL, f"rank {o['rank']}"
    for o in ranks[:(pp - 1) * tp]:
        assert o["embeds"] is None

    assert_memory_split(ranks, reference, pp, tp, REPLICATED)

    assert_reads_own_blocks(ranks, "blocks", PREFIX + "patch_embed.proj.weight", PREFIX + "merger.mlp.0.weight", 2)


def test_tp_that_does_not_divide_the_heads_is_refused(model_dir: Path) -> None:
    assert_tp3_refused(check_vision_layout_2_5, ParallelVisionTower2_5, vision_config(model_dir), "vision tower's num_heads")


def test_a_batch_of_images_equals_each_image_alone_bit_for_bit(model_dir: Path) -> None:
    config = vision_config(model_dir)
    tower = ParallelVisionTower2_5(config, ParallelState.single(), (0, config.depth))
    tower.load_weights(model_dir)
    grids = ((1, 4, 4), (1, 12, 20), (2, 8, 12), (1, 16, 10))
    pixels, grid = images(grids, seed=9)
    together = vision_pipeline_step(tower, pixels, grid).image_embeds  # one thread: `one_thread`
    alone = [vision_pipeline_step(tower, p, g[None]).image_embeds
             for p, g in zip(pixels.split(grid.prod(-1).tolist()), grid)]
    assert together is not None
    assert torch.equal(together, torch.cat([a for a in alone if a is not None]))
