"""Qwen3-Omni's audio tower, split over tensor-parallel ranks and cut into pipeline ranges.

Role: our own `Qwen3OmniMoeAudioEncoder` for ONE rank of the encoder stage's pp x tp grid. The conv
front-end (three stride-2 Conv2d + conv_out) and the sinusoidal positions live on the first pipeline
rank, ln_post + proj1/act/proj2 on the last, and every rank holds the layers [start, end) it owns. The
math mirrors transformers line for line. tests/parallel/test_parallel_audio_tower.py checks it against
transformers at pp = tp = 1 (1e-5) and across gloo ranks (1e-4).

TP sharding: attention by heads (q, k, v column-parallel, out_proj row-parallel), fc1/fc2 by ffn columns,
proj1/proj2 likewise (column, then row: one all-reduce). The conv front-end, the layer norms and the biases
of row-parallel linears are replicated. Windowed attention needs no communication, because a window
never spans heads.

Data flow (one batch of clips):
    feature_lens (B,) -> audio_batch(): chunk_lengths, valid_indices, cu_seqlens   (every rank, no weights)
    first pp rank:  features (n_mel, sum T_valid) -> chunks of 2*n_window frames (n_chunks, 1, n_mel, Tc)
                    -> conv2d1..3 + gelu -> conv_out -> + positions -> valid frames -> hidden (N, d_model)
    other ranks:    hidden (N, d_model) received from the previous pipeline rank
    forward(hidden, batch) -> layers start..end-1 (attention inside each cu_seqlens window)
                           -> last rank: ln_post -> proj1 -> act -> proj2 -> (N, output_dim)
`audio_pipeline_step` runs that across the pipeline; only the hidden (N, d_model) crosses a boundary.

The layers and helpers shared with parallel_vision_tower.py are here too: `LayerNorm`,
`ParallelFFN`, `varlen_attention` and the checkpoint plan helpers (the plan is read by `loader.load_plan`).

Run the checks: python -m pytest tests/parallel/test_parallel_audio_tower.py -q
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from omnimesh.models.loader import Plan, load_plan
from omnimesh.parallel.layers import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
    divide,
)
from omnimesh.parallel.parallel_state import ParallelState, pp_recv, pp_send
from omnimesh.parallel.partition import partition_layers

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,  # transformers' GELUActivation: the exact (erf) gelu
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
}


# ---- shared with parallel_vision_tower.py ----

def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; the Qwen3-Omni towers use {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def check_heads_divide(what: str, num_heads: int, tp: int) -> None:
    """ValueError naming the head count and the tp values that divide it."""
    if tp < 1 or num_heads % tp:
        valid = [t for t in range(1, num_heads + 1) if num_heads % t == 0]
        raise ValueError(f"tensor-parallel size tp={tp} must divide the {what}={num_heads} (attention is split by "
                         f"heads); valid tp values for this tower: {valid}")


def check_layer_range(layer_range: tuple[int, int], n: int, ps: ParallelState, what: str) -> tuple[int, int]:
    start, end = layer_range
    if not 0 <= start < end <= n:
        raise ValueError(f"layer_range {layer_range} must satisfy 0 <= start < end <= {n} ({what})")
    if ps.is_first_pp_rank != (start == 0) or ps.is_last_pp_rank != (end == n):
        raise ValueError(f"pipeline rank {ps.pp_rank} of {ps.pp_size} got layer_range {layer_range}: the first rank "
                         f"must start at 0 and the last must end at {n}; use partition_layers({n}, {ps.pp_size})")
    return start, end


def replicated_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    """A parameter every TP rank holds whole (loaded by `default_weight_loader`)."""
    p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    p.weight_loader = default_weight_loader  # type: ignore[attr-defined]
    return p


class LayerNorm(nn.Module):
    """nn.LayerNorm with replicated weight and bias that carry checkpoint loaders."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.size, self.eps = size, eps
        self.weight = replicated_param(size, dtype=dtype)
        self.bias = replicated_param(size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.size,), self.weight, self.bias, self.eps)


class ParallelFFN(nn.Module):
    """fc2(act(fc1(x))) with biases: fc1 split by output columns, fc2 by input columns, one all-reduce.

    Used for the towers' MLPs (audio fc1/fc2, vision linear_fc1/fc2), the audio head (proj1/proj2) and the
    vision patch mergers (mlp.0/mlp.2).
    """

    def __init__(self, d_in: int, d_inner: int, d_out: int, act: str, ps: ParallelState, dtype: torch.dtype) -> None:
        super().__init__()
        tp: dict[str, Any] = {"tp_rank": ps.tp_rank, "tp_size": ps.tp_size, "ps": ps, "params_dtype": dtype}
        self.fc1 = ColumnParallelLinear(d_in, d_inner, bias=True, **tp)
        self.fc2 = RowParallelLinear(d_inner, d_out, bias=True, **tp)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))  # (N, d_inner / tp) -> (N, d_out), all-reduced

    def plan(self, plan: Plan, fc1_key: str, fc2_key: str) -> None:
        """Checkpoint keys `<fc1_key>.weight/.bias` and `<fc2_key>.weight/.bias`."""
        add_weight_and_bias(plan, fc1_key, self.fc1)
        add_weight_and_bias(plan, fc2_key, self.fc2)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Attention inside each [cu[i], cu[i+1]) segment, none across: q, k, v (N, nh, D) -> (N, nh * D). The batch
    builders keep `cu_seqlens` on the host, so reading the lengths in every layer never waits for the device.

    Segment by segment, exactly as transformers' sdpa path does (no (N, N) mask is ever built).
    """
    N = q.shape[0]
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    parts = [t.transpose(0, 1).unsqueeze(0).split(lengths, dim=2) for t in (q, k, v)]  # 3 x [(1, nh, n_i, D)]
    outs = [F.scaled_dot_product_attention(qi, ki, vi, scale=scale).transpose(1, 2)  # (1, n_i, nh, D)
            for qi, ki, vi in zip(*parts)]
    return torch.cat(outs, dim=1).reshape(N, -1)  # (N, nh * D)


def add_to_plan(plan: Plan, key: str, param: nn.Parameter, *args: Any) -> None:
    param.checkpoint_name = key  # type: ignore[attr-defined]
    plan.setdefault(key, []).append((param, param.weight_loader, args))  # type: ignore[attr-defined]


def add_weight_and_bias(plan: Plan, key: str, module: nn.Module, *args: Any) -> None:
    """`<key>.weight` and (when the module has one) `<key>.bias`, both through their own loaders."""
    add_to_plan(plan, key + ".weight", module.weight, *args)  # type: ignore[arg-type]
    if getattr(module, "bias", None) is not None:
        add_to_plan(plan, key + ".bias", module.bias, *args)  # type: ignore[arg-type]


class TowerRank(nn.Module):
    """What one rank of any tower (audio or vision, either family) shares: its blocks [start, end), the checkpoint
    plan it reads (`checkpoint_plan`, the tower's own) and its bytes."""

    blocks_name = "layers"  # how `load_weights` names this rank's part in an error
    default_prefix = ""
    layers_attr = "encoder_layers"  # the config's block count

    def __init__(self, config: Any, ps: ParallelState, layer_range: tuple[int, int], dtype: torch.dtype,
                 check_layout: Callable[[Any, int, int], None]) -> None:
        """The tower's sizes checked for this tp (`check_layout`, ValueError naming them) and the block range."""
        super().__init__()
        check_layout(config, 1, ps.tp_size)
        n = getattr(config, self.layers_attr)
        self.start, self.end = check_layer_range(layer_range, n, ps, self.layers_attr)
        self.config, self.ps, self.dtype = config, ps, dtype

    def checkpoint_plan(self, prefix: str) -> Plan:
        raise NotImplementedError

    def load_weights(self, model_dir: Path, prefix: str | None = None) -> tuple[str, ...]:
        """Read ONLY this rank's tensors (its blocks, the embedding / head where they live), sharding each as read.

        Missing keys -> ValueError naming them. Returns the checkpoint keys read.
        """
        return load_plan(self, model_dir, self.checkpoint_plan(prefix or self.default_prefix),
                                    f"{self.blocks_name} [{self.start}, {self.end})")

    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())


def check_rows(hidden: torch.Tensor, rows: int, width: int, what: str) -> None:
    """The hidden a tower rank receives must be (rows, width)."""
    if tuple(hidden.shape) != (rows, width):
        raise ValueError(f"hidden must be (N={rows}, {what}={width}), got {tuple(hidden.shape)}")


# ---- the audio tower ----

def check_audio_layout(config: Any, pp: int, tp: int, custom_partition: list[int] | None = None) -> None:
    """Every size a pp x tp layout of the audio tower must divide (ValueError names it), before any process group."""
    check_heads_divide("audio tower's encoder_attention_heads", config.encoder_attention_heads, tp)
    divide(config.encoder_ffn_dim, tp, "encoder_ffn_dim")
    divide(config.d_model, tp, "d_model (proj1 output)")
    partition_layers(config.encoder_layers, pp, custom_partition)


def audio_output_lengths(feature_lens: torch.Tensor, n_window: int) -> torch.Tensor:
    """Tokens the tower emits per clip of `feature_lens` mel frames (transformers' formula; its 13 tokens per
    full chunk hold for the config default n_window = 50 only, and the constructor refuses any other)."""
    chunk = n_window * 2
    leave = feature_lens % chunk
    lens = (leave - 1) // 2 + 1
    return ((lens - 1) // 2 + 1 - 1) // 2 + 1 + (feature_lens // chunk) * 13


@dataclass(frozen=True)
class AudioBatch:
    """Per-batch metadata every pipeline rank derives from `feature_lens` alone (nothing of it is sent)."""

    feature_lens: torch.Tensor  # (B,) valid mel frames per clip
    chunk_lengths: torch.Tensor  # (n_chunks,) frames per conv chunk (2 * n_window, the tail shorter)
    valid_indices: torch.Tensor  # (N,) rows of the (n_chunks * max_chunk_tokens) conv output that are real
    cu_seqlens: torch.Tensor  # (n_windows + 1,) int32 attention-window boundaries over the N tokens (on the host)

    @property
    def n_tokens(self) -> int:
        return int(self.valid_indices.numel())


def audio_batch(config: Any, feature_lens: torch.Tensor) -> AudioBatch:
    """Chunking, valid positions and attention windows, as transformers' tower computes them.

    Attention windows are `max_chunk_tokens * (n_window_infer // (2 * n_window))` tokens, where
    max_chunk_tokens is the longest chunk's token count over the WHOLE batch (13 once any clip has a full
    chunk): transformers' rule, so a clip's windows can depend on the other clips in its batch.
    """
    if feature_lens.dim() != 1 or feature_lens.numel() == 0 or int(feature_lens.min()) < 1:
        raise ValueError(f"feature_lens must be a non-empty 1-D tensor of frame counts >= 1, got {feature_lens.tolist()}")
    lens = feature_lens.long()
    n_window, chunk = config.n_window, config.n_window * 2
    chunk_num = torch.ceil(lens / chunk).long()  # (B,)
    chunk_lengths = torch.full((int(chunk_num.sum()),), chunk, dtype=torch.long, device=lens.device)
    tail = F.pad(chunk_num, (1, 0), value=-1).cumsum(0)[1:]  # (B,) index of each clip's last chunk
    chunk_lengths[tail] = lens % chunk
    chunk_lengths = torch.where(chunk_lengths == 0, chunk, chunk_lengths)

    chunk_tokens = audio_output_lengths(chunk_lengths, n_window)  # (n_chunks,)
    max_tokens = int(chunk_tokens.max())
    valid = torch.arange(max_tokens, device=lens.device) < chunk_tokens.unsqueeze(1)  # (n_chunks, max_tokens)
    valid_indices = valid.flatten().nonzero().squeeze(-1)  # (N,)

    window = max_tokens * (config.n_window_infer // chunk)
    bounds = [0]
    for clip_tokens in audio_output_lengths(lens, n_window).tolist():
        bounds += [window] * (clip_tokens // window) + ([clip_tokens % window] if clip_tokens % window else [])
    cu_seqlens = torch.tensor(bounds).cumsum(-1, dtype=torch.int32)  # host: every layer reads its lengths
    return AudioBatch(feature_lens=lens, chunk_lengths=chunk_lengths, valid_indices=valid_indices,
                      cu_seqlens=cu_seqlens)


def sinusoid_positions(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Rows 0..length-1 of transformers' SinusoidsPositionEmbedding: (length, channels) float32."""
    increment = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-increment * torch.arange(channels // 2).float())  # (C/2,)
    scaled = torch.arange(length)[:, None] * inv_timescales[None, :]  # (length, C/2)
    return torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=1)  # (length, C)


class ParallelAudioAttention(nn.Module):
    """`k_bias=False`: k_proj has no bias (Qwen2.5-Omni's tower); the fused bias's k slice stays zero, never read."""

    def __init__(self, config: Any, ps: ParallelState, dtype: torch.dtype, k_bias: bool = True) -> None:
        super().__init__()
        tp: dict[str, Any] = {"tp_rank": ps.tp_rank, "tp_size": ps.tp_size, "ps": ps, "params_dtype": dtype}
        d, nh = config.d_model, config.encoder_attention_heads
        self.head_dim = divide(d, nh, "d_model / encoder_attention_heads")
        self.qkv_proj = QKVParallelLinear(d, self.head_dim, nh, nh, bias=True, **tp)
        self.out_proj = RowParallelLinear(d, d, bias=True, **tp)
        self.k_bias = k_bias
        if not k_bias:
            cast(nn.Parameter, self.qkv_proj.bias).data.narrow(0, self.qkv_proj.q_size, self.qkv_proj.kv_size).zero_()

    def plan(self, plan: Plan, p: str) -> None:
        """Checkpoint keys `<p>{q,k,v}_proj.weight/.bias` (no k bias when k_bias=False) and `<p>out_proj.*`."""
        for s in "qkv":
            add_to_plan(plan, f"{p}{s}_proj.weight", self.qkv_proj.weight, s)
            if s != "k" or self.k_bias:
                add_to_plan(plan, f"{p}{s}_proj.bias", cast(nn.Parameter, self.qkv_proj.bias), s)
        add_weight_and_bias(plan, p + "out_proj", self.out_proj)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        N, D = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.qkv_proj.q_size] * 3, dim=-1)  # 3 x (N, nh/tp * D)
        o = varlen_attention(q.view(N, -1, D), k.view(N, -1, D), v.view(N, -1, D), cu_seqlens, D**-0.5)
        return self.out_proj(o)  # (N, d_model), all-reduced


class ParallelAudioLayer(nn.Module):
    def __init__(self, config: Any, ps: ParallelState, dtype: torch.dtype, k_bias: bool = True) -> None:
        super().__init__()
        d = config.d_model
        self.self_attn_layer_norm = LayerNorm(d, 1e-5, dtype)
        self.self_attn = ParallelAudioAttention(config, ps, dtype, k_bias)
        self.final_layer_norm = LayerNorm(d, 1e-5, dtype)
        self.mlp = ParallelFFN(d, config.encoder_ffn_dim, d, config.activation_function, ps, dtype)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), cu_seqlens)  # (N, d)
        x = x + self.mlp(self.final_layer_norm(x))  # (N, d)
        if x.dtype == torch.float16:  # transformers clamps fp16 activations after every layer
            bound = torch.finfo(x.dtype).max - 1000
            x = torch.clamp(x, min=-bound, max=bound)
        return x

    def plan(self, plan: Plan, p: str) -> None:
        """This layer's checkpoint keys under `p` = `<prefix>layers.<i>.`."""
        self.self_attn.plan(plan, p + "self_attn.")
        add_weight_and_bias(plan, p + "self_attn_layer_norm", self.self_attn_layer_norm)
        add_weight_and_bias(plan, p + "final_layer_norm", self.final_layer_norm)
        self.mlp.plan(plan, p + "fc1", p + "fc2")


def chunked_features(tower: Any, features: torch.Tensor, batch: AudioBatch) -> torch.Tensor:
    """A first audio rank's input check and chunking: features (n_mel, sum T_valid) -> each chunk's frames,
    right-padded with zeros: (n_chunks, n_mel, Tc) in the tower's dtype."""
    if tower.front is None:
        raise ValueError(f"pipeline rank {tower.ps.pp_rank} holds no conv front-end (only the first rank does)")
    n_mel, total = tower.config.num_mel_bins, int(batch.feature_lens.sum())
    if tuple(features.shape) != (n_mel, total):
        raise ValueError(f"features must be (num_mel_bins={n_mel}, sum(feature_lens)={total}) valid frames, got "
                         f"{tuple(features.shape)}; drop padded frames first (feature_attention_mask)")
    chunks = features.to(tower.ps.device).T.split(batch.chunk_lengths.tolist(), dim=0)  # [(Tc_i, n_mel)]
    return nn.utils.rnn.pad_sequence(list(chunks), batch_first=True).transpose(1, 2).to(tower.dtype)


class ParallelAudioTower(TowerRank):
    """One rank's part of the audio tower (`thinker_config.audio_config`)."""

    blocks_name = "audio tower layers"
    default_prefix = "thinker.audio_tower."

    def __init__(self, config: Any, ps: ParallelState, layer_range: tuple[int, int],
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, ps, layer_range, dtype, check_audio_layout)
        if config.scale_embedding:
            raise ValueError("scale_embedding=True is not supported (Qwen3-Omni's audio tower does not scale)")
        if config.n_window != 50:  # transformers' token count hard-codes 13 tokens per 100-frame chunk
            raise ValueError(f"n_window={config.n_window} is not supported: the tower's length formula assumes 50")
        d, c = config.d_model, config.downsample_hidden_size
        freq = (((config.num_mel_bins + 1) // 2 + 1) // 2 + 1) // 2  # mel bins left after three stride-2 convs
        with torch.device(ps.device):
            self.front: nn.ParameterDict | None = None  # first pp rank: conv front-end, replicated over TP
            if ps.is_first_pp_rank:
                self.front = nn.ParameterDict({
                    "conv2d1_weight": replicated_param(c, 1, 3, 3, dtype=dtype),
                    "conv2d1_bias": replicated_param(c, dtype=dtype),
                    "conv2d2_weight": replicated_param(c, c, 3, 3, dtype=dtype),
                    "conv2d2_bias": replicated_param(c, dtype=dtype),
                    "conv2d3_weight": replicated_param(c, c, 3, 3, dtype=dtype),
                    "conv2d3_bias": replicated_param(c, dtype=dtype),
                    "conv_out_weight": replicated_param(d, c * freq, dtype=dtype),  # (d, c * freq), no bias
                })
            self.layers = nn.ModuleList(ParallelAudioLayer(config, ps, dtype) for _ in range(self.start, self.end))
            self.ln_post = LayerNorm(d, 1e-5, dtype) if ps.is_last_pp_rank else None
            self.proj = ParallelFFN(d, d, config.output_dim, config.activation_function, ps, dtype) \
                if ps.is_last_pp_rank else None

    def audio_layers(self) -> list[ParallelAudioLayer]:
        return [cast(ParallelAudioLayer, layer) for layer in self.layers]

    def batch(self, feature_lens: torch.Tensor) -> AudioBatch:
        return audio_batch(self.config, feature_lens.to(self.ps.device))

    @torch.no_grad()
    def embed_features(self, features: torch.Tensor, batch: AudioBatch) -> torch.Tensor:
        """features (n_mel, sum T_valid) -> hidden (N, d_model); first pipeline rank only (no collective)."""
        padded = chunked_features(self, features, batch).unsqueeze(1)  # (n_chunks, 1, n_mel, Tc)
        w = cast(nn.ParameterDict, self.front)
        outs = []
        for part in padded.split(self.config.conv_chunksize, dim=0):  # bounded conv activations, as transformers
            h = F.gelu(F.conv2d(part, w["conv2d1_weight"], w["conv2d1_bias"], stride=2, padding=1))
            h = F.gelu(F.conv2d(h, w["conv2d2_weight"], w["conv2d2_bias"], stride=2, padding=1))
            h = F.gelu(F.conv2d(h, w["conv2d3_weight"], w["conv2d3_bias"], stride=2, padding=1))
            outs.append(h)  # (b, c, freq, t)
        h = torch.cat(outs, dim=0)
        b, c, f, t = h.shape
        if t > self.config.max_source_positions:
            raise ValueError(f"a chunk yields {t} positions, more than max_source_positions="
                             f"{self.config.max_source_positions}")
        h = F.linear(h.permute(0, 3, 1, 2).contiguous().view(b, t, c * f), w["conv_out_weight"])  # (b, t, d)
        h = h + sinusoid_positions(t, self.config.d_model).to(h.device, h.dtype).unsqueeze(0)  # (b, t, d)
        return torch.index_select(h.reshape(-1, h.shape[-1]), 0, batch.valid_indices)  # (N, d)

    @torch.no_grad()
    def forward(self, hidden: torch.Tensor, batch: AudioBatch) -> torch.Tensor:
        """This rank's layers on hidden (N, d_model); the last rank adds ln_post + projection -> (N, output_dim)."""
        check_rows(hidden, batch.n_tokens, self.config.d_model, "d_model")
        for layer in self.layers:
            hidden = layer(hidden, batch.cu_seqlens)  # (N, d)
        if self.ln_post is not None and self.proj is not None:
            hidden = self.proj(self.ln_post(hidden))  # (N, output_dim)
        return hidden

    def checkpoint_plan(self, prefix: str) -> Plan:
        plan: Plan = {}
        if self.front is not None:
            for name, param in self.front.items():
                module, kind = name.rsplit("_", 1)
                add_to_plan(plan, f"{prefix}{module}.{kind}", param)
        for idx, layer in zip(range(self.start, self.end), self.audio_layers()):
            layer.plan(plan, f"{prefix}layers.{idx}.")
        if self.ln_post is not None and self.proj is not None:
            add_weight_and_bias(plan, prefix + "ln_post", self.ln_post)
            self.proj.plan(plan, prefix + "proj1", prefix + "proj2")
        return plan


def audio_pipeline_step(tower: Any, features: torch.Tensor | None,
                        feature_lens: torch.Tensor) -> torch.Tensor:
    """One blocking forward through the whole pipeline; every rank of the stage calls it for the same batch.
    `tower`: a `ParallelAudioTower` or Qwen2.5-Omni's `ParallelAudioTower2_5` (the same methods).

    `feature_lens` (B,) is given to EVERY rank (the executor's step metadata): each derives the chunking,
    the token count N and the attention windows from it. `features` (n_mel, sum T_valid) is needed on the
    first rank only. What crosses each boundary p -> p+1 (TP rank t to TP rank t): the hidden (N, d_model)
    in the tower's dtype, nothing else. Returns (N, output_dim) on the last rank, the boundary hidden elsewhere.
    """
    ps = tower.ps
    batch = tower.batch(feature_lens)
    if ps.is_first_pp_rank:
        if features is None:
            raise ValueError("the first pipeline rank needs the mel features (n_mel, sum T_valid)")
        hidden = tower.embed_features(features, batch)
    else:
        hidden = pp_recv((batch.n_tokens, tower.config.d_model), tower.dtype, ps)
    out = tower(hidden, batch)
    pp_send(out, ps)  # a no-op on the last pipeline rank
    return out
