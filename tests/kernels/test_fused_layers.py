"""Whole decoder layers in one kernel call (`cpu_kernels`' dense_layer and decode_layer) against the same layers
run op by op (`fusable` off: the kernels one by one with Python between them).

What it proves:
- a decode-only batched step of a thinker layer (MoE), a talker layer (MoE + shared expert), a dense-MLP
  layer and a Qwen2.5-Omni layer (q/k/v biases, no q/k norm) gives the same output bit for bit, and writes the
  same keys and values into the paged pool;
- a step with a prefill chunk, a request's own cache and a MoE step too big for its kernel are left to the
  op-by-op layer (the fused call says None);
- the code predictor's layer over its per-step cache (2 tokens, then 1 and 1; full causal and a sliding
  window) gives the same output and cache bit for bit, and the whole predictor the same codes, hidden states
  and codec sum;
- layers with tp > 1, another dtype, an o bias or two norm eps are not fused (a q/k/v bias is), and the ops
  refuse bad inputs with errors that name them.

Run: python -m pytest tests/kernels/test_fused_layers.py -q
"""

from __future__ import annotations

import copy
import types
from typing import Any

import pytest
import torch

from omnimesh.kernels import cpu_kernels
from omnimesh.models.qwen3_omni import parallel_code_predictor as pcp
from omnimesh.models.qwen3_omni.paged_kv import BatchLayout, PagedBatch, PagedKVPool
from omnimesh.models.qwen3_omni.parallel_text_model import (
    KVCache,
    ParallelDecoderLayer,
    ParallelSparseMoe,
    fusable_layer,
)
from omnimesh.models.qwen3_omni.tiny_config import tiny_qwen3_omni_config
from omnimesh.parallel.parallel_state import ParallelState

DECODES = [(1, 6, [3, 9]), (1, 2, [1]), (1, 11, [0, 5, 12])]  # (new, past, block table): one token each
BLOCK = 4


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    assert cpu_kernels.load(), f"the CPU kernels did not load here: {cpu_kernels.status()}"


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randomized(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = gen(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return module


def decoder_layer(kind: str) -> ParallelDecoderLayer:
    if kind == "qwen2.5":
        from omnimesh.models.qwen2_5_omni.tiny_config import tiny_qwen2_5_omni_config

        text = tiny_qwen2_5_omni_config().thinker_config.text_config
        layer = ParallelDecoderLayer(text, 0, ParallelState.single(), torch.float32, is_talker=False)
        assert layer.self_attn.qkv_proj.bias is not None and layer.self_attn.qk_norms is None
        return randomized(layer, seed=7)  # type: ignore[return-value]
    config = tiny_qwen3_omni_config()
    text = copy.deepcopy((config.talker_config if kind == "talker" else config.thinker_config).text_config)
    if kind == "dense":
        text.mlp_only_layers = [0]
    layer = ParallelDecoderLayer(text, 0, ParallelState.single(), torch.float32, is_talker=kind == "talker")
    assert isinstance(layer.mlp, ParallelSparseMoe) == (kind != "dense")
    assert (kind == "talker") == (getattr(layer.mlp, "shared_expert", None) is not None)
    return randomized(layer, seed=len(kind))  # type: ignore[return-value]


def pools(layer: ParallelDecoderLayer, seed: int, blocks: int = 16,
          block: int = BLOCK) -> tuple[PagedKVPool, PagedKVPool]:
    """Two pools of `blocks` blocks of `block` tokens for `layer`'s keys and values, with the same random contents."""
    attn = layer.self_attn
    kv, D = attn.qkv_proj.kv_size // attn.head_dim, attn.head_dim
    a, b = (PagedKVPool((0, 1), blocks, block, kv, D, torch.float32, "cpu") for _ in range(2))
    g = gen(seed)
    for pool in (a, b):
        pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=g))
        pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=g))
        g = gen(seed)  # the same contents in both
    return a, b


def step_inputs(layer: ParallelDecoderLayer, n: int, seed: int) -> tuple[torch.Tensor, ...]:
    g, D = gen(seed), layer.self_attn.head_dim
    x = torch.randn(1, n, layer.input_layernorm.weight.shape[0], generator=g)
    return x, torch.randn(1, n, D, generator=g), torch.randn(1, n, D, generator=g)  # x, cos, signed sin


@pytest.mark.parametrize("kind", ["thinker", "talker", "dense", "qwen2.5"])
def test_a_decode_step_equals_the_op_by_op_layer(kind: str) -> None:
    assert decode_step_equal(decoder_layer(kind), DECODES, BLOCK, seed=3), "a decode-only step must take the fused layer"


def decode_step_equal(layer: ParallelDecoderLayer, decodes: list[tuple[int, int, list[int]]], block: int,
                      seed: int) -> bool:
    """A decode-only step of `decodes` through `layer` op by op and as one fused call, over two pools of the
    same contents: False when the fused call leaves it to the op-by-op layer; else the same output and pool
    writes bit for bit (asserted)."""
    eager_pool, fused_pool = pools(layer, seed=seed, blocks=16, block=block)
    layout = BatchLayout.build(decodes, block)
    x, cos, sin = step_inputs(layer, layout.num_tokens, seed=seed + 1)
    with torch.inference_mode():
        layer.fusable = False
        want = layer(x, cos, sin, PagedBatch(eager_pool, layout))
        layer.fusable = True
        got = layer._fused(x, cos, sin, PagedBatch(fused_pool, layout))
    if got is None:
        return False
    assert torch.equal(got, want)
    assert torch.equal(fused_pool.k[0], eager_pool.k[0]) and torch.equal(fused_pool.v[0], eager_pool.v[0])
    return True


def test_prefill_rows_own_caches_and_large_moe_steps_run_op_by_op() -> None:
    layer = decoder_layer("talker")
    pool, _ = pools(layer, seed=5)
    with_prefill = BatchLayout.build(DECODES + [(3, 5, [4, 7])], BLOCK)
    x, cos, sin = step_inputs(layer, with_prefill.num_tokens, seed=6)
    with torch.inference_mode():
        assert layer._fused(x, cos, sin, PagedBatch(pool, with_prefill)) is None
        assert layer._fused(x[:, :1], cos[:, :1], sin[:, :1], KVCache((0, 1))) is None
        moe = layer.mlp
        assert isinstance(moe, ParallelSparseMoe)
        big = next(n for n in range(1, 1 << 16) if not moe.fits(n))
        assert big > len(DECODES)
    # a decode-only step of `big` requests: one token each, one block each
    many = BatchLayout.build([(1, 0, [b % 16]) for b in range(big)], BLOCK)
    x, cos, sin = step_inputs(layer, big, seed=7)
    with torch.inference_mode():
        assert layer._fused(x, cos, sin, PagedBatch(pool, many)) is None


def predictor_config(window: int | None) -> Any:
    config = copy.deepcopy(tiny_qwen3_omni_config().talker_config.code_predictor_config)
    if window is not None:
        config.sliding_window = window
        config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    return config


@pytest.mark.parametrize("window", [None, 2])
def test_a_code_predictor_layer_equals_the_op_by_op_layer(window: int | None) -> None:
    config = predictor_config(window)
    layer = randomized(pcp.ParallelCodePredictorLayer(config, 0, ParallelState.single(), torch.float32), seed=8)
    assert layer.self_attn.window == window
    predictor_steps_equal(layer, config.hidden_size, window, seed=9)


def predictor_steps_equal(layer: Any, hidden: int, window: int | None, seed: int) -> None:
    """The predictor's steps (the 2-row prefix, then one residual code at a time) through `layer` fused and op by
    op over caches of their own: the same output and cache bit for bit at each step."""
    eager, fused = KVCache((0, 1)), KVCache((0, 1))
    g, B, D = gen(seed), 3, layer.self_attn.head_dim
    with torch.inference_mode():
        for T in (2, 1, 1):
            x = torch.randn(B, T, hidden, generator=g)
            cos, sin = torch.randn(1, T, D, generator=g), torch.randn(1, T, D, generator=g)
            seen = eager.get_seq_length()
            mask = pcp.causal_window_mask(T, seen, seen, window, x.device)
            layer.fusable = False
            want = layer(x, cos, sin, eager, mask)
            layer.fusable = True
            got = layer._fused(x, cos, sin, fused)
            assert got is not None
            assert torch.equal(got, want)
            for a, b in zip(fused.history(0), eager.history(0)):
                assert a is not None and b is not None and torch.equal(a, b)


def test_the_whole_code_predictor_gives_the_same_codes_fused() -> None:
    config = predictor_config(None)
    model = pcp.ParallelCodePredictor(config, ParallelState.single(), (0, config.num_hidden_layers))
    randomized(model, seed=10)
    prefix = torch.randn(5, 2, config.hidden_size, generator=gen(11))
    results = {}
    with torch.inference_mode():
        for on in (False, True):
            for layer in model.layers:
                layer.fusable = on
            results[on] = pcp.predict_residuals(model, prefix, batch=5)
    want, got = results[False], results[True]
    assert got.codes == want.codes
    assert all(torch.equal(a, b) for a, b in zip(got.hidden, want.hidden))
    assert want.codec_sum is not None and got.codec_sum is not None and torch.equal(got.codec_sum, want.codec_sum)


def test_only_one_rank_float32_layers_without_o_bias_with_one_eps_are_fused() -> None:
    layer = decoder_layer("thinker")
    attn, ln1, ln2 = layer.self_attn, layer.input_layernorm, layer.post_attention_layernorm
    one = ParallelState.single()
    assert layer.fusable and fusable_layer(one, torch.float32, attn, ln1, ln2)
    two_ranks = types.SimpleNamespace(tp_size=2)  # what the rule reads of a tp = 2 rank's state
    assert not fusable_layer(two_ranks, torch.float32, attn, ln1, ln2)  # type: ignore[arg-type]
    assert not fusable_layer(one, torch.bfloat16, attn, ln1, ln2)
    other_eps = copy.copy(ln2)
    other_eps.eps = ln1.eps * 10
    assert not fusable_layer(one, torch.float32, attn, ln1, other_eps)
    biased = copy.copy(attn)
    biased.o_proj = copy.copy(attn.o_proj)
    biased.o_proj.bias = torch.nn.Parameter(torch.zeros(1))
    assert not fusable_layer(one, torch.float32, biased, ln1, ln2)
    assert decoder_layer("qwen2.5").fusable  # a q/k/v bias: the qkv linear adds it inside the kernel


def test_the_layer_ops_refuse_bad_inputs_with_errors_that_name_them() -> None:
    ops = cpu_kernels.ops()
    layer = randomized(pcp.ParallelCodePredictorLayer(predictor_config(None), 0, ParallelState.single(), torch.float32), 12)
    x, D = torch.zeros(2, 1, 64), layer.self_attn.head_dim
    cos = sin = torch.zeros(1, 1, D)
    past = torch.zeros(2, 2, 3, D)
    with pytest.raises(RuntimeError, match="give both past keys and values or none"):
        ops.dense_layer(x, *layer._attn_args, cos, sin, past, None, *layer._mlp_args)
    with pytest.raises(RuntimeError, match=r"a fused layer takes x \(B, T, H\)"):
        ops.dense_layer(x[0], *layer._attn_args, cos, sin, None, None, *layer._mlp_args)
    with pytest.raises(RuntimeError, match="x must be float32"):
        ops.dense_layer(x.double(), *layer._attn_args, cos, sin, None, None, *layer._mlp_args)
    lm = decoder_layer("talker")
    pool, _ = pools(lm, seed=13)
    batch = PagedBatch(pool, BatchLayout.build(DECODES, BLOCK))
    args = batch.decode_only(0)
    assert args is not None
    xs, cs, sn = step_inputs(lm, len(DECODES), seed=14)
    with pytest.raises(RuntimeError, match=r"decode_layer takes x \(1, N, H\)"):
        ops.decode_layer(xs.expand(2, -1, -1), *lm._attn_args, cs, sn, *args, *lm._o_args, *lm._mlp_args)
    with pytest.raises(RuntimeError, match="write slot 99 is outside the pool's 64"):
        bad = (*args[:2], torch.tensor([99, 0, 1]), *args[3:])
        ops.decode_layer(xs, *lm._attn_args, cs, sn, *bad, *lm._o_args, *lm._mlp_args)
