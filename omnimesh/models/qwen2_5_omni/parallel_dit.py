"""Qwen2.5-Omni's token2wav DiT decoder layers, tensor-parallel and cut into pipeline ranges.

Role: transformers' `DiTDecoderLayer` stack (`code2wav_dit_model.transformer_blocks`) for ONE rank of the
vocoder stage's pp x tp grid: its layers [start, end) only. Everything else of the DiT (time embedding,
code embedding, speaker encoder, input projection, final `norm_out` + `proj_out`) stays with the stage's
driver (dit_batch.sample_mels, transformers' own modules): the driver sends each evaluation's projected
input and time embedding, and gets the last layer's hidden back. The math mirrors transformers line for
line:
    attn_norm (AdaLayerNormZero): linear(silu(t)) (R, 6H) -> shift/scale/gate for attention and MLP;
    LayerNorm(eps 1e-6, no affine) * (1 + scale) + shift
    attention: q/k/v (with biases), RoPE on the FIRST head only (deinterleaved head dim, then half-split
    rotation), attention under the mask -look_backward <= block_diff <= look_ahead (per layer; computed
    block-locally, `dit_attention.block_attention`: each query block against its window's blocks only), to_out
    residuals gated by gate_msa / gate_mlp; MLP: Linear -> gelu(tanh) -> Linear.

TP sharding: to_q/to_k/to_v fused column-parallel by heads, to_out row-parallel (one all-reduce); the MLP
column then row parallel (one all-reduce); the modulation linear (H -> 6H) is replicated (every rank needs
all six chunks). TP rank 0 owns global head 0, so it alone applies RoPE. Row-parallel biases are replicated
and added once after the all-reduce.

Geometry: every rank builds the rotary table (cos, sin (1, T, D), as transformers'
`Qwen2_5OmniDiTRotaryEmbedding`) and one block-window mask per (look_backward, look_ahead) its layers use
(`dit_attention.window_mask`: padded frames are unreachable from real ones) from the step's metadata alone
(frames per row, T); nothing of it is sent.

Data flow (one DiT evaluation of R rows, every rank of the stage calls `dit_pipeline_step` for it):
    driver: x = input_embed.proj([noise | speaker enc | code embed | cond]) (R, T, H), t = time_embed (R, H)
    every rank:     frames (R,), T -> cos, sin (1, T, D), window masks (R x nb, 1, block, W x block); t (R, H)
    first pp rank:  hidden = x;  others: hidden (R, T, H) received from the previous pipeline rank
        -> layers start..end-1 over this rank's heads / ff columns -> send to the next pipeline rank
    last pp rank:   hidden (R, T, H) -> driver: norm_out(hidden, t) -> proj_out -> velocity
The time embedding travels in the step's command to every rank (R x H floats); only the hidden crosses a
pipeline boundary.

Run the checks: python -m pytest tests/parallel/test_qwen2_5_dit.py -q
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from omnimesh.models.qwen2_5_omni.dit_attention import block_attention, num_blocks, window_mask
from omnimesh.models.qwen3_omni.parallel_audio_tower import (
    ParallelFFN,
    Plan,
    TowerRank,
    add_to_plan,
    add_weight_and_bias,
    check_heads_divide,
    replicated_param,
)
from omnimesh.parallel.layers import QKVParallelLinear, RowParallelLinear, divide
from omnimesh.parallel.parallel_state import ParallelState, pp_recv, pp_send
from omnimesh.parallel.partition import partition_layers

__all__ = ["ParallelDiT", "check_dit_layout", "dit_head_dim", "dit_pipeline_step", "dit_rotary"]

NORM_EPS = 1e-6  # transformers' AdaLayerNormZero and ff_norm
Window = tuple[int, int]  # a layer's (look_backward, look_ahead) in blocks
Geometry = tuple[torch.Tensor, torch.Tensor, dict[Window, torch.Tensor]]  # cos, sin, the mask of each window


def dit_head_dim(config: Any) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def check_dit_layout(config: Any, pp: int, tp: int, custom_partition: list[int] | None = None) -> None:
    """Every size a pp x tp layout of the DiT must divide (ValueError names it), before any process group."""
    check_heads_divide("token2wav DiT's num_attention_heads", config.num_attention_heads, tp)
    divide(int(config.hidden_size * config.ff_mult), tp, "token2wav DiT's ff inner size (hidden_size * ff_mult)")
    partition_layers(config.num_hidden_layers, pp, custom_partition)
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope != "default":
        raise ValueError(f"token2wav DiT rope_type {rope!r} is not supported (only 'default')")


def dit_rotary(config: Any, total: int, device: torch.device | str,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (1, T, D) for positions 0..T-1: transformers' `Qwen2_5OmniDiTRotaryEmbedding` (default rope),
    op for op (inv_freq made on the CPU, as its constructor does)."""
    dim = dit_head_dim(config)
    base = config.rope_parameters["rope_theta"]
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    positions = torch.arange(total, device=device)[None, :]  # (1, T)
    freqs = positions[..., None].float() * inv_freq.to(device=device, dtype=torch.float)  # (1, T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (1, T, D)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rope_first_head(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (R, nh, T, D): head 0 deinterleaved ((x0, x1, x2, ...) -> (x0, x2, ..., x1, x3, ...)) and rotated
    (x * cos + rotate_half(x) * sin, cos/sin (1|R, T, D)); the other heads untouched (transformers' DiT)."""
    h = x[:, :1]
    h = torch.cat((h[..., 0::2], h[..., 1::2]), dim=-1)  # (R, 1, T, D)
    half = h.shape[-1] // 2
    rotated = torch.cat((-h[..., half:], h[..., :half]), dim=-1)
    h = h * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
    return torch.cat((h, x[:, 1:]), dim=1)


class ParallelDiTLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, ps: ParallelState, dtype: torch.dtype) -> None:
        super().__init__()
        tp: dict[str, Any] = {"tp_rank": ps.tp_rank, "tp_size": ps.tp_size, "ps": ps, "params_dtype": dtype}
        H, nh = int(config.hidden_size), int(config.num_attention_heads)
        self.hidden_size, self.head_dim, self.block_size = H, dit_head_dim(config), int(config.block_size)
        self.look_ahead = 1 if layer_idx in config.look_ahead_layers else 0
        self.look_backward = 1 if layer_idx in config.look_backward_layers else 0
        self.rope = ps.tp_rank == 0  # owns global head 0, the only head transformers rotates
        self.modulation = nn.ParameterDict({"weight": replicated_param(6 * H, H, dtype=dtype),
                                            "bias": replicated_param(6 * H, dtype=dtype)})
        self.qkv = QKVParallelLinear(H, self.head_dim, nh, nh, bias=True, **tp)
        self.to_out = RowParallelLinear(nh * self.head_dim, H, bias=True, **tp)
        self.ff = ParallelFFN(H, int(H * config.ff_mult), H, "gelu_pytorch_tanh", ps, dtype)

    def window(self) -> Window:
        return self.look_backward, self.look_ahead

    def forward(self, x: torch.Tensor, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """x (R, T, H), t (R, H) time embedding, mask: `window_mask` of this layer's window -> (R, T, H),
        whole on every TP rank."""
        R, T, H, D = x.shape[0], x.shape[1], self.hidden_size, self.head_dim
        emb = F.linear(F.silu(t), self.modulation["weight"], self.modulation["bias"])  # (R, 6H)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = torch.chunk(emb, 6, dim=1)
        norm = F.layer_norm(x, (H,), eps=NORM_EPS) * (1 + scale_msa[:, None]) + shift_msa[:, None]
        q, k, v = self.qkv(norm).split([self.qkv.q_size, self.qkv.kv_size, self.qkv.kv_size], dim=-1)
        q, k, v = (a.view(R, T, -1, D).transpose(1, 2) for a in (q, k, v))  # (R, nh/tp, T, D)
        if self.rope:
            q, k = rope_first_head(q, cos, sin), rope_first_head(k, cos, sin)
        o = block_attention(q, k, v, mask, self.block_size, *self.window())  # (R, nh/tp, T, D)
        x = x + gate_msa.unsqueeze(1) * self.to_out(o.transpose(1, 2).reshape(R, T, -1))  # all-reduced
        norm = F.layer_norm(x, (H,), eps=NORM_EPS) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        return x + gate_mlp.unsqueeze(1) * self.ff(norm)  # (R, T, H)

    def plan(self, plan: Plan, p: str) -> None:
        """This layer's checkpoint keys under `p` = `<prefix>transformer_blocks.<i>.`."""
        add_to_plan(plan, p + "attn_norm.linear.weight", self.modulation["weight"])
        add_to_plan(plan, p + "attn_norm.linear.bias", self.modulation["bias"])
        for s in "qkv":
            add_to_plan(plan, f"{p}attn.to_{s}.weight", self.qkv.weight, s)
            add_to_plan(plan, f"{p}attn.to_{s}.bias", cast(nn.Parameter, self.qkv.bias), s)
        add_weight_and_bias(plan, p + "attn.to_out.0", self.to_out)
        self.ff.plan(plan, p + "ff.ff.0", p + "ff.ff.3")


class ParallelDiT(TowerRank):
    """One rank's decoder layers of Qwen2.5-Omni's token2wav DiT (`token2wav_config.dit_config`)."""

    blocks_name = "token2wav DiT layers"
    default_prefix = "token2wav.code2wav_dit_model."
    layers_attr = "num_hidden_layers"

    def __init__(self, config: Any, ps: ParallelState, layer_range: tuple[int, int],
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, ps, layer_range, dtype, check_dit_layout)
        self.hidden_size, self.block_size = int(config.hidden_size), int(config.block_size)
        with torch.device(ps.device):
            self.layers = nn.ModuleList(ParallelDiTLayer(config, i, ps, dtype) for i in range(self.start, self.end))
        self._geometry: tuple[tuple[Any, ...], Geometry] | None = None

    def dit_layers(self) -> list[ParallelDiTLayer]:
        return [cast(ParallelDiTLayer, layer) for layer in self.layers]

    def geometry(self, frames: Sequence[int], total: int) -> Geometry:
        """cos, sin (1, T, D) and the window masks (`window_mask`, one per window this rank's layers use) of
        rows with `frames` real frames padded to `total`; the last one is kept (a decode's ~40 evaluations
        share it)."""
        key = (tuple(int(n) for n in frames), int(total))
        cached = self._geometry  # one read: two compute threads may step disjoint batches on this rank at once
        if cached is None or cached[0] != key:
            if not key[0] or not all(1 <= n <= total for n in key[0]):
                raise ValueError(f"frames must be one count in 1..{total} per row, got {list(key[0])}")
            cos, sin = dit_rotary(self.config, total, self.ps.device, self.dtype)
            masks = {window: window_mask(self.block_size, key[0], total, *window, self.ps.device)
                     for window in sorted({layer.window() for layer in self.dit_layers()})}
            cached = key, (cos, sin, masks)
            self._geometry = cached
        return cached[1]

    @torch.no_grad()
    def forward(self, hidden: torch.Tensor, time_embedding: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                masks: dict[Window, torch.Tensor]) -> torch.Tensor:
        """This rank's layers on hidden (R, T, H) with time_embedding (R, H), the rotary table cos/sin
        (1 or R, T, D) and `geometry`'s window masks -> (R, T, H) (padded frames: finite, to drop)."""
        R, T = hidden.shape[0], hidden.shape[1]
        if hidden.dim() != 3 or hidden.shape[2] != self.hidden_size:
            raise ValueError(f"hidden must be (R, T, {self.hidden_size}), got {tuple(hidden.shape)}")
        if tuple(time_embedding.shape) != (R, self.hidden_size):
            raise ValueError(f"time_embedding must be (R={R}, {self.hidden_size}), got {tuple(time_embedding.shape)}")
        rows = R * num_blocks(T, self.block_size)
        for layer in self.dit_layers():
            mask = masks[layer.window()]
            if mask.shape[0] != rows or mask.shape[2] != self.block_size:
                raise ValueError(f"the {layer.window()} window mask must be (R x blocks = {rows}, 1, "
                                 f"{self.block_size}, ...), got {tuple(mask.shape)}")
            hidden = layer(hidden, time_embedding, cos, sin, mask)
        return hidden

    def checkpoint_plan(self, prefix: str) -> Plan:
        plan: Plan = {}
        for idx, layer in zip(range(self.start, self.end), self.dit_layers()):
            layer.plan(plan, f"{prefix}transformer_blocks.{idx}.")
        return plan


def dit_pipeline_step(model: ParallelDiT, hidden: torch.Tensor | None, time_embedding: torch.Tensor,
                      frames: Sequence[int], total: int) -> torch.Tensor:
    """One DiT evaluation across the pipeline; every rank of the stage calls it for the same step.

    `frames` (R,) real frames per row and `total` (T) on every rank (they give the geometry and the shape
    of what is received), `time_embedding` (R, H) on every rank, `hidden` (R, T, H) on the first pipeline
    rank (ignored elsewhere). Only the hidden crosses a pipeline boundary. Returns this rank's output
    (R, T, H): the DiT's last layer on the last pipeline rank.
    """
    ps = model.ps
    if ps.is_first_pp_rank:
        if hidden is None:
            raise ValueError(f"the first pipeline rank needs the hidden (R, T, {model.hidden_size})")
    else:
        hidden = pp_recv((len(frames), total, model.hidden_size), model.dtype, ps)
    cos, sin, masks = model.geometry(frames, total)
    hidden = model(hidden, time_embedding.to(ps.device, model.dtype), cos, sin, masks)  # (R, T, H)
    pp_send(hidden, ps)  # no-op on the last pipeline rank
    return hidden
