"""code2wav's pre-transformer, tensor-parallel, cut into pipeline ranges, incremental on a sliding-window cache.

Role: our own `Qwen3OmniMoeCode2WavTransformerModel` for ONE rank of a pp x tp grid, for the vocoder stage:
its layers [start, end) with attention sharded by heads (q/k/v column-parallel, o row-parallel) and the MLP
by intermediate columns, one all-reduce each, as in `ParallelTextModel`; the final norm on the last pipeline
rank. The math mirrors transformers: pre-norm RMSNorm, no q/k norm, 1-D RoPE, causal attention limited to
the last `sliding_window` (72) positions in EVERY layer, silu MLP, and a learnt per-channel layer scale on
both residual branches. The code embedding (`code2wav.code_embedding`, mean over quantizers) stays with the
caller, like the LM stages' embeddings: the first rank receives frames-to-be (1, n, H).

Streaming: the streamer feeds n new codes at a time at positions seen..seen+n-1. Query q sees keys
q-71..q, so the cache never needs more than the last `sliding_window - 1` keys per layer:
`SlidingWindowKVCache` keeps exactly those (memory is bounded however long the request), and its
`get_seq_length` still counts every position seen, which is where the mask and positions come from.
Windows of any size give the same frames as one pass over all codes (tests: 1, 7, 30 codes, past 72).

Batching: `forward` takes the windows of B requests at once, x (B, T, H) right-padded to the longest
(row b holds `lengths[b]` real codes), positions (B, T) and one cache per row. Per layer, q/k/v, the MLP
and the norms run once for the whole batch; each row's keys are [its cached keys | its T new keys],
right-padded to the longest row, and the (B, 1, T, S) mask lets query i of row b see only that row's keys
k <= q within the window. Real queries never see a padded key (padded keys come after every real query,
padded key slots beyond a row's length are masked), and only the real keys enter each cache, so a row's
output equals decoding it alone; padded query rows hold finite garbage the caller drops.

Data flow (one engine step of B requests; every rank of the stage calls `batch_pipeline_step` for it):
    first pp rank:  x = code_embedding(codes + offset).mean(quantizers) (B, T, H), positions (B, T)
        -> layers start..end-1 over this rank's heads / columns (hidden (B, T, H) crosses pp boundaries)
        -> final norm (last pp rank) -> frames (B, T, H) for the conv stack

Run the checks: python -m pytest tests/parallel/test_parallel_code2wav_transformer.py -q
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from omnimesh.engine.step_gate import checkpoint
from omnimesh.kernels import cpu_kernels
from omnimesh.models.qwen3_omni.parallel_code_predictor import (
    CheckpointPlan,
    ParallelDenseAttention,
    Rotary1D,
    check_dense_layout,
    check_layer_range,
    check_supported,
    pipeline_step,
)
from omnimesh.models.qwen3_omni.parallel_text_model import ParallelMLP, RMSNorm, gqa_attention, qkv_heads, signed_sin
from omnimesh.parallel.layers import default_weight_loader
from omnimesh.parallel.parallel_state import ParallelState, pp_recv, pp_send

__all__ = ["ParallelCode2WavTransformer", "SlidingWindowKVCache", "batch_pipeline_step", "check_code2wav_layout",
           "pipeline_step"]


def check_code2wav_layout(config: Any, pp: int, tp: int, custom_partition: list[int] | None = None) -> None:
    """Every size a pp x tp layout must divide (heads, intermediate, layers), before any process group."""
    check_dense_layout(config, pp, tp, custom_partition)
    if config.sliding_window is None or config.sliding_window < 1:
        raise ValueError(f"sliding_window={config.sliding_window} must be >= 1 (code2wav's layers are all windowed)")


class SlidingWindowKVCache:
    """One request's keys/values for THIS rank's layers and heads, trimmed to the last `window - 1` positions.

    `update(layer_idx, k, v)` (global layer index) takes (1, n_kv/tp, T, D) and returns the kept history plus
    the new keys (1, n_kv/tp, stored + T, D), then keeps only the last `window - 1` (what any later query can
    still see). `get_seq_length` is the number of positions seen (not stored), like transformers'
    `DynamicSlidingWindowLayer.cumulative_length`; `stored_length` is how many keys are kept.
    """

    def __init__(self, layer_range: tuple[int, int], window: int) -> None:
        if window < 1:
            raise ValueError(f"window={window} must be >= 1")
        self.start, self.end = layer_range
        self.window = window
        n = self.end - self.start
        self._k: list[torch.Tensor | None] = [None] * n
        self._v: list[torch.Tensor | None] = [None] * n
        self._seen = [0] * n

    def get_seq_length(self) -> int:
        return self._seen[0]

    def stored_length(self) -> int:
        k = self._k[0]
        return 0 if k is None else int(k.shape[2])

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.start <= layer_idx < self.end:
            raise ValueError(f"layer {layer_idx} is not in this cache's range [{self.start}, {self.end})")
        i = layer_idx - self.start
        old_k, old_v = self._k[i], self._v[i]
        full_k = k if old_k is None else torch.cat([old_k, k], dim=2)  # (1, n_kv, stored + T, D)
        full_v = v if old_v is None else torch.cat([old_v, v], dim=2)
        keep = min(full_k.shape[2], self.window - 1)
        # clone: a view would pin the whole (stored + T) buffer until the next window
        self._k[i] = full_k[:, :, full_k.shape[2] - keep:].clone()  # (1, n_kv, <= window - 1, D)
        self._v[i] = full_v[:, :, full_v.shape[2] - keep:].clone()
        self._seen[i] += k.shape[2]
        return full_k, full_v


class LayerScale(nn.Module):
    """Per-channel scale (H,) of a residual branch, replicated over TP (it acts after the all-reduce)."""

    def __init__(self, size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)
        self.scale.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class ParallelCode2WavLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, ps: ParallelState, dtype: torch.dtype) -> None:
        super().__init__()
        H = config.hidden_size
        self.input_layernorm = RMSNorm(H, config.rms_norm_eps, dtype)
        self.self_attn = ParallelDenseAttention(config, layer_idx, ps, dtype, qk_norm=False)
        self.self_attn_layer_scale = LayerScale(H, dtype)
        self.post_attention_layernorm = RMSNorm(H, config.rms_norm_eps, dtype)
        self.mlp = ParallelMLP(H, config.intermediate_size, ps, dtype, reduce=True)
        self.mlp_layer_scale = LayerScale(H, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches: Sequence[SlidingWindowKVCache],
                lengths: Sequence[int], mask: torch.Tensor) -> torch.Tensor:
        attn = batch_attention(self.self_attn, self.input_layernorm(x), cos, sin, caches, lengths, mask)  # (B, T, H)
        x = x + self.self_attn_layer_scale(attn)  # (B, T, H)
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))  # (B, T, H)


def batch_attention(attn: ParallelDenseAttention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    caches: Sequence[SlidingWindowKVCache], lengths: Sequence[int], mask: torch.Tensor) -> torch.Tensor:
    """`attn`'s projections over x (B, T, H) (rows right-padded, row b real up to lengths[b]); each row attends
    over [its cache | its T new keys] (padded to the longest row, see `batch_window_mask`). Only a row's real
    keys enter its cache. -> (B, T, H), all-reduced over TP."""
    B, T, D = x.shape[0], x.shape[1], attn.head_dim
    proj = attn.qkv_proj
    q, k, v = qkv_heads(proj(x), proj.q_size // D, proj.kv_size // D, D, attn.qk_norms,
                        cos.unsqueeze(1), sin.unsqueeze(1))  # (B, nh/tp | nkv/tp, T, D); sin: signed_sin
    keys, values = [], []
    for b, (cache, n) in enumerate(zip(caches, lengths)):
        kb, vb = cache.update(attn.layer_idx, k[b:b + 1, :, :n], v[b:b + 1, :, :n])  # (1, nkv/tp, stored_b + n, D)
        keys.append(torch.cat([kb, k[b:b + 1, :, n:]], dim=2) if n < T else kb)  # (1, nkv/tp, stored_b + T, D)
        values.append(torch.cat([vb, v[b:b + 1, :, n:]], dim=2) if n < T else vb)
    S = mask.shape[-1]
    k = torch.cat([F.pad(t, (0, 0, 0, S - t.shape[2])) for t in keys])  # (B, nkv/tp, S, D)
    v = torch.cat([F.pad(t, (0, 0, 0, S - t.shape[2])) for t in values])
    o = gqa_attention(q, k, v, attn.n_rep, D**-0.5, mask)  # (B, nh/tp, T, D)
    return attn.o_proj(o.transpose(1, 2).reshape(B, T, -1))  # (B, T, H)


def batch_window_mask(seen: Sequence[int], stored: Sequence[int], T: int, window: int,
                      device: torch.device) -> torch.Tensor:
    """Bool (B, 1, T, S) mask, S = max(stored) + T: row b's keys are its `stored[b]` cached keys (positions
    seen_b - stored_b .. seen_b - 1) then its T new keys (seen_b ..), then padding; query i (position
    seen_b + i) sees key k iff k <= q and q - k < window (transformers' sliding window), never padding."""
    seen_t = torch.tensor(list(seen), device=device)[:, None, None]  # (B, 1, 1)
    stored_t = torch.tensor(list(stored), device=device)[:, None, None]
    S = int(max(stored)) + T
    q = seen_t + torch.arange(T, device=device)[None, :, None]  # (B, T, 1)
    j = torch.arange(S, device=device)[None, None, :]  # (1, 1, S) key slot
    k = seen_t - stored_t + j  # (B, 1, S) key position
    ok = (j < stored_t + T) & (k <= q) & (q - k < window)  # (B, T, S)
    return ok.unsqueeze(1)


class ParallelCode2WavTransformer(nn.Module):
    """One rank's part of code2wav's `pre_transformer` (`code2wav_config`)."""

    def __init__(self, config: Any, ps: ParallelState, layer_range: tuple[int, int],
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        check_supported(config)
        check_code2wav_layout(config, 1, ps.tp_size)
        self.start, self.end = check_layer_range(config.num_hidden_layers, ps, layer_range)
        self.config, self.ps, self.dtype = config, ps, dtype
        cpu_kernels.prepare(ps.device)  # fused CPU kernels for the small per-token ops (built once per machine)
        self.hidden_size, self.window = int(config.hidden_size), int(config.sliding_window)
        with torch.device(ps.device):
            self.layers = nn.ModuleList(ParallelCode2WavLayer(config, i, ps, dtype) for i in range(self.start, self.end))
            self.norm = RMSNorm(self.hidden_size, config.rms_norm_eps, dtype) if ps.is_last_pp_rank else None
            self.rotary = Rotary1D(config)

    def new_cache(self) -> SlidingWindowKVCache:
        """A per-request cache for this rank's layers and heads, kept for the whole stream."""
        return SlidingWindowKVCache((self.start, self.end), self.window)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                caches: SlidingWindowKVCache | Sequence[SlidingWindowKVCache],
                lengths: Sequence[int] | None = None) -> torch.Tensor:
        """This rank's layers on x (B, T, H) at positions (B, T) (row b: seen_b..seen_b+T-1, seen_b = its
        cache's length), one cache per row (a bare cache: B = 1), row b real up to lengths[b] (default T)
        -> (B, T, H), final-normed on the last rank; padded rows' outputs are garbage to drop."""
        caches = [caches] if isinstance(caches, SlidingWindowKVCache) else list(caches)
        B, T = len(caches), x.shape[1]
        lengths = [T] * B if lengths is None else list(lengths)
        if x.dim() != 3 or x.shape[0] != B or x.shape[2] != self.hidden_size:
            raise ValueError(f"x must be ({B} = one row per cache, T, {self.hidden_size}), got {tuple(x.shape)}")
        if positions.shape != (B, T):
            raise ValueError(f"positions must be (B={B}, T={T}), got {tuple(positions.shape)}")
        if len(lengths) != B or not all(1 <= n <= T for n in lengths):
            raise ValueError(f"lengths must be {B} row lengths in 1..{T}, got {lengths}")
        cos, sin = self.rotary(positions.to(x.device), x.dtype)  # (B, T, D) each
        sin = signed_sin(sin)  # what apply_rope takes
        mask = batch_window_mask([c.get_seq_length() for c in caches], [c.stored_length() for c in caches], T,
                                 self.window, x.device)  # (B, 1, T, S)
        hidden = x  # (B, T, H)
        for layer in self.layers:
            checkpoint()
            hidden = layer(hidden, cos, sin, caches, lengths, mask)  # (B, T, H)
        return self.norm(hidden) if self.norm is not None else hidden

    def checkpoint_plan(self, prefix: str) -> CheckpointPlan:
        plan = CheckpointPlan()
        for idx, layer in zip(range(self.start, self.end), self.layers):
            layer = cast(ParallelCode2WavLayer, layer)
            p = f"{prefix}layers.{idx}."
            plan.add(p + "input_layernorm.weight", layer.input_layernorm.weight)
            plan.add(p + "post_attention_layernorm.weight", layer.post_attention_layernorm.weight)
            plan.add(p + "self_attn_layer_scale.scale", layer.self_attn_layer_scale.scale)
            plan.add(p + "mlp_layer_scale.scale", layer.mlp_layer_scale.scale)
            plan.add_attention(p + "self_attn.", layer.self_attn)
            plan.add_mlp(p + "mlp.", layer.mlp)
        if self.norm is not None:
            plan.add(prefix + "norm.weight", self.norm.weight)
        return plan

    def load_weights(self, model_dir: Path, prefix: str = "code2wav.pre_transformer.") -> tuple[str, ...]:
        """Read ONLY this rank's tensors, sharding each as read. Missing keys -> ValueError naming them."""
        what = f"code2wav pre-transformer layers [{self.start}, {self.end})"
        return self.checkpoint_plan(prefix).load(model_dir, self, what)

    def param_bytes(self) -> int:
        """Bytes of this rank's parameters (buffers such as inv_freq excluded)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())


def batch_pipeline_step(model: ParallelCode2WavTransformer, x: torch.Tensor | None, positions: torch.Tensor,
                        caches: Sequence[SlidingWindowKVCache], lengths: Sequence[int]) -> torch.Tensor:
    """`pipeline_step` for a batch: every rank of the stage calls it for the same step; only the hidden
    (B, T, H) crosses each pp boundary, its shape known on every rank from `positions` (B, T). `x` is the
    input on the first pipeline rank (ignored elsewhere). Returns this rank's output (B, T, H)."""
    ps = model.ps
    if ps.is_first_pp_rank:
        if x is None:
            raise ValueError(f"the first pipeline rank needs its input x (B, T, {model.hidden_size})")
    else:
        x = pp_recv((*positions.shape, model.hidden_size), model.dtype, ps)
    hidden = model(x, positions, caches, lengths)  # (B, T, H)
    pp_send(hidden, ps)  # no-op on the last pipeline rank
    return hidden
