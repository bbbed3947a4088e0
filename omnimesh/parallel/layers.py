"""Tensor-parallel building blocks: column / row linears, vocab-parallel embedding and head, MoE experts.

Role: the sharded weights of one TP rank and the one collective each block needs. Every layer takes
`tp_rank` and `tp_size` as plain arguments (a unit test builds rank 0 and rank 1 in one process) and the
`ParallelState` only for its collective; with `ps=None` no collective runs and the caller combines the
shards by hand (what the unit tests do). Every parameter carries `weight_loader(param, full_tensor, ...)`
that narrows the FULL checkpoint tensor to this rank's shard, so a rank only ever keeps its shard.

Data flow inside one transformer block (x replicated on every TP rank):
    x (T, H) -> ColumnParallel / QKVParallel / MergedColumnParallel -> (T, out / tp)   no communication
             -> RowParallel (T, in / tp) -> partial (T, H) -> all-reduce over TP -> (T, H)
    ids (T,) -> VocabParallelEmbedding: rows [start, end) of the vocab, zeros elsewhere -> all-reduce -> (T, H)
    hidden (T, H) -> ParallelLMHead -> (T, V / tp) -> all-gather over TP -> (T, V)
    MoE: ParallelExperts holds every expert with 1/tp of its intermediate dim -> partial (T, H); the MoE
         block all-reduces once (together with the shared expert)

Vocab sharding pads: each rank owns ceil(V / tp) rows, the last rank's surplus rows are zeros (an
embedding row never looked up; head logits cut off after the gather), so any vocab works with any tp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omnimesh.kernels import cpu_kernels
from omnimesh.parallel.parallel_state import ParallelState, tp_all_gather, tp_all_reduce


def divide(n: int, tp_size: int, what: str) -> int:
    """`n / tp_size`, or a ValueError naming the size and the tensor-parallel sizes that would divide it."""
    if n % tp_size:
        valid = [t for t in range(1, n + 1) if n % t == 0 and t <= 64]
        raise ValueError(f"{what}={n} does not divide by tensor-parallel size {tp_size}; valid tp values: {valid}")
    return n // tp_size


def _check_rank(tp_rank: int, tp_size: int, ps: ParallelState | None) -> None:
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} must lie in 0..tp_size-1 with tp_size={tp_size} >= 1")
    if ps is not None and (ps.tp_rank, ps.tp_size) != (tp_rank, tp_size):
        raise ValueError(f"layer built for tp_rank={tp_rank}/tp_size={tp_size} but ParallelState says "
                         f"{ps.tp_rank}/{ps.tp_size}")


def _check_full(param: nn.Parameter, full: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(full.shape) != expected:
        name = getattr(param, "checkpoint_name", "tensor")
        raise ValueError(f"checkpoint {name} has shape {tuple(full.shape)}, expected the full shape {expected}")


def default_weight_loader(param: nn.Parameter, full: torch.Tensor) -> None:
    """Replicated parameter (norms, router, shared-expert gate): every rank keeps the whole tensor."""
    _check_full(param, full, tuple(param.shape))
    with torch.no_grad():  # (not through .data: the copy bumps the version, so tables made from it are remade)
        param.copy_(full)


def _param(*shape: int, dtype: torch.dtype | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W (out, in) split by output rows: this rank computes outputs [r*out/tp, (r+1)*out/tp)."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool = False, tp_rank: int = 0, tp_size: int = 1,
                 ps: ParallelState | None = None, gather_output: bool = False,
                 params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        _check_rank(tp_rank, tp_size, ps)
        self.input_size, self.output_size = input_size, output_size
        self.tp_rank, self.tp_size, self.ps, self.gather_output = tp_rank, tp_size, ps, gather_output
        self.output_per_rank = divide(output_size, tp_size, "output_size")
        self.weight = _param(self.output_per_rank, input_size, dtype=params_dtype)  # (out / tp, in)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = _param(self.output_per_rank, dtype=params_dtype)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor) -> None:
        _check_full(param, full, (self.output_size, *param.shape[1:]))
        n = self.output_per_rank
        param.data.copy_(full.narrow(0, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)  # (..., out / tp)
        return tp_all_gather(y, self.ps, dim=-1) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one GEMM (gate and up): each rank holds its slice of EACH part.

    Local weight rows: [part0 rows r*n0/tp .. ; part1 rows r*n1/tp .. ; ...]; loaded per part with
    `weight_loader(param, full_part, shard_id)`.
    """

    def __init__(self, input_size: int, output_sizes: list[int], *, bias: bool = False, tp_rank: int = 0,
                 tp_size: int = 1, ps: ParallelState | None = None, params_dtype: torch.dtype | None = None) -> None:
        self.output_sizes = list(output_sizes)
        for i, n in enumerate(self.output_sizes):
            divide(n, tp_size, f"output_sizes[{i}]")
        super().__init__(input_size, sum(self.output_sizes), bias=bias, tp_rank=tp_rank, tp_size=tp_size, ps=ps,
                         params_dtype=params_dtype)

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id: int = 0) -> None:  # type: ignore[override]
        if not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id {shard_id} is outside 0..{len(self.output_sizes) - 1}")
        _check_full(param, full, (self.output_sizes[shard_id], *param.shape[1:]))
        n = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        param.data.narrow(0, offset, n).copy_(full.narrow(0, self.tp_rank * n, n))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projections split by heads: this rank holds num_heads/tp q heads and num_kv_heads/tp kv heads.

    Output per rank: [q (nh/tp * D) | k (nkv/tp * D) | v (nkv/tp * D)]; tp must divide both head counts.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, *, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1, ps: ParallelState | None = None,
                 params_dtype: torch.dtype | None = None) -> None:
        check_heads(num_heads, num_kv_heads, tp_size)
        self.head_dim, self.num_heads, self.num_kv_heads = head_dim, num_heads, num_kv_heads
        self.q_size = num_heads // tp_size * head_dim  # per rank
        self.kv_size = num_kv_heads // tp_size * head_dim  # per rank
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias=bias, tp_rank=tp_rank,
                         tp_size=tp_size, ps=ps, params_dtype=params_dtype)

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id: str = "q") -> None:  # type: ignore[override]
        sizes = {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}
        offsets = {"q": 0, "k": self.q_size, "v": self.q_size + self.kv_size}
        if shard_id not in sizes:
            raise ValueError(f"shard_id {shard_id!r} must be 'q', 'k' or 'v'")
        n = sizes[shard_id]
        _check_full(param, full, (n * self.tp_size, *param.shape[1:]))
        param.data.narrow(0, offsets[shard_id], n).copy_(full.narrow(0, self.tp_rank * n, n))


def check_heads(num_heads: int, num_kv_heads: int, tp_size: int) -> None:
    """tp must divide both the query and the key/value head counts (kv heads are not replicated)."""
    if num_heads % tp_size or num_kv_heads % tp_size:
        valid = [t for t in range(1, num_kv_heads + 1) if num_heads % t == 0 and num_kv_heads % t == 0]
        raise ValueError(
            f"tensor-parallel size tp={tp_size} must divide num_attention_heads={num_heads} and "
            f"num_key_value_heads={num_kv_heads}; valid tp values for this model: {valid}"
        )


class RowParallelLinear(nn.Module):
    """y = x W^T with W (out, in) split by input columns: x arrives split (..., in/tp), partial sums all-reduced."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool = False, tp_rank: int = 0, tp_size: int = 1,
                 ps: ParallelState | None = None, reduce_results: bool = True,
                 params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        _check_rank(tp_rank, tp_size, ps)
        self.input_size, self.output_size = input_size, output_size
        self.tp_rank, self.tp_size, self.ps, self.reduce_results = tp_rank, tp_size, ps, reduce_results
        self.input_per_rank = divide(input_size, tp_size, "input_size")
        self.weight = _param(output_size, self.input_per_rank, dtype=params_dtype)  # (out, in / tp)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = _param(output_size, dtype=params_dtype)
            self.bias.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor) -> None:
        _check_full(param, full, (self.output_size, self.input_size))
        n = self.input_per_rank
        param.data.copy_(full.narrow(1, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)  # (..., out): this rank's share of the sum over the input dim
        reduced = self.reduce_results and (self.tp_size == 1 or self.ps is not None)
        if reduced:
            y = tp_all_reduce(y, self.ps)  # the one collective of the block
        if self.bias is not None and (reduced or self.tp_rank == 0):
            y = y + self.bias  # added once: after the sum, or by rank 0 alone when the sum happens elsewhere
        return y


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocab split over TP: rank r owns ids [r*ceil(V/tp), ...), others contribute zeros."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_rank: int = 0, tp_size: int = 1,
                 ps: ParallelState | None = None, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        _check_rank(tp_rank, tp_size, ps)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_rank, self.tp_size, self.ps = tp_rank, tp_size, ps
        self.rows_per_rank = -(-num_embeddings // tp_size)  # ceil: pad instead of requiring V % tp == 0
        self.vocab_start = min(tp_rank * self.rows_per_rank, num_embeddings)
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, num_embeddings)
        self.weight = _param(self.rows_per_rank, embedding_dim, dtype=params_dtype)  # (ceil(V / tp), H)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor) -> None:
        _check_full(param, full, (self.num_embeddings, self.embedding_dim))
        param.data.zero_()  # padding rows stay zero
        n = self.vocab_end - self.vocab_start
        param.data.narrow(0, 0, n).copy_(full.narrow(0, self.vocab_start, n))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise ValueError(f"token ids must lie in 0..{self.num_embeddings - 1}, got {ids.min()}..{ids.max()}")
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)  # (..., H)
        mine = (ids >= self.vocab_start) & (ids < self.vocab_end)  # (...,)
        local = torch.where(mine, ids - self.vocab_start, torch.zeros_like(ids))  # (...,)
        out = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)  # (..., H), zeros not mine
        return tp_all_reduce(out, self.ps)  # exactly one rank contributes each row


class ParallelLMHead(VocabParallelEmbedding):
    """logits = h W^T with W (V, H) split like VocabParallelEmbedding; local logits all-gathered over TP."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        logits = F.linear(hidden, self.weight)  # (..., ceil(V / tp))
        if self.tp_size > 1 and self.ps is None:
            return logits  # simulated shard: the caller concatenates the ranks' pieces
        logits = tp_all_gather(logits, self.ps, dim=-1)  # (..., tp * ceil(V / tp))
        return logits[..., : self.num_embeddings]  # (..., V): drop padding columns


# A step whose dense expert GEMMs (tokens x experts x 3 x I/tp x H multiply-adds) stay under this runs them
# all: on the tiny model (8 experts, 64 x 32) that is up to ~40 tokens, where each op's fixed cost (~10 us
# on CPU) outweighs the wasted multiply-adds; a real checkpoint (128 experts, 2048 x 768) never qualifies.
DENSE_EXPERT_MACS = 1 << 21


class ParallelExperts(nn.Module):
    """Routed MoE experts, each split along its intermediate dim (every rank holds every expert, I/tp wide).

    gate_up (E, 2*I/tp, H) = [gate rows of this rank; up rows of this rank] per expert (the layout of
    transformers' fused `gate_up_proj`, so tp = 1 is the same GEMM); down (E, H, I/tp).
    `forward` returns this rank's partial sum (the MoE block all-reduces it once).
    Loader: `weight_loader(param, full_per_expert, expert_id, shard_id)` with shard_id "gate" | "up" | "down",
    the checkpoint's per-expert `experts.{e}.{gate,up,down}_proj.weight`.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, tp_rank: int = 0,
                 tp_size: int = 1, ps: ParallelState | None = None, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        _check_rank(tp_rank, tp_size, ps)
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.inter_per_rank = divide(intermediate_size, tp_size, "moe_intermediate_size")
        self.gate_up = _param(num_experts, 2 * self.inter_per_rank, hidden_size, dtype=params_dtype)  # (E, 2I/tp, H)
        self.down = _param(num_experts, hidden_size, self.inter_per_rank, dtype=params_dtype)  # (E, H, I/tp)
        self.gate_up.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.down.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, expert_id: int, shard_id: str) -> None:
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert_id {expert_id} is outside 0..{self.num_experts - 1}")
        n, r = self.inter_per_rank, self.tp_rank
        if shard_id in ("gate", "up"):
            _check_full(param, full, (self.intermediate_size, self.hidden_size))
            offset = 0 if shard_id == "gate" else n
            param.data[expert_id].narrow(0, offset, n).copy_(full.narrow(0, r * n, n))
        elif shard_id == "down":
            _check_full(param, full, (self.hidden_size, self.intermediate_size))
            param.data[expert_id].copy_(full.narrow(1, r * n, n))
        else:
            raise ValueError(f"shard_id {shard_id!r} must be 'gate', 'up' or 'down'")

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """x (N, H), top_k_index / top_k_weights (N, k) -> this rank's partial output (N, H).

        Small steps (every expert's GEMMs over all N tokens within `DENSE_EXPERT_MACS`) run `_dense`: a
        few batched ops instead of ~5 per hit expert, which is what a tiny model's step costs; larger
        steps route sparsely (`_sparse`)."""
        if self.runs_dense(x.shape[0]):
            return self._dense(x, top_k_index, top_k_weights)
        return self._sparse(x, top_k_index, top_k_weights)

    def runs_dense(self, tokens: int) -> bool:
        """Whether a step of `tokens` tokens runs every expert on every token (see `DENSE_EXPERT_MACS`)."""
        return tokens * self.num_experts * 3 * self.inter_per_rank * self.hidden_size <= DENSE_EXPERT_MACS

    def _dense(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, weighted by the routing weight (0 where not routed): (N, H).
        A routed pair's value is the sparse path's; adding the zero terms changes no bit when k <= 2
        (what remains is one sum of k terms, in another order when k > 2: float rounding only)."""
        weights = torch.zeros(x.shape[0], self.num_experts, dtype=x.dtype, device=x.device)  # (N, E)
        weights.scatter_(1, top_k_index, top_k_weights.to(x.dtype))
        gate_up = torch.matmul(x, self.gate_up.transpose(1, 2))  # (E, N, 2 I/tp)
        if cpu_kernels.use(gate_up):
            act = cpu_kernels.ops().silu_mul(gate_up)  # (E, N, I/tp)
        else:
            gate, up = gate_up.chunk(2, dim=-1)  # 2 x (E, N, I/tp)
            act = F.silu(gate) * up
        y = torch.bmm(act, self.down.transpose(1, 2))  # (E, N, H)
        return (y * weights.t().unsqueeze(-1)).sum(0)  # (N, H)

    def _sparse(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """The routed (token, slot) pairs only: (N, H).

        The (token, slot) pairs are sorted by expert once, so each hit expert is a slice (no per-expert
        search), and one `index_add_` adds every contribution in expert order, as per-expert adds would:
        each expert sees the same rows in the same (token) order as transformers' loop, same results. Off CPU
        `add_in_expert_order` adds them in that order without `index_add_`'s atomics."""
        k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1)  # (N*k,) expert of each (token, slot)
        order = torch.argsort(flat, stable=True)  # (N*k,) grouped by expert, tokens ascending within
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token_idx = order // k  # (N*k,)
        h = x[token_idx]  # (N*k, H)
        ys: list[torch.Tensor] = []
        start = 0
        for e, n in enumerate(counts):
            if n:
                gate, up = F.linear(h[start:start + n], self.gate_up[e]).chunk(2, dim=-1)  # 2 x (n, I/tp)
                ys.append(F.linear(F.silu(gate) * up, self.down[e]))  # (n, H)
                start += n
        y = torch.cat(ys) * top_k_weights.reshape(-1)[order, None]  # (N*k, H)
        if x.device.type == "cpu":
            out = torch.zeros_like(x)  # (N, H)
            return out.index_add_(0, token_idx, y.to(out.dtype))
        return add_in_expert_order(y.to(x.dtype), order, top_k_index)


def add_in_expert_order(y: torch.Tensor, order: torch.Tensor, top_k_index: torch.Tensor) -> torch.Tensor:
    """Each token's k routed contributions summed one at a time in expert order, from zero: what `index_add_`
    over the expert-sorted pairs adds on CPU, bit for bit, but in a fixed order on any device (CUDA's
    `index_add_` adds a token's k rows with atomics, in no fixed order, so a bf16 sum could change from run to
    run). y (N*k, H): the contributions in `order`'s (expert-sorted) order; top_k_index (N, k) -> (N, H)."""
    N, k = top_k_index.shape
    by_pair = torch.empty_like(y)
    by_pair[order] = y  # (N*k, H) back in (token, slot) order
    by_pair = by_pair.view(N, k, -1)
    slots = torch.argsort(top_k_index, dim=1, stable=True)  # (N, k) each token's slots in expert order
    ordered = by_pair.gather(1, slots[..., None].expand(by_pair.shape))  # (N, k, H) in expert order per token
    out = torch.zeros_like(ordered[:, 0])  # (N, H)
    for j in range(k):
        out = out + ordered[:, j]
    return out
