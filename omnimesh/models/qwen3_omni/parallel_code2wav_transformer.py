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

Data flow (one window of one request; every rank of the stage calls `pipeline_step` for it):
    first pp rank:  x = code_embedding(codes + offset).mean(quantizers) (1, n, H), positions (1, n)
        -> layers start..end-1 over this rank's heads / columns (hidden crosses pp boundaries)
        -> final norm (last pp rank) -> frames (1, n, H) for the conv stack

Run the checks: python -m pytest tests/parallel/test_parallel_code2wav_transformer.py -q
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from omnimesh.models.qwen3_omni.parallel_code_predictor import (
    CheckpointPlan,
    ParallelDenseAttention,
    Rotary1D,
    causal_window_mask,
    check_dense_layout,
    check_layer_range,
    check_supported,
    pipeline_step,
)
from omnimesh.models.qwen3_omni.parallel_text_model import ParallelMLP, RMSNorm
from omnimesh.parallel.layers import default_weight_loader
from omnimesh.parallel.parallel_state import ParallelState

__all__ = ["ParallelCode2WavTransformer", "SlidingWindowKVCache", "check_code2wav_layout", "pipeline_step"]


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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: SlidingWindowKVCache,
                mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin, cache, mask))  # (1, T, H)
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))  # (1, T, H)


class ParallelCode2WavTransformer(nn.Module):
    """One rank's part of code2wav's `pre_transformer` (`code2wav_config`)."""

    def __init__(self, config: Any, ps: ParallelState, layer_range: tuple[int, int],
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        check_supported(config)
        check_code2wav_layout(config, 1, ps.tp_size)
        self.start, self.end = check_layer_range(config.num_hidden_layers, ps, layer_range)
        self.config, self.ps, self.dtype = config, ps, dtype
        self.hidden_size, self.window = int(config.hidden_size), int(config.sliding_window)
        with torch.device(ps.device):
            self.layers = nn.ModuleList(ParallelCode2WavLayer(config, i, ps, dtype) for i in range(self.start, self.end))
            self.norm = RMSNorm(self.hidden_size, config.rms_norm_eps, dtype) if ps.is_last_pp_rank else None
            self.rotary = Rotary1D(config)

    def new_cache(self) -> SlidingWindowKVCache:
        """A per-request cache for this rank's layers and heads, kept for the whole stream."""
        return SlidingWindowKVCache((self.start, self.end), self.window)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: SlidingWindowKVCache) -> torch.Tensor:
        """This rank's layers on x (1, T, H) at positions (1, T) (= seen..seen+T-1) -> (1, T, H), final-normed
        on the last rank."""
        if x.dim() != 3 or x.shape[0] != 1 or x.shape[2] != self.hidden_size:
            raise ValueError(f"x must be (1, T, {self.hidden_size}), got {tuple(x.shape)}")
        if positions.shape != (1, x.shape[1]):
            raise ValueError(f"positions must be (1, T={x.shape[1]}), got {tuple(positions.shape)}")
        T = x.shape[1]
        cos, sin = self.rotary(positions.to(x.device), x.dtype)  # (1, T, D) each
        mask = causal_window_mask(T, cache.get_seq_length(), cache.stored_length(), self.window, x.device)  # (T, S)
        hidden = x  # (1, T, H)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, cache, mask)  # (1, T, H)
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
