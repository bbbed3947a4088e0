"""Qwen2.5-Omni's audio tower, split over tensor-parallel ranks and cut into pipeline ranges.

Role: our own `Qwen2_5OmniAudioEncoder` for ONE rank of the encoder stage's pp x tp grid, built from the
pieces of Qwen3-Omni's (omnimesh/models/qwen3_omni/parallel_audio_tower.py: `ParallelAudioLayer` with
`k_bias=False`, `LayerNorm`, `varlen_attention`, the checkpoint plan and layout checks). The Conv1d front-end
and the sinusoidal positions live on the first pipeline rank, the per-clip average pooling + ln_post + proj
on the last, and every rank holds the layers [start, end) it owns. The math mirrors transformers line for
line. tests/parallel/test_qwen2_5_audio_tower.py checks it against transformers at pp = tp = 1 (1e-5) and
across gloo ranks (1e-4).

Differences from Qwen3-Omni's tower: conv1 (k3, pad 1) + gelu, masked to each chunk's frames, then conv2
(k3, stride 2, pad 1) + gelu; attention windows are the chunks themselves (n_window tokens each, the tail
shorter); k_proj has no bias (its slice of the fused qkv bias stays zero); after the layers each clip's
tokens are averaged in pairs (AvgPool1d(2, 2) per clip: a pair never spans two clips, an odd last token
is dropped), then ln_post and ONE Linear `proj` (d_model -> output_dim). `scale_embedding` is ignored, as
transformers' forward ignores it; `audio_bos_eos_token` is never used by the tower and never read.

TP sharding: attention by heads (q, k, v column-parallel, out_proj row-parallel), fc1/fc2 by ffn columns.
The conv front-end, the layer norms, the biases of row-parallel linears and `proj` are replicated: the
hidden is whole on every TP rank after each layer's all-reduce, so a replicated `proj` needs no collective
at all (column-parallel would add an all-gather to save d_model * output_dim weights: 4.6M for the 7B model).

Data flow (one batch of clips):
    feature_lens (B,) -> audio_batch_2_5(): chunk_lengths, valid_indices, cu_seqlens, pool_indices
                                            (every rank, no weights)
    first pp rank:  features (n_mel, sum T_valid) -> chunks of 2*n_window frames (n_chunks, n_mel, Tc)
                    -> conv1 + gelu, * frame mask -> conv2 + gelu -> + positions -> valid rows -> hidden (N, d)
                    N = sum over clips of (T - 1) // 2 + 1
    other ranks:    hidden (N, d_model) received from the previous pipeline rank
    forward(hidden, batch) -> layers start..end-1 (attention inside each chunk)
                           -> last rank: (h[pool] + h[pool + 1]) / 2 -> ln_post -> proj -> (n_out, output_dim)
                              n_out per clip = ((T - 1) // 2 + 1 - 2) // 2 + 1   (`audio_output_lengths_2_5`)
Qwen3-Omni's `audio_pipeline_step` runs it across the pipeline (it reads only the tower's `ps`, `dtype`,
`config.d_model`, `batch`, `embed_features` and `forward`); only the hidden (N, d_model) crosses a boundary.

Run the checks: python -m pytest tests/parallel/test_qwen2_5_audio_tower.py -q
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from omnimesh.models.qwen3_omni.parallel_audio_tower import (
    AudioBatch,
    LayerNorm,
    ParallelAudioLayer,
    Plan,
    TowerRank,
    add_to_plan,
    add_weight_and_bias,
    check_audio_layout,
    check_rows,
    chunked_features,
    replicated_param,
    sinusoid_positions,
)
from omnimesh.parallel.parallel_state import ParallelState

__all__ = ["AudioBatch2_5", "ParallelAudioTower2_5", "audio_batch_2_5", "audio_output_lengths_2_5",
           "check_audio_layout", "conv_output_lengths"]


def conv_output_lengths(feature_lens: torch.Tensor) -> torch.Tensor:
    """Tokens per clip (or per chunk) after conv2's stride 2: (T - 1) // 2 + 1 (transformers' `aftercnn_lens`)."""
    return (feature_lens - 1) // 2 + 1


def audio_output_lengths_2_5(feature_lens: torch.Tensor) -> torch.Tensor:
    """Tokens the tower emits per clip of `feature_lens` mel frames: conv2's stride 2, then the stride-2 average
    pooling (transformers' `_get_feat_extract_output_lengths(...)[1]`, the processor's <|AUDIO|> count)."""
    return (conv_output_lengths(feature_lens) - 2) // 2 + 1


@dataclass(frozen=True)
class AudioBatch2_5(AudioBatch):
    """Qwen3's per-batch metadata (cu_seqlens: one attention window per chunk here) + the pooling pairs."""

    pool_indices: torch.Tensor  # (n_out,) row of each pair's first token among the N; the second is the next row

    @property
    def n_out_tokens(self) -> int:
        return int(self.pool_indices.numel())


def audio_batch_2_5(config: Any, feature_lens: torch.Tensor) -> AudioBatch2_5:
    """Chunking, valid positions, attention windows and pooling pairs, as transformers' tower computes them."""
    if feature_lens.dim() != 1 or feature_lens.numel() == 0 or int(feature_lens.min()) < 1:
        raise ValueError(f"feature_lens must be a non-empty 1-D tensor of frame counts >= 1, "
                         f"got {feature_lens.tolist()}")
    lens = feature_lens.long()
    chunk = config.n_window * 2
    chunk_num = torch.ceil(lens / chunk).long()  # (B,)
    chunk_lengths = torch.full((int(chunk_num.sum()),), chunk, dtype=torch.long, device=lens.device)
    tail = F.pad(chunk_num, (1, 0), value=-1).cumsum(0)[1:]  # (B,) index of each clip's last chunk
    chunk_lengths[tail] = lens % chunk
    chunk_lengths = torch.where(chunk_lengths == 0, chunk, chunk_lengths)

    chunk_tokens = conv_output_lengths(chunk_lengths)  # (n_chunks,)
    valid = torch.arange(int(chunk_tokens.max()), device=lens.device) < chunk_tokens.unsqueeze(1)  # (n_chunks, t)
    valid_indices = valid.flatten().nonzero().squeeze(-1)  # (N,)
    cu_seqlens = F.pad(chunk_tokens.cumsum(0), (1, 0)).to(torch.int32).cpu()  # (n_chunks + 1,): a window per chunk

    # chunk is even, so a clip's chunks give (T - 1) // 2 + 1 tokens in all: clips are consecutive runs of rows
    clip_tokens = conv_output_lengths(lens).tolist()
    starts = [sum(clip_tokens[:i]) for i in range(len(clip_tokens))]
    pool_indices = torch.cat([s + 2 * torch.arange(n // 2, device=lens.device)  # n // 2 == (n - 2) // 2 + 1
                              for s, n in zip(starts, clip_tokens)])
    return AudioBatch2_5(feature_lens=lens, chunk_lengths=chunk_lengths, valid_indices=valid_indices,
                         cu_seqlens=cu_seqlens, pool_indices=pool_indices)


class ParallelAudioTower2_5(TowerRank):
    """One rank's part of Qwen2.5-Omni's audio tower (`thinker_config.audio_config`)."""

    blocks_name = "audio tower layers"
    default_prefix = "thinker.audio_tower."

    def __init__(self, config: Any, ps: ParallelState, layer_range: tuple[int, int],
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, ps, layer_range, dtype, check_audio_layout)
        if config.n_window > config.max_source_positions:  # a full chunk yields n_window positions
            raise ValueError(f"n_window={config.n_window} exceeds max_source_positions={config.max_source_positions}")
        d, n_mel = config.d_model, config.num_mel_bins
        with torch.device(ps.device):
            self.front: nn.ParameterDict | None = None  # first pp rank: conv front-end, replicated over TP
            if ps.is_first_pp_rank:
                self.front = nn.ParameterDict({
                    "conv1_weight": replicated_param(d, n_mel, 3, dtype=dtype),
                    "conv1_bias": replicated_param(d, dtype=dtype),
                    "conv2_weight": replicated_param(d, d, 3, dtype=dtype),
                    "conv2_bias": replicated_param(d, dtype=dtype),
                })
            self.layers = nn.ModuleList(ParallelAudioLayer(config, ps, dtype, k_bias=False)
                                        for _ in range(self.start, self.end))
            self.ln_post = LayerNorm(d, 1e-5, dtype) if ps.is_last_pp_rank else None
            self.head: nn.ParameterDict | None = None  # last pp rank: proj, replicated over TP (no collective)
            if ps.is_last_pp_rank:
                self.head = nn.ParameterDict({
                    "proj_weight": replicated_param(config.output_dim, d, dtype=dtype),
                    "proj_bias": replicated_param(config.output_dim, dtype=dtype),
                })

    def audio_layers(self) -> list[ParallelAudioLayer]:
        return [cast(ParallelAudioLayer, layer) for layer in self.layers]

    def batch(self, feature_lens: torch.Tensor) -> AudioBatch2_5:
        return audio_batch_2_5(self.config, feature_lens.to(self.ps.device))

    @torch.no_grad()
    def embed_features(self, features: torch.Tensor, batch: AudioBatch2_5) -> torch.Tensor:
        """features (n_mel, sum T_valid) -> hidden (N, d_model); first pipeline rank only (no collective)."""
        padded = chunked_features(self, features, batch)  # (n_chunks, n_mel, Tc)
        w = cast(nn.ParameterDict, self.front)
        frames = torch.arange(padded.shape[2], device=padded.device) < batch.chunk_lengths.unsqueeze(1)
        mask = frames.unsqueeze(1).to(self.dtype)  # (n_chunks, 1, Tc): conv2 must not see conv1 on padding
        h = F.gelu(F.conv1d(padded, w["conv1_weight"], w["conv1_bias"], padding=1)) * mask  # (n_chunks, d, Tc)
        h = F.gelu(F.conv1d(h, w["conv2_weight"], w["conv2_bias"], stride=2, padding=1)).transpose(1, 2)  # (., t, d)
        h = h + sinusoid_positions(h.shape[1], self.config.d_model).to(h.device, h.dtype).unsqueeze(0)
        return torch.index_select(h.reshape(-1, h.shape[-1]), 0, batch.valid_indices)  # (N, d)

    @torch.no_grad()
    def forward(self, hidden: torch.Tensor, batch: AudioBatch2_5) -> torch.Tensor:
        """This rank's layers on hidden (N, d_model); the last rank adds pooling, ln_post, proj: (n_out, out)."""
        check_rows(hidden, batch.n_tokens, self.config.d_model, "d_model")
        for layer in self.layers:
            hidden = layer(hidden, batch.cu_seqlens)  # (N, d)
        if self.ln_post is not None and self.head is not None:
            pool = batch.pool_indices
            hidden = (hidden[pool] + hidden[pool + 1]) / 2  # (n_out, d): pairs within each clip
            hidden = F.linear(self.ln_post(hidden), self.head["proj_weight"], self.head["proj_bias"])  # (n_out, out)
        return hidden

    def checkpoint_plan(self, prefix: str) -> Plan:
        plan: Plan = {}
        for group in (self.front, self.head):
            for name, param in (group.items() if group is not None else ()):
                module, kind = name.rsplit("_", 1)
                add_to_plan(plan, f"{prefix}{module}.{kind}", param)
        for idx, layer in zip(range(self.start, self.end), self.audio_layers()):
            layer.plan(plan, f"{prefix}layers.{idx}.")  # no k_proj.bias (k_bias=False)
        if self.ln_post is not None:
            add_weight_and_bias(plan, prefix + "ln_post", self.ln_post)
        return plan
