"""omnimesh's fused CPU kernels at the widths of the released checkpoints, not only the tiny model's (hidden 64,
head_dim 16, 8 experts): vectorised loops over a 128-wide head, 8 query heads per key head, M-RoPE sections of
64 rotary pairs and a 152k vocabulary run code paths a 16-wide head never reaches.

What it proves, with random weights at these widths (one layer each, so the suite stays fast):
- q/k norm + RoPE, attention (decode, prefill, a window) and the paged decode over a pool, for Qwen3-Omni's
  thinker (32 query / 4 key heads of 128) and talker (16 / 2) heads, equal the eager formulas; the M-RoPE
  tables equal the eager ones for Qwen3-Omni's interleaved [24, 20, 20] and Qwen2.5-Omni's [16, 24, 24];
- greedy picks over a 152,064-id vocabulary (penalties, suppressed ids) equal the eager picks;
- a decode-only step of a Qwen2.5-Omni-3B thinker layer (2048 wide, 16 / 2 heads, MLP 11008, q/k/v biases) and
  of a Qwen3-Omni dense-MLP layer (2048 wide, 32 / 4 heads, q/k norms) takes the whole-layer kernel and gives
  the op-by-op layer's output and pool writes bit for bit; a Qwen3-Omni-30B-A3B MoE layer (768-wide experts,
  top 8) is past the MoE kernel's size and runs op by op;
- the code predictor's layer at Qwen3-Omni's widths (1024 wide, 16 / 8 heads, MLP 3072) equals its op-by-op
  layer and cache bit for bit.

Run: python -m pytest tests/kernels/test_kernels_at_real_widths.py -q
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from omnimesh.kernels import cpu_kernels
from omnimesh.models.qwen3_omni import parallel_code_predictor as pcp
from omnimesh.models.qwen3_omni.parallel_text_model import (
    MRotary,
    ParallelDecoderLayer,
    ParallelSparseMoe,
    RMSNorm,
    gqa_attention,
    qkv_heads,
    signed_sin,
)
from omnimesh.models.qwen3_omni.sampling import Sampler, SamplingParams, greedy_batch
from omnimesh.models.qwen3_omni.tiny_config import tiny_qwen3_omni_config
from omnimesh.parallel.layers import default_weight_loader
from omnimesh.parallel.parallel_state import ParallelState
from tests.kernels.test_cpu_kernels import eager, gen, paged_attend_equal
from tests.kernels.test_fused_layers import decode_step_equal, predictor_steps_equal

ATOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def kernels() -> Any:
    assert cpu_kernels.load(), f"the CPU kernels did not load here: {cpu_kernels.status()}"
    return cpu_kernels.ops()
QWEN3_MROPE = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [24, 20, 20], "interleaved": True}
QWEN2_5_MROPE = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}
DECODES = [(1, 37, [3, 9, 14, 4, 11]), (1, 2, [1]), (1, 60, [0, 5, 12, 2, 6, 7, 8, 10])]  # (new, past, blocks of 8)
BLOCK = 8


def scaled_randn(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights of a trained model's scale (0.02; norms around 1), so 2048-wide sums stay in float32's range."""
    g = gen(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.02 if p.dim() > 1 else 0.1) + ("norm" in name))
    return module


@pytest.mark.parametrize("heads,kv_heads", [(32, 4), (16, 2)])
def test_attention_kernels_at_128_wide_heads(kernels: Any, heads: int, kv_heads: int) -> None:
    g, D = gen(1), 128
    norms = (RMSNorm(D, 1e-6, torch.float32), RMSNorm(D, 1e-6, torch.float32))
    for n in norms:
        default_weight_loader(n.weight, torch.randn(D, generator=g))
    for B, T in ((1, 37), (4, 1), (3, 5)):
        qkv = torch.randn(B, T, (heads + 2 * kv_heads) * D, generator=g)
        cos, sin = torch.randn(1, 1, T, D, generator=g), signed_sin(torch.randn(1, 1, T, D, generator=g))
        want = eager(qkv_heads, qkv, heads, kv_heads, D, norms, cos, sin)
        for name, a, b in zip("qkv", qkv_heads(qkv, heads, kv_heads, D, norms, cos, sin), want):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-5, msg=f"{name} B={B} T={T}")
    for T, S, window in ((1, 300, 0), (37, 37, 0), (5, 100, 0), (4, 60, 24)):
        q = torch.randn(1, heads, T, D, generator=g)
        k, v = torch.randn(1, kv_heads, S, D, generator=g), torch.randn(1, kv_heads, S, D, generator=g)
        past = S - T
        mask = pcp.causal_window_mask(T, past, past, window or None, q.device)
        want = gqa_attention(q, k, v, heads // kv_heads, D**-0.5, mask, is_causal=mask is None and T > 1)
        torch.testing.assert_close(kernels.attention(q, k, v, past, 0, window, D**-0.5), want, atol=ATOL, rtol=1e-5,
                                   msg=f"T={T} S={S} window={window}")
    seqs = [(1, 40, [3, 9, 20]), (1, 2, [1]), (7, 50, [4, 7, 30, 31]), (1, 130, list(range(40, 49)))]  # a prefill too
    paged_attend_equal(heads, kv_heads, D, blocks=64, block=16, seqs=seqs, seed=2)


@pytest.mark.parametrize("model_type,rope", [("qwen3_omni_moe_text", QWEN3_MROPE), ("qwen2_5_omni_text", QWEN2_5_MROPE)])
def test_mrope_tables_for_64_rotary_pairs(model_type: str, rope: dict[str, Any]) -> None:
    rotary = MRotary(SimpleNamespace(model_type=model_type, head_dim=128, rope_parameters=rope))
    t = torch.arange(37, dtype=torch.float32)
    positions = torch.stack([t, t * 2 + 1, 90 - t]).view(3, 1, 37)  # t, h, w differ: every section is read
    for a, b in zip(rotary.tables(positions, torch.float32), eager(rotary.tables, positions, torch.float32)):
        assert a.shape == b.shape == (1, 37, 128)
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-6)


def test_greedy_picks_over_a_152k_vocabulary() -> None:
    g, B, V = gen(3), 6, 152_064
    for trial in range(8):
        logits = torch.randn(B, V, generator=g)
        histories = [torch.randint(0, V, (int(torch.randint(0, 300, (1,), generator=g)),), generator=g).tolist()
                     for _ in range(B)]
        params = SamplingParams(temperature=0.0, repetition_penalty=1.05 if trial % 2 else 1.0,
                                suppress_tokens=(3, 151_643, 152_000) if trial % 3 == 0 else ())
        fused = greedy_batch([Sampler(params) for _ in range(B)], logits, histories)
        with cpu_kernels.disabled():
            assert fused == greedy_batch([Sampler(params) for _ in range(B)], logits, histories), trial


def real_width_layer(kind: str) -> ParallelDecoderLayer:
    """One decoder layer of a released checkpoint's widths (random weights)."""
    if kind == "qwen2.5-3b":
        from omnimesh.models.qwen2_5_omni.tiny_config import tiny_qwen2_5_omni_config

        text = copy.deepcopy(tiny_qwen2_5_omni_config().thinker_config.text_config)
        text.hidden_size, text.intermediate_size, text.rope_parameters = 2048, 11008, dict(QWEN2_5_MROPE)
        text.num_attention_heads, text.num_key_value_heads, text.head_dim = 16, 2, 128
    else:  # Qwen3-Omni-30B-A3B's thinker widths
        text = copy.deepcopy(tiny_qwen3_omni_config().thinker_config.text_config)
        text.hidden_size, text.rope_parameters = 2048, dict(QWEN3_MROPE)
        text.num_attention_heads, text.num_key_value_heads, text.head_dim = 32, 4, 128
        text.moe_intermediate_size, text.num_experts, text.num_experts_per_tok, text.intermediate_size = 768, 16, 8, 6144
        text.mlp_only_layers = [0] if kind == "qwen3-dense" else []
    layer = ParallelDecoderLayer(text, 0, ParallelState.single(), torch.float32, is_talker=False)
    assert layer.self_attn.head_dim == 128
    return scaled_randn(layer, seed=len(kind))  # type: ignore[return-value]


@pytest.mark.parametrize("kind", ["qwen2.5-3b", "qwen3-dense", "qwen3-moe"])
def test_a_decode_step_of_a_real_width_layer_equals_the_op_by_op_layer(kind: str) -> None:
    layer = real_width_layer(kind)
    fused = decode_step_equal(layer, DECODES, BLOCK, seed=4)
    if kind == "qwen3-moe":  # 8 of 768-wide experts: past the MoE kernel's multiply-adds, so op by op
        assert isinstance(layer.mlp, ParallelSparseMoe) and not layer.mlp.fits(1) and not fused
    else:
        assert fused, "a decode-only step must take the fused layer"


def test_a_real_width_code_predictor_layer_equals_the_op_by_op_layer() -> None:
    config = copy.deepcopy(tiny_qwen3_omni_config().talker_config.code_predictor_config)
    config.hidden_size, config.intermediate_size = 1024, 3072
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 16, 8, 128
    layer = scaled_randn(pcp.ParallelCodePredictorLayer(config, 0, ParallelState.single(), torch.float32), seed=6)
    assert layer.self_attn.head_dim == 128
    predictor_steps_equal(layer, config.hidden_size, None, seed=7)
