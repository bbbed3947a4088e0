"""Whole decoder layers in one kernel call (`cpu_kernels`' dense_layer and decode_layer) against the same layers
run op by op (`fusable` off: the kernels one by one with Python between them).

What it proves:
- a decode-only batched step of a thinker layer (MoE), a talker layer (MoE + shared expert) and a dense-MLP
  layer gives the same output bit for bit, and writes the same keys and values into the paged pool;
- a step with a prefill chunk, a request's own cache and a MoE step too big for its kernel are left to the
  op-by-op layer (the fused call says None);
- the code predictor's layer over its per-step cache (2 tokens, then 1 and 1; full causal and a sliding
  window) gives the same output and cache bit for bit, and the whole predictor the same codes, hidden states
  and codec sum.

Run: python -m pytest tests/kernels/test_fused_layers.py -q
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from omnimesh.kernels import cpu_kernels
from omnimesh.models.qwen3_omni import parallel_code_predictor as pcp
from omnimesh.models.qwen3_omni.paged_kv import BatchLayout, PagedBatch, PagedKVPool
from omnimesh.models.qwen3_omni.parallel_text_model import KVCache, ParallelDecoderLayer, ParallelSparseMoe
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
    config = tiny_qwen3_omni_config()
    text = copy.deepcopy((config.talker_config if kind == "talker" else config.thinker_config).text_config)
    if kind == "dense":
        text.mlp_only_layers = [0]
    layer = ParallelDecoderLayer(text, 0, ParallelState.single(), torch.float32, is_talker=kind == "talker")
    assert isinstance(layer.mlp, ParallelSparseMoe) == (kind != "dense")
    assert (kind == "talker") == (getattr(layer.mlp, "shared_expert", None) is not None)
    return randomized(layer, seed=len(kind))  # type: ignore[return-value]


def pools(layer: ParallelDecoderLayer, seed: int) -> tuple[PagedKVPool, PagedKVPool]:
    attn = layer.self_attn
    kv, D = attn.qkv_proj.kv_size // attn.head_dim, attn.head_dim
    a, b = (PagedKVPool((0, 1), 16, BLOCK, kv, D, torch.float32, "cpu") for _ in range(2))
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


@pytest.mark.parametrize("kind", ["thinker", "talker", "dense"])
def test_a_decode_step_equals_the_op_by_op_layer(kind: str) -> None:
    layer = decoder_layer(kind)
    eager_pool, fused_pool = pools(layer, seed=3)
    layout = BatchLayout.build(DECODES, BLOCK)
    x, cos, sin = step_inputs(layer, layout.num_tokens, seed=4)
    with torch.inference_mode():
        layer.fusable = False
        want = layer(x, cos, sin, PagedBatch(eager_pool, layout))
        layer.fusable = True
        got = layer._fused(x, cos, sin, PagedBatch(fused_pool, layout))
    assert got is not None, "a decode-only step must take the fused layer"
    assert torch.equal(got, want)
    assert torch.equal(fused_pool.k[0], eager_pool.k[0]) and torch.equal(fused_pool.v[0], eager_pool.v[0])


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
    eager, fused = KVCache((0, 1)), KVCache((0, 1))
    g, B, D = gen(9), 3, layer.self_attn.head_dim
    with torch.inference_mode():
        for T in (2, 1, 1):  # the predictor's steps: the prefix, then one residual code at a time
            x = torch.randn(B, T, config.hidden_size, generator=g)
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
