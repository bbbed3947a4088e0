"""Slot lifetimes of the shm arena: nothing leaks and nothing is reused while read.

- 1,000 requests with random cancellations (consumed, cancelled before the claim, cancelled while
  claimed, dropped unread, stale frames replayed): the arena ends with all its bytes free and no live
  slot, and every tensor a consumer read equals what was published, also after being held for a while;
- a stale reference (its slot taken back and published again) is refused, never read;
- a consumer's live claim survives a replayed/stale frame of the same slot and a discard of its part;
- a consumer process killed while holding a slot: the slot is kept while it lives, reclaimed after;
- a request deadline that passed reclaims an unclaimed slot in a deep sweep, never a claimed one; a request
  without a deadline gets one for its still unclaimed frames when its stream ends (UNCLAIMED_TTL_S); a metrics
  scrape runs the deep sweep when it is due, so an idle stage reports such slots free;
- a part the consumer refuses (FrameError) does not strand the references it carried."""

from __future__ import annotations

import gc
import random
import signal
import time

import pytest
import torch
from transport_testlib import make_tensor, over_wire, python_child, read_line

from omnimesh.transport import slot_owner
from omnimesh.transport.chunk_codec import ChunkAssembler
from omnimesh.transport.frames import FrameError, StageChunk
from omnimesh.transport.shm_region import MAPPED, PUBLISHED, RegionError, RegionReader
from omnimesh.v1 import stage_pb2, tensor_pb2

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16]


def test_thousand_requests_with_random_cancellations(make_transport) -> None:
    rng = random.Random(1234)
    producer = make_transport("leak", arena_bytes=16 * 2**20)
    arena = producer.arena
    assert arena is not None
    consumer = make_transport("leak-consumer", preference="grpc")  # its own reader, no arena
    start = arena.free_bytes()
    held: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []  # (received, sent) still held
    stale: list[tuple[str, stage_pb2.Chunk]] = []  # parts whose slots were taken back
    counts = dict.fromkeys("abcde", 0)

    def check_and_drop_some(keep: int) -> None:
        while len(held) > keep:
            got, sent = held.pop(rng.randrange(len(held)))
            for name, t in sent.items():  # still intact after the arena served other requests
                assert torch.equal(got[name], t), name

    for i in range(1000):
        rid = f"req-{i}"
        sent = {f"t{k}": make_tensor(rng.choice(DTYPES), (rng.choice([0, 1, 7, 100, 3000, 40_000]),), seed=i * 3 + k)
                for k in range(rng.randint(1, 3))}
        parts = [over_wire(p) for p in producer.encoder("shm", rid, deadline=0.0).parts(StageChunk(tensors=sent))]
        assert len(parts) == 1
        refs = sum(f.WhichOneof("payload") == "shm" for f in parts[0].tensors)
        fate = rng.choice("abcde")
        counts[fate] += 1
        if fate in "ace":  # the consumer reads the chunk
            chunk = consumer.assembler(rid).add(parts[0])
            assert chunk is not None
            for name, t in sent.items():
                assert torch.equal(chunk.tensors[name], t), (rid, name)
            if fate == "c":  # the request is cancelled while the consumer holds its tensors
                if rng.random() < 0.5:
                    producer.end_request(rid, cancelled=True)
                else:
                    assert producer.release(rid) == 0  # all claimed: nothing to take back
            else:
                producer.end_request(rid, cancelled=False)
            if fate == "e":  # the same frame comes again (a retry) while the tensors are held: refused
                if refs:
                    with pytest.raises(FrameError, match="no longer holds this tensor"):
                        consumer.assembler(rid).add(parts[0])
            if rng.random() < 0.5:
                held.append((chunk.tensors, sent))
            del chunk
        elif fate == "b":  # cancelled before the consumer claims anything
            if rng.random() < 0.5:
                producer.end_request(rid, cancelled=True)
            else:
                assert producer.release(rid) == refs
            stale.append((rid, parts[0]))
        else:  # "d": the consumer drops the frame unread
            consumer.assembler(rid).discard(parts[0])
            stale.append((rid, parts[0]))
        check_and_drop_some(keep=rng.randint(0, 8))
        if stale and rng.random() < 0.05:  # a late frame of a taken-back request
            rid_s, part = stale.pop(rng.randrange(len(stale)))
            if any(f.WhichOneof("payload") == "shm" for f in part.tensors):
                with pytest.raises(FrameError, match=rid_s):
                    consumer.assembler(rid_s).add(part)

    assert min(counts.values()) > 150, counts
    check_and_drop_some(keep=0)
    gc.collect()
    assert arena.free_bytes() == start
    assert arena.live_slots == 0 and arena.requests_holding() == 0
    assert int((arena.region.table["state"] != 0).sum()) == 0
    assert arena.fallbacks == 0  # 16 MiB is enough: every non-empty tensor really went through shm


def test_stale_reference_is_refused(make_arena) -> None:
    arena = make_arena("stale", max_slots=1)  # one slot: the next publication reuses it
    reader = RegionReader()
    old = arena.publish(torch.arange(8.0), "req-old")
    assert old is not None
    arena.end_request("req-old", cancelled=True)
    assert arena.live_slots == 0 and arena.reclaimed_unreleased == 1
    new = arena.publish(torch.full((8,), 7.0), "req-new")
    assert new is not None
    assert (new.slot, new.offset) == (old.slot, old.offset) and new.generation == old.generation + 1

    with pytest.raises(RegionError, match="released, cancelled or expired"):
        reader.view(old.region, old.host_id, old.slot, old.generation, old.offset, old.nbytes, "old")
    frame = tensor_pb2.TensorFrame(name="hidden", dtype="float32", shape=[8], shm=old)
    with pytest.raises(FrameError, match=r"tensor 'hidden' of request req-old.*released") as info:
        ChunkAssembler(reader, "req-old").add(stage_pb2.Chunk(tensors=[frame]))
    assert isinstance(info.value.__cause__, RegionError)
    # the refusal did not disturb the new publication
    assert int(arena.region.table["state"][new.slot]) == PUBLISHED
    view = reader.view(new.region, new.host_id, new.slot, new.generation, new.offset, new.nbytes, "new")
    assert torch.equal(torch.frombuffer(view, dtype=torch.float32), torch.full((8,), 7.0))
    del view
    gc.collect()
    assert arena.free_bytes() == arena.size


def test_live_claim_survives_replay_stale_frame_and_discard(make_arena) -> None:
    """A consumer that holds a slot keeps it (lock and all) whatever else arrives for that slot."""
    arena = make_arena("replay", max_slots=1)
    reader = RegionReader()
    old = arena.publish(torch.zeros(16), "req-a")
    assert old is not None
    arena.end_request("req-a", cancelled=True)
    sent = torch.arange(16.0)
    new = arena.publish(sent, "req-b")
    assert new is not None and new.slot == old.slot
    part = stage_pb2.Chunk(tensors=[tensor_pb2.TensorFrame(name="x", dtype="float32", shape=[16], shm=new)])
    asm = ChunkAssembler(reader, "req-b")
    chunk = asm.add(part)
    assert chunk is not None
    got = chunk.tensors["x"]

    stale = stage_pb2.Chunk(tensors=[tensor_pb2.TensorFrame(name="x", dtype="float32", shape=[16], shm=old)])
    with pytest.raises(FrameError):
        ChunkAssembler(reader, "req-a").add(stale)  # a late frame of the cancelled request
    with pytest.raises(FrameError):
        ChunkAssembler(reader, "req-b").add(part)  # the same frame again
    asm.discard(part)  # and the consumer drops the part it already read
    ChunkAssembler(reader, "req-a").discard(stale)

    # the claim is intact: the producer cannot take the slot back (its consumer is alive) ...
    arena.end_request("req-b", cancelled=True)
    assert arena.sweep(deep=True) == 0
    assert arena.live_slots == 1 and int(arena.region.table["state"][new.slot]) == MAPPED
    assert arena.publish(torch.ones(16), "req-c") is None  # ... so nothing overwrites what it reads
    assert torch.equal(got, sent)
    del got, chunk
    gc.collect()
    assert arena.free_bytes() == arena.size and arena.live_slots == 0


def test_refused_part_does_not_strand_its_references(make_transport) -> None:
    """A part the consumer refuses half-way: the references it did not claim go back to the producer."""
    producer = make_transport("refuse")
    arena = producer.arena
    assert arena is not None
    start = arena.free_bytes()
    parts = producer.encoder("shm", "req-r").parts(StageChunk(tensors={"a": torch.ones(10), "b": torch.ones(20)}))
    part = parts[0]
    part.tensors[0].shape[:] = [11]  # header says 44 bytes, the slot holds 40
    with pytest.raises(FrameError, match="'a' of request req-r"):
        producer.assembler("req-r").add(part)
    gc.collect()
    assert arena.free_bytes() == start and arena.live_slots == 0


_HOLDER = """
import json, sys, time
from omnimesh.transport.shm_region import RegionReader
ref = json.loads(sys.argv[1])[0]
view = RegionReader().view(ref["region"], ref["host_id"], ref["slot"], ref["generation"], ref["offset"],
                           ref["nbytes"], "child")
print("mapped", bytes(view[:4]).hex(), flush=True)
time.sleep(60)
"""


def test_consumer_killed_while_holding_a_slot(make_arena) -> None:
    arena = make_arena("dead", max_slots=8)
    start = arena.free_bytes()
    sent = torch.tensor([1, 2, 3, 4, 5], dtype=torch.uint8)
    ref = arena.publish(sent, "req-dead")
    assert ref is not None
    child = python_child(_HOLDER, {"region": ref.region, "host_id": ref.host_id, "slot": ref.slot,
                                   "generation": ref.generation, "offset": ref.offset, "nbytes": ref.nbytes})
    try:
        assert read_line(child) == "mapped 01020304"
        arena.end_request("req-dead", cancelled=True)  # claimed: not taken back
        assert arena.free_bytes() == start - 64  # a deep sweep keeps the slot of a living consumer
        assert arena.live_slots == 1 and int(arena.region.table["state"][ref.slot]) == MAPPED
    finally:
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=30)
    assert child.returncode == -signal.SIGKILL
    assert arena.free_bytes() == start  # the kernel dropped the dead consumer's lock: reclaimed
    assert arena.live_slots == 0 and arena.reclaimed_unreleased == 1
    with pytest.raises(RegionError, match="no longer holds"):  # and its reference is now stale
        RegionReader().view(ref.region, ref.host_id, ref.slot, ref.generation, ref.offset, ref.nbytes, "late")


def test_expired_deadline_reclaims_unclaimed_slots_only(make_arena) -> None:
    arena = make_arena("deadline", max_slots=8)
    start = arena.free_bytes()
    past = time.time() - 1.0
    expired = arena.publish(torch.ones(4), "req-expired", deadline_unix_s=past)
    claimed = arena.publish(torch.ones(4), "req-claimed", deadline_unix_s=past)
    future = arena.publish(torch.ones(4), "req-future", deadline_unix_s=time.time() + 3600)
    never = arena.publish(torch.ones(4), "req-never")  # deadline 0: none
    assert None not in (expired, claimed, future, never)
    reader = RegionReader()
    view = reader.view(claimed.region, claimed.host_id, claimed.slot, claimed.generation, claimed.offset,
                       claimed.nbytes, "claimed")
    assert arena.sweep(deep=False) == 0  # expiry is a deep-sweep matter
    assert arena.sweep(deep=True) == 1
    assert arena.live_slots == 3 and arena.reclaimed_unreleased == 1
    with pytest.raises(RegionError, match="released, cancelled or expired"):
        reader.view(expired.region, expired.host_id, expired.slot, expired.generation, expired.offset,
                    expired.nbytes, "expired")
    del view
    gc.collect()
    arena.end_request("req-future", cancelled=True)
    arena.end_request("req-never", cancelled=True)
    assert arena.free_bytes() == start and arena.live_slots == 0




def test_a_request_without_a_deadline_gets_one_for_its_unclaimed_frames_at_its_end(make_arena, monkeypatch) -> None:
    """--request-timeout 0: a frame whose consumer died before claiming it (a gateway killed between the
    stage's answer and its read) would hold its slot until the producer exits; once the request's stream
    ended its unclaimed frames expire UNCLAIMED_TTL_S later. A running request's frames never do."""
    arena = make_arena("orphans", max_slots=8)
    start = arena.free_bytes()
    table = arena.region.table
    ended = arena.publish(torch.ones(4), "req-ended")
    claimed = arena.publish(torch.ones(4), "req-ended")
    running = arena.publish(torch.ones(4), "req-running")
    waiting = arena.publish(torch.ones(4), "req-waiting")
    assert None not in (ended, claimed, running, waiting)
    view = RegionReader().view(claimed.region, claimed.host_id, claimed.slot, claimed.generation,
                               claimed.offset, claimed.nbytes, "claimed")
    arena.end_request("req-waiting", cancelled=False)  # the default: an hour to be claimed
    assert time.time() + 3590 < table["deadline"][waiting.slot] < time.time() + 3610
    monkeypatch.setattr(slot_owner, "UNCLAIMED_TTL_S", -1.0)  # as if that hour had passed
    arena.end_request("req-ended", cancelled=False)
    assert table["deadline"][running.slot] == 0 and table["deadline"][claimed.slot] == 0  # claimed: its own
    assert arena.sweep(deep=True) == 1 and arena.reclaimed_unreleased == 1  # the unclaimed one alone
    assert arena.live_slots == 3
    del view
    gc.collect()
    arena.end_request("req-running", cancelled=True)
    arena.end_request("req-waiting", cancelled=True)
    arena.sweep()
    assert arena.free_bytes() == start and arena.live_slots == 0


@pytest.mark.parametrize(("field", "value", "match"), [
    ("offset", 64, "the frame says 40 at 64"),
    ("offset", 3, "outside the data"),
    ("offset", 2**40, "outside the data"),
    ("slot", 10**6, "outside region"),
    ("region", "omnimesh-rgn-txtest-nosuch", "does not exist"),
    ("region", "../etc/passwd", "not an omnimesh shared-memory region name"),
])
def test_forged_reference_is_refused(make_transport, field: str, value: object, match: str) -> None:
    producer = make_transport("forged")
    arena = producer.arena
    assert arena is not None
    part = producer.encoder("shm", "req-f").parts(StageChunk(tensors={"w": torch.ones(10)}))[0]
    setattr(part.tensors[0].shm, field, value)
    with pytest.raises(FrameError, match=f"tensor 'w' of request req-f.*{match}"):
        producer.assembler("req-f").add(part)
    arena.end_request("req-f", cancelled=True)  # what the refusal did not give back, the cancel does
    assert arena.free_bytes() == arena.size and arena.live_slots == 0


_PRODUCER = """
import json, sys, time
from omnimesh.transport.host_id import host_id
from omnimesh.transport.shm_region import PUBLISHED, Region
tag = json.loads(sys.argv[1])[0]
region = Region.create(tag, max_slots=4, data_size=4096)
region.mm[region.data_offset: region.data_offset + 4] = bytes([9, 8, 7, 6])
region.lock_exclusive(0)
region.table[0] = (PUBLISHED, 0, 1, 0, 4, 0.0, 0)
region.unlock(0)
print(region.name, host_id(), flush=True)
time.sleep(60)
"""


def test_a_dead_producers_region_is_unmapped_once_nothing_views_it(make_arena) -> None:
    """A stage that stops or restarts leaves consumers mapping its old arena: the reader unmaps it (and
    removes its name) as soon as no tensor views it any more, and never touches a living producer's."""
    from transport_testlib import TAG, our_region_files

    alive = make_arena("alive", max_slots=8)
    ref = alive.publish(torch.arange(4, dtype=torch.uint8), "req-alive")
    assert ref is not None
    reader = RegionReader()
    alive_view = reader.view(ref.region, ref.host_id, ref.slot, ref.generation, ref.offset, ref.nbytes, "alive")
    child = python_child(_PRODUCER, f"{TAG}-gone")
    try:
        name, host = read_line(child).split()
        held = torch.frombuffer(reader.view(name, host, 0, 1, 0, 4, "gone"), dtype=torch.uint8)
        assert held.tolist() == [9, 8, 7, 6]
    finally:
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=30)
    assert reader.drop_dead() == 0 and name in reader._regions  # still viewed: kept, and still readable
    assert held.tolist() == [9, 8, 7, 6] and name not in our_region_files()  # its name is gone already
    del held
    gc.collect()
    assert reader.drop_dead() == 1 and name not in reader._regions
    assert ref.region in reader._regions and bytes(alive_view) == bytes(range(4))  # the living one stays


def test_a_scrape_reports_expired_slots_free_with_nothing_published_since(make_transport, monkeypatch) -> None:
    """The arena gauges are read at scrape time: a deep sweep is due every DEEP_SWEEP_EVERY_S there too, so an
    idle stage (no publish to trigger one) reports the slot of an expired request as free, not in use."""
    from prometheus_client import CollectorRegistry, generate_latest

    from omnimesh.transport.transport_metrics import register_transport_metrics

    producer = make_transport("scrape", arena_bytes=2**20)
    arena = producer.arena
    assert arena is not None and arena.publish(torch.ones(64), "req-gone", deadline_unix_s=time.time() - 1)
    registry = CollectorRegistry()
    register_transport_metrics(registry, producer, {"stage": "talker"})

    def scraped(name: str) -> float:
        [line] = [x for x in generate_latest(registry).decode().splitlines() if x.startswith(name + "{")]
        return float(line.rsplit(" ", 1)[1])

    assert scraped("omnimesh:shm_arena_slots_in_use") == 1  # the arena is new: no deep sweep due yet
    monkeypatch.setattr(slot_owner, "DEEP_SWEEP_EVERY_S", 0.0)  # as if its interval had passed
    assert scraped("omnimesh:shm_arena_slots_in_use") == 0
    assert scraped("omnimesh:shm_arena_reclaimed_total") == 1
    assert scraped("omnimesh:shm_arena_free_bytes") == scraped("omnimesh:shm_arena_size_bytes")
