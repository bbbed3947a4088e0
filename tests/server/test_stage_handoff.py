"""A stage handing its outputs off through shared memory, through a real gRPC server on 127.0.0.1 (the
arithmetic stage of test_stage_servicer: each input `x` comes back as `y = 2 * x`):
- `open.transport = shm`: outputs travel as arena references (no tensor byte inline), equal, and their slots
  come back when the caller drops the tensors;
- frames the caller read but never claimed come back with the `Release` RPC;
- a stream the caller cancels takes back its own unclaimed frames;
- an unknown transport is INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
import gc

import grpc
import pytest
import torch
from test_stage_servicer import DoubleHandler

from omnimesh.engine.loop import EngineLoop
from omnimesh.transport.frames import StageChunk
from omnimesh.transport.stage_client import StageCallError
from omnimesh.transport.transport import Transport
from tests.stage_harness import served_stage


@pytest.fixture
async def shm_stage():
    transport = Transport("txtest-double", "auto", 4 * 2**20)
    assert transport.arena is not None
    async with served_stage(DoubleHandler(), EngineLoop("double"), transport=transport) as served:
        yield served.client, transport.arena
    transport.close()


async def _until(check, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_outputs_travel_as_references_and_come_back_when_dropped(shm_stage):
    client, arena = shm_stage
    start = arena.free_bytes()
    info = await client.info()
    assert info.transport == "auto" and info.host_id == client.transport.host_id
    x = torch.arange(1000, dtype=torch.float32)
    s = await client.open("r1", transport="shm")
    await s.send(StageChunk(tensors={"x": x}, final=True))
    chunks = [c async for c in s]
    torch.testing.assert_close(chunks[0].tensors["y"], 2 * x, rtol=0, atol=0)
    assert (s.tensor_bytes, s.inline_bytes) == (4000, 0) and s.received_bytes < 400
    assert arena.live_slots == 1  # the caller's tensor maps the slot
    del chunks
    gc.collect()
    assert arena.free_bytes() == start and arena.live_slots == 0


async def test_release_takes_back_frames_the_caller_never_claimed(shm_stage):
    client, arena = shm_stage
    start = arena.free_bytes()
    s = await client.open("r2", transport="shm")
    for i in range(3):
        await s.send(StageChunk(tensors={"x": torch.full((64,), float(i))}, final=i == 2))
    parts = [p async for p in s.parts()]  # read, never assembled: as a gateway whose next stage failed
    assert sum(len(p.tensors) for p in parts) == 3 and s.done is not None
    assert arena.live_slots == 3  # a normal end: the frames may still be on their way to a consumer
    assert await client.release("r2") == 3
    assert arena.free_bytes() == start
    assert await client.release("r2") == 0  # idempotent


async def test_a_cancelled_stream_takes_back_its_unclaimed_frames(shm_stage):
    client, arena = shm_stage
    start = arena.free_bytes()
    s = await client.open("r3", transport="shm")
    await s.send(StageChunk(tensors={"x": torch.ones(256)}))  # not final: the request stays open
    await _until(lambda: arena.live_slots == 1)
    await s.cancel()
    await _until(lambda: arena.live_slots == 0)
    assert arena.free_bytes() == start


async def test_an_unknown_transport_is_invalid_argument(shm_stage):
    client, _ = shm_stage
    s = await client.open("r4", transport="carrier-pigeon")
    await s.send(StageChunk(tensors={"x": torch.ones(2)}, final=True))
    with pytest.raises(StageCallError) as err:
        [c async for c in s]
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "open.transport" in err.value.message


async def test_a_frame_whose_slot_was_taken_back_by_a_cancel_is_a_cancel(shm_stage):
    """A client that goes away: the gateway cancels the thinker's call (which takes back its unclaimed slots) and
    the talker's, while a thinker part it already relayed is on its way to the talker. The talker, reading it,
    found the slot gone and failed the request as INVALID_ARGUMENT (`request_failure_total` rose under random
    disconnects on a real mesh). Its own call turning cancelled makes it a cancel; without the cancel the stale
    reference is still the caller's error."""
    producer, arena = shm_stage
    failed: list[grpc.StatusCode] = []
    consumer_engine = EngineLoop("double")
    fail = consumer_engine.fail
    consumer_engine.fail = lambda rid, code, message: (failed.append(code), fail(rid, code, message))  # type: ignore
    async with served_stage(DoubleHandler(), consumer_engine,
                            transport=Transport("txtest-consumer", "grpc")) as consumer:
        for cancelled in (True, False):
            s = await producer.open(f"p-{cancelled}", transport="shm")
            await s.send(StageChunk(tensors={"x": torch.ones(256)}))  # not final: the request stays open
            part = await anext(aiter(s.parts()))
            assert part.tensors[0].WhichOneof("payload") == "shm"
            await s.cancel()  # the producer takes the unclaimed slot back
            await _until(lambda: arena.live_slots == 0)
            relayed = await consumer.client.open(f"c-{cancelled}")
            await relayed.send_part(part)
            if cancelled:
                await asyncio.sleep(0.1)  # it reads the part first; the cancel comes a moment later
                await relayed.cancel()
                await _until(lambda: consumer_engine.num_requests == 0)
                assert failed == []
            else:
                with pytest.raises(StageCallError) as err:
                    [c async for c in relayed]
                assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
                assert "no longer holds this tensor" in err.value.message
                assert failed == [grpc.StatusCode.INVALID_ARGUMENT]
