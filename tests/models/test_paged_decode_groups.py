"""Gathered decodes in bounded groups (`paged_kv.decode_group`, the path every decode takes off the CPU kernel:
CUDA, and CPU pools that are not float32): a step's decodes attend in groups whose gathered keys and values fit
DECODE_GATHER_BYTES, and the output is the one of a single call over all of them.

What it proves:
- a GPU rank's reserve beside its pool: the groups' bound, or one prefill chunk's past at --max-model-len;
- the group size: what the bound holds, at least one request, the per-query-head copies counted where SDPA
  needs them (off CPU); a real Qwen3-Omni thinker's 32k-key decodes go one at a time;
- a step of nine ragged decodes beside a prefill chunk, in groups of 1, 2 and 4 (one SDPA call per group),
  gives the attention of one group of all nine (float32 and bfloat16 pools), and writes the pool the same.
"""

from __future__ import annotations

import pytest
import torch

from omnimesh.kernels import cpu_kernels
from omnimesh.models.qwen3_omni import paged_kv
from omnimesh.models.qwen3_omni.paged_kv import BatchLayout, PagedBatch, PagedKVPool, decode_group, gather_reserve


def test_a_gpu_rank_keeps_the_largest_gather_free() -> None:
    """Beside its KV pool a CUDA rank keeps free the most its attention gathers at once: the decode groups'
    bound, or one prefill chunk's whole past at --max-model-len when that is larger."""
    # Qwen3-Omni-30B-A3B's thinker at 32k: 2 x 32768 keys x 128 x 2 bytes x (4 + 32 heads) = 604 MB
    assert gather_reserve(32768, 4, 32, 128, 2, repeat=True) == 2 * 32768 * 128 * 2 * 36 > paged_kv.DECODE_GATHER_BYTES
    assert gather_reserve(4096, 4, 32, 128, 2, repeat=True) == paged_kv.DECODE_GATHER_BYTES  # 75 MB: the groups'
    assert gather_reserve(0, 4, 32, 128, 2, repeat=True) == paged_kv.DECODE_GATHER_BYTES  # length not given


def test_the_group_size_follows_the_bound() -> None:
    # Qwen3-Omni-30B-A3B's thinker: 32 query / 4 key heads of 128, bf16, copies per query head on CUDA
    assert decode_group(32768, 4, 32, 128, 2, repeat=True) == 1  # 604 MB each: past the 512 MiB bound alone
    assert decode_group(1024, 4, 32, 128, 2, repeat=True) == 512 * 2**20 // (2 * 1024 * 128 * 2 * 36)  # 28
    assert decode_group(1024, 4, 32, 128, 2, repeat=False) == 512 * 2**20 // (2 * 1024 * 128 * 2 * 4)  # CPU: 256
    assert decode_group(8, 2, 4, 16, 4, repeat=False, limit=2 * 8 * 16 * 4 * 2 * 3) == 3
    assert decode_group(8, 2, 4, 16, 4, repeat=False, limit=1) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decodes_in_groups_equal_one_call(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    g, heads, kv_heads, D, block = torch.Generator().manual_seed(0), 8, 2, 16, 4
    seqs = [(1, 3 + 5 * i, list(range(4 * i, 4 * i + 2 + (3 + 5 * i) // 4))) for i in range(9)]
    seqs.insert(4, (3, 2, [60, 61]))  # a prefill chunk among them
    layout = BatchLayout.build(seqs, block)
    N = layout.num_tokens
    q = torch.randn(1, heads, N, D, generator=g)
    k, v = torch.randn(1, kv_heads, N, D, generator=g), torch.randn(1, kv_heads, N, D, generator=g)
    start = torch.randn(64 * block, kv_heads, D, generator=g), torch.randn(64 * block, kv_heads, D, generator=g)
    runs, calls = {}, []
    attention = paged_kv.gqa_attention
    monkeypatch.setattr(paged_kv, "gqa_attention",
                        lambda qq, *a, **kw: calls.append(qq.shape[0]) or attention(qq, *a, **kw))  # counts the calls
    for size in (1, 2, 4, 9):
        calls.clear()
        pool = PagedKVPool((0, 1), 64, block, kv_heads, D, dtype, "cpu")
        pool.k[0].copy_(start[0])
        pool.v[0].copy_(start[1])
        smax = layout.decode_slots.shape[1]
        monkeypatch.setattr(paged_kv, "DECODE_GATHER_BYTES", size * 2 * smax * D * 4 * kv_heads)
        with cpu_kernels.disabled():
            batch = PagedBatch(pool, layout)
            assert not batch.fused
            runs[size] = batch.attend(0, q, k, v, heads // kv_heads, D**-0.5), pool
        assert calls == [min(size, 9 - a) for a in range(0, 9, size)] + [1], (size, calls)  # the groups, the prefill
    want, want_pool = runs[9]
    for size in (1, 2, 4):
        got, pool = runs[size]
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=f"groups of {size}")
        assert torch.equal(pool.k[0], want_pool.k[0]) and torch.equal(pool.v[0], want_pool.v[0])
