"""mrope.decode_positions_batch: column b is what `decode_positions` gives request b alone (the talker's
batched step bookkeeping reads it), text row = seq_len, t / h / w rows = seq_len + rope_delta."""

from __future__ import annotations

import torch

from omnimesh.models.qwen3_omni.mrope import decode_positions, decode_positions_batch


def test_batch_columns_equal_the_single_request_positions() -> None:
    lens, deltas = [0, 7, 31, 4096], [0, -3, 5, -4000]
    got = decode_positions_batch(lens, deltas)
    assert got.shape == (4, 4) and got.dtype == torch.float32
    for b, (n, d) in enumerate(zip(lens, deltas)):
        assert torch.equal(got[:, b:b + 1], decode_positions(n, d)[:, 0])
    assert got[:, 1].tolist() == [7.0, 4.0, 4.0, 4.0]
