"""omnimesh's fused CPU kernels (omnimesh/csrc/cpu_kernels.cpp) against the eager PyTorch code they replace.

What it proves:
- the kernels build and load on this machine (CI has g++ and ninja), and a model layer takes them only for
  float32 CPU tensors of small steps;
- each kernel equals the eager formula it stands in for, within float rounding, over the shapes the layers
  give it: RMSNorm (strided rows, with and without a weight), q/k norm + RoPE (GQA, per-row tables), the
  M-RoPE tables, attention (decode, prefill from empty, chunked prefill, a sliding window), the paged
  decode over a pool (ragged lengths beside a prefill chunk, the pool written the same), silu * up and the
  MoE step (shared expert, top-k renormalised or not, and a zero router whose tied weights must pick
  transformers' experts);
- bad inputs raise errors that name them, never crash;
- a whole thinker stage gives the same tokens with and without the kernels;
- OMNIMESH_CPU_KERNELS: 0 runs eager, an unknown value is refused, and a machine that cannot build them runs
  eager with a warning under `auto` and stops with an error under `1`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from omnimesh.kernels import cpu_kernels
from omnimesh.models.qwen3_omni.paged_kv import BatchLayout, PagedBatch, PagedKVPool
from omnimesh.models.qwen3_omni.parallel_code_predictor import causal_window_mask
from omnimesh.models.qwen3_omni.parallel_text_model import (
    MRotary,
    ParallelSparseMoe,
    RMSNorm,
    gqa_attention,
    qkv_heads,
    signed_sin,
)
from omnimesh.parallel.layers import default_weight_loader
from omnimesh.parallel.parallel_state import ParallelState

REPO = Path(__file__).resolve().parents[2]
ATOL = 2e-6


@pytest.fixture(scope="module", autouse=True)
def kernels() -> Any:
    assert cpu_kernels.load(), f"the CPU kernels did not load here: {cpu_kernels.status()}"
    return cpu_kernels.ops()


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_use_takes_only_float32_cpu_tensors() -> None:
    assert cpu_kernels.use(torch.zeros(3))
    assert not cpu_kernels.use(torch.zeros(3, dtype=torch.float64))
    assert not cpu_kernels.use(torch.zeros(3, dtype=torch.bfloat16))
    assert not cpu_kernels.use(torch.zeros(3, device="meta"))
    with cpu_kernels.disabled():
        assert not cpu_kernels.use(torch.zeros(3))
    assert cpu_kernels.use(torch.zeros(3))


@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_equals_eager(kernels: Any, weighted: bool) -> None:
    g = gen(0)
    w = torch.randn(64, generator=g) if weighted else None
    for x in (torch.randn(64, generator=g), torch.randn(3, 5, 64, generator=g),
              torch.randn(4, 6, 64, generator=g).transpose(0, 1),  # rows not contiguous
              torch.randn(2, 3, 100, generator=g)[..., 10:74]):  # a slice of wider rows
        want = F.rms_norm(x, (64,), w, 1e-6)
        torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6), want, atol=ATOL, rtol=1e-6)


def test_rms_norm_module_uses_the_kernel_and_eager_agrees() -> None:
    norm = RMSNorm(64, 1e-6, torch.float32)
    default_weight_loader(norm.weight, torch.randn(64, generator=gen(1)))
    x = torch.randn(2, 7, 64, generator=gen(2))
    with cpu_kernels.disabled():
        want = norm(x)
    torch.testing.assert_close(norm(x), want, atol=ATOL, rtol=1e-6)


def eager(fn: Any, *args: Any) -> Any:
    with cpu_kernels.disabled():
        return fn(*args)


@pytest.mark.parametrize("heads,kv_heads,B,T,per_row,normed", [
    (4, 2, 2, 3, False, True), (4, 4, 1, 1, False, True), (8, 2, 3, 2, True, True), (4, 1, 2, 5, True, False)])
def test_qk_norm_rope_equals_eager_qkv_heads(heads: int, kv_heads: int, B: int, T: int, per_row: bool,
                                             normed: bool) -> None:
    g, D = gen(3), 16
    norms = None
    if normed:
        norms = (RMSNorm(D, 1e-6, torch.float32), RMSNorm(D, 1e-6, torch.float32))
        for n in norms:
            default_weight_loader(n.weight, torch.randn(D, generator=g))
    qkv = torch.randn(B, T, (heads + 2 * kv_heads) * D, generator=g)
    rows = B if per_row else 1
    cos = torch.randn(rows, 1, T, D, generator=g)
    sin = signed_sin(torch.randn(rows, 1, T, D, generator=g))
    want = eager(qkv_heads, qkv, heads, kv_heads, D, norms, cos, sin)
    got = qkv_heads(qkv, heads, kv_heads, D, norms, cos, sin)
    for name, a, b in zip("qkv", got, want):
        assert a.shape == b.shape, name
        assert a.is_contiguous(), name
        torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-6, msg=name)


def test_mrope_tables_equal_eager_m_rotary() -> None:
    class Config:
        model_type = "qwen3_omni_moe_text"
        head_dim = 16
        rope_parameters = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}

    rotary = MRotary(Config())
    t = torch.arange(9, dtype=torch.float32)
    positions = torch.stack([t, t * 2 + 1, 40 - t]).view(3, 1, 9)  # t, h, w differ: every section is read
    want = eager(rotary.tables, positions, torch.float32)
    got = rotary.tables(positions, torch.float32)
    for a, b in zip(got, want):
        assert a.shape == b.shape == (1, 9, 16)
        torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-6)


@pytest.mark.parametrize("T,S,window", [(1, 9, 0), (5, 5, 0), (3, 11, 0), (4, 10, 6), (1, 30, 7)])
def test_attention_equals_sdpa_with_the_layers_masks(kernels: Any, T: int, S: int, window: int) -> None:
    g, B, heads, kv_heads, D = gen(4), 2, 4, 2, 16
    q = torch.randn(B, heads, T, D, generator=g)
    k, v = torch.randn(B, kv_heads, S, D, generator=g), torch.randn(B, kv_heads, S, D, generator=g)
    past = S - T  # every key kept (KVCache): the queries are the last T positions
    mask = causal_window_mask(T, past, past, window or None, q.device)
    want = gqa_attention(q, k, v, heads // kv_heads, D**-0.5, mask, is_causal=mask is None and T > 1)
    torch.testing.assert_close(kernels.attention(q, k, v, past, 0, window, D**-0.5), want, atol=ATOL, rtol=1e-5)


def test_attention_over_a_window_of_stored_keys(kernels: Any) -> None:
    """Keys that start later than position 0 (a sliding cache keeps only the latest): k_start places them."""
    g, T, stored, seen, window, D = gen(5), 3, 6, 20, 7, 16
    q = torch.randn(1, 2, T, D, generator=g)
    k, v = torch.randn(1, 2, stored + T, D, generator=g), torch.randn(1, 2, stored + T, D, generator=g)
    mask = causal_window_mask(T, seen, stored, window, q.device)
    want = gqa_attention(q, k, v, 1, D**-0.5, mask)
    torch.testing.assert_close(kernels.attention(q, k, v, seen, seen - stored, window, D**-0.5), want, atol=ATOL,
                               rtol=1e-5)


def test_paged_decode_equals_the_gathered_sdpa_path() -> None:
    """A step of three decodes (ragged histories) and a chunked prefill over a shared pool: the fused path
    gives the same attention and writes the same keys / values into the pool as the eager one."""
    seqs = [(1, 6, [3, 9]), (1, 2, [1]), (3, 5, [4, 7]), (1, 11, [0, 5, 12])]  # (new, past, block table)
    paged_attend_equal(heads=4, kv_heads=2, D=16, blocks=16, block=4, seqs=seqs, seed=6)


def paged_attend_equal(heads: int, kv_heads: int, D: int, blocks: int, block: int,
                       seqs: list[tuple[int, int, list[int]]], seed: int) -> None:
    """One layer's attention of a step (`seqs`: new rows, cached rows, block table each) over a pool of random
    contents, fused and eager: the same attention within float rounding, the same pool writes exactly."""
    g = gen(seed)
    pool, fused_pool = (PagedKVPool((0, 1), blocks, block, kv_heads, D, torch.float32, "cpu") for _ in range(2))
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=g))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=g))
    fused_pool.k[0].copy_(pool.k[0])
    fused_pool.v[0].copy_(pool.v[0])
    layout = BatchLayout.build(seqs, block)
    N = layout.num_tokens
    q = torch.randn(1, heads, N, D, generator=g)
    k, v = torch.randn(1, kv_heads, N, D, generator=g), torch.randn(1, kv_heads, N, D, generator=g)
    with cpu_kernels.disabled():
        eager_batch = PagedBatch(pool, layout)
        assert not eager_batch.fused
        want = eager_batch.attend(0, q, k, v, heads // kv_heads, D**-0.5)
    batch = PagedBatch(fused_pool, layout)
    assert batch.fused
    got = batch.attend(0, q, k, v, heads // kv_heads, D**-0.5)
    torch.testing.assert_close(got, want, atol=ATOL * max(1, D // 16), rtol=1e-5)
    assert torch.equal(fused_pool.k[0], pool.k[0]) and torch.equal(fused_pool.v[0], pool.v[0])


def test_silu_mul_equals_eager(kernels: Any) -> None:
    g = gen(7)
    for x in (torch.randn(5, 64, generator=g), torch.randn(8, 3, 64, generator=g), torch.randn(2, 9, 128, generator=g)[:, ::2]):
        gate, up = x.chunk(2, dim=-1)
        torch.testing.assert_close(kernels.silu_mul(x), F.silu(gate) * up, atol=ATOL, rtol=1e-6)


class MoeConfig:
    hidden_size, num_experts, num_experts_per_tok, moe_intermediate_size, shared_expert_intermediate_size = 64, 8, 2, 32, 48

    def __init__(self, norm_topk: bool) -> None:
        self.norm_topk_prob = norm_topk


def moe_block(shared: bool, norm_topk: bool, zero_router: bool, seed: int) -> ParallelSparseMoe:
    ps = ParallelState(world_size=1, rank=0, pp_size=1, tp_size=1, pp_rank=0, tp_rank=0, backend="gloo",
                       device=torch.device("cpu"))
    block = ParallelSparseMoe(MoeConfig(norm_topk), ps, torch.float32, shared=shared)  # type: ignore[arg-type]
    g = gen(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        if zero_router:
            block.router.zero_()  # every expert weighs 1/E: the top-k choice is the tie order
    return block


@pytest.mark.parametrize("shared,norm_topk,zero_router", [
    (False, True, False), (True, False, False), (True, False, True), (False, True, True)])
def test_moe_step_equals_the_eager_block(shared: bool, norm_topk: bool, zero_router: bool) -> None:
    block = moe_block(shared, norm_topk, zero_router, seed=8)
    g = gen(9)
    for tokens in (1, 5, 16):
        x = torch.randn(1, tokens, 64, generator=g)
        assert block.fused(x[0])
        want = eager(block, x)
        torch.testing.assert_close(block(x), want, atol=ATOL, rtol=1e-5)


def test_moe_step_leaves_large_steps_to_aten() -> None:
    block = moe_block(True, False, False, seed=10)
    assert not block.fused(torch.zeros(4096, 64))
    assert not block.fused(torch.zeros(4, 64, dtype=torch.float64))


def test_bad_inputs_raise_errors_that_name_them(kernels: Any) -> None:
    with pytest.raises(RuntimeError, match="x must be float32"):
        kernels.rms_norm(torch.zeros(2, 4, dtype=torch.float64), None, 1e-6)
    with pytest.raises(RuntimeError, match="weight has 3 values for rows of 4"):
        kernels.rms_norm(torch.zeros(2, 4), torch.zeros(3), 1e-6)
    with pytest.raises(RuntimeError, match=r"qkv must be \(B, T, \(heads \+ 2 kv_heads\) head_dim\)"):
        kernels.qk_norm_rope(torch.zeros(1, 2, 10), 4, 2, 16, None, None, 1e-6, torch.zeros(1, 2, 16), torch.zeros(1, 2, 16))
    with pytest.raises(RuntimeError, match="sees no key"):
        kernels.attention(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), 0, 5, 0, 1.0)
    q, kv = torch.zeros(1, 2, 1, 8), torch.zeros(1, 1, 1, 8)
    pool = torch.zeros(4, 1, 8)
    one = torch.tensor([0])
    with pytest.raises(RuntimeError, match="write slot 9 is outside the pool's 4"):
        kernels.paged_decode(q, kv, kv, pool, pool.clone(), torch.tensor([9]), one, torch.tensor([[0]]), torch.tensor([1]),
                             1.0, torch.zeros(1, 2, 1, 8))
    with pytest.raises(RuntimeError, match="slot 7 is outside the pool's 4"):
        kernels.paged_decode(q, kv, kv, pool, pool.clone(), one, one, torch.tensor([[7]]), torch.tensor([1]), 1.0,
                             torch.zeros(1, 2, 1, 8))
    with pytest.raises(RuntimeError, match="top_k 9 must be in 1..8"):
        kernels.moe(torch.zeros(1, 4), torch.zeros(8, 4), torch.zeros(8, 6, 4), torch.zeros(8, 4, 3), 9, True, None, None,
                    None)


def test_a_thinker_stage_gives_the_same_tokens_with_and_without_the_kernels(tmp_path: Path) -> None:
    from omnimesh.config.serve_args import ServeArgs
    from omnimesh.models.qwen3_omni.tiny import build_tiny_qwen3_omni
    from services.llm.thinker_handler import build_handler
    from tests.services.test_lm_batching import Driver, open_thinker, prompts, token_ids

    handler = build_handler(build_tiny_qwen3_omni(tmp_path / "m"), ServeArgs(max_model_len=96))
    ids = prompts([5, 17, 9, 30], seed=11)

    def run() -> dict[str, list[int]]:
        d = Driver(handler)
        d.add(*(open_thinker(handler, f"r{i}", p, 24) for i, p in enumerate(ids)))
        return {rid: token_ids(chunks) for rid, chunks in d.run().items()}

    with torch.inference_mode():
        fused = run()
        with cpu_kernels.disabled():
            plain = run()
    assert fused == plain and all(len(t) == 24 for t in fused.values())


def probe(env: dict[str, str]) -> subprocess.CompletedProcess:
    code = ("import logging; logging.basicConfig(level=logging.INFO)\n"
            "from omnimesh.kernels import cpu_kernels as k\n"
            "try:\n    print('loaded' if k.load() else 'eager', k.status())\n"
            "except Exception as e:\n    print('error', type(e).__name__, e)\n")
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=120)


def test_env_zero_runs_eager_and_an_unknown_value_is_refused() -> None:
    off = probe({cpu_kernels.ENV: "0"})
    assert off.stdout.startswith("eager OMNIMESH_CPU_KERNELS=0"), off.stdout + off.stderr
    bad = probe({cpu_kernels.ENV: "sometimes"})
    assert "error ValueError" in bad.stdout and "use auto, 0 (eager PyTorch) or 1 (required)" in bad.stdout


def test_a_machine_that_cannot_build_runs_eager_or_stops_when_they_are_required(tmp_path: Path) -> None:
    env = {"OMNIMESH_CACHE": str(tmp_path), "CXX": str(tmp_path / "no-such-compiler")}  # an empty cache: must build
    auto = probe(env)
    assert auto.stdout.startswith("eager "), auto.stdout + auto.stderr
    assert "omnimesh CPU kernels unavailable" in auto.stderr and "Install g++ and ninja" in auto.stderr
    required = probe({**env, cpu_kernels.ENV: "1"})
    assert "error KernelsUnavailable" in required.stdout and "install g++ and ninja" in required.stdout


def test_large_calls_spread_over_threads_with_the_same_values(kernels: Any) -> None:
    """Rows are independent, so a call split over two intra-op threads gives the bits of one thread; an error
    raised on a worker thread reaches the caller."""
    from tests.models.qwen3_omni_fixtures import torch_threads

    g = gen(12)
    x, w = torch.randn(4096, 64, generator=g), torch.randn(64, generator=g)
    act = 3 * torch.randn(2, 16, 40000, generator=g)
    alpha, inv_beta = torch.rand(1, 16, 1, generator=g) + 0.5, torch.rand(1, 16, 1, generator=g)
    q, k = torch.randn(64, 4, 3, 16, generator=g), torch.randn(64, 2, 9, 16, generator=g)
    calls = [lambda: kernels.rms_norm(x, w, 1e-6), lambda: kernels.snake(act, alpha, inv_beta),
             lambda: kernels.silu_mul(x), lambda: kernels.attention(q, k, k, 6, 0, 0, 0.25)]
    with torch_threads(1):
        one = [f() for f in calls]
    with torch_threads(2):
        two = [f() for f in calls]
        with pytest.raises(RuntimeError, match="sees no key"):
            kernels.attention(q, k, k, 0, 4, 0, 0.25)  # keys start after the first queries: an error on a worker
    for a, b in zip(one, two):
        assert torch.equal(a, b)


def test_greedy_pick_equals_the_eager_greedy_batch() -> None:
    """Penalty over each row's history (ids past the vocabulary ignored), suppressed ids, ties and a NaN: the
    kernel picks what the eager ops pick, row by row."""
    from omnimesh.models.qwen3_omni.sampling import Sampler, SamplingParams, greedy_batch

    g = gen(13)
    for trial in range(120):
        B, V = 5, 300
        logits = torch.randn(B, V, generator=g)
        if trial % 3 == 0:
            logits = logits.round(decimals=1)  # many ties: the first maximum wins
        if trial % 7 == 0:
            logits[1, 17] = float("nan")  # torch.argmax: the NaN
        histories = [torch.randint(0, V + 20, (int(torch.randint(0, 30, (1,), generator=g)),), generator=g).tolist()
                     for _ in range(B)]
        params = SamplingParams(temperature=0.0, repetition_penalty=1.05 if trial % 2 else 1.0,
                                suppress_tokens=(3, 7, 250) if trial % 5 == 0 else ())
        fused = greedy_batch([Sampler(params) for _ in range(B)], logits, histories)
        with cpu_kernels.disabled():
            eager_ids = greedy_batch([Sampler(params) for _ in range(B)], logits, histories)
        assert fused == eager_ids, trial


def test_greedy_pick_refuses_offsets_that_do_not_cover_the_history(kernels: Any) -> None:
    logits, history = torch.zeros(2, 8), torch.tensor([1, 2, 3])
    with pytest.raises(RuntimeError, match="needs B \\+ 1 = 3 offsets"):
        kernels.greedy_pick(logits, history, torch.tensor([0, 3]), 1.1, None)
    with pytest.raises(RuntimeError, match="offsets must run from 0 to the history's 3 ids"):
        kernels.greedy_pick(logits, history, torch.tensor([0, 1, 2]), 1.1, None)
    with pytest.raises(RuntimeError, match="suppress must be a bool mask of the 8 ids"):
        kernels.greedy_pick(logits, history, torch.tensor([0, 1, 3]), 1.1, torch.zeros(4, dtype=torch.bool))
