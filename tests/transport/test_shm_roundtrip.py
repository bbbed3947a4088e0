"""Shared-memory round trip: ChunkEncoder("shm") -> wire -> ChunkAssembler gives back equal tensors of every
dtype and shape (0-dim, empty, non-contiguous); the consumer's tensor is the producer's arena memory (writes
show through both ways, no copy); empty tensors travel inline, and so do CPU tensors under the producer's
--shm-min-tensor-size; dropping the tensors frees the arena. A full arena (or out of slots) falls back to
inline bytes, counts the fallback, and works again once freed."""

from __future__ import annotations

import gc

import pytest
import torch
from transport_testlib import make_tensor, over_wire

from omnimesh.transport.chunk_codec import ChunkAssembler, ChunkEncoder
from omnimesh.transport.frames import StageChunk
from omnimesh.transport.shm_region import RegionReader

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16]
SHAPES = [(), (0,), (3, 0, 2), (7,), (4, 5, 3)]


def _aligned(nbytes: int) -> int:
    return (nbytes + 63) // 64 * 64


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_every_shape(make_transport, dtype: torch.dtype) -> None:
    producer = make_transport("rt")
    arena = producer.arena
    assert arena is not None
    start = arena.free_bytes()
    rid = f"req-rt-{dtype}"
    sent = {f"t{i}": make_tensor(dtype, shape, seed=i) for i, shape in enumerate(SHAPES)}
    parts = ChunkEncoder("shm", producer, rid).parts(StageChunk(tensors=sent, text="hello", seq=4, final=True))
    assert len(parts) == 1 and not parts[0].more
    kinds = {f.name: f.WhichOneof("payload") for f in parts[0].tensors}
    for name, t in sent.items():
        assert kinds[name] == ("data" if t.numel() == 0 else "shm"), name  # empty tensors travel inline
    used = sum(_aligned(t.numel() * t.element_size()) for t in sent.values() if t.numel())
    assert arena.free_bytes_now == start - used and arena.live_slots == 3

    chunk = ChunkAssembler(RegionReader(), rid).add(over_wire(parts[0]))
    assert chunk is not None
    assert (chunk.text, chunk.seq, chunk.final) == ("hello", 4, True)
    assert list(chunk.tensors) == list(sent)
    for name, t in sent.items():
        got = chunk.tensors[name]
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert torch.equal(got, t), name

    del got, chunk
    gc.collect()
    assert arena.free_bytes() == start and arena.live_slots == 0


def test_consumer_tensor_is_the_arena_memory(make_transport) -> None:
    """Zero copy: the consumer's tensor and the producer's arena are the same bytes."""
    producer = make_transport("zc")
    arena = producer.arena
    assert arena is not None and arena._data is not None
    sent = torch.arange(1000, dtype=torch.int64)
    part = ChunkEncoder("shm", producer, "req-zc").parts(StageChunk(tensors={"codes": sent}))[0]
    ref = part.tensors[0].shm
    chunk = ChunkAssembler(RegionReader(), "req-zc").add(over_wire(part))
    assert chunk is not None
    got = chunk.tensors["codes"]
    assert torch.equal(got, sent)

    producer_view = arena._data[ref.offset: ref.offset + ref.nbytes].view(torch.int64)
    producer_view[5] = -12345  # the producer writes its arena ...
    assert int(got[5]) == -12345  # ... and the consumer's tensor shows it
    got[7] = 999  # and the other way round
    assert int(producer_view[7]) == 999
    del got, chunk, producer_view
    gc.collect()
    assert arena.free_bytes() == arena.size


def test_non_contiguous_and_many_tensors(make_transport) -> None:
    producer = make_transport("nc")
    base = torch.randn(6, 9)
    sent = {"t": base.t(), "strided": base[:, ::2], "slice": base[2:4], "scalar": torch.tensor(3.5)}
    parts = ChunkEncoder("shm", producer, "req-nc").parts(StageChunk(tensors=sent))
    chunk = ChunkAssembler(RegionReader(), "req-nc").add(over_wire(parts[0]))
    assert chunk is not None
    for name, t in sent.items():
        assert torch.equal(chunk.tensors[name], t), name


def test_tensors_under_the_minimum_go_inline(make_transport) -> None:
    producer = make_transport("min", min_ref_bytes=1024)
    arena = producer.arena
    assert arena is not None
    start = arena.free_bytes()
    sent = {"small": torch.randn(255), "edge": torch.randn(256), "big": torch.randn(4, 100, dtype=torch.float64)}
    parts = producer.encoder("shm", "req-min").parts(StageChunk(tensors=sent))  # 1020, 1024 and 3200 bytes
    assert [(f.name, f.WhichOneof("payload")) for p in parts for f in p.tensors] == [
        ("small", "data"), ("edge", "shm"), ("big", "shm")]
    assert arena.live_slots == 2 and arena.fallbacks == 0  # chosen inline, not a fallback
    chunk = ChunkAssembler(RegionReader(), "req-min").add(over_wire(parts[-1]))
    assert chunk is not None and all(torch.equal(chunk.tensors[k], v) for k, v in sent.items())
    del chunk
    gc.collect()
    assert arena.free_bytes() == start and arena.live_slots == 0
    assert [f.WhichOneof("payload") for f in make_transport("min0").encoder("shm", "r").parts(
        StageChunk(tensors={"small": torch.randn(3)}))[0].tensors] == ["shm"]  # 0: every tensor by reference


def test_full_arena_falls_back_inline_and_recovers(make_transport) -> None:
    producer = make_transport("full", arena_bytes=2**20)
    arena = producer.arena
    assert arena is not None
    start = arena.free_bytes()
    reader = RegionReader()
    a, b = torch.randn(150_000), torch.randn(150_000)  # 600 kB each: one fits a 1 MiB arena, two do not
    parts = ChunkEncoder("shm", producer, "req-full").parts(StageChunk(tensors={"a": a, "b": b}))
    assert [f.WhichOneof("payload") for p in parts for f in p.tensors] == ["shm", "data"]
    assert arena.fallbacks == 1
    chunk = ChunkAssembler(reader, "req-full").add(over_wire(parts[-1]))
    assert chunk is not None and torch.equal(chunk.tensors["a"], a) and torch.equal(chunk.tensors["b"], b)

    # while the consumer holds "a" (alive, lock held) the arena stays full, even after a deep sweep
    assert arena.publish(b, "req-full-2") is None
    assert arena.fallbacks == 2
    assert arena.publish(torch.zeros(2**20), "req-too-big") is None  # larger than the whole arena
    assert arena.fallbacks == 3

    del chunk
    gc.collect()
    ref = arena.publish(b, "req-full-3")  # the released slot is swept on demand: publishing works again
    assert ref is not None and arena.fallbacks == 3
    arena.end_request("req-full-3", cancelled=True)
    assert arena.free_bytes() == start and arena.live_slots == 0


def test_out_of_slots_falls_back(make_arena) -> None:
    arena = make_arena("slots", size=2**20, max_slots=2)
    refs = [arena.publish(torch.ones(4), f"r{i}") for i in range(3)]
    assert refs[0] is not None and refs[1] is not None and refs[2] is None
    assert arena.fallbacks == 1
    assert arena.free_bytes_now == arena.size - 2 * 64  # the failed publication gave its extent back
    arena.end_request("r0", cancelled=True)
    assert arena.publish(torch.ones(4), "r3") is not None


def test_extent_allocator_coalesces_and_refuses_double_free() -> None:
    import random

    from omnimesh.transport.shm_arena import Extents

    rng = random.Random(7)
    ext = Extents(64 * 1000)
    taken: list[tuple[int, int]] = []
    for _ in range(3000):
        if taken and (rng.random() < 0.45 or ext.largest < 64 * 40):
            start, n = taken.pop(rng.randrange(len(taken)))
            ext.free(start, n)
        else:
            n = rng.randint(1, 64 * 40)
            start = ext.alloc(n)
            assert start is not None and start % 64 == 0
            for s, m in taken:  # never overlaps a live extent
                assert start + n <= s or s + (m + 63) // 64 * 64 <= start
            taken.append((start, n))
    for start, n in taken:
        ext.free(start, n)
    assert ext.free_bytes == ext.size == ext.largest  # one extent again
    start = ext.alloc(100)
    ext.free(start, 100)
    with pytest.raises(RuntimeError, match="double free"):
        ext.free(start, 100)


def test_empty_tensor_is_not_published(make_arena) -> None:
    """An empty tensor has no bytes to share: publish says "send inline" and the allocator stays sound."""
    arena = make_arena("empty")
    assert arena.publish(torch.empty(0, 3), "req-e") is None
    assert arena.publish(torch.ones(4), "req-e") is not None
    arena.end_request("req-e", cancelled=True)
    assert arena.free_bytes() == arena.size and arena.live_slots == 0 and arena.fallbacks == 0
