"""The Omni text decoders (thinker LM or talker LM), tensor-parallel and cut into pipeline ranges.

Role: our own implementation of `Qwen3OmniMoeThinkerTextModel` / `Qwen3OmniMoeTalkerModel` (and of Qwen2.5-Omni's
dense `Qwen2_5OmniThinkerTextModel` / talker LM: text_arch.py says what differs) for ONE rank of
a stage's pp x tp grid: its layers [start, end), its TP shard of every weight, the embedding only on the
first pipeline rank, the final norm and the LM / codec head only on the last. The math mirrors transformers
line for line (pre-norm RMSNorm, q/k per-head norm, GQA, interleaved M-RoPE, causal attention, router
softmax -> top-k -> optional renorm, silu experts, the talker's sigmoid-gated shared expert, deepstack adds;
Qwen2.5-Omni: q/k/v biases, no q/k norm, contiguous M-RoPE sections, dense layers);
tests/parallel/ check it against transformers (pp = tp = 1, 1e-5) and across gloo ranks (1e-4).

TP sharding: attention by heads (q, k, v column-parallel, o row-parallel), dense MLPs by intermediate
columns, and MoE experts by their intermediate dim (every rank holds every expert, I/tp wide; the router
is replicated, so all TP ranks route identically and each computes its slice for every routed token; one
all-reduce per MoE block covers routed + shared experts). Whole-expert (EP) sharding was not chosen: its
per-rank load follows the routing skew and it needs a token all-to-all; slicing keeps every rank equally
busy with the same column -> row pattern and collective count as a dense MLP.

Data flow (one step of one request on one rank):
    first pp rank:  ids -> embed (vocab-parallel) -> [caller merges media] -> x (1, T, H)
    other ranks:    x = hidden (1, T, H) received from the previous pipeline rank
    forward(x, position_ids (4|3, 1, T), cache, visual_pos_mask, deepstack, capture_layer)
        -> layers start..end-1 (deepstack[i] added after global layer i when this rank owns it)
        -> final norm (last rank) -> StageOutput(hidden (1, T, H), captured (1, T, H) | None)
    last pp rank:   compute_logits(hidden[:, -1]) -> (1, V) all-gathered over TP
`pipeline_step` runs that across pipeline ranks (what crosses a boundary is documented there).
On CPU (float32, one TP rank) a decode-only batched step runs each layer as ONE fused kernel call
(`ParallelDecoderLayer._fused`: the same ops in the same order, bit for bit, without the Python between them).

Run the checks: python -m pytest tests/parallel -q
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from omnimesh.engine.step_gate import checkpoint
from omnimesh.kernels import cpu_kernels
from omnimesh.models.loader import Plan, checkpoint_files, dummy_weights, load_plan
from omnimesh.models.qwen3_omni.text_arch import text_arch
from omnimesh.parallel.layers import (
    MergedColumnParallelLinear,
    ParallelExperts,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    check_heads,
    default_weight_loader,
    divide,
)
from omnimesh.parallel.parallel_state import ParallelState, pp_recv, pp_send, tp_all_reduce
from omnimesh.parallel.partition import partition_layers



def check_parallel_layout(config: Any, pp: int, tp: int, custom_partition: list[int] | None = None) -> None:
    """Every size a pp x tp layout must divide, checked before any process-group work (ValueError names them)."""
    check_heads(config.num_attention_heads, config.num_key_value_heads, tp)
    arch = text_arch(config)
    if arch.num_experts > 0:
        divide(config.moe_intermediate_size, tp, "moe_intermediate_size")
    if getattr(config, "shared_expert_intermediate_size", 0):
        divide(config.shared_expert_intermediate_size, tp, "shared_expert_intermediate_size")
    n = config.num_hidden_layers
    if not all(arch.sparse(i, is_talker=False) for i in range(n)):  # some dense layer (all of Qwen2.5-Omni's)
        divide(config.intermediate_size, tp, "intermediate_size")
    partition_layers(n, pp, custom_partition)


@dataclass(frozen=True)
class StageOutput:
    hidden: torch.Tensor  # (1, T, H): after the final norm on the last pp rank, else the boundary hidden
    captured: torch.Tensor | None  # (1, T, H) at `capture_layer`, when this rank holds it


class KVCache:
    """One request's keys/values for THIS rank's layers and heads, contiguous per layer.

    `update(layer_idx, k, v)` (global layer index) appends (1, n_kv/tp, T, D) and returns the whole
    (1, n_kv/tp, S, D) history; `attend` stores and attends (the `LMCache` interface, which the stage's
    batched steps implement over a paged pool in paged_kv.py).
    """

    def __init__(self, layer_range: tuple[int, int]) -> None:
        self.start, self.end = layer_range
        self._k: list[torch.Tensor | None] = [None] * (self.end - self.start)
        self._v: list[torch.Tensor | None] = [None] * (self.end - self.start)

    def get_seq_length(self) -> int:
        k = self._k[0]
        return 0 if k is None else int(k.shape[2])

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_rep: int,
               scale: float) -> torch.Tensor:
        """Store k/v (1, nkv, T, D) and attend q (1, nh, T, D) over the whole history -> (1, nh, T, D).
        (`paged_kv.PagedBatch.attend` is the same for many requests at once.)"""
        T = q.shape[2]
        k, v = self.update(layer_idx, k, v)  # (1, nkv, S, D)
        past = k.shape[2] - T  # this layer's cached tokens before this step
        if small_attention(q, T, k.shape[2]):
            return cpu_kernels.ops().attention(q, k, v, past, 0, 0, scale)  # query t at past + t: causal
        mask = None  # SDPA's own causal mask covers a prefill from empty and single-token decode
        if T > 1 and past > 0:  # chunked prefill: query i sees keys 0..past+i
            mask = torch.arange(past + T, device=q.device)[None, :] <= torch.arange(past, past + T, device=q.device)[:, None]
        return gqa_attention(q, k, v, n_rep, scale, mask, is_causal=mask is None and T > 1)

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        i = self._index(layer_idx)
        old_k, old_v = self._k[i], self._v[i]
        self._k[i] = k if old_k is None else torch.cat([old_k, k], dim=2)  # (1, n_kv, S, D)
        self._v[i] = v if old_v is None else torch.cat([old_v, v], dim=2)
        return self._k[i], self._v[i]  # type: ignore[return-value]

    def history(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The layer's keys and values so far (1, n_kv/tp, S, D), None before its first step."""
        i = self._index(layer_idx)
        return self._k[i], self._v[i]

    def keep(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Replace the layer's history with k / v (its old history + this step's, made by a fused layer)."""
        i = self._index(layer_idx)
        self._k[i], self._v[i] = k, v

    def _index(self, layer_idx: int) -> int:
        if not self.start <= layer_idx < self.end:
            raise ValueError(f"layer {layer_idx} is not in this cache's range [{self.start}, {self.end})")
        return layer_idx - self.start


class LMCache(Protocol):
    """What the attention layers write keys/values to and read them from: one request's `KVCache`, or a
    `paged_kv.PagedBatch` (many requests' blocks in a shared pool, one batched step)."""

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_rep: int,
               scale: float) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    """transformers' Qwen3 RMSNorm: normalise in float32, scale in the input dtype (replicated weight)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight: nn.Parameter = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_kernels.use(x) and self.weight.dtype == torch.float32:
            return cpu_kernels.ops().rms_norm(x, self.weight, self.eps)  # one pass per row (5 aten ops eager)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # bit-identical to transformers in fp32
        return self.weight * self.normalize(x)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """`forward` before its weight: `forward(x) == normalize(x) * weight`, bit for bit."""
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, None, self.eps)
        h = x.to(torch.float32)
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


_QK_WEIGHTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def qkv_heads(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, norms: tuple[RMSNorm, RMSNorm] | None,
              cos: torch.Tensor, sin_signed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv (B, T, (heads + 2 kv_heads) D), the fused projection -> q (B, heads, T, D), k and v (B, kv_heads, T, D),
    q and k per-head RMS-normed (`norms` = (q_norm, k_norm), or None) and rotated (`apply_rope`; cos and
    sin_signed broadcast to (B, 1, T, D)). q and k go through ONE normalisation (each head then scaled by
    its norm's weight) and ONE rotation: the same bits as norming and rotating them apart, in half the ops.
    On CPU (float32) all of it is one kernel (`cpu_kernels`: q, k, v come back contiguous)."""
    B, T = qkv.shape[0], qkv.shape[1]
    if cpu_kernels.use(qkv) and cos.dtype == torch.float32:
        qw, kw = (norms[0].weight, norms[1].weight) if norms is not None else (None, None)
        tables = cos.reshape(-1, T, head_dim), sin_signed.reshape(-1, T, head_dim)  # (1 | B, T, D)
        return cpu_kernels.ops().qk_norm_rope(qkv, heads, kv_heads, head_dim, qw, kw,
                                              norms[0].eps if norms is not None else 0.0, *tables)
    h = qkv.view(B, T, heads + 2 * kv_heads, head_dim)
    qk = h[:, :, :heads + kv_heads]  # (B, T, heads + kv_heads, D)
    if norms is not None:
        qk = norms[0].normalize(qk) * _qk_weight(norms, heads, kv_heads)
    qk = apply_rope(qk.transpose(1, 2), cos, sin_signed)  # (B, heads + kv_heads, T, D)
    return qk[:, :heads], qk[:, heads:], h[:, :, heads + kv_heads:].transpose(1, 2)


def _qk_weight(norms: tuple[RMSNorm, RMSNorm], heads: int, kv_heads: int) -> torch.Tensor:
    """(heads + kv_heads, D): q_norm's weight for each q head, then k_norm's for each k head; made again
    when either weight is replaced or changed in place (loading happens after construction)."""
    q, k = norms[0].weight, norms[1].weight
    key = (q.data_ptr(), q._version, k.data_ptr(), k._version, heads, kv_heads)
    cached = _QK_WEIGHTS.get(norms[0])
    if cached is None or cached[0] != key:
        with torch.no_grad():
            weight = torch.cat([q.expand(heads, -1), k.expand(kv_heads, -1)])
        cached = _QK_WEIGHTS[norms[0]] = (key, weight)
    return cached[1]


class MRotary(nn.Module):
    """M-RoPE (t, h, w sections): interleaved as Qwen3OmniMoeThinkerTextRotaryEmbedding computes it, or in
    contiguous sections as Qwen2_5OmniRotaryEmbedding does (`text_arch`'s `interleaved_mrope`)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        rope = config.rope_parameters
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type {rope['rope_type']!r} is not supported yet (only 'default')")
        arch = text_arch(config)
        dim, self.interleaved = arch.head_dim, arch.interleaved_mrope
        self.mrope_section = list(rope.get("mrope_section", [24, 20, 20] if self.interleaved else [16, 24, 24]))
        if sum(self.mrope_section) != dim // 2:
            raise ValueError(f"mrope_section {self.mrope_section} must sum to head_dim / 2 = {dim // 2}")
        inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))  # (D/2,)
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (3, 1, T) -> cos, sin (1, T, D)."""
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)  # (3, 1, T, D/2)
        out = []
        if not self.interleaved:  # section i of the D/2 frequencies takes row i (t, h, w), then the halves repeat
            for f in (freqs.cos(), freqs.sin()):
                parts = [m[i % 3] for i, m in enumerate(f.split(self.mrope_section, dim=-1))]  # (1, T, s_i)
                sectioned = torch.cat(parts, dim=-1)  # (1, T, D/2)
                out.append(torch.cat((sectioned, sectioned), dim=-1).to(dtype))  # (1, T, D)
            return out[0], out[1]
        for f in (freqs.cos(), freqs.sin()):
            thw = f[0].clone()  # (1, T, D/2): t everywhere, then h and w on their interleaved slots
            for dim, offset in ((1, 1), (2, 2)):
                idx = slice(offset, self.mrope_section[dim] * 3, 3)
                thw[..., idx] = f[dim, ..., idx]
            out.append(torch.cat((thw, thw), dim=-1).to(dtype))  # (1, T, D)
        return out[0], out[1]

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (3, 1, T) -> cos, signed_sin (1, T, D): what `qkv_heads` takes (one kernel on CPU)."""
        if self.interleaved and dtype == torch.float32 and positions.device.type == "cpu" \
                and cpu_kernels.use(self.inv_freq):
            return cpu_kernels.ops().mrope(positions.reshape(3, -1).float(), self.inv_freq, self.mrope_section[1],
                                           self.mrope_section[2])
        cos, sin = self(positions, dtype)
        return cos, signed_sin(sin)


SMALL_ATTENTION = 4096  # queries x keys per head up to which the CPU attention kernel runs (decode, tiny steps)


def small_attention(q: torch.Tensor, T: int, S: int) -> bool:
    """Whether T queries of q (float32, CPU) over S keys go to `cpu_kernels`' attention instead of SDPA (whose
    flash kernel costs ~15 us a call at any size, and wins on long ones: it vectorises the softmax)."""
    return T * S <= SMALL_ATTENTION and cpu_kernels.use(q)


def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_rep: int, scale: float,
                  mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
    """SDPA of q (B, nh, T, D) over k / v (B, nh / n_rep, S, D), each kv head serving n_rep query heads.
    On CPU the kernel reads the shared kv heads itself (`enable_gqa`: two fewer copies per call, the same
    values bit for bit); elsewhere k / v are repeated first, because CUDA's memory-efficient kernel (the
    one a masked call takes) has no GQA and would fall back to the math kernel."""
    if n_rep > 1 and q.device.type != "cpu":
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                          enable_gqa=n_rep > 1 and q.device.type == "cpu")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin (..., D) -> [-sin[:D/2], sin[D/2:]], the table `apply_rope` takes (made once per forward)."""
    first, second = sin.chunk(2, dim=-1)
    return torch.cat((-first, second), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """transformers' x * cos + rotate_half(x) * sin, bit for bit, in 4 ops instead of 7: rotate_half(x) is
    [-x2, x1] and roll(x) is [x2, x1], so the sign moves into the table (-x2 * s1 == x2 * -s1 exactly)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


class ParallelAttention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, ps: ParallelState, dtype: torch.dtype) -> None:
        super().__init__()
        tp: dict[str, Any] = {"tp_rank": ps.tp_rank, "tp_size": ps.tp_size, "ps": ps, "params_dtype": dtype}
        arch = text_arch(config)
        self.layer_idx, self.head_dim = layer_idx, arch.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, arch.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=arch.qkv_bias, **tp)
        self.o_proj = RowParallelLinear(config.num_attention_heads * arch.head_dim, config.hidden_size,
                                        bias=arch.o_bias, **tp)
        self.qk_norms: tuple[RMSNorm, RMSNorm] | None = None
        if arch.qk_norm:  # registered as q_norm / k_norm (the checkpoint's names)
            self.q_norm = RMSNorm(arch.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(arch.head_dim, config.rms_norm_eps, dtype)
            self.qk_norms = (self.q_norm, self.k_norm)
        self.n_rep = config.num_attention_heads // config.num_key_value_heads

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LMCache) -> torch.Tensor:
        T, D = x.shape[1], self.head_dim
        proj = self.qkv_proj
        q, k, v = qkv_heads(proj(x), proj.q_size // D, proj.kv_size // D, D, self.qk_norms,
                            cos.unsqueeze(1), sin.unsqueeze(1))  # (1, nh/tp | nkv/tp, T, D); sin: signed_sin
        o = cache.attend(self.layer_idx, q, k, v, self.n_rep, D**-0.5)  # (1, nh/tp, T, D)
        return self.o_proj(o.transpose(1, 2).reshape(1, T, -1))  # (1, T, H), all-reduced


class ParallelMLP(nn.Module):
    """silu(x Wg) * (x Wu) Wd, intermediate dim split over TP (dense layers and the talker's shared expert)."""

    def __init__(self, hidden: int, inter: int, ps: ParallelState, dtype: torch.dtype, reduce: bool) -> None:
        super().__init__()
        tp: dict[str, Any] = {"tp_rank": ps.tp_rank, "tp_size": ps.tp_size, "ps": ps, "params_dtype": dtype}
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], **tp)
        self.down_proj = RowParallelLinear(inter, hidden, reduce_results=reduce, **tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # (..., 2 I/tp)
        if cpu_kernels.use(gate_up):
            return self.down_proj(cpu_kernels.ops().silu_mul(gate_up))  # (..., H)
        gate, up = gate_up.chunk(2, dim=-1)  # 2 x (..., I/tp)
        return self.down_proj(F.silu(gate) * up)  # (..., H)


# The fused MoE kernel's limit (multiply-adds of a step's routed + shared experts), where one thread's per-token
# loops (weights read per token) stop beating aten's GEMMs plus their per-op cost. Measured on the tiny model
# (1 thread): fused 12 / 22 / 53 us at 1 / 16 / 64 tokens against aten's 33 / 61 / 148; a real checkpoint's one
# token (128 experts of 2048 x 768, top-8: ~38M) never qualifies
FUSED_MOE_MACS = 1 << 21


class ParallelSparseMoe(nn.Module):
    """Replicated router -> top-k -> TP-sliced experts (+ sigmoid-gated shared expert) -> one all-reduce."""

    def __init__(self, config: Any, ps: ParallelState, dtype: torch.dtype, shared: bool) -> None:
        super().__init__()
        self.ps, self.top_k, self.norm_topk = ps, config.num_experts_per_tok, config.norm_topk_prob
        self.router = nn.Parameter(torch.empty(config.num_experts, config.hidden_size, dtype=dtype),
                                   requires_grad=False)  # (E, H), replicated
        self.router.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        self.experts = ParallelExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                                       tp_rank=ps.tp_rank, tp_size=ps.tp_size, ps=ps, params_dtype=dtype)
        self.shared_expert: ParallelMLP | None = None
        self.shared_expert_gate: nn.Parameter | None = None
        if shared:
            self.shared_expert = ParallelMLP(config.hidden_size, config.shared_expert_intermediate_size, ps, dtype,
                                             reduce=False)
            self.shared_expert_gate = nn.Parameter(torch.empty(1, config.hidden_size, dtype=dtype),
                                                   requires_grad=False)  # (1, H), replicated
            self.shared_expert_gate.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])  # (N, H)
        if self.fused(h):
            shared = self.shared_expert
            out = cpu_kernels.ops().moe(h, self.router, self.experts.gate_up, self.experts.down, self.top_k,
                                        bool(self.norm_topk), None if shared is None else shared.gate_up_proj.weight,
                                        None if shared is None else shared.down_proj.weight, self.shared_expert_gate)
            return tp_all_reduce(out, self.ps).reshape(shape)  # (N, H) partial over TP, like the path below
        logits = F.linear(h, self.router)  # (N, E)
        probs = F.softmax(logits, dim=-1, dtype=torch.float)  # (N, E)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)  # (N, k)
        if self.norm_topk:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        out = self.experts(h, top_i, top_w.to(logits.dtype))  # (N, H) partial over TP
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            # sigmoid(gate) * sum_r(partial_r) == sum_r(sigmoid(gate) * partial_r): still one all-reduce
            out = out + torch.sigmoid(F.linear(h, self.shared_expert_gate)) * self.shared_expert(h)
        return tp_all_reduce(out, self.ps).reshape(shape)  # (1, T, H)

    def fused(self, h: torch.Tensor) -> bool:
        """Whether this step's N tokens go to the CPU MoE kernel (router, top-k, experts, shared expert in one
        call): float32 CPU, and few enough multiply-adds (`FUSED_MOE_MACS`) that one thread's loops beat aten's
        GEMMs plus their per-op cost."""
        return self.fits(h.shape[0]) and cpu_kernels.use(h)

    def fits(self, tokens: int) -> bool:
        """Whether `tokens` tokens are few enough multiply-adds for the CPU MoE kernel (`fused`'s size rule)."""
        experts = self.experts
        macs = tokens * (self.top_k + (self.shared_expert is not None)) * 3 * experts.inter_per_rank * experts.hidden_size
        return macs <= FUSED_MOE_MACS


def fusable_layer(ps: ParallelState, dtype: torch.dtype, attn: Any, ln1: RMSNorm, ln2: RMSNorm) -> bool:
    """Whether `cpu_kernels`' whole-layer ops (dense_layer, decode_layer) can run a layer with attention `attn` and
    norms ln1 / ln2: one TP rank (no collective inside), float32, no o bias (a q/k/v bias, Qwen2's, the qkv
    linear adds), one eps for both norms."""
    return ps.tp_size == 1 and dtype == torch.float32 and attn.o_proj.bias is None and ln1.eps == ln2.eps


class ParallelDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, ps: ParallelState, dtype: torch.dtype, is_talker: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = ParallelAttention(config, layer_idx, ps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        sparse = text_arch(config).sparse(layer_idx, is_talker)
        self.mlp: nn.Module = (ParallelSparseMoe(config, ps, dtype, shared=is_talker) if sparse
                               else ParallelMLP(config.hidden_size, config.intermediate_size, ps, dtype, reduce=True))
        attn, D, self.layer_idx = self.self_attn, self.self_attn.head_dim, layer_idx
        # a decode-only batched step can run the whole layer as ONE kernel call (`cpu_kernels`' decode_layer),
        # its arguments read once here (the loader copies weights into these same parameters)
        self.fusable = fusable_layer(ps, dtype, attn, self.input_layernorm, self.post_attention_layernorm)
        norms = attn.qk_norms
        self._attn_args = (self.input_layernorm.weight, attn.qkv_proj.weight, attn.qkv_proj.bias,
                           None if norms is None else norms[0].weight, None if norms is None else norms[1].weight,
                           0.0 if norms is None else norms[0].eps)
        self._o_args = (D**-0.5, attn.o_proj.weight, self.post_attention_layernorm.weight, self.input_layernorm.eps,
                        attn.qkv_proj.q_size // D, attn.qkv_proj.kv_size // D, D)
        mlp = self.mlp
        if isinstance(mlp, ParallelSparseMoe):
            shared = mlp.shared_expert
            self._mlp_args: tuple[Any, ...] = (
                mlp.router, mlp.experts.gate_up, mlp.experts.down, mlp.top_k, bool(mlp.norm_topk),
                None if shared is None else shared.gate_up_proj.weight,
                None if shared is None else shared.down_proj.weight, mlp.shared_expert_gate)
        else:
            self._mlp_args = (None, cast(ParallelMLP, mlp).gate_up_proj.weight, cast(ParallelMLP, mlp).down_proj.weight,
                              0, False, None, None, None)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LMCache) -> torch.Tensor:
        if self.fusable and cpu_kernels.use(x) and cos.dtype == torch.float32:
            fused = self._fused(x, cos, sin, cache)
            if fused is not None:
                return fused
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)  # (1, T, H)
        return x + self.mlp(self.post_attention_layernorm(x))  # (1, T, H)

    def _fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LMCache) -> torch.Tensor | None:
        """A decode-only batched step's layer as ONE kernel call: the ops `forward` runs (paged decode, the MoE
        kernel or the silu MLP), in its order, with its values bit for bit, without the Python between them.
        None where `forward` runs it op by op: a request's own cache, prefill rows, a MoE too big for its kernel."""
        decode_only = getattr(cache, "decode_only", None)  # PagedBatch (paged_kv.py) has it, KVCache does not
        pools = decode_only(self.layer_idx) if decode_only is not None else None
        if pools is None or (isinstance(self.mlp, ParallelSparseMoe) and not self.mlp.fits(x.shape[1])):
            return None
        return cpu_kernels.ops().decode_layer(x, *self._attn_args, cos, sin, *pools, *self._o_args, *self._mlp_args)


class ParallelTextModel(nn.Module):
    """One rank's part of the thinker LM (`thinker_config.text_config`) or talker LM (`talker_config.text_config`)."""

    def __init__(self, config: Any, ps: ParallelState, layer_range: tuple[int, int], *, is_talker: bool,
                 with_head: bool = True, with_embed: bool = True, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (the Omni LMs use 'silu')")
        check_parallel_layout(config, 1, ps.tp_size)
        n, (start, end) = config.num_hidden_layers, layer_range
        if not 0 <= start < end <= n:
            raise ValueError(f"layer_range {layer_range} must satisfy 0 <= start < end <= {n} (num_hidden_layers)")
        if ps.is_first_pp_rank != (start == 0) or ps.is_last_pp_rank != (end == n):
            raise ValueError(f"pipeline rank {ps.pp_rank} of {ps.pp_size} got layer_range {layer_range}: the first "
                             f"rank must start at 0 and the last must end at {n}; use partition_layers({n}, {ps.pp_size})")
        self.config, self.ps, self.is_talker = config, ps, is_talker
        # Qwen3-Omni's talker names its input table codec_embedding; Qwen2.5-Omni's talker keeps embed_tokens
        self.embed_name = "codec_embedding" if is_talker and text_arch(config).family == "qwen3_omni" else "embed_tokens"
        cpu_kernels.prepare(ps.device)  # fused CPU kernels for the small per-token ops (built once per machine)
        self.start, self.end, self.num_layers = start, end, n
        tp: dict[str, Any] = {"tp_rank": ps.tp_rank, "tp_size": ps.tp_size, "ps": ps, "params_dtype": dtype}
        with torch.device(ps.device):
            self.embed = VocabParallelEmbedding(config.vocab_size, config.hidden_size, **tp) \
                if ps.is_first_pp_rank and with_embed else None
            self.layers = nn.ModuleList(ParallelDecoderLayer(config, i, ps, dtype, is_talker) for i in range(start, end))
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype) if ps.is_last_pp_rank else None
            self.head = ParallelLMHead(config.vocab_size, config.hidden_size, **tp) \
                if ps.is_last_pp_rank and with_head else None
            self.rotary = MRotary(config)

    def decoder_layers(self) -> list[ParallelDecoderLayer]:
        return [cast(ParallelDecoderLayer, layer) for layer in self.layers]

    def new_cache(self) -> KVCache:
        return KVCache((self.start, self.end))

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (..., ) -> embeddings (..., H); first pipeline rank only (collective over TP)."""
        if self.embed is None:
            raise ValueError(f"pipeline rank {self.ps.pp_rank} holds no embedding (only the first rank does)")
        return self.embed(ids.to(self.ps.device))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (..., H) -> logits (..., V); last pipeline rank only (all-gather over TP)."""
        if self.head is None:
            raise ValueError(f"pipeline rank {self.ps.pp_rank} holds no head (only the last rank, with_head=True)")
        return self.head(hidden)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, cache: LMCache,
                visual_pos_mask: torch.Tensor | None = None, deepstack: list[torch.Tensor] | None = None,
                capture_layer: int | None = None) -> StageOutput:
        """Run this rank's layers on x (1, T, H); see the module docstring and decoder.py's capture convention.
        `cache` is one request's `KVCache`, or a `PagedBatch`: then x packs the new tokens of many requests
        (T = their sum) and position_ids / visual_pos_mask / deepstack rows are packed the same way."""
        if x.dim() != 3 or x.shape[0] != 1 or x.shape[2] != self.config.hidden_size:
            raise ValueError(f"x must be (1, T, {self.config.hidden_size}), got {tuple(x.shape)}")
        if position_ids.dim() != 3 or position_ids.shape[0] not in (3, 4) or position_ids.shape[2] != x.shape[1]:
            raise ValueError(f"position_ids must be (4 or 3, 1, T={x.shape[1]}), got {tuple(position_ids.shape)}")
        if capture_layer is not None and not 0 <= capture_layer <= self.num_layers:
            raise ValueError(f"capture_layer={capture_layer} is outside 0..{self.num_layers}")
        # (3, 1, T) t/h/w rows; row 0 of a (4, 1, T) (text positions) only shapes transformers' mask, and for
        # unpadded requests it equals the cache positions, which is what the caches' causal masks are built from
        mrope = position_ids[-3:]
        cos, sin = self.rotary.tables(mrope.to(x.device), x.dtype)  # (1, T, D) each; sin: signed_sin
        hidden = x  # (1, T, H)
        captured = hidden if capture_layer == 0 and self.start == 0 else None
        for idx, layer in zip(range(self.start, self.end), self.layers):
            checkpoint()
            hidden = layer(hidden, cos, sin, cache)  # (1, T, H)
            if capture_layer == idx + 1 and capture_layer < self.num_layers:
                captured = hidden
            if deepstack is not None and idx < len(deepstack):
                if visual_pos_mask is None:
                    raise ValueError("deepstack features given without visual_pos_mask (1, T)")
                hidden = hidden.clone()
                hidden[visual_pos_mask] = hidden[visual_pos_mask] + deepstack[idx].to(hidden)  # (n_vis, H) rows
        if self.norm is not None:
            hidden = self.norm(hidden)  # (1, T, H)
            if capture_layer == self.num_layers:
                captured = hidden
        return StageOutput(hidden=hidden, captured=captured)

    def checkpoint_plan(self, prefix: str, head_key: str) -> Plan:
        """Checkpoint key -> [(param, loader, extra loader args)] for exactly this rank's tensors."""
        plan: Plan = {}

        def add(key: str, param: nn.Parameter, *args: Any) -> None:
            param.checkpoint_name = key  # type: ignore[attr-defined]
            plan.setdefault(key, []).append((param, param.weight_loader, args))  # type: ignore[attr-defined]

        embed_key = f"{prefix}{self.embed_name}.weight"
        if self.embed is not None:
            add(embed_key, self.embed.weight)
        for idx, layer in zip(range(self.start, self.end), self.decoder_layers()):
            p = f"{prefix}layers.{idx}."
            add(p + "input_layernorm.weight", layer.input_layernorm.weight)
            add(p + "post_attention_layernorm.weight", layer.post_attention_layernorm.weight)
            attn = layer.self_attn
            for s in "qkv":
                add(f"{p}self_attn.{s}_proj.weight", attn.qkv_proj.weight, s)
                if attn.qkv_proj.bias is not None:
                    add(f"{p}self_attn.{s}_proj.bias", attn.qkv_proj.bias, s)
            add(p + "self_attn.o_proj.weight", attn.o_proj.weight)
            if attn.o_proj.bias is not None:
                add(p + "self_attn.o_proj.bias", attn.o_proj.bias)
            if attn.qk_norms is not None:
                add(p + "self_attn.q_norm.weight", attn.qk_norms[0].weight)
                add(p + "self_attn.k_norm.weight", attn.qk_norms[1].weight)
            mlp = layer.mlp
            dense = [(p + "mlp.", mlp)] if isinstance(mlp, ParallelMLP) else []
            if isinstance(mlp, ParallelSparseMoe):
                add(p + "mlp.gate.weight", mlp.router)
                for e in range(mlp.experts.num_experts):
                    add(f"{p}mlp.experts.{e}.gate_proj.weight", mlp.experts.gate_up, e, "gate")
                    add(f"{p}mlp.experts.{e}.up_proj.weight", mlp.experts.gate_up, e, "up")
                    add(f"{p}mlp.experts.{e}.down_proj.weight", mlp.experts.down, e, "down")
                if mlp.shared_expert is not None and mlp.shared_expert_gate is not None:
                    dense.append((p + "mlp.shared_expert.", mlp.shared_expert))
                    add(p + "mlp.shared_expert_gate.weight", mlp.shared_expert_gate)
            for q, m in dense:
                add(q + "gate_proj.weight", m.gate_up_proj.weight, 0)
                add(q + "up_proj.weight", m.gate_up_proj.weight, 1)
                add(q + "down_proj.weight", m.down_proj.weight)
        if self.norm is not None:
            add(prefix + "norm.weight", self.norm.weight)
        if self.head is not None:
            add(head_key, self.head.weight)
        return plan

    def load_weights(self, model_dir: Path, prefix: str | None = None, head_key: str | None = None) -> tuple[str, ...]:
        """Read ONLY this rank's tensors from the safetensors folder, sharding each as it is read.

        Defaults: thinker `thinker.model.` + `thinker.lm_head.weight`; talker `talker.model.` +
        `talker.codec_head.weight` (a tied config falls back to the embedding key). Missing keys -> ValueError
        naming them. Returns the checkpoint keys read.
        """
        role = "talker" if self.is_talker else "thinker"
        prefix = prefix if prefix is not None else f"{role}.model."
        head_key = head_key if head_key is not None else ("talker.codec_head.weight" if self.is_talker
                                                          else "thinker.lm_head.weight")
        files = {} if dummy_weights() else checkpoint_files(Path(model_dir))
        if head_key not in files and getattr(self.config, "tie_word_embeddings", False):
            head_key = f"{prefix}{self.embed_name}.weight"
        return load_plan(self, model_dir, self.checkpoint_plan(prefix, head_key),
                         f"{role} layers [{self.start}, {self.end})", files)

    def param_bytes(self) -> int:
        """Bytes of this rank's parameters (buffers such as inv_freq excluded)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())


def pipeline_step(model: ParallelTextModel, x: torch.Tensor | None, position_ids: torch.Tensor, cache: LMCache, *,
                  visual_pos_mask: torch.Tensor | None = None, deepstack: list[torch.Tensor] | None = None,
                  capture_layer: int | None = None) -> StageOutput:
    """One blocking forward through the whole pipeline; every rank of the stage calls it for the same step.

    What crosses each boundary p -> p+1 (TP rank t to TP rank t, over the PP group), in this order:
      1. hidden (1, T, H) in the model dtype, always; T comes from `position_ids`, which every rank gets from
         the executor's step metadata (so no shape handshake);
      2. the captured hidden (1, T, H), only when `capture_layer` lies in an earlier rank's layers: it is
         relayed rank by rank to the last pipeline rank, which returns it (each rank decides from its own
         layer range and `capture_layer`, so no flag travels).
    Deepstack features do not cross: each rank receives `deepstack` / `visual_pos_mask` as inputs and uses the
    entries for the layers it owns. `x` is the inputs_embeds on the first rank and ignored elsewhere.
    On the last rank the result holds the final hidden and the captured hidden.
    """
    ps, T, H = model.ps, position_ids.shape[-1], model.config.hidden_size
    dtype = next(model.parameters()).dtype
    if ps.is_first_pp_rank:
        if x is None:
            raise ValueError("the first pipeline rank needs inputs_embeds x (1, T, H)")
    else:
        x = pp_recv((1, T, H), dtype, ps)
    # hidden index c is produced while running layer max(c - 1, 0) (c = 0: that layer's input)
    capture_at = None if capture_layer is None else max(capture_layer - 1, 0)
    relayed = pp_recv((1, T, H), dtype, ps) if capture_at is not None and capture_at < model.start else None
    out = model(x, position_ids, cache, visual_pos_mask, deepstack, capture_layer)
    captured = out.captured if relayed is None else relayed
    if not ps.is_last_pp_rank:
        pp_send(out.hidden, ps)
        if capture_at is not None and capture_at < model.end and captured is not None:
            pp_send(captured, ps)
    return StageOutput(hidden=out.hidden, captured=captured)
