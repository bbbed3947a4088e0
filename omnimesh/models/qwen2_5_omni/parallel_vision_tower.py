"""Qwen2.5-Omni's vision tower, split over tensor-parallel ranks and cut into pipeline ranges.

Role: our own `Qwen2_5OmniVisionEncoder` for ONE rank of the encoder stage's pp x tp grid, built on the
pieces of Qwen3-Omni's (omnimesh/models/qwen3_omni/parallel_vision_tower.py: same contract, same
`VisionOutput`, same attention and rotary). The patch embedding (Conv3d with kernel = stride, no bias) lives
on the first pipeline rank, the patch merger on the last, and every rank holds the blocks [start, end) it
owns. What differs from Qwen3-Omni's: RMSNorm instead of LayerNorm, a gated SiLU MLP with biases (gate_proj,
up_proj, down_proj), separate q / k / v checkpoint tensors, no position table, no deepstack, and window
attention: the patches are reordered into windows of `window_size` pixels (whole merge units), the blocks
in `fullatt_block_indexes` attend within each frame (cu_seqlens), the others within each window
(cu_window_seqlens), and the merger's tokens are put back in patch order at the end. The math mirrors
transformers line for line; tests/parallel/test_qwen2_5_vision_tower.py checks it against transformers at
pp = tp = 1 (1e-5) and across gloo ranks (1e-4).

TP sharding (as Qwen3-Omni's): attention by heads (q, k, v into one column-parallel QKVParallelLinear, each
loaded from its own checkpoint tensor; proj row-parallel), the MLP by intermediate columns (gate and up
column-parallel in one GEMM, down row-parallel), the merger's mlp.0 / mlp.2 column then row (one
all-reduce). Patch embedding, RMSNorm weights and the biases of row-parallel linears are replicated.

Data flow (one batch of images / frames):
    grid_thw (n, 3) -> vision_batch_2_5(): cu_seqlens (per frame), cu_window_seqlens, the window order of
                       the patches and its inverse over merged tokens, rotary cos/sin in window order
                       (every rank, no weights)
    first pp rank:  pixel_values (N, C*T*P*P) -> patch embed -> window order -> hidden (N, hidden)
    other ranks:    hidden (N, hidden), in window order, from the previous pipeline rank
    forward(hidden, batch) -> blocks start..end-1 (full or window attention per block)
                           -> last rank: merger -> patch order -> image_embeds (N / merge^2, out_hidden)
Qwen3-Omni's `vision_pipeline_step` runs it across the pipeline (no deepstack: `deepstack_before` is 0):
only the window-ordered hidden crosses a boundary.

Run the checks: python -m pytest tests/parallel/test_qwen2_5_vision_tower.py -q
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from omnimesh.models.qwen3_omni.parallel_audio_tower import (
    ParallelFFN,
    Plan,
    TowerRank,
    add_to_plan,
    add_weight_and_bias,
    check_heads_divide,
    check_rows,
    replicated_param,
)
from omnimesh.models.qwen3_omni.parallel_text_model import RMSNorm
from omnimesh.models.qwen3_omni.parallel_vision_tower import (
    NORM_EPS,
    ParallelVisionAttention,
    VisionBatch,
    VisionOutput,
    per_image,
    vision_batch,
)
from omnimesh.parallel.layers import MergedColumnParallelLinear, RowParallelLinear, divide
from omnimesh.parallel.parallel_state import ParallelState
from omnimesh.parallel.partition import partition_layers


def check_vision_layout_2_5(config: Any, pp: int, tp: int, custom_partition: list[int] | None = None) -> None:
    """Every size a pp x tp layout of the vision tower must divide (ValueError names it), before any process group."""
    check_heads_divide("vision tower's num_heads", config.num_heads, tp)
    divide(config.intermediate_size, tp, "vision intermediate_size")
    divide(config.hidden_size * config.spatial_merge_size**2, tp, "merger hidden (hidden_size * spatial_merge_size^2)")
    if config.hidden_act != "silu":
        raise ValueError(f"vision hidden_act {config.hidden_act!r} is not supported (Qwen2.5-Omni's MLP uses 'silu')")
    if config.window_size // config.spatial_merge_size // config.patch_size < 1:
        raise ValueError(f"window_size={config.window_size} must cover at least one merge unit "
                         f"(spatial_merge_size * patch_size = {config.spatial_merge_size * config.patch_size} px)")
    partition_layers(config.depth, pp, custom_partition)


def window_index(grid_thw: torch.Tensor, merge: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' `get_vision_window_index`: merged tokens (N / m^2,) in window order, each frame cut into
    `window` x `window` merged-token windows (row-major, the last row / column of windows shorter), and the
    window boundaries over patches (n_windows + 1,) int32, empty windows left out."""
    order, lengths, offset = [], [], 0
    for t, h, w in grid_thw.tolist():
        gh, gw = h // merge, w // merge
        index = torch.arange(t * gh * gw).reshape(t, gh, gw)
        pad_h, pad_w = window - gh % window, window - gw % window  # (a whole empty row of windows when divisible)
        nh, nw = (gh + pad_h) // window, (gw + pad_w) // window
        padded = F.pad(index, (0, pad_w, 0, pad_h), "constant", -100).reshape(t, nh, window, nw, window)
        padded = padded.permute(0, 1, 3, 2, 4).reshape(t, nh * nw, window * window)  # (t, windows, window^2)
        lengths.append((padded != -100).sum(-1).reshape(-1))
        flat = padded.reshape(-1)
        order.append(flat[flat != -100] + offset)
        offset += t * gh * gw
    sizes = torch.cat(lengths)
    cu = F.pad((sizes[sizes > 0] * merge**2).cumsum(0, dtype=torch.int32), (1, 0), value=0)
    return torch.cat(order).to(grid_thw.device), cu.cpu()  # cu on the host: every layer reads its lengths


@dataclass(frozen=True)
class VisionBatch2_5:
    """Per-batch metadata every pipeline rank derives from `grid_thw` alone (nothing of it is sent).

    Both attention views share the window-ordered rotary: `full.cu_seqlens` is one segment per frame (the
    `fullatt_block_indexes` blocks), `window.cu_seqlens` one per window (every other block). A frame's
    patches stay contiguous in window order, so full attention per frame is unchanged by the reorder."""

    full: VisionBatch  # cu_seqlens per frame; cos / sin (N, head_dim) float32 in window order
    window: VisionBatch  # the same with cu_seqlens = cu_window_seqlens (n_windows + 1,)
    patch_order: torch.Tensor  # (N,) row i of the window-ordered hidden is patch patch_order[i]
    reverse_index: torch.Tensor  # (N / m^2,) merged tokens back from window order to patch order

    @property
    def grid_thw(self) -> torch.Tensor:
        return self.full.grid_thw

    @property
    def n_patches(self) -> int:
        return self.full.n_patches

    @property
    def n_tokens(self) -> int:
        return self.full.n_tokens

    @property
    def rows(self) -> list[int]:
        """t*h*w of each image: contiguous in window order too (windows never span images)."""
        return self.full.rows


def vision_batch_2_5(config: Any, grid_thw: torch.Tensor) -> VisionBatch2_5:
    """cu_seqlens, the windows and the 2-D rotary of every patch, as transformers' tower computes them (the
    rotary and cu_seqlens are Qwen3-Omni's: same axial table in merge-block order, one segment per frame)."""
    batch = vision_batch(config, grid_thw)  # validates grid_thw
    m = config.spatial_merge_size
    merged_order, cu_window = window_index(batch.grid_thw, m, config.window_size // m // config.patch_size)
    unit = torch.arange(m * m, device=merged_order.device)
    patch_order = (merged_order[:, None] * m * m + unit).reshape(-1)  # (N,): each merge unit's m^2 patches
    full = dataclasses.replace(batch, cos=batch.cos[patch_order], sin=batch.sin[patch_order])
    return VisionBatch2_5(full=full, window=dataclasses.replace(full, cu_seqlens=cu_window),
                          patch_order=patch_order, reverse_index=torch.argsort(merged_order))


class ParallelVisionAttention2_5(ParallelVisionAttention):
    """Qwen3-Omni's vision attention (fused q/k/v GEMM split by heads, rotary, varlen SDPA, row-parallel
    proj); the checkpoint stores q, k and v apart, so each is loaded through the QKV loader's own shard."""

    def __init__(self, config: Any, ps: ParallelState, dtype: torch.dtype) -> None:
        super().__init__(config, ps, dtype)
        for p in (self.qkv.weight, self.qkv.bias):
            p.weight_loader = self.qkv.weight_loader  # type: ignore[union-attr]


class ParallelGatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), all three with biases: gate and up column-parallel in one GEMM, down
    row-parallel (one all-reduce). The text models' ParallelMLP has no biases, hence this one."""

    def __init__(self, hidden: int, inter: int, ps: ParallelState, dtype: torch.dtype) -> None:
        super().__init__()
        tp: dict[str, Any] = {"tp_rank": ps.tp_rank, "tp_size": ps.tp_size, "ps": ps, "params_dtype": dtype}
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], bias=True, **tp)
        self.down_proj = RowParallelLinear(inter, hidden, bias=True, **tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # 2 x (N, I/tp)
        return self.down_proj(F.silu(gate) * up)  # (N, hidden), all-reduced

    def plan(self, plan: Plan, prefix: str) -> None:
        """Checkpoint keys `<prefix>{gate,up,down}_proj.{weight,bias}`."""
        add_weight_and_bias(plan, prefix + "gate_proj", self.gate_up_proj, 0)
        add_weight_and_bias(plan, prefix + "up_proj", self.gate_up_proj, 1)
        add_weight_and_bias(plan, prefix + "down_proj", self.down_proj)


class ParallelVisionBlock2_5(nn.Module):
    def __init__(self, config: Any, ps: ParallelState, dtype: torch.dtype) -> None:
        super().__init__()
        d = config.hidden_size
        self.norm1 = RMSNorm(d, NORM_EPS, dtype)
        self.attn = ParallelVisionAttention2_5(config, ps, dtype)
        self.norm2 = RMSNorm(d, NORM_EPS, dtype)
        self.mlp = ParallelGatedMLP(d, config.intermediate_size, ps, dtype)

    def forward(self, x: torch.Tensor, batch: VisionBatch) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), batch)  # (N, hidden)
        return x + self.mlp(self.norm2(x))  # (N, hidden)

    def plan(self, plan: Plan, prefix: str) -> None:
        add_weight_and_bias(plan, prefix + "norm1", self.norm1)
        add_weight_and_bias(plan, prefix + "norm2", self.norm2)
        for s in "qkv":
            add_weight_and_bias(plan, f"{prefix}attn.{s}", self.attn.qkv, s)
        add_weight_and_bias(plan, prefix + "attn.proj", self.attn.proj)
        self.mlp.plan(plan, prefix + "mlp.")


class ParallelPatchMerger2_5(nn.Module):
    """merge^2 neighbouring patches -> one token: RMSNorm (per patch) -> mlp.0 -> GELU -> mlp.2."""

    def __init__(self, config: Any, ps: ParallelState, dtype: torch.dtype) -> None:
        super().__init__()
        self.merged = config.hidden_size * config.spatial_merge_size**2
        self.ln_q = RMSNorm(config.hidden_size, NORM_EPS, dtype)
        self.mlp = ParallelFFN(self.merged, self.merged, config.out_hidden_size, "gelu", ps, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged))  # (N / m^2, out_hidden), all-reduced

    def plan(self, plan: Plan, prefix: str) -> None:
        add_weight_and_bias(plan, prefix + "ln_q", self.ln_q)
        self.mlp.plan(plan, prefix + "mlp.0", prefix + "mlp.2")


class ParallelVisionTower2_5(TowerRank):
    """One rank's part of the vision tower (`thinker_config.vision_config`)."""

    blocks_name = "vision tower blocks"
    default_prefix = "thinker.visual."
    layers_attr = "depth"

    def __init__(self, config: Any, ps: ParallelState, layer_range: tuple[int, int],
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, ps, layer_range, dtype, check_vision_layout_2_5)
        self.patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size**2
        self.full_attention = set(config.fullatt_block_indexes)
        d, kt, kp = config.hidden_size, config.temporal_patch_size, config.patch_size
        with torch.device(ps.device):
            self.patch_weight = replicated_param(d, config.in_channels, kt, kp, kp, dtype=dtype) \
                if ps.is_first_pp_rank else None  # (hidden, C, T, P, P), no bias
            self.blocks = nn.ModuleList(ParallelVisionBlock2_5(config, ps, dtype) for _ in range(self.start, self.end))
            self.merger = ParallelPatchMerger2_5(config, ps, dtype) if ps.is_last_pp_rank else None

    def vision_blocks(self) -> list[ParallelVisionBlock2_5]:
        return [cast(ParallelVisionBlock2_5, block) for block in self.blocks]

    def batch(self, grid_thw: torch.Tensor) -> VisionBatch2_5:
        return vision_batch_2_5(self.config, grid_thw.to(self.ps.device))

    @torch.no_grad()
    def embed_patches(self, pixel_values: torch.Tensor, batch: VisionBatch2_5) -> torch.Tensor:
        """pixel_values (N, C*T*P*P) in patch order -> hidden (N, hidden) in window order; first pp rank only."""
        if self.patch_weight is None:
            raise ValueError(f"pipeline rank {self.ps.pp_rank} holds no patch embedding (only the first rank does)")
        if tuple(pixel_values.shape) != (batch.n_patches, self.patch_dim):
            raise ValueError(f"pixel_values must be (sum(t*h*w)={batch.n_patches}, C*T*P*P={self.patch_dim}) for "
                             f"grid_thw {batch.grid_thw.tolist()}, got {tuple(pixel_values.shape)}")
        # Conv3d with kernel = stride is one GEMM over each patch's flattened (C, T, P, P) (see Qwen3-Omni's)
        x = pixel_values.to(self.ps.device, self.dtype)  # (N, C*T*P*P), flattened (C, T, P, P)
        x = F.linear(x, self.patch_weight.view(self.config.hidden_size, -1))  # (N, hidden)
        return x[batch.patch_order]  # (N, hidden) in window order

    @torch.no_grad()
    def forward(self, hidden: torch.Tensor, batch: VisionBatch2_5) -> VisionOutput:
        """This rank's blocks on hidden (N, hidden) in window order; the last rank merges and restores patch order.

        `VisionOutput.hidden` stays in window order (what the next rank receives); deepstack is always empty."""
        check_rows(hidden, batch.n_patches, self.config.hidden_size, "hidden_size")
        for idx, block in zip(range(self.start, self.end), self.blocks):
            hidden = block(hidden, batch.full if idx in self.full_attention else batch.window)  # (N, hidden)
        embeds = None
        if self.merger is not None:  # per image: each image gets what it gets alone (Qwen3-Omni's `per_image`)
            embeds = per_image(self.merger, hidden, batch.rows)[batch.reverse_index]  # (N / m^2, out_hidden)
        return VisionOutput(hidden=hidden, deepstack=[], image_embeds=embeds)

    def checkpoint_plan(self, prefix: str) -> Plan:
        plan: Plan = {}
        if self.patch_weight is not None:
            add_to_plan(plan, prefix + "patch_embed.proj.weight", self.patch_weight)
        for idx, block in zip(range(self.start, self.end), self.vision_blocks()):
            block.plan(plan, f"{prefix}blocks.{idx}.")
        if self.merger is not None:
            self.merger.plan(plan, prefix + "merger.")
        return plan

    def deepstack_before(self, layer: int) -> int:
        """No deepstack features: nothing but the hidden crosses a pipeline boundary."""
        return 0
