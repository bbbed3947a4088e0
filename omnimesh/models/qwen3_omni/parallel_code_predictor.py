"""The talker's code predictor (a small dense Qwen3 decoder), tensor-parallel and cut into pipeline ranges.

Role: our own `Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration` for ONE rank of a pp x tp grid:
its layers [start, end) with attention sharded by heads and the MLP by intermediate columns (the same
column -> row pattern as `ParallelTextModel`, one all-reduce each), the per-group codec embeddings
(`model.codec_embedding[j]`) only on the first pipeline rank and the per-group heads (`lm_head[j]`) only on
the last. The math mirrors transformers (pre-norm RMSNorm, per-head q/k norm, GQA, 1-D RoPE, causal
attention, a window on `sliding_attention` layers if the config has any, silu MLP, final norm); tests/parallel/
check it against transformers (pp = tp = 1, 1e-5) and across gloo ranks (1e-4).

Embeddings and heads are REPLICATED over TP by default (`vocab_parallel=False`): each of the 2 x 15 tables
of the real model is 2048 x 1024, and per residual step the model only looks up one row and runs one
(1, H) x (H, 2048) GEMV, so splitting them saves ~4 MB per table per rank but adds two collectives (an
all-reduce for the lookup, an all-gather for the logits) to each of the 15 strictly sequential steps per
talker token, which are all latency (the whole predictor is ~12 tiny collectives per step). With replicated
heads every TP rank also holds the full logits. `vocab_parallel=True` splits them like `ParallelTextModel`
(ceil(V / tp) rows per rank) for layouts where memory matters more.

Data flow (one talker step of one request; every rank of the stage runs `predict_residuals` in lock-step):
    first pp rank:  prefix (1, 2, H) = [talker last hidden, talker codec embedding of code c0]
    step j = 0 .. G-2:  x at positions (0, 1) for j = 0, else (1 + j,)
        -> pipeline_step: layers start..end-1 (hidden crosses pp boundaries) -> final norm (last rank)
        -> last rank: lm_head[j](hidden[:, -1]) -> logits (V,) -> `sample` on the last pp rank's TP rank 0
        -> id broadcast over the stage's gloo group -> every rank knows r_{j+1}
        -> first rank: x = codec_embedding[j](r_{j+1}) (1, 1, H) for the next step
    -> ResidualCodes(codes r_1..r_{G-1}, codec_sum (1, 1, H) on the first rank, hidden per step on the last)
The generic `pipeline_step` and the dense attention here are reused by `parallel_code2wav_transformer.py`.
On CPU (float32, one TP rank) each layer of a step is ONE fused kernel call (`ParallelCodePredictorLayer._fused`).

Run the checks: python -m pytest tests/parallel/test_parallel_code_predictor.py -q
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from omnimesh.engine.step_gate import checkpoint
from omnimesh.kernels import cpu_kernels
from omnimesh.models.loader import Plan, load_plan
from omnimesh.models.qwen3_omni.parallel_text_model import (
    KVCache,
    ParallelMLP,
    RMSNorm,
    fusable_layer,
    gqa_attention,
    qkv_heads,
    signed_sin,
    small_attention,
)
from omnimesh.parallel.layers import (
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    check_heads,
    divide,
)
from omnimesh.parallel.parallel_state import ParallelState, cpu_broadcast, pp_recv, pp_send
from omnimesh.parallel.partition import partition_layers

Sample = Callable[[torch.Tensor], int]  # logits (V,) -> token id


class LayerCache(Protocol):
    """What a layer needs from a per-request KV cache (`KVCache`, `SlidingWindowKVCache`)."""

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def get_seq_length(self) -> int: ...


def check_dense_layout(config: Any, pp: int, tp: int, custom_partition: list[int] | None = None) -> None:
    """Every size a pp x tp layout of a dense decoder must divide, checked before any process-group work."""
    check_heads(config.num_attention_heads, config.num_key_value_heads, tp)
    divide(config.intermediate_size, tp, "intermediate_size")
    partition_layers(config.num_hidden_layers, pp, custom_partition)


def check_layer_range(num_layers: int, ps: ParallelState, layer_range: tuple[int, int]) -> tuple[int, int]:
    start, end = layer_range
    if not 0 <= start < end <= num_layers:
        raise ValueError(f"layer_range {layer_range} must satisfy 0 <= start < end <= {num_layers} (num_hidden_layers)")
    if ps.is_first_pp_rank != (start == 0) or ps.is_last_pp_rank != (end == num_layers):
        raise ValueError(f"pipeline rank {ps.pp_rank} of {ps.pp_size} got layer_range {layer_range}: the first rank "
                         f"must start at 0 and the last must end at {num_layers}; use "
                         f"partition_layers({num_layers}, {ps.pp_size})")
    return start, end


def check_supported(config: Any) -> None:
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (Qwen3-Omni uses 'silu')")
    rope_type = config.rope_parameters.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported yet (only 'default')")


def head_dim_of(config: Any) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def layer_window(config: Any, layer_idx: int) -> int | None:
    """The attention window of layer `layer_idx` (None = full causal), as transformers decides it."""
    types = getattr(config, "layer_types", None)
    return int(config.sliding_window) if types is not None and types[layer_idx] == "sliding_attention" else None


def causal_window_mask(T: int, seen: int, stored: int, window: int | None,
                       device: torch.device) -> torch.Tensor | None:
    """Bool (T, stored + T) mask for T new queries at absolute positions seen..seen+T-1 over the `stored`
    cached keys (the latest ones, ending at seen - 1) plus the T new keys: key k is visible to query q iff
    k <= q and q - k < window (transformers' `sliding_window_overlay`). None when every key is visible."""
    if T == 1 and (window is None or stored + 1 <= window):
        return None
    q = torch.arange(seen, seen + T, device=device)[:, None]  # (T, 1)
    k = torch.arange(seen - stored, seen + T, device=device)[None, :]  # (1, S)
    ok = k <= q  # (T, S)
    return ok & (q - k < window) if window is not None else ok


class Rotary1D(nn.Module):
    """Plain RoPE over one position axis, as `Qwen3OmniMoeRotaryEmbedding` ('default', scaling 1)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        dim = head_dim_of(config)
        inv_freq = 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # (D/2,)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (1, T) -> cos, sin (1, T, D)."""
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)  # (1, T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (1, T, D)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class ParallelDenseAttention(nn.Module):
    """Attention of one dense layer, split by heads over TP: q/k/v column-parallel, o row-parallel."""

    def __init__(self, config: Any, layer_idx: int, ps: ParallelState, dtype: torch.dtype, *, qk_norm: bool) -> None:
        super().__init__()
        tp: dict[str, Any] = {"tp_rank": ps.tp_rank, "tp_size": ps.tp_size, "ps": ps, "params_dtype": dtype}
        self.layer_idx, self.head_dim = layer_idx, head_dim_of(config)
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, heads, kv_heads,
                                          bias=config.attention_bias, **tp)
        self.o_proj = RowParallelLinear(heads * self.head_dim, config.hidden_size, bias=config.attention_bias, **tp)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype) if qk_norm else None
        self.n_rep = heads // kv_heads
        self.window = layer_window(config, layer_idx)

    @property
    def qk_norms(self) -> tuple[RMSNorm, RMSNorm] | None:
        return (self.q_norm, self.k_norm) if self.q_norm is not None and self.k_norm is not None else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LayerCache,
                mask: torch.Tensor | None) -> torch.Tensor:
        B, T, D = x.shape[0], x.shape[1], self.head_dim  # B: requests at the same positions (batched steps)
        q, k, v = qkv_heads(self.qkv_proj(x), self.qkv_proj.q_size // D, self.qkv_proj.kv_size // D, D, self.qk_norms,
                            cos.unsqueeze(1), sin.unsqueeze(1))  # (B, nh/tp | nkv/tp, T, D); sin: signed_sin
        k, v = cache.update(self.layer_idx, k, v)  # (B, nkv/tp, S, D): cached keys + these T
        S = k.shape[2]
        if isinstance(cache, KVCache) and small_attention(q, T, S):  # every key kept: query t at S - T + t
            o = cpu_kernels.ops().attention(q, k, v, S - T, 0, self.window or 0, D**-0.5)  # `mask`'s rule
        else:
            o = gqa_attention(q, k, v, self.n_rep, D**-0.5, mask)  # (B, nh/tp, T, D)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))  # (B, T, H), all-reduced


class CheckpointPlan:
    """Checkpoint key -> the (param, weight_loader, extra loader args) it fills, for one rank's tensors only."""

    def __init__(self) -> None:
        self.entries: Plan = {}

    def add(self, key: str, param: nn.Parameter, *args: Any) -> None:
        param.checkpoint_name = key  # type: ignore[attr-defined]
        self.entries.setdefault(key, []).append((param, param.weight_loader, args))  # type: ignore[attr-defined]

    def add_attention(self, prefix: str, attn: ParallelDenseAttention) -> None:
        for s in "qkv":
            self.add(f"{prefix}{s}_proj.weight", attn.qkv_proj.weight, s)
            if attn.qkv_proj.bias is not None:
                self.add(f"{prefix}{s}_proj.bias", attn.qkv_proj.bias, s)
        self.add(prefix + "o_proj.weight", attn.o_proj.weight)
        if attn.o_proj.bias is not None:
            self.add(prefix + "o_proj.bias", attn.o_proj.bias)
        if attn.q_norm is not None and attn.k_norm is not None:
            self.add(prefix + "q_norm.weight", attn.q_norm.weight)
            self.add(prefix + "k_norm.weight", attn.k_norm.weight)

    def add_mlp(self, prefix: str, mlp: ParallelMLP) -> None:
        self.add(prefix + "gate_proj.weight", mlp.gate_up_proj.weight, 0)
        self.add(prefix + "up_proj.weight", mlp.gate_up_proj.weight, 1)
        self.add(prefix + "down_proj.weight", mlp.down_proj.weight)

    def load(self, model_dir: Path, module: nn.Module, what: str) -> tuple[str, ...]:
        """Read exactly the planned keys (one full tensor at a time), shard each into its params; keys read."""
        return load_plan(module, model_dir, self.entries, what)


class ParallelCodePredictorLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, ps: ParallelState, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = ParallelDenseAttention(config, layer_idx, ps, dtype, qk_norm=True)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = ParallelMLP(config.hidden_size, config.intermediate_size, ps, dtype, reduce=True)
        attn, D, self.layer_idx = self.self_attn, self.self_attn.head_dim, layer_idx
        # `cpu_kernels`' dense_layer can run the whole layer in one call
        self.fusable = fusable_layer(ps, dtype, attn, self.input_layernorm, self.post_attention_layernorm)
        norms = attn.qk_norms
        # its arguments, read once (nn.Module's attribute lookups cost more than the kernel's Python call); the
        # loader copies weights into these same parameters, so the references stay right
        self._attn_args = (self.input_layernorm.weight, attn.qkv_proj.weight, attn.qkv_proj.bias,
                           norms[0].weight if norms else None,
                           norms[1].weight if norms else None, norms[0].eps if norms else 0.0)
        self._mlp_args = (attn.o_proj.weight, self.post_attention_layernorm.weight, self.mlp.gate_up_proj.weight,
                          self.mlp.down_proj.weight, self.input_layernorm.eps, attn.qkv_proj.q_size // D,
                          attn.qkv_proj.kv_size // D, D, attn.window or 0, D**-0.5)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LayerCache,
                mask: torch.Tensor | None) -> torch.Tensor:
        if self.fusable and isinstance(cache, KVCache) and cpu_kernels.use(x) and cos.dtype == torch.float32:
            fused = self._fused(x, cos, sin, cache)
            if fused is not None:
                return fused
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, mask)  # (1, T, H)
        return x + self.mlp(self.post_attention_layernorm(x))  # (1, T, H)

    def _fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache) -> torch.Tensor | None:
        """The layer as ONE kernel call (float32 CPU, a small attention): the ops `forward` runs, in its order, with
        its values bit for bit, without the Python between them. None where the attention is not small: `forward`
        runs it op by op."""
        past_k, past_v = cache.history(self.layer_idx)
        T = x.shape[1]
        if not small_attention(x, T, T + (0 if past_k is None else past_k.shape[2])):
            return None
        y, k, v = cpu_kernels.ops().dense_layer(x, *self._attn_args, cos, sin, past_k, past_v, *self._mlp_args)
        cache.keep(self.layer_idx, k, v)
        return y  # (B, T, H)


class ParallelCodePredictor(nn.Module):
    """One rank's part of the talker's code predictor (`talker_config.code_predictor_config`)."""

    def __init__(self, config: Any, ps: ParallelState, layer_range: tuple[int, int],
                 dtype: torch.dtype = torch.float32, *, vocab_parallel: bool = False) -> None:
        super().__init__()
        check_supported(config)
        check_dense_layout(config, 1, ps.tp_size)
        self.start, self.end = check_layer_range(config.num_hidden_layers, ps, layer_range)
        self.config, self.ps, self.dtype, self.vocab_parallel = config, ps, dtype, vocab_parallel
        cpu_kernels.prepare(ps.device)  # fused CPU kernels for the small per-token ops (built once per machine)
        self.hidden_size, self.num_code_groups = int(config.hidden_size), int(config.num_code_groups)
        if self.num_code_groups < 2:
            raise ValueError(f"num_code_groups={self.num_code_groups} leaves no residual code to predict (needs >= 2)")
        vocab: dict[str, Any] = ({"tp_rank": ps.tp_rank, "tp_size": ps.tp_size, "ps": ps} if vocab_parallel
                                 else {"tp_rank": 0, "tp_size": 1, "ps": None})  # replicated: a 1-rank shard
        V, H, n_tables = config.vocab_size, config.hidden_size, self.num_code_groups - 1
        with torch.device(ps.device):
            self.codec_embedding = nn.ModuleList(VocabParallelEmbedding(V, H, **vocab, params_dtype=dtype)
                                                 for _ in range(n_tables)) if ps.is_first_pp_rank else None
            self.layers = nn.ModuleList(ParallelCodePredictorLayer(config, i, ps, dtype)
                                        for i in range(self.start, self.end))
            self.norm = RMSNorm(H, config.rms_norm_eps, dtype) if ps.is_last_pp_rank else None
            self.lm_head = nn.ModuleList(ParallelLMHead(V, H, **vocab, params_dtype=dtype)
                                         for _ in range(n_tables)) if ps.is_last_pp_rank else None
            self.rotary = Rotary1D(config)
        self.windows = [layer_window(config, i) for i in range(self.start, self.end)]
        self._constants: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor, dict[int | None, torch.Tensor | None]]] = {}

    def new_cache(self) -> KVCache:
        """A per-request cache for this rank's layers and heads (the predictor restarts it every talker step)."""
        return KVCache((self.start, self.end))

    def embed_codes(self, group: int, ids: torch.Tensor, checked: bool = False) -> torch.Tensor:
        """ids (...,) of residual code group+1 -> `codec_embedding[group]` rows (..., H); first pp rank only.
        `checked`: the ids are known to lie in the table (picked from its own head), so no range check."""
        if self.codec_embedding is None:
            raise ValueError(f"pipeline rank {self.ps.pp_rank} holds no codec embedding (only the first rank does)")
        table = cast(VocabParallelEmbedding, self.codec_embedding[group])
        ids = ids.to(self.ps.device)
        if checked and table.tp_size == 1:
            return F.embedding(ids, table.weight)  # (..., H)
        return table(ids)

    def compute_logits(self, group: int, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (..., H) -> `lm_head[group]` logits (..., V); last pp rank only (all TP ranks when vocab-parallel)."""
        if self.lm_head is None:
            raise ValueError(f"pipeline rank {self.ps.pp_rank} holds no lm_head (only the last rank does)")
        return cast(ParallelLMHead, self.lm_head[group])(hidden)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: LayerCache) -> torch.Tensor:
        """This rank's layers on x (B, T, H) at positions (1, T) -> (B, T, H), final-normed on the last rank
        (B requests at the same positions: the predictor restarts at 0 every talker step)."""
        if x.dim() != 3 or x.shape[2] != self.hidden_size:
            raise ValueError(f"x must be (B, T, {self.hidden_size}), got {tuple(x.shape)}")
        if positions.shape != (1, x.shape[1]):
            raise ValueError(f"positions must be (1, T={x.shape[1]}), got {tuple(positions.shape)}")
        seen = cache.get_seq_length()
        cos, sin, masks = self._step_constants(positions, seen, x)
        hidden = x  # (1, T, H)
        for layer, window in zip(self.layers, self.windows):
            checkpoint()
            hidden = layer(hidden, cos, sin, cache, masks[window])  # (1, T, H)
        return self.norm(hidden) if self.norm is not None else hidden

    def _step_constants(self, positions: torch.Tensor, seen: int, x: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, dict[int | None, torch.Tensor | None]]:
        """cos, signed_sin (1, T, D) and the mask (T, S) | None per window of a step: the predictor restarts at
        position 0 every talker step, so the same G - 1 steps recur and their constants are made once
        (~10 small ops a step otherwise). Read-only: the layers never write into them."""
        key = (tuple(positions.flatten().tolist()), seen, x.dtype, x.device)
        found = self._constants.get(key)
        if found is None:
            T = x.shape[1]
            cos, sin = self.rotary(positions.to(x.device), x.dtype)  # (1, T, D) each
            sin = signed_sin(sin)  # what apply_rope takes
            masks = {w: causal_window_mask(T, seen, seen, w, x.device) for w in set(self.windows)}  # (T, S) | None
            if len(self._constants) >= 4 * self.num_code_groups:  # other positions than a step's: stay bounded
                self._constants.clear()
            found = self._constants[key] = (cos, sin, masks)
        return found

    def checkpoint_plan(self, prefix: str) -> CheckpointPlan:
        plan = CheckpointPlan()
        for j, table in enumerate(self.codec_embedding or []):
            plan.add(f"{prefix}model.codec_embedding.{j}.weight", cast(VocabParallelEmbedding, table).weight)
        for idx, layer in zip(range(self.start, self.end), self.layers):
            layer = cast(ParallelCodePredictorLayer, layer)
            p = f"{prefix}model.layers.{idx}."
            plan.add(p + "input_layernorm.weight", layer.input_layernorm.weight)
            plan.add(p + "post_attention_layernorm.weight", layer.post_attention_layernorm.weight)
            plan.add_attention(p + "self_attn.", layer.self_attn)
            plan.add_mlp(p + "mlp.", layer.mlp)
        if self.norm is not None:
            plan.add(prefix + "model.norm.weight", self.norm.weight)
        for j, head in enumerate(self.lm_head or []):
            plan.add(f"{prefix}lm_head.{j}.weight", cast(ParallelLMHead, head).weight)
        return plan

    def load_weights(self, model_dir: Path, prefix: str = "talker.code_predictor.") -> tuple[str, ...]:
        """Read ONLY this rank's tensors (its layers; tables / heads where they live), sharding each as read.

        Missing keys -> ValueError naming them. Returns the checkpoint keys read.
        """
        what = f"code predictor layers [{self.start}, {self.end})"
        return self.checkpoint_plan(prefix).load(model_dir, self, what)

    def param_bytes(self) -> int:
        """Bytes of this rank's parameters (buffers such as inv_freq excluded)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())


class DenseStack(Protocol):
    """What `pipeline_step` drives: a rank's layer range of a dense decoder."""

    ps: ParallelState
    hidden_size: int
    dtype: torch.dtype

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor: ...


def pipeline_step(model: DenseStack, x: torch.Tensor | None, positions: torch.Tensor, cache: Any,
                  batch: int = 1) -> torch.Tensor:
    """One blocking forward through the whole pipeline; every rank of the stage calls it for the same step.

    Only the hidden (B, T, H) in the model dtype crosses each boundary p -> p+1 (TP rank t to TP rank t);
    T comes from `positions` (1, T) and B from `batch`, which every rank gets from the step metadata, so no
    shape handshake.
    `x` is the input on the first pipeline rank and ignored elsewhere. Returns this rank's output hidden
    (the final-normed hidden on the last rank).
    """
    ps, T = model.ps, positions.shape[-1]
    if ps.is_first_pp_rank:
        if x is None:
            raise ValueError(f"the first pipeline rank needs its input x (1, T, {model.hidden_size})")
    else:
        x = pp_recv((batch, T, model.hidden_size), model.dtype, ps)
    hidden = model(x, positions, cache)  # (B, T, H)
    pp_send(hidden, ps)  # no-op on the last pipeline rank
    return hidden


@dataclass(frozen=True)
class ResidualCodes:
    codes: tuple[tuple[int, ...], ...]  # per request r_1 .. r_{G-1}, known on every rank
    codec_sum: torch.Tensor | None  # (B, 1, H) talker embedding of c0 + codec_embedding[j](r_{j+1}); first pp rank
    hidden: tuple[torch.Tensor, ...]  # per step the final-normed hidden, (B, 2, H) then (B, 1, H); last pp rank


_POSITIONS: dict[int, torch.Tensor] = {}


def _positions(j: int) -> torch.Tensor:
    """Residual step j's positions (1, T): (0, 1) for j = 0 (the prefix), else (1 + j,); made once, read-only."""
    found = _POSITIONS.get(j)
    if found is None:
        found = _POSITIONS[j] = torch.arange(2).view(1, 2) if j == 0 else torch.tensor([[1 + j]])
    return found


def greedy(logits: torch.Tensor) -> int:
    return int(torch.argmax(logits, dim=-1).item())


def _pick(picks: Sequence[Sample], logits: torch.Tensor, greedy_rows: list[int]) -> list[int]:
    """Each row's id from logits (B, V): the greedy rows with ONE argmax (the same ids as row by row), the
    sampled ones through their own sampler, in row order."""
    ids = [0] * len(picks)
    if greedy_rows:
        rows = logits if len(greedy_rows) == len(picks) else logits[greedy_rows]
        for b, token in zip(greedy_rows, torch.argmax(rows, dim=-1).tolist()):
            ids[b] = token
    for b, pick in enumerate(picks):
        if pick is not greedy:
            ids[b] = pick(logits[b])
    return ids


@torch.no_grad()
def predict_residuals(model: ParallelCodePredictor, prefix: torch.Tensor | None, *,
                      sample: Sequence[Sample | None] | None = None, batch: int = 1) -> ResidualCodes:
    """The residual codes r_1..r_{G-1} of one talker step for `batch` requests at once (what
    `Qwen3OmniTalker._predict_residuals` does for one).

    Every rank of the stage calls this in lock-step. `prefix` (B, 2, H) = per request [talker last hidden,
    talker codec embedding of c0] on the first pipeline rank (ignored elsewhere). `sample[b]` (None or
    missing: greedy) picks request b's ids and runs only on the last pipeline rank's TP rank 0
    (`ps.last_pp_rank_driver`), so seeded samplers live there alone; the ids reach every rank through one
    gloo broadcast per step. A fresh KV cache per call: the predictor restarts at position 0 every talker
    step, so all B requests share positions and need no padding.
    """
    ps, H = model.ps, model.hidden_size
    x: torch.Tensor | None = None
    embeds: list[torch.Tensor] = []
    if ps.is_first_pp_rank:
        if prefix is None or tuple(prefix.shape) != (batch, 2, H):
            raise ValueError(f"the first pipeline rank needs prefix ({batch}, 2, {H}), got "
                             f"{None if prefix is None else tuple(prefix.shape)}")
        x = prefix.to(device=ps.device, dtype=model.dtype)
        embeds.append(x[:, 1:])  # (B, 1, H)
    picks = [(sample[b] if sample is not None and b < len(sample) else None) or greedy for b in range(batch)]
    greedy_rows = [b for b in range(batch) if picks[b] is greedy]
    cache = model.new_cache()
    codes: list[list[int]] = [[] for _ in range(batch)]
    hiddens: list[torch.Tensor] = []
    all_greedy = len(greedy_rows) == batch
    for j in range(model.num_code_groups - 1):
        positions = _positions(j)  # (1, T)
        hidden = pipeline_step(model, x, positions, cache, batch)  # (B, T, H)
        tokens = None
        if ps.is_last_pp_rank:
            hiddens.append(hidden)
            logits = model.compute_logits(j, hidden[:, -1])  # (B, V)
            if ps.rank == ps.last_pp_rank_driver:
                tokens = (torch.argmax(logits, dim=-1).cpu() if all_greedy  # (B,) the same ids as _pick's
                          else torch.tensor(_pick(picks, logits, greedy_rows), dtype=torch.long))
        if tokens is None:  # a rank that does not pick: the broadcast fills it
            tokens = torch.zeros(batch, dtype=torch.long)
        cpu_broadcast(tokens, ps.last_pp_rank_driver, ps)  # CPU: crosses the gloo group
        for b, token in enumerate(tokens.tolist()):
            codes[b].append(token)
        if ps.is_first_pp_rank:
            # (B, 1, H): next step's input, and part of the sum; the ids are argmaxes over the head's own
            # vocabulary (or a sampler's pick from it), so the lookup skips the range check of user input
            x = model.embed_codes(j, tokens.view(batch, 1), checked=True)
            embeds.append(x)
    codec_sum = torch.cat(embeds, dim=1).sum(1, keepdim=True) if ps.is_first_pp_rank else None  # (B, 1, H)
    return ResidualCodes(codes=tuple(tuple(c) for c in codes), codec_sum=codec_sum, hidden=tuple(hiddens))
