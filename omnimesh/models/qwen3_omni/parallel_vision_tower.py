"""Qwen3-Omni's vision tower, split over tensor-parallel ranks and cut into pipeline ranges.

Role: our own `Qwen3OmniMoeVisionEncoder` for ONE rank of the encoder stage's pp x tp grid. The patch
embedding (Conv3d with kernel = stride) and the learned position table live on the first pipeline rank.
The final patch merger lives on the last. Every rank holds the blocks [start, end) it owns and the
deepstack merger of each deepstack layer among them. The math mirrors transformers line for line:
bilinear (align_corners) resampling of the square position table in merge-block order, 2-D axial
rotary, full attention within each frame (cu_seqlens), pre-norm blocks, 2x2 patch mergers.
tests/parallel/test_parallel_vision_tower.py checks it against transformers at pp = tp = 1 (1e-5) and
across gloo ranks (1e-4).

TP sharding: attention by heads (the fused qkv is column-parallel, loaded per q/k/v slice of the fused
checkpoint tensor; proj is row-parallel), MLP linear_fc1/fc2 by columns, and each merger's mlp.0/mlp.2 the
same way (one all-reduce per merger). Patch embedding, position table, layer norms and the biases of
row-parallel linears are replicated.

Data flow (one batch of images / frames):
    grid_thw (n, 3) -> vision_batch(): cu_seqlens, rotary cos/sin (N, head_dim)   (every rank, no weights)
    first pp rank:  pixel_values (N, C*T*P*P) -> patch embed + resampled positions -> hidden (N, hidden)
    other ranks:    hidden (N, hidden) + the deepstack features made upstream, from the previous rank
    forward(hidden, batch) -> blocks start..end-1; after deepstack layer i: merger_list[j](hidden)
                           -> last rank: merger(hidden) -> image_embeds (N / merge^2, out_hidden)
`vision_pipeline_step` runs that across the pipeline (what crosses a boundary is documented there).

Run the checks: python -m pytest tests/parallel/test_parallel_vision_tower.py -q
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from omnimesh.models.qwen3_omni.parallel_audio_tower import (
    LayerNorm,
    ParallelFFN,
    Plan,
    TowerRank,
    add_to_plan,
    add_weight_and_bias,
    check_heads_divide,
    check_rows,
    replicated_param,
    varlen_attention,
)
from omnimesh.parallel.layers import QKVParallelLinear, RowParallelLinear, divide
from omnimesh.parallel.parallel_state import ParallelState, pp_recv, pp_send
from omnimesh.parallel.partition import partition_layers

NORM_EPS = 1e-6  # blocks and mergers


def check_vision_layout(config: Any, pp: int, tp: int, custom_partition: list[int] | None = None) -> None:
    """Every size a pp x tp layout of the vision tower must divide (ValueError names it), before any process group."""
    check_heads_divide("vision tower's num_heads", config.num_heads, tp)
    divide(config.intermediate_size, tp, "vision intermediate_size")
    divide(config.hidden_size * config.spatial_merge_size**2, tp, "merger hidden (hidden_size * spatial_merge_size^2)")
    bad = [i for i in config.deepstack_visual_indexes if not 0 <= i < config.depth]
    if bad:
        raise ValueError(f"deepstack_visual_indexes {bad} are outside the tower's blocks 0..{config.depth - 1}")
    partition_layers(config.depth, pp, custom_partition)


@dataclass(frozen=True)
class VisionBatch:
    """Per-batch metadata every pipeline rank derives from `grid_thw` alone (nothing of it is sent)."""

    grid_thw: torch.Tensor  # (n, 3) long: frames, patch rows, patch columns per image / video
    cu_seqlens: torch.Tensor  # (n_frames + 1,) int32: attention stays within one frame
    cos: torch.Tensor  # (N, head_dim) float32 2-D rotary
    sin: torch.Tensor  # (N, head_dim) float32
    n_patches: int  # N = sum t*h*w
    n_tokens: int  # N / merge^2: rows of image_embeds and of each deepstack feature
    rows: list[int]  # t*h*w of each image: its patches' rows (the mergers split by them: `per_image`)


def merge_order_rows_cols(grid_thw: torch.Tensor, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Patch row and column of every patch (N,), in the tower's order: frame, merge block, in-block row, col."""
    counts = grid_thw[:, 0] * grid_thw[:, 1] * grid_thw[:, 2]  # (n,)
    heights = torch.repeat_interleave(grid_thw[:, 1], counts)  # (N,)
    widths = torch.repeat_interleave(grid_thw[:, 2], counts)
    starts = torch.repeat_interleave(F.pad(counts.cumsum(0)[:-1], (1, 0)), counts)
    within = (torch.arange(int(counts.sum()), device=grid_thw.device) - starts) % (heights * widths)  # in frame
    blocks_w = widths // merge
    in_col, in_row = within % merge, (within // merge) % merge
    block_col = (within // (merge * merge)) % blocks_w
    block_row = within // (merge * merge * blocks_w)
    return block_row * merge + in_row, block_col * merge + in_col  # (N,), (N,)


def _bilinear_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """align_corners bilinear taps (N, 2) into a `side`-long axis and their weights (N, 2), per target index."""
    src = index.to(torch.float32) * (side - 1) / torch.clamp(size - 1, min=1)  # (N,)
    floor = torch.floor(src)
    offsets = torch.arange(0, 2, device=index.device)  # floor, floor + 1
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)  # (N, 2)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)  # (N, 2)
    return taps, weights


def position_interpolation(grid_thw: torch.Tensor, side: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the (side * side) position table (N, 4) and weights (N, 4) that resample it to every image grid."""
    row, col = merge_order_rows_cols(grid_thw, merge)
    counts = grid_thw.prod(-1)
    h_taps, h_w = _bilinear_taps(row, torch.repeat_interleave(grid_thw[:, 1], counts), side)
    w_taps, w_w = _bilinear_taps(col, torch.repeat_interleave(grid_thw[:, 2], counts), side)
    indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)  # (N, 4)
    weights = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)  # (N, 4)
    return indices, weights


def vision_batch(config: Any, grid_thw: torch.Tensor) -> VisionBatch:
    """cu_seqlens and the 2-D rotary of every patch, as transformers' tower computes them."""
    m = config.spatial_merge_size
    if grid_thw.dim() != 2 or grid_thw.shape[1] != 3 or grid_thw.shape[0] == 0 or int(grid_thw.min()) < 1:
        raise ValueError(f"grid_thw must be (n_images >= 1, 3) of positive (t, h, w), got {grid_thw.tolist()}")
    if bool((grid_thw[:, 1:] % m).any()):
        raise ValueError(f"every grid h and w must divide by spatial_merge_size={m}, got {grid_thw.tolist()}")
    grid = grid_thw.long()
    frame_sizes = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0])  # (n_frames,)
    cu_seqlens = F.pad(frame_sizes.cumsum(0, dtype=torch.int32), (1, 0), value=0).cpu()  # host: read per layer
    head_dim = config.hidden_size // config.num_heads
    rope = config.rope_parameters
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"vision rope_type {rope['rope_type']!r} is not supported (only 'axial')")
    spatial = head_dim // 2
    inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))  # (D/4,)
    row, col = merge_order_rows_cols(grid, m)
    freqs = torch.stack([row, col], dim=-1)[..., None].float() * inv_freq.to(grid.device)  # (N, 2, D/4)
    out = []
    for f in (freqs.cos(), freqs.sin()):
        hw = torch.cat([f[:, 0], f[:, 1]], dim=-1)  # (N, D/2): h angles, then w angles
        out.append(torch.cat([hw, hw], dim=-1))  # (N, D)
    n = int(cu_seqlens[-1])
    return VisionBatch(grid_thw=grid, cu_seqlens=cu_seqlens, cos=out[0], sin=out[1], n_patches=n,
                       n_tokens=n // m**2, rows=grid.prod(-1).tolist())


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def fused_qkv_loader(qkv: QKVParallelLinear) -> Any:
    """Loader for the checkpoint's fused (3 * hidden, ...) qkv tensor: each third through the q/k/v loader."""
    def load(param: nn.Parameter, full: torch.Tensor) -> None:
        for part, shard_id in zip(full.chunk(3, dim=0), "qkv"):
            qkv.weight_loader(param, part, shard_id)
    return load


class ParallelVisionAttention(nn.Module):
    def __init__(self, config: Any, ps: ParallelState, dtype: torch.dtype) -> None:
        super().__init__()
        tp: dict[str, Any] = {"tp_rank": ps.tp_rank, "tp_size": ps.tp_size, "ps": ps, "params_dtype": dtype}
        d, nh = config.hidden_size, config.num_heads
        self.head_dim = divide(d, nh, "vision hidden_size / num_heads")
        self.qkv = QKVParallelLinear(d, self.head_dim, nh, nh, bias=True, **tp)
        self.proj = RowParallelLinear(d, d, bias=True, **tp)
        for p in (self.qkv.weight, self.qkv.bias):
            p.weight_loader = fused_qkv_loader(self.qkv)  # type: ignore[union-attr]

    def forward(self, x: torch.Tensor, batch: VisionBatch) -> torch.Tensor:
        N, D = x.shape[0], self.head_dim
        q, k, v = (t.view(N, -1, D) for t in self.qkv(x).split([self.qkv.q_size] * 3, dim=-1))  # (N, nh/tp, D)
        cos, sin = batch.cos.unsqueeze(-2), batch.sin.unsqueeze(-2)  # (N, 1, D) float32
        qf, kf = q.float(), k.float()  # rotary in float32, as transformers
        q = (qf * cos + _rotate_half(qf) * sin).to(q.dtype)
        k = (kf * cos + _rotate_half(kf) * sin).to(k.dtype)
        return self.proj(varlen_attention(q, k, v, batch.cu_seqlens, D**-0.5))  # (N, hidden), all-reduced


class ParallelVisionBlock(nn.Module):
    def __init__(self, config: Any, ps: ParallelState, dtype: torch.dtype) -> None:
        super().__init__()
        d = config.hidden_size
        self.norm1 = LayerNorm(d, NORM_EPS, dtype)
        self.attn = ParallelVisionAttention(config, ps, dtype)
        self.norm2 = LayerNorm(d, NORM_EPS, dtype)
        self.mlp = ParallelFFN(d, config.intermediate_size, d, config.hidden_act, ps, dtype)

    def forward(self, x: torch.Tensor, batch: VisionBatch) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), batch)  # (N, hidden)
        return x + self.mlp(self.norm2(x))  # (N, hidden)


class ParallelPatchMerger(nn.Module):
    """merge^2 neighbouring patches -> one token: LayerNorm (before or after the shuffle) -> mlp.0 -> GELU -> mlp.2."""

    def __init__(self, config: Any, ps: ParallelState, dtype: torch.dtype, postshuffle_norm: bool) -> None:
        super().__init__()
        self.merged = config.hidden_size * config.spatial_merge_size**2
        self.postshuffle_norm = postshuffle_norm
        self.ln_q = LayerNorm(self.merged if postshuffle_norm else config.hidden_size, NORM_EPS, dtype)
        self.mlp = ParallelFFN(self.merged, self.merged, config.out_hidden_size, "gelu", ps, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.postshuffle_norm:  # deepstack mergers
            h = self.ln_q(x.view(-1, self.merged))  # (N / m^2, hidden * m^2)
        else:
            h = self.ln_q(x).view(-1, self.merged)  # (N / m^2, hidden * m^2)
        return self.mlp(h)  # (N / m^2, out_hidden), all-reduced

    def plan(self, plan: Plan, prefix: str) -> None:
        add_weight_and_bias(plan, prefix + "ln_q", self.ln_q)
        self.mlp.plan(plan, prefix + "mlp.0", prefix + "mlp.2")


@dataclass(frozen=True)
class VisionOutput:
    hidden: torch.Tensor  # (N, hidden) after this rank's last block (the pre-merger hidden on the last rank)
    deepstack: list[torch.Tensor]  # [(N / m^2, out_hidden)] in layer order: all of them on the last rank
    image_embeds: torch.Tensor | None  # (N / m^2, out_hidden) on the last rank, else None


def per_image(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """`fn` (a merger: GEMMs over rows) on each image's rows of x (N, ...) apart, the results concatenated.
    MKL picks its GEMM kernel, and with it the order of each row's sums, by the whole GEMM's shape, and a
    merger has only a few rows per image: one call over a batch's images rounded a 4-row image ~3e-8 away
    from its own request's call on a Xeon with AVX-512. Per image, a batch gives every request what it gets
    alone, at the price of one call (and on tp > 1 one all-reduce) per image. The patch embedding and the
    blocks (many rows per image) stay one batched call: exact there on the hosts tested
    (tests/parallel/test_parallel_vision_tower.py)."""
    if len(rows) == 1:
        return fn(x)
    return torch.cat([fn(part) for part in x.split(rows)])


class ParallelVisionTower(TowerRank):
    """One rank's part of the vision tower (`thinker_config.vision_config`)."""

    blocks_name = "vision tower blocks"
    default_prefix = "thinker.visual."
    layers_attr = "depth"

    def __init__(self, config: Any, ps: ParallelState, layer_range: tuple[int, int],
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, ps, layer_range, dtype, check_vision_layout)
        self.side = int(config.num_position_embeddings**0.5)
        self.patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size**2
        # deepstack layers in block order, each with its merger_list index in the checkpoint
        self.deepstack_layers = sorted(set(config.deepstack_visual_indexes))
        d, kt, kp = config.hidden_size, config.temporal_patch_size, config.patch_size
        with torch.device(ps.device):
            self.patch_weight = replicated_param(d, config.in_channels, kt, kp, kp, dtype=dtype) \
                if ps.is_first_pp_rank else None  # (hidden, C, T, P, P)
            self.patch_bias = replicated_param(d, dtype=dtype) if ps.is_first_pp_rank else None
            self.pos_embed = replicated_param(config.num_position_embeddings, d, dtype=dtype) \
                if ps.is_first_pp_rank else None  # (side * side, hidden)
            self.blocks = nn.ModuleList(ParallelVisionBlock(config, ps, dtype) for _ in range(self.start, self.end))
            self.deepstack_mergers = nn.ModuleDict({
                str(i): ParallelPatchMerger(config, ps, dtype, postshuffle_norm=True)
                for i in self.deepstack_layers if self.start <= i < self.end
            })
            self.merger = ParallelPatchMerger(config, ps, dtype, postshuffle_norm=False) \
                if ps.is_last_pp_rank else None

    def vision_blocks(self) -> list[ParallelVisionBlock]:
        return [cast(ParallelVisionBlock, block) for block in self.blocks]

    def batch(self, grid_thw: torch.Tensor) -> VisionBatch:
        return vision_batch(self.config, grid_thw.to(self.ps.device))

    def deepstack_before(self, layer: int) -> int:
        """How many deepstack features the blocks before `layer` produce (what a rank starting there receives)."""
        return sum(i < layer for i in self.deepstack_layers)

    @torch.no_grad()
    def embed_patches(self, pixel_values: torch.Tensor, batch: VisionBatch) -> torch.Tensor:
        """pixel_values (N, C*T*P*P) -> hidden (N, hidden); first pipeline rank only (no collective)."""
        if self.patch_weight is None or self.pos_embed is None:
            raise ValueError(f"pipeline rank {self.ps.pp_rank} holds no patch embedding (only the first rank does)")
        if tuple(pixel_values.shape) != (batch.n_patches, self.patch_dim):
            raise ValueError(f"pixel_values must be (sum(t*h*w)={batch.n_patches}, C*T*P*P={self.patch_dim}) for "
                             f"grid_thw {batch.grid_thw.tolist()}, got {tuple(pixel_values.shape)}")
        cfg = self.config
        # Conv3d with kernel = stride over one patch is one GEMM over its flattened (C, T, P, P) values; as a
        # linear it also stays out of cuDNN's TF32 convolutions (~1e-3 off in fp32 on an H200 by default)
        x = pixel_values.to(self.ps.device, self.dtype)  # (N, C*T*P*P), flattened (C, T, P, P)
        x = F.linear(x, self.patch_weight.view(cfg.hidden_size, -1), self.patch_bias)  # (N, hidden)
        idx, w = position_interpolation(batch.grid_thw, self.side, cfg.spatial_merge_size)  # (N, 4), (N, 4)
        pos = (F.embedding(idx, self.pos_embed) * w[:, :, None]).sum(1)  # (N, hidden)
        return x + pos.to(x.dtype)

    @torch.no_grad()
    def forward(self, hidden: torch.Tensor, batch: VisionBatch) -> VisionOutput:
        """This rank's blocks on hidden (N, hidden), its deepstack mergers, and the final merger on the last rank."""
        check_rows(hidden, batch.n_patches, self.config.hidden_size, "hidden_size")
        deepstack: list[torch.Tensor] = []
        for idx, block in zip(range(self.start, self.end), self.blocks):
            hidden = block(hidden, batch)  # (N, hidden)
            if str(idx) in self.deepstack_mergers:
                deepstack.append(per_image(self.deepstack_mergers[str(idx)], hidden, batch.rows))  # (N / m^2, out_hidden)
        embeds = per_image(self.merger, hidden, batch.rows) if self.merger is not None else None  # (N / m^2, out_hidden)
        return VisionOutput(hidden=hidden, deepstack=deepstack, image_embeds=embeds)

    def checkpoint_plan(self, prefix: str) -> Plan:
        plan: Plan = {}
        if self.patch_weight is not None and self.patch_bias is not None and self.pos_embed is not None:
            add_to_plan(plan, prefix + "patch_embed.proj.weight", self.patch_weight)
            add_to_plan(plan, prefix + "patch_embed.proj.bias", self.patch_bias)
            add_to_plan(plan, prefix + "pos_embed.weight", self.pos_embed)
        for idx, block in zip(range(self.start, self.end), self.vision_blocks()):
            p = f"{prefix}blocks.{idx}."
            add_weight_and_bias(plan, p + "norm1", block.norm1)
            add_weight_and_bias(plan, p + "norm2", block.norm2)
            add_weight_and_bias(plan, p + "attn.qkv", block.attn.qkv)  # fused: fused_qkv_loader splits it
            add_weight_and_bias(plan, p + "attn.proj", block.attn.proj)
            block.mlp.plan(plan, p + "mlp.linear_fc1", p + "mlp.linear_fc2")
        for layer, merger in self.deepstack_mergers.items():
            j = self.config.deepstack_visual_indexes.index(int(layer))  # merger_list is in config order
            cast(ParallelPatchMerger, merger).plan(plan, f"{prefix}merger_list.{j}.")
        if self.merger is not None:
            self.merger.plan(plan, prefix + "merger.")
        return plan


def vision_pipeline_step(tower: Any, pixel_values: torch.Tensor | None, grid_thw: torch.Tensor) -> VisionOutput:
    """One blocking forward through the whole pipeline; every rank of the stage calls it for the same batch.

    `grid_thw` (n, 3) is given to EVERY rank (the executor's step metadata): each derives N, N / m^2, the
    attention segments and the rotary from it, so no shape travels. `pixel_values` is needed on the first
    rank only. What crosses each boundary p -> p+1 (TP rank t to TP rank t, over the PP group), in order:
      1. hidden (N, hidden_size) in the tower's dtype, always;
      2. every deepstack feature produced so far (by blocks < the next rank's start), each
         (N / m^2, out_hidden_size), in block order: rank p relays what it received and appends its own,
         so the last rank ends up with all of them. Each side counts them from its own layer range
         (`deepstack_before`), so no count travels.
    On the last rank the result holds image_embeds and the full deepstack list (transformers' order);
    elsewhere image_embeds is None and deepstack is what this rank sent on.
    """
    ps, cfg = tower.ps, tower.config
    batch = tower.batch(grid_thw)
    relayed: list[torch.Tensor] = []
    if ps.is_first_pp_rank:
        if pixel_values is None:
            raise ValueError("the first pipeline rank needs pixel_values (N, C*T*P*P)")
        hidden = tower.embed_patches(pixel_values, batch)
    else:
        hidden = pp_recv((batch.n_patches, cfg.hidden_size), tower.dtype, ps)
        relayed = [pp_recv((batch.n_tokens, cfg.out_hidden_size), tower.dtype, ps)
                   for _ in range(tower.deepstack_before(tower.start))]
    out = tower(hidden, batch)
    deepstack = relayed + out.deepstack
    if not ps.is_last_pp_rank:
        pp_send(out.hidden, ps)
        for feature in deepstack:
            pp_send(feature, ps)
    return VisionOutput(hidden=out.hidden, deepstack=deepstack, image_embeds=out.image_embeds)
