"""Block-local attention for Qwen2.5-Omni's token2wav DiT: O(T) memory and work instead of transformers' O(T^2).

Role: transformers' `DiTDecoderLayer` attends under the mask `-look_backward <= block_diff <= look_ahead`, where
block_diff is the key's block minus the query's (blocks of `block_size` frames, 24 in the real checkpoint) and
each layer's window is 0 or 1 block either way: a frame sees at most three blocks. transformers still builds
the (B, heads, T, T) distance and scores, so a decode's memory and time grow with the square of its length (on
the tiny DiT, 2,000 codes = 4,000 frames: +521 MiB and 33 s in the DiT alone, 1,000 codes: +210 MiB, 7 s).
Here each query block attends only the W = back + 1 + ahead blocks of its window: the scores are
(R, nb, heads, block, W x block), so memory and work grow with T. The keys a real frame attends are exactly
those of transformers' mask (the window's blocks, minus padding and positions past the row's end), so the
output equals it to float rounding (the softmax sums fewer masked zeros, in another order).

Padding (rows right-padded to the longest, and T rounded up to whole blocks): a real frame never attends a
padded one; a padded frame attends only itself (no all-masked row, no NaN; its output is dropped).

Data flow (per layer; the masks are built once per step's geometry, one per (back, ahead) window):
    window_mask(block_size, frames, T, back, ahead) -> (R x nb, 1, block, W x block) bool
    block_attention(q, k, v (R, heads, T, D), mask, block_size, back, ahead)
        -> q as (R x nb, heads, block, D); k, v padded by `back` blocks before and `ahead` after (and to whole
           blocks), each query block's W key blocks side by side (R x nb, heads, W x block, D)
        -> scaled_dot_product_attention under the mask -> (R, heads, T, D)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def num_blocks(total: int, block_size: int) -> int:
    return -(-total // block_size)


def window_mask(block_size: int, frames: Sequence[int], total: int, back: int, ahead: int,
                device: torch.device | str) -> torch.Tensor:
    """(R x nb, 1, block_size, W x block_size) bool, W = back + 1 + ahead, nb = ceil(total / block_size): which
    key of its window each query may attend. Row r has frames[r] real frames; key j of query block b sits at
    frame (b - back) x block_size + j."""
    nb, width = num_blocks(total, block_size), back + 1 + ahead
    query = torch.arange(nb * block_size, device=device).view(1, nb, block_size, 1)
    key = (torch.arange(nb, device=device).view(1, nb, 1, 1) - back) * block_size \
        + torch.arange(width * block_size, device=device).view(1, 1, 1, -1)
    real = torch.tensor([int(n) for n in frames], device=device).view(-1, 1, 1, 1)
    mask = (query < real) & (key >= 0) & (key < real)  # a real frame: the real frames of its window
    mask = mask | ((query >= real) & (key == query))  # a padded frame: itself
    return mask.reshape(-1, 1, block_size, width * block_size)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, block_size: int,
                    back: int, ahead: int) -> torch.Tensor:
    """q, k, v (R, heads, T, D) and `window_mask`'s mask -> attention output (R, heads, T, D)."""
    R, heads, T, D = q.shape
    nb, width = num_blocks(T, block_size), back + 1 + ahead
    pad = nb * block_size - T
    q = F.pad(q, (0, 0, 0, pad)).view(R, heads, nb, block_size, D).transpose(1, 2).reshape(-1, heads, block_size, D)

    def windows(x: torch.Tensor) -> torch.Tensor:  # (R, heads, T, D) -> (R x nb, heads, W x block, D)
        x = F.pad(x, (0, 0, back * block_size, (ahead * block_size) + pad))
        x = x.view(R, heads, nb + width - 1, block_size, D)
        x = torch.cat([x[:, :, j:j + nb] for j in range(width)], dim=3)  # (R, heads, nb, W x block, D)
        return x.transpose(1, 2).reshape(-1, heads, width * block_size, D)

    out = F.scaled_dot_product_attention(q, windows(k), windows(v), attn_mask=mask)  # (R x nb, heads, block, D)
    return out.view(R, nb, heads, block_size, D).transpose(1, 2).reshape(R, heads, nb * block_size, D)[:, :, :T]
