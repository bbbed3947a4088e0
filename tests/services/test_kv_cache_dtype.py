"""--kv-cache-dtype: the thinker's / talker's paged KV cache kept in bfloat16 or fp8 while attention runs in the
model's dtype.

What is proved: a pool of a narrower dtype holds proportionally more blocks in the same --kv-cache-memory; the
paged attention over an fp8 / bfloat16 pool equals float32 attention over keys and values rounded to that dtype
(decodes and a chunked prefill in one step; out-of-range values saturate instead of turning to NaN); a whole
thinker on an fp8 cache still batches exactly (16 requests at once = each alone on the same cache) and stays
close to the float32 cache's logits; the memory plan counts the narrower cache.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from omnimesh.config.serve_args import ServeArgs
from omnimesh.config.stage_config import KV_CACHE_DTYPE_CHOICES
from omnimesh.models.qwen3_omni import paged_kv
from services.llm.thinker_handler import build_handler as thinker_handler
from tests.services.test_lm_batching import Driver, Recorder, assert_same_run, open_thinker, prompts, solo, token_ids

BLOCK = 4
NH, NKV, D = 4, 2, 8


def test_every_flag_value_names_a_dtype() -> None:
    assert tuple(paged_kv.KV_CACHE_DTYPES) == KV_CACHE_DTYPE_CHOICES
    assert paged_kv.kv_cache_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert paged_kv.kv_cache_dtype("fp8", torch.float32) is torch.float8_e4m3fn
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        paged_kv.kv_cache_dtype("int4", torch.float32)


def _step(pool: paged_kv.PagedKVPool, seqs: list[tuple[int, int, list[int]]], q: torch.Tensor, k: torch.Tensor,
          v: torch.Tensor) -> torch.Tensor:
    batch = paged_kv.PagedBatch(pool, paged_kv.BatchLayout.build(seqs, BLOCK))
    return batch.attend(0, q, k, v, NH // NKV, D ** -0.5)


def _qkv(n: int, g: torch.Generator, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(torch.randn(1, h, n, D, generator=g) * scale for h in (NH, NKV, NKV))  # type: ignore[return-value]


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                        reason="needs a CUDA device")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("name", ["bfloat16", "float16", "fp8", "fp8_e5m2"])
def test_paged_attention_over_a_narrow_pool_equals_attention_over_rounded_keys(name: str, device: str) -> None:
    dtype = paged_kv.KV_CACHE_DTYPES[name]
    g = torch.Generator().manual_seed(0)
    narrow = paged_kv.PagedKVPool((0, 1), 16, BLOCK, NKV, D, dtype, device)
    wide = paged_kv.PagedKVPool((0, 1), 16, BLOCK, NKV, D, torch.float32, device)
    first = [(6, 0, [0, 1]), (3, 0, [2]), (9, 0, [3, 4, 5])]  # three prefills
    second = [(1, 6, [0, 1]), (1, 3, [2]), (5, 9, [3, 4, 5, 6])]  # two decodes and a prefill chunk over its past
    for seqs in (first, second):
        q, k, v = (t.to(device) for t in _qkv(sum(n for n, _, _ in seqs), g))
        got = _step(narrow, seqs, q, k, v)
        want = _step(wide, seqs, q, k.to(dtype).float(), v.to(dtype).float())  # the same keys, rounded
        torch.testing.assert_close(got, want, atol=1e-5 if device == "cuda" else 1e-6, rtol=1e-5)
        assert got.dtype == torch.float32
    assert narrow.nbytes() * (4 // narrow.k[0].element_size()) == wide.nbytes()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_padded_decodes_never_read_what_the_pools_memory_held_before(monkeypatch, dtype: torch.dtype) -> None:
    """A pool is allocated uninitialised, and on a GPU its memory may hold NaNs from earlier use (the profiling
    run's activations). A step's shorter decodes are padded with slot 0, masked out, but 0 x NaN is NaN in the
    attention's weighted sum: slot 0's block is zeroed when the pool is made, whatever nothing has written."""
    real_empty = torch.empty
    with monkeypatch.context() as patched:  # memory that held NaNs
        patched.setattr(torch, "empty", lambda *a, **kw: real_empty(*a, **kw).view(torch.uint8).fill_(0xFF)
                        .view(kw["dtype"]))
        pool = paged_kv.PagedKVPool((0, 1), 4, BLOCK, NKV, D, dtype, "cpu")
    assert not torch.isfinite(pool.k[0][BLOCK:].float()).any()
    g = torch.Generator().manual_seed(3)
    _step(pool, [(5, 0, [1, 2])], *_qkv(5, g))  # two requests on blocks 1-3, none on block 0
    _step(pool, [(1, 0, [3])], *_qkv(1, g))
    out = _step(pool, [(1, 5, [1, 2]), (1, 1, [3])], *_qkv(2, g))  # the second decode padded to the first's 6 keys
    assert torch.isfinite(out).all()


def test_fp8_saturates_at_its_largest_value() -> None:
    pool = paged_kv.PagedKVPool((0, 1), 2, BLOCK, NKV, D, torch.float8_e4m3fn, "cpu")
    g = torch.Generator().manual_seed(1)
    q, k, v = _qkv(3, g, scale=1e4)  # far beyond e4m3's 448
    out = _step(pool, [(3, 0, [0])], q, k, v)
    kept = paged_kv.load(pool.k[0], torch.arange(3), torch.float32)
    assert torch.isfinite(out).all() and torch.isfinite(kept).all()
    assert kept.abs().max() == 448.0 and ((kept.abs() == 448.0) == (k[0].transpose(0, 1).abs() >= 464)).all()


def test_a_thinker_on_an_fp8_cache_batches_exactly_and_stays_near_float32(model_dir: Path, thinker: Any) -> None:
    args = dict(max_model_len=128, kv_cache_memory="1MiB", stream_interval=1)
    fp8 = thinker_handler(model_dir, ServeArgs(kv_cache_dtype="fp8", **args))
    engine = fp8.batcher.engine
    assert engine.allocator.num_blocks == 4 * thinker.batcher.engine.allocator.num_blocks
    lengths = [3, 40, 7, 12, 5, 33, 18, 9, 26, 4, 15, 21, 37, 11, 6, 29]
    ids = prompts(lengths, seed=3)
    alone = [solo(fp8, p, 8) for p in ids]
    rec = Recorder(engine)
    d = Driver(fp8)
    d.add(*(open_thinker(fp8, f"r{i}", p, 8) for i, p in enumerate(ids)))
    chunks = d.run()
    rec.stop()
    for i, want in enumerate(alone):
        assert_same_run((token_ids(chunks[f"r{i}"]), rec.stacked(f"r{i}")), want, f"r{i} on the fp8 cache")
    assert rec.sizes[0] == 16
    # the first logits row depends on the prompt's keys only through the cache: fp8 rounding moves it a little
    for p, (_, logits) in zip(ids[:4], alone[:4]):
        _, ref = solo(thinker, p, 1)
        diff = (logits[0] - ref[0]).abs().max().item()
        assert 0 < diff < 0.05 * ref[0].abs().max().item(), diff

