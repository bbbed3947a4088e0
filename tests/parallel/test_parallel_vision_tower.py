"""ParallelVisionTower equals transformers' vision tower (pp = tp = 1), and every gloo layout equals pp = tp = 1.

The tiny folder's vision tower is re-drawn first (`with_random_tower`): the tiny build stores zero biases,
unit norms and 0.02-std weights, which would hide a misplaced bias or norm. Input: two images with grids
[1, 4, 4] and [1, 4, 6] (the position table is 8 x 8, so both are resampled) plus a 2-frame clip [2, 2, 4]
(attention per frame): 56 patches -> 14 tokens. The tiny tower has 2 blocks with deepstack at block 0, so
at pp = 2 the deepstack feature is made on pipeline rank 0 and must be relayed to rank 1.

Checks: pp = tp = 1 vs `Qwen3OmniMoeForConditionalGeneration.from_pretrained(...)`'s vision tower
(image_embeds and every deepstack feature) within 1e-5. Layouts (pp, tp) in {(2,1), (1,2), (2,2)}, as
gloo ranks spawned by tests/parallel/gloo_harness.py, equal pp = tp = 1 within 1e-4 on every TP rank of the
last pipeline rank. Each rank's parameter bytes are <= 1.1 x total / (pp*tp) + its named replicated parts,
and each rank reads only its own blocks and mergers. A tp that does not divide the heads is a ValueError
naming the numbers. A batch of images (the encoder stage's batching) gives each image, bit for bit, what
it gets alone: its mergers run one GEMM per image (`per_image`).

Run: python -m pytest tests/parallel/test_parallel_vision_tower.py -q
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
    one_thread,  # noqa: F401
    run_layout,
    run_single,
    thinker_sub_config,
    tower_result,
    with_random_tower,
)

from omnimesh.models.qwen3_omni.parallel_vision_tower import (
    ParallelVisionTower,
    check_vision_layout,
    per_image,
    vision_pipeline_step,
)
from omnimesh.parallel.parallel_state import ParallelState

PREFIX = "thinker.visual."
GRIDS = ((1, 4, 4), (1, 4, 6), (2, 2, 4))
EXACT_TOL = 1e-5
LAYOUT_TOL = 1e-4
# TP-replicated parameter-name parts: patch embedding + position table (first pp rank), layer norms,
# biases of row-parallel linears (attn.proj, and fc2 of every MLP and merger)
REPLICATED = ("patch_", "pos_embed", "norm", "ln_q", "attn.proj.bias", "fc2.bias")


def vision_config(model_dir: Path) -> Any:
    return thinker_sub_config(model_dir, "vision_config")


def images() -> tuple[torch.Tensor, torch.Tensor]:
    """pixel_values (N, C*T*P*P) and grid_thw (n, 3)."""
    grid = torch.tensor(GRIDS)
    return torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(4)), grid


def scenario(ps: ParallelState, model_dir: Path) -> dict[str, Any]:
    config = vision_config(model_dir)
    tower, layer_range, keys = load_tower_rank(ParallelVisionTower, config, config.depth, ps, model_dir)
    pixels, grid = images()
    out = vision_pipeline_step(tower, pixels if ps.is_first_pp_rank else None, grid)
    return tower_result(ps, tower, layer_range, keys, embeds=out.image_embeds,  # deepstack (n, tokens, out):
                        deepstack=torch.stack(out.deepstack) if ps.is_last_pp_rank else None)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_random_tower(build_tiny(tmp_path_factory), tmp_path_factory.mktemp("vision") / "qwen3-omni", PREFIX)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> dict[str, Any]:
    return run_single(scenario, model_dir)


def test_single_rank_matches_transformers(model_dir: Path, reference: dict[str, Any]) -> None:
    from transformers import Qwen3OmniMoeForConditionalGeneration

    visual = Qwen3OmniMoeForConditionalGeneration.from_pretrained(model_dir).thinker.model.visual
    pixels, grid = images()
    with torch.no_grad():
        expected = visual(pixels, grid_thw=grid)
    assert reference["embeds"].shape == expected.pooler_output.shape == (14, 64)
    assert expected.pooler_output.abs().max() > 0.5, "outputs too small for the tolerance to mean anything"
    assert (reference["embeds"] - expected.pooler_output).abs().max() < EXACT_TOL
    assert len(expected.deepstack_features) == reference["deepstack"].shape[0] == 1
    for ours, theirs in zip(reference["deepstack"], expected.deepstack_features):
        assert (ours - theirs).abs().max() < EXACT_TOL
    # every parameter of transformers' tower is accounted for, nothing twice
    assert reference["param_bytes"] == sum(p.numel() * 4 for p in visual.parameters())
    assert set(reference["keys"]) == {PREFIX + n for n, _ in visual.named_parameters()}


@pytest.mark.parametrize(("pp", "tp"), [(2, 1), (1, 2), (2, 2)])
def test_layout_matches_single_rank(pp: int, tp: int, model_dir: Path, reference: dict[str, Any]) -> None:
    check_vision_layout(vision_config(model_dir), pp, tp)  # sizes checked before any process exists
    ranks = run_layout(pp, tp, scenario, model_dir)
    for o in ranks[(pp - 1) * tp:]:  # every TP rank of the last pp rank: embeds and the relayed deepstack
        assert (o["embeds"] - reference["embeds"]).abs().max() < LAYOUT_TOL, f"rank {o['rank']}"
        assert o["deepstack"].shape == reference["deepstack"].shape
        assert (o["deepstack"] - reference["deepstack"]).abs().max() < LAYOUT_TOL, f"rank {o['rank']}"

    assert_memory_split(ranks, reference, pp, tp, REPLICATED)

    assert_reads_own_blocks(ranks, "blocks", PREFIX + "patch_embed.proj.weight", PREFIX + "merger.mlp.0.weight", 2)
    for o in ranks:  # the deepstack merger of block 0 with that block
        assert (PREFIX + "merger_list.0.mlp.0.weight" in o["keys"]) == (o["layer_range"][0] == 0)


def test_tp_that_does_not_divide_the_heads_is_refused(model_dir: Path) -> None:
    assert_tp3_refused(check_vision_layout, ParallelVisionTower, vision_config(model_dir), "vision tower's num_heads")


def test_a_batch_of_images_equals_each_image_alone_bit_for_bit(model_dir: Path) -> None:
    """Grids of 16 to 320 patches, so one GEMM over the batch has other shapes than each image's own."""
    config = vision_config(model_dir)
    ps = ParallelState.single()
    tower = ParallelVisionTower(config, ps, (0, config.depth))
    tower.load_weights(model_dir)
    grids = [[1, 4, 4], [1, 8, 10], [1, 12, 12], [1, 16, 20], [2, 6, 8]]
    gen = torch.Generator().manual_seed(9)
    pixels = [torch.randn(t * h * w, 3 * 2 * 16 * 16, generator=gen) for t, h, w in grids]
    together = vision_pipeline_step(tower, torch.cat(pixels), torch.tensor(grids))  # one thread: `one_thread`
    alone = [vision_pipeline_step(tower, p, torch.tensor([g])) for p, g in zip(pixels, grids)]
    assert together.image_embeds is not None
    assert torch.equal(together.image_embeds, torch.cat([a.image_embeds for a in alone]))
    for i, feature in enumerate(together.deepstack):
        assert torch.equal(feature, torch.cat([a.deepstack[i] for a in alone]))
    # per_image itself: fn sees each image's rows apart (a fn that reads its first row shows the split)
    x = torch.arange(12.0).view(6, 2)
    assert torch.equal(per_image(lambda part: part - part[0], x, [2, 4]), torch.cat([x[:2] - x[0], x[2:] - x[2]]))
    assert torch.equal(per_image(lambda part: part - part[0], x, [6]), x - x[0])
