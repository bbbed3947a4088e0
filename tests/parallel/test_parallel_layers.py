"""Each tensor-parallel layer, tp_size = 2 simulated in one process, equals the unsharded torch module.

Rank 0 and rank 1 are built side by side with `ps=None` (no collective runs); their outputs are combined by
hand the way the collective would (concatenate for column / head shards, sum for row / embedding / expert
partials) and compared with nn.Linear / nn.Embedding / a plain expert loop. The weight loaders are fed the
FULL tensors and must keep only the rank's shard.

Run: python -m pytest tests/parallel/test_parallel_layers.py -q
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from omnimesh.parallel.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelExperts,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    add_in_expert_order,
)

TP = 2
TOL = 1e-6


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def linear(i: int, o: int, bias: bool, seed: int) -> nn.Linear:
    layer = nn.Linear(i, o, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(o, i, generator=gen(seed)))
        if bias:
            layer.bias.copy_(torch.randn(o, generator=gen(seed + 1)))
    return layer


def load(param: nn.Parameter, full: torch.Tensor, *args: object) -> None:
    param.weight_loader(param, full, *args)  # type: ignore[attr-defined]


def test_column_parallel() -> None:
    full = linear(8, 6, bias=True, seed=0)
    x = torch.randn(5, 8, generator=gen(9))
    outs = []
    for r in range(TP):
        shard = ColumnParallelLinear(8, 6, bias=True, tp_rank=r, tp_size=TP)
        load(shard.weight, full.weight.data)
        assert shard.bias is not None
        load(shard.bias, full.bias.data)
        assert shard.weight.shape == (3, 8)  # only the shard is kept
        assert torch.equal(shard.weight, full.weight[r * 3:(r + 1) * 3])
        outs.append(shard(x))  # (5, 3)
    assert (torch.cat(outs, dim=-1) - full(x)).abs().max() < TOL


def test_merged_column_parallel_gate_up() -> None:
    gate, up = linear(8, 4, False, 1), linear(8, 4, False, 2)
    x = torch.randn(3, 8, generator=gen(9))
    outs = []
    for r in range(TP):
        shard = MergedColumnParallelLinear(8, [4, 4], tp_rank=r, tp_size=TP)
        load(shard.weight, gate.weight.data, 0)
        load(shard.weight, up.weight.data, 1)
        assert shard.weight.shape == (4, 8)
        outs.append(shard(x).chunk(2, dim=-1))  # this rank's (gate, up) slices, (3, 2) each
    assert (torch.cat([o[0] for o in outs], -1) - gate(x)).abs().max() < TOL
    assert (torch.cat([o[1] for o in outs], -1) - up(x)).abs().max() < TOL


def test_qkv_parallel_splits_heads() -> None:
    H, D, nh, nkv = 16, 4, 4, 2
    q, k, v = linear(H, nh * D, False, 3), linear(H, nkv * D, False, 4), linear(H, nkv * D, False, 5)
    x = torch.randn(2, H, generator=gen(9))
    parts: list[tuple[torch.Tensor, ...]] = []
    for r in range(TP):
        shard = QKVParallelLinear(H, D, nh, nkv, tp_rank=r, tp_size=TP)
        for name, lin in zip("qkv", (q, k, v)):
            load(shard.weight, lin.weight.data, name)
        assert (shard.q_size, shard.kv_size) == (nh // TP * D, nkv // TP * D)
        assert shard.weight.shape == ((nh + 2 * nkv) * D // TP, H)
        parts.append(shard(x).split([shard.q_size, shard.kv_size, shard.kv_size], dim=-1))
    for i, lin in enumerate((q, k, v)):
        assert (torch.cat([p[i] for p in parts], -1) - lin(x)).abs().max() < TOL


def test_qkv_rejects_tp_that_does_not_divide_the_heads() -> None:
    with pytest.raises(ValueError, match=r"tp=3 must divide num_attention_heads=4 and num_key_value_heads=2; "
                                         r"valid tp values for this model: \[1, 2\]"):
        QKVParallelLinear(16, 4, 4, 2, tp_rank=0, tp_size=3)


@pytest.mark.parametrize("bias", [False, True])
def test_row_parallel_partial_sums(bias: bool) -> None:
    full = linear(8, 6, bias=bias, seed=6)
    x = torch.randn(4, 8, generator=gen(9))
    total = torch.zeros(4, 6)
    for r in range(TP):
        shard = RowParallelLinear(8, 6, bias=bias, tp_rank=r, tp_size=TP)  # ps=None: no all-reduce
        load(shard.weight, full.weight.data)
        if bias:
            assert shard.bias is not None
            load(shard.bias, full.bias.data)
        assert shard.weight.shape == (6, 4)
        assert torch.equal(shard.weight, full.weight[:, r * 4:(r + 1) * 4])
        total += shard(x[:, r * 4:(r + 1) * 4])  # the all-reduce, by hand
    assert (total - full(x)).abs().max() < TOL


@pytest.mark.parametrize("vocab", [10, 9])  # 9: the last rank's surplus row is padding
def test_vocab_parallel_embedding(vocab: int) -> None:
    full = nn.Embedding(vocab, 4)
    with torch.no_grad():
        full.weight.copy_(torch.randn(vocab, 4, generator=gen(7)))
    ids = torch.tensor([[0, 4, 5, vocab - 1, 2, 7]])
    total = torch.zeros(1, 6, 4)
    for r in range(TP):
        shard = VocabParallelEmbedding(vocab, 4, tp_rank=r, tp_size=TP)
        load(shard.weight, full.weight.data)
        assert shard.weight.shape == (5, 4)
        n = shard.vocab_end - shard.vocab_start
        assert torch.equal(shard.weight[:n], full.weight[shard.vocab_start:shard.vocab_end])
        assert not shard.weight[n:].any()  # padding rows are zero
        total += shard(ids)  # other ranks' ids contribute zeros; summing = the all-reduce
    assert torch.equal(total, full(ids))
    with pytest.raises(ValueError, match=rf"token ids must lie in 0..{vocab - 1}"):
        VocabParallelEmbedding(vocab, 4)(torch.tensor([vocab]))


def test_parallel_lm_head_gathers_logits() -> None:
    vocab = 9
    full = linear(4, vocab, False, 8)
    h = torch.randn(3, 4, generator=gen(9))
    pieces = []
    for r in range(TP):
        shard = ParallelLMHead(vocab, 4, tp_rank=r, tp_size=TP)
        load(shard.weight, full.weight.data)
        pieces.append(shard(h))  # (3, 5) local logits
    assert (torch.cat(pieces, -1)[:, :vocab] - full(h)).abs().max() < TOL
    single = ParallelLMHead(vocab, 4)
    load(single.weight, full.weight.data)
    assert single(h).shape == (3, vocab)


@pytest.mark.parametrize("dense", [True, False])
def test_experts_slice_intermediate_dim(dense: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ways of running the experts (all on every token, or only the routed pairs) give the reference."""
    monkeypatch.setattr(ParallelExperts, "runs_dense", lambda self, tokens: dense)
    taken: list[str] = []
    for path in ("_dense", "_sparse"):
        monkeypatch.setattr(ParallelExperts, path, spy(getattr(ParallelExperts, path), path, taken))
    E, H, inter, N, k = 3, 8, 4, 6, 2
    g = gen(10)
    gate = [torch.randn(inter, H, generator=g) for _ in range(E)]
    up = [torch.randn(inter, H, generator=g) for _ in range(E)]
    down = [torch.randn(H, inter, generator=g) for _ in range(E)]
    x = torch.randn(N, H, generator=g)
    top_i = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1], [2, 0], [1, 2]])
    top_w = torch.rand(N, k, generator=g)
    ref = torch.zeros(N, H)
    for n in range(N):
        for j in range(k):
            e = int(top_i[n, j])
            ref[n] += top_w[n, j] * (down[e] @ (F.silu(gate[e] @ x[n]) * (up[e] @ x[n])))
    total = torch.zeros(N, H)
    for r in range(TP):
        shard = ParallelExperts(E, H, inter, tp_rank=r, tp_size=TP)
        for e in range(E):
            load(shard.gate_up, gate[e], e, "gate")
            load(shard.gate_up, up[e], e, "up")
            load(shard.down, down[e], e, "down")
        assert shard.gate_up.shape == (E, inter, H) and shard.down.shape == (E, H, inter // TP)
        total += shard(x, top_i, top_w)  # partial sums, all-reduced by hand
    assert (total - ref).abs().max() < 1e-5
    assert taken == ["_dense" if dense else "_sparse"] * TP


def spy(method: Any, name: str, taken: list[str]) -> Any:
    def run(self: Any, *args: Any) -> Any:
        taken.append(name)
        return method(self, *args)
    return run


def test_only_tiny_expert_steps_run_dense() -> None:
    tiny = ParallelExperts(8, 64, 32)  # the built-in tiny model's MoE: dense up to 42 tokens
    assert tiny.runs_dense(1) and tiny.runs_dense(42) and not tiny.runs_dense(43)
    with torch.device("meta"):  # Qwen3-Omni-30B-A3B's thinker experts: never, not even one token
        real = ParallelExperts(128, 2048, 768)
    assert not real.runs_dense(1)


def test_loader_rejects_a_wrong_full_shape() -> None:
    shard = ColumnParallelLinear(8, 6, tp_rank=1, tp_size=TP)
    shard.weight.checkpoint_name = "model.layers.0.q_proj.weight"  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"model.layers.0.q_proj.weight has shape \(3, 8\), expected the full "
                                         r"shape \(6, 8\)"):
        load(shard.weight, torch.zeros(3, 8))


def test_sizes_that_do_not_divide_are_named() -> None:
    with pytest.raises(ValueError, match=r"output_size=6 does not divide by tensor-parallel size 4; "
                                         r"valid tp values: \[1, 2, 3, 6\]"):
        ColumnParallelLinear(8, 6, tp_rank=0, tp_size=4)
    with pytest.raises(ValueError, match=r"moe_intermediate_size=4 does not divide by tensor-parallel size 3"):
        ParallelExperts(2, 8, 4, tp_rank=0, tp_size=3)
    with pytest.raises(ValueError, match=r"tp_rank=2 must lie in 0..tp_size-1 with tp_size=2"):
        RowParallelLinear(8, 6, tp_rank=2, tp_size=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adding_in_expert_order_is_transformers_per_expert_loop(dtype: torch.dtype) -> None:
    """The sum CUDA steps take instead of one `index_add_` (whose atomics add a token's k rows in no fixed
    order): each token's contributions one at a time in expert order, as transformers' loop adds them (one
    `index_add_` per expert), bit for bit; in float32 also what the CPU path's single `index_add_` gives."""
    g = torch.Generator().manual_seed(3)
    N, E, k, H = 37, 16, 8, 24
    top_k_index = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])  # (N, k) distinct experts
    order = torch.argsort(top_k_index.reshape(-1), stable=True)
    y = (torch.randn(N * k, H, generator=g) * 10).to(dtype)  # contributions in expert-sorted order
    experts = top_k_index.reshape(-1)[order]
    want = torch.zeros(N, H, dtype=dtype)
    for e in range(E):  # transformers' loop: expert by expert, each token at most once per add
        hit = experts == e
        want.index_add_(0, (order // k)[hit], y[hit])
    got = add_in_expert_order(y, order, top_k_index)
    assert got.dtype == dtype and torch.equal(got, want)
    if dtype == torch.float32:
        assert torch.equal(got, torch.zeros(N, H).index_add_(0, order // k, y))
    reversed_order = torch.zeros(N, H, dtype=dtype)
    for e in reversed(range(E)):
        hit = experts == e
        reversed_order.index_add_(0, (order // k)[hit], y[hit])
    assert not torch.equal(reversed_order, want)  # the order of the adds shows in the bits: the test pins it
