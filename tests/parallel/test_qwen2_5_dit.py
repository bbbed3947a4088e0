"""ParallelDiT (Qwen2.5-Omni's token2wav DiT decoder layers) equals transformers' layers, and over gloo.

Reference: transformers' `dit.transformer_blocks` loop (its whole token2wav, loaded alone) on 2 right-padded rows of
26 and 60 real frames (block_size 24: three blocks, the short row's padding spans two), with a per-row
block distance (`block_distance` below: transformers' (T, T) one, padding unreachable) and transformers' own
rotary table. Ours computes the same attention block-locally (`dit_attention`), which
`test_block_attention_equals_the_full_mask` checks alone against SDPA under that full mask, for every window,
ragged rows and lengths that are not whole blocks.
The folder is the tiny one with the DiT's layers re-drawn at O(1) (`with_random_tower`: weights
N(0, 1/fan_in)), since the tiny init's gates (std 0.02) leave attention all but invisible;
`test_the_mask_and_rope_matter` proves the comparison sees a wrong mask or a missing RoPE (~2 vs 1e-5).
Ours at pp = tp = 1 (through `DiTBackend`, in-process) must equal it within 1e-5; gloo layouts (2,1),
(1,2), (2,2) of the rank program must equal pp = tp = 1 within 1e-4 on the real frames, over two steps
whose rows change length, with each rank reading only its layers and holding <= 1.1 x its share of the
parameters plus the replicated modulation linears and row-parallel biases.

Run: python -m pytest tests/parallel/test_qwen2_5_dit.py -q
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from gloo_harness import (  # one_thread: autouse here
    assert_memory_split,
    fake_tp3,
    layers_read,
    one_thread,  # noqa: F401
    param_sizes,
    run_layout,
    run_single,
    with_random_tower,
)

from omnimesh.models.qwen2_5_omni.dit_attention import block_attention, window_mask
from omnimesh.models.qwen2_5_omni.dit_shard import DiTBackend, DiTShard, DiTShardSpec, DiTStep
from omnimesh.models.qwen2_5_omni.parallel_dit import ParallelDiT, check_dit_layout, dit_rotary
from omnimesh.parallel.parallel_state import ParallelState

TOL, GLOO_TOL = 1e-5, 1e-4
PREFIX = "token2wav.code2wav_dit_model."
STEPS = ((26, 60), (60, 13))  # real frames per row, T = the longest
HIDDEN = 64
UNREACHABLE = 1 << 20  # a block distance no layer's look-ahead/-back window reaches: masked


def block_distance(block_size: int, frames: list[int], total: int) -> torch.Tensor:
    """(B, 1, T, T) int64: transformers' block distance (key block - query block) for the real frames of each
    row; UNREACHABLE from a real frame to a padded one and between padded frames, 0 from a padded frame to
    itself (the reference the block-local masks must agree with)."""
    blocks = torch.arange(total) // block_size
    distance = blocks.unsqueeze(0) - blocks.unsqueeze(1)
    eye = torch.eye(total, dtype=torch.bool)
    rows = []
    for n in frames:
        real = torch.arange(total) < n
        both = real.unsqueeze(1) & real.unsqueeze(0)
        rows.append(torch.where(both, distance, torch.where(eye & ~real.unsqueeze(1), 0, UNREACHABLE)))
    return torch.stack(rows).unsqueeze(1)


@pytest.mark.parametrize("window", [(0, 0), (1, 0), (0, 1), (1, 1), (2, 1)])
@pytest.mark.parametrize("frames", [(26, 60), (60, 13, 1), (5,), (24, 48), (97, 200, 130)])
def test_block_attention_equals_the_full_mask(window: tuple[int, int], frames: tuple[int, ...]) -> None:
    """Each real frame's output equals SDPA over (R, heads, T, T) under transformers' mask to float rounding;
    padded frames stay finite. Block 8 (so the rows span 1-25 blocks, ragged ends)."""
    gen = torch.Generator().manual_seed(sum(frames) + 7 * window[0] + window[1])
    bs, back, ahead, T = 8, *window, max(frames)
    q, k, v = (torch.randn(len(frames), 3, T, 16, generator=gen) for _ in range(3))
    distance = block_distance(bs, list(frames), T)
    full = (distance >= -back) & (distance <= ahead)  # transformers' mask
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=full)
    got = block_attention(q, k, v, window_mask(bs, frames, T, back, ahead, "cpu"), bs, back, ahead)
    assert got.shape == want.shape and torch.isfinite(got).all()
    for r, n in enumerate(frames):
        assert (got[r, :, :n] - want[r, :, :n]).abs().max() < 1e-5
    # the window is what decides: one block less either way gives other outputs wherever a frame sees a neighbour
    if ahead and max(frames) > bs:
        narrower = block_attention(q, k, v, window_mask(bs, frames, T, back, 0, "cpu"), bs, back, 0)
        assert (narrower[:, :, :bs] - got[:, :, :bs]).abs().max() > 1e-2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omnimesh.models.qwen2_5_omni.tiny import build_tiny_qwen2_5_omni

    tiny = build_tiny_qwen2_5_omni(tmp_path_factory.mktemp("q25") / "model")
    folder = with_random_tower(tiny, tmp_path_factory.mktemp("dit") / "model", PREFIX + "transformer_blocks.")
    return folder


def dit_config(model_dir: Path) -> Any:
    from transformers import AutoConfig  # the config classes only

    return AutoConfig.from_pretrained(model_dir, local_files_only=True).token2wav_config.dit_config


def inputs(frames: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden (R, T, H) (padding noise too) and time_embedding (R, H), O(1)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(len(frames), max(frames), HIDDEN, generator=gen), torch.randn(len(frames), HIDDEN, generator=gen)


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> dict[str, Any]:
    """transformers' layers on STEPS[0]: the inputs, its rotary table and distance, its output."""
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavModel

    from omnimesh.models.loader import build_submodule

    whole: Any = build_submodule(model_dir, config_path="token2wav_config", factory=Qwen2_5OmniToken2WavModel,
                                 prefix="token2wav.", dtype=torch.float32)  # transformers' whole token2wav
    dit = whole.code2wav_dit_model
    frames = STEPS[0]
    hidden, t = inputs(frames, 0)
    T = hidden.shape[1]
    rotary = dit.rotary_embed(hidden, torch.arange(T)[None, :].repeat(len(frames), 1))
    distance = block_distance(dit.block_size, list(frames), T)
    out = hidden
    with torch.no_grad():
        for block in dit.transformer_blocks:
            out = block(out, t, position_embeddings=rotary, block_diff=distance)
    return {"hidden": hidden, "t": t, "rotary": rotary, "distance": distance, "out": out}


def test_single_rank_matches_transformers(model_dir: Path, hf: dict[str, Any]) -> None:
    cos, sin = dit_rotary(dit_config(model_dir), hf["hidden"].shape[1], "cpu", torch.float32)
    assert torch.equal(cos.expand_as(hf["rotary"][0]), hf["rotary"][0])  # every rank's own table: bit for bit
    assert torch.equal(sin.expand_as(hf["rotary"][1]), hf["rotary"][1])
    backend = DiTBackend.build(DiTShardSpec(model_dir))  # pp = tp = 1: in this process
    out = backend(hf["hidden"], hf["t"], STEPS[0])
    assert out.shape == hf["out"].shape and torch.isfinite(out).all()
    assert (out - hf["out"]).abs().max() < TOL
    # frame counts that do not describe the rows are refused by name, never run
    with pytest.raises(ValueError, match=r"frames must give one count per row of hidden \(2\), got 1"):
        backend(hf["hidden"], hf["t"], STEPS[0][:1])
    with pytest.raises(ValueError, match=r"frames must be one count in 1\.\.60 per row, got \[26, 61\]"):
        backend(hf["hidden"], hf["t"], (26, 61))


def test_the_mask_and_rope_matter(model_dir: Path, hf: dict[str, Any]) -> None:
    """Masks that ignore the padding move the short row's real frames, no RoPE moves every row: by far
    more than the tolerance, so the comparison above sees both."""
    model = ParallelDiT(dit_config(model_dir), ParallelState.single(), (0, 2))
    model.load_weights(model_dir)
    T, n = hf["hidden"].shape[1], STEPS[0][0]
    cos, sin, masks = model.geometry(STEPS[0], T)
    assert sorted(masks) == [(0, 1), (1, 0)]  # the tiny DiT's two layers: one looks back a block, one ahead
    plain = model.geometry((T, T), T)[2]
    unmasked = model(hf["hidden"], hf["t"], cos, sin, plain)
    assert (unmasked[0, :n] - hf["out"][0, :n]).abs().max() > 1e4 * TOL
    unrotated = model(hf["hidden"], hf["t"], torch.ones_like(cos), torch.zeros_like(sin), masks)
    assert (unrotated - hf["out"]).abs().max() > 1e4 * TOL
    with pytest.raises(ValueError, match=r"the \(1, 0\) window mask must be \(R x blocks = 6, 1, 24, \.\.\.\), "
                                         r"got \(1, 1, 24, 48\)"):
        model(hf["hidden"], hf["t"], cos, sin, model.geometry((13,), 13)[2])  # another step's masks


def scenario(ps: ParallelState, model_dir: Path) -> dict[str, Any]:
    """The rank program over STEPS (rows change length between them): the owner's outputs + accounting."""
    shard = DiTShard(DiTShardSpec(model_dir), ps)
    outs = [shard.execute(DiTStep(*inputs(frames, seed), frames)) for seed, frames in enumerate(STEPS)]
    model = shard.model
    return {"outs": outs if outs[0] is not None else None, "keys": list(shard.keys),
            "layer_range": (model.start, model.end), "param_bytes": model.param_bytes(), "sizes": param_sizes(model)}


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> dict[str, Any]:
    return run_single(scenario, model_dir)


@pytest.mark.parametrize(("pp", "tp"), [(2, 1), (1, 2), (2, 2)])
def test_layout_matches_single_rank(pp: int, tp: int, model_dir: Path, reference: dict[str, Any]) -> None:
    check_dit_layout(dit_config(model_dir), pp, tp)
    ranks = run_layout(pp, tp, scenario, model_dir)
    owner = (pp - 1) * tp  # last pipeline rank, tp rank 0
    for rank, o in enumerate(ranks):
        assert (o["outs"] is not None) == (rank == owner)
        start, end = o["layer_range"]
        assert layers_read(o["keys"], "transformer_blocks") == set(range(start, end))
        assert all(k.startswith(PREFIX + "transformer_blocks.") for k in o["keys"])
    for frames, got, want in zip(STEPS, ranks[owner]["outs"], reference["outs"]):
        for r, n in enumerate(frames):
            assert (got[r, :n] - want[r, :n]).abs().max() < GLOO_TOL
    assert_memory_split(ranks, reference, pp, tp, ("modulation", "to_out.bias", "fc2.bias"))


def test_layouts_that_do_not_divide_are_named(model_dir: Path) -> None:
    config = dit_config(model_dir)
    heads = (r"tensor-parallel size tp=3 must divide the token2wav DiT's num_attention_heads=4 .*"
             r"valid tp values for this tower: \[1, 2, 4\]")
    with pytest.raises(ValueError, match=heads):
        check_dit_layout(config, 1, 3)
    with pytest.raises(ValueError, match=heads):
        ParallelDiT(config, fake_tp3(), (0, 2))  # before any process group
    with pytest.raises(ValueError, match=r"pp=3 exceeds the model's 2 layers"):
        check_dit_layout(config, 3, 1)
    odd = copy.deepcopy(config)
    odd.hidden_size, odd.ff_mult = 66, 1  # 4 heads of 16 (inner 64, tp 2 divides), ff inner 66: tp 4 does not
    check_dit_layout(odd, 1, 2)
    with pytest.raises(ValueError, match=r"ff inner size \(hidden_size \* ff_mult\)=66 does not divide by "
                                         r"tensor-parallel size 4"):
        check_dit_layout(odd, 1, 4)
