"""Prefix-cache keys of a thinker prompt's rows (`InputRun.prefix_keys`, see models/qwen3_omni/lm_engine.py).

A row's keys and values in the KV cache depend on the rows before it and on the row itself: for a text row
its token id and M-RoPE positions, for a media row the encoder's output for it, which the gateway names by
its item's content digest (gateway/media_digest.py; `audio_hashes` / `image_hashes` / `video_hashes` in the
thinker's input, one per item in prompt order). Each row's key is one int64 row:

    text row:   [token id,            -1,              M-RoPE positions (P)]
    media row:  [its item's digest,   offset in item,  M-RoPE positions (P)]

The keys run up to the first row they cannot name: a media row of a modality that came without digests
(or whose per-item token counts do not add up to its rows). When the request's media rows are captured for
the talker (speech out), their offsets carry `CAPTURED`: such blocks must keep those rows' hidden states
too (the engine serves them from the block, lm_engine.py), so they are never shared with a text-only
request's blocks, which keep none. Qwen2.5-Omni's talker reads EVERY prompt row's hidden: with `all_captured`
its text rows carry `CAPTURED - 1` in place of -1 as well (H floats kept per row of such blocks). The engine hashes whole blocks of these keys, chained
(engine/kv_blocks.py), so a block's hash covers everything before it.
"""

from __future__ import annotations

import torch
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

from omnimesh.models.qwen3_omni.thinker import PreparedPrompt, Qwen3OmniThinker

CAPTURED = 1 << 40  # added to a media row's offset when its hidden state goes to the talker


def _item_rows(kind: str, prompt: PreparedPrompt, merge: int) -> torch.Tensor | None:
    """Placeholder rows per item of `kind` (n_items,), from the prompt's own lengths and grids."""
    if kind == "audio":
        lengths = prompt.audio_feature_lengths
        return None if lengths is None else _get_feat_extract_output_lengths(lengths.view(-1).long())
    grid = prompt.image_grid_thw if kind == "image" else prompt.video_grid_thw
    return None if grid is None else grid.long().prod(-1) // merge


def prompt_prefix_keys(thinker: Qwen3OmniThinker, prompt: PreparedPrompt, hashes: dict[str, torch.Tensor | None],
                       *, captured: bool, all_captured: bool = False) -> torch.Tensor:
    """(m, 2 + P) int64 keys of the prompt's first m rows (see the module docstring); `captured`: the media
    rows' hidden states go to the talker; `all_captured`: every row's does (Qwen2.5-Omni's speech)."""
    ids = prompt.ids.view(-1).long()
    first = ids.clone()
    second = torch.full_like(ids, CAPTURED - 1 if all_captured else -1)
    limit = ids.numel()
    merge = thinker.mrope.spatial_merge_size ** 2
    for kind, token in (("audio", thinker.audio_token_id), ("image", thinker.image_token_id),
                        ("video", thinker.video_token_id)):
        rows = torch.nonzero(ids == token).view(-1)
        if not rows.numel():
            continue
        digests, counts = hashes.get(f"{kind}_hashes"), _item_rows(kind, prompt, merge)
        if (digests is None or counts is None or digests.numel() != counts.numel()
                or int(counts.sum()) != rows.numel()):
            limit = min(limit, int(rows[0]))  # rows it cannot name: the keys stop there
            continue
        item = torch.repeat_interleave(torch.arange(counts.numel()), counts)  # (rows,) item of each row
        starts = torch.cumsum(counts, 0) - counts
        first[rows] = digests.view(-1).long()[item]
        second[rows] = torch.arange(rows.numel()) - starts[item] + (CAPTURED if captured else 0)
    return torch.cat([first[:limit, None], second[:limit, None], prompt.positions[:, :limit].T.long()], dim=1)
