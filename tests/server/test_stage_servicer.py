"""The generic stage machinery (EngineLoop + StageServicer + StageClient) through a real gRPC server on
127.0.0.1, with a small arithmetic stage: each input chunk `x` comes back as `2 * x`; option `steps`
makes a request take that many engine steps (one output chunk each)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from omnimesh.engine.loop import EngineLoop
from omnimesh.engine.task import StageRequestError, StageTask
from omnimesh.server.stage_server import STAGE_SERVICE
from omnimesh.transport.frames import StageChunk
from omnimesh.transport.stage_client import StageCallError, StageClient
from omnimesh.v1 import stage_pb2, stage_pb2_grpc
from tests.stage_harness import served_stage


class DoubleTask(StageTask):
    def __init__(self, rid: str, steps: int, fail: bool, log: list):
        super().__init__(rid)
        self.pending: list[torch.Tensor] = []
        self.steps_left = steps
        self.fail = fail
        self.saw_final = False
        self.log = log

    def feed(self, chunk: StageChunk) -> None:
        if "x" not in chunk.tensors:
            raise ValueError("chunk has no tensor 'x'")
        self.pending.append(chunk.tensors["x"])
        self.saw_final = chunk.final

    def ready(self) -> bool:
        return bool(self.pending) or (self.saw_final and self.steps_left > 0)

    def step(self) -> list[StageChunk]:
        self.log.append(self.request_id)
        if self.fail:
            raise RuntimeError("boom")
        time.sleep(0.002)
        if self.pending:
            out = [StageChunk(tensors={"y": 2 * x}) for x in self.pending]
            self.pending.clear()
        else:
            self.steps_left -= 1
            out = [StageChunk(text=f"s{self.steps_left}")]
        if self.saw_final and not self.pending and self.steps_left == 0:
            self.finished = True
        return out


class DoubleHandler:
    name = "double"

    def __init__(self):
        self.log: list[str] = []

    def info(self) -> stage_pb2.StageInfo:
        return stage_pb2.StageInfo(stage="double")

    def open(self, msg: stage_pb2.Open) -> StageTask:
        if msg.options.get("refuse") == "1":
            raise StageRequestError(grpc.StatusCode.UNAVAILABLE, "double: this stage lost a rank")
        steps = int(msg.options.get("steps", "0"))
        if steps < 0:
            raise ValueError("steps must be >= 0")
        return DoubleTask(msg.request_id, steps, msg.options.get("fail") == "1", self.log)


@pytest.fixture
async def stage():
    handler = DoubleHandler()
    engine = EngineLoop("double")
    async with served_stage(handler, engine) as served:
        await served.health.set("", health_pb2.HealthCheckResponse.SERVING)
        yield served.client, engine, handler, served.port


async def collect(stream):
    return [c async for c in stream]


async def test_chunks_roundtrip_in_order(stage):
    client, engine, _, _ = stage
    s = await client.open("r1")
    for i in range(3):
        await s.send(StageChunk(tensors={"x": torch.full((2,), float(i))}, final=i == 2))
    out = await collect(s)
    ys = [c.tensors["y"] for c in out if "y" in c.tensors]
    assert [y.tolist() for y in ys] == [[0.0, 0.0], [2.0, 2.0], [4.0, 4.0]]
    assert [c.seq for c in out] == list(range(len(out)))
    assert out[-1].final and s.done.finish_reason == "stop"
    assert engine.num_requests == 0


async def test_missing_input_chunk_is_data_loss(stage):
    client, engine, _, _ = stage
    s = await client.open("r-gap", options={"steps": "1000"})
    await s.send(StageChunk(tensors={"x": torch.ones(1)}))
    s._send_seq = 2  # skip seq 1: a lost chunk
    await s.send(StageChunk(tensors={"x": torch.ones(1)}, final=True))
    with pytest.raises(StageCallError) as err:
        await collect(s)
    assert err.value.code == grpc.StatusCode.DATA_LOSS and "chunk 1 is missing" in err.value.message
    await asyncio.sleep(0.05)
    assert engine.num_requests == 0


async def test_bad_input_and_failing_step_fail_only_their_request(stage):
    client, _, _, _ = stage
    bad = await client.open("bad")
    await bad.send(StageChunk(tensors={"z": torch.ones(1)}, final=True))
    boom = await client.open("boom", options={"fail": "1"})
    await boom.send(StageChunk(tensors={"x": torch.ones(1)}, final=True))
    good = await client.open("good")
    await good.send(StageChunk(tensors={"x": torch.ones(1)}, final=True))
    with pytest.raises(StageCallError) as e1:
        await collect(bad)
    assert e1.value.code == grpc.StatusCode.INVALID_ARGUMENT and "no tensor 'x'" in e1.value.message
    with pytest.raises(StageCallError) as e2:
        await collect(boom)
    assert e2.value.code == grpc.StatusCode.INTERNAL and "boom" in e2.value.message
    out = await collect(good)
    assert out[0].tensors["y"].tolist() == [2.0]


async def test_a_frame_larger_than_memory_is_resource_exhausted(stage):
    """A header that declares more bytes than the process can allocate fails its request with a message,
    at once (not a reader that dies and leaves the request waiting for its deadline); others go on."""
    from omnimesh.v1 import tensor_pb2

    client, engine, _, _ = stage
    s = await client.open("huge")
    frame = tensor_pb2.TensorFrame(name="x", dtype="float32", shape=[1, 10**15], data=b"\0" * 8)
    await s.send_part(stage_pb2.Chunk(final=True, tensors=[frame]))
    with pytest.raises(StageCallError) as err:
        await asyncio.wait_for(collect(s), 10)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than double can allocate" in err.value.message and "[1, 1000000000000000]" in err.value.message
    good = await client.open("after-huge")
    await good.send(StageChunk(tensors={"x": torch.ones(1)}, final=True))
    assert (await collect(good))[0].tensors["y"].tolist() == [2.0]
    assert engine.num_requests == 0


async def test_writes_after_the_answer_still_yield_the_stages_error(stage):
    """The stage answers (refuses at `open`, or fails mid-request) while the caller is still writing: the
    writes succeed and the reader gets the stage's own error, not gRPC's INTERNAL for a closed stream."""
    client, engine, _, _ = stage
    refused = await client.open("refused", options={"refuse": "1"})
    failing = await client.open("failing", options={"fail": "1"})
    await failing.send(StageChunk(tensors={"x": torch.ones(1)}))
    await asyncio.sleep(0.5)  # both answers are on the wire before the next writes
    for i in range(3):
        await refused.send(StageChunk(tensors={"x": torch.ones(1)}, final=i == 2))
        await failing.send(StageChunk(tensors={"x": torch.ones(1)}, final=i == 2))
    with pytest.raises(StageCallError) as err:
        await collect(refused)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and "lost a rank" in err.value.message
    with pytest.raises(StageCallError) as err:
        await collect(failing)
    assert err.value.code == grpc.StatusCode.INTERNAL and "boom" in err.value.message
    assert engine.num_requests == 0


async def test_requests_interleave(stage):
    client, _, handler, _ = stage
    slow = await client.open("slow", options={"steps": "50"})
    await slow.send(StageChunk(tensors={"x": torch.ones(1)}, final=True))
    fast = await client.open("fast", options={"steps": "2"})
    await fast.send(StageChunk(tensors={"x": torch.ones(1)}, final=True))
    fast_out, slow_out = await asyncio.gather(collect(fast), collect(slow))
    assert len(slow_out) == 51 and len(fast_out) == 3
    # the fast request finished while the slow one still had most of its steps to go
    last_fast = max(i for i, r in enumerate(handler.log) if r == "fast")
    assert handler.log[last_fast + 1 :].count("slow") > 30


async def test_whole_input_waits_for_final_chunk(stage):
    client, _, handler, _ = stage
    s = await client.open("whole", whole_input=True)
    await s.send(StageChunk(tensors={"x": torch.ones(1)}))
    await asyncio.sleep(0.1)
    assert "whole" not in handler.log  # nothing ran before the final chunk
    await s.send(StageChunk(tensors={"x": torch.ones(1)}, final=True))
    out = await collect(s)
    assert len([c for c in out if "y" in c.tensors]) == 2


async def test_cancel_frees_the_request(stage):
    client, engine, _, _ = stage
    s = await client.open("c", options={"steps": "100000"})
    await s.send(StageChunk(tensors={"x": torch.ones(1)}, final=True))
    await asyncio.sleep(0.05)
    assert engine.num_requests == 1
    await s.cancel()
    for _ in range(100):
        if engine.num_requests == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.num_requests == 0


async def test_first_message_must_be_open(stage):
    _, _, _, port = stage
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = stage_pb2_grpc.StageStub(ch).Process()
        await call.write(stage_pb2.StageRequest(chunk=stage_pb2.Chunk(seq=0, final=True)))
        msg = await call.read()
        assert msg.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "open" in msg.error.message


async def test_health_and_reflection(stage):
    client, _, _, port = stage
    assert await client.serving()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        call = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo()
        await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        reply = await call.read()
        names = {s.name for s in reply.list_services_response.service}
        assert STAGE_SERVICE in names and "grpc.health.v1.Health" in names
        await call.done_writing()


async def test_unreachable_stage_is_unavailable():
    client = StageClient("ghost", "127.0.0.1:1")
    with pytest.raises(StageCallError) as err:
        s = await client.open("x")
        await s.send(StageChunk(tensors={"x": torch.ones(1)}, final=True))
        await collect(s)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert not await client.serving(timeout_s=0.5)
    await client.close()


class RecordingBatcher:
    """Steps every task it is given in one call; records the batch sizes; fails 'boom' requests alone."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.inference_mode: set[bool] = set()

    def step_batch(self, tasks: list[StageTask]) -> dict:
        self.sizes.append(len(tasks))
        self.inference_mode.add(torch.is_inference_mode_enabled())
        out: dict = {}
        for task in tasks:
            try:
                out[task.request_id] = task.step()
            except RuntimeError as exc:
                out[task.request_id] = exc
        return out


async def test_a_batcher_steps_many_requests_per_call():
    handler, batcher = DoubleHandler(), RecordingBatcher()
    engine = EngineLoop("double", batcher=batcher)
    async with served_stage(handler, engine) as served:
        client = served.client
        streams = [await client.open(f"r{i}", options={"steps": "20", "fail": "1" if i == 3 else "0"}) for i in range(8)]
        for s in streams:
            await s.send(StageChunk(tensors={"x": torch.ones(1)}, final=True))
        results = await asyncio.gather(*(collect(s) for s in streams), return_exceptions=True)
        assert isinstance(results[3], StageCallError) and results[3].code == grpc.StatusCode.INTERNAL
        assert all(len(r) == 21 for i, r in enumerate(results) if i != 3)
        assert max(batcher.sizes) >= 4, batcher.sizes  # requests shared steps
        assert sum(batcher.sizes) < 8 * 21  # ... so there were fewer calls than request-steps
        assert batcher.inference_mode == {True}  # steps skip autograd bookkeeping
        assert engine.num_requests == 0


class BurstTask(StageTask):
    """One step emits five chunks at once (what a stage's queue holds when its writer fell behind)."""

    def feed(self, chunk: StageChunk) -> None:
        self.fed = True

    def ready(self) -> bool:
        return getattr(self, "fed", False) and not self.finished

    def step(self) -> list[StageChunk]:
        self.finished = True
        return [StageChunk(tensors={"y": torch.tensor([float(i)])}, text="abcde"[i], final=i == 4) for i in range(5)]


class BurstHandler:
    name = "burst"

    def __init__(self, merging: bool) -> None:
        if merging:
            self.merge_outputs = lambda chunks: StageChunk(
                tensors={"y": torch.cat([c.tensors["y"] for c in chunks])}, text="".join(c.text for c in chunks),
                final=chunks[-1].final)

    def info(self) -> stage_pb2.StageInfo:
        return stage_pb2.StageInfo(stage="burst")

    def open(self, msg: stage_pb2.Open) -> StageTask:
        return BurstTask(msg.request_id)


@pytest.mark.parametrize("merging", [True, False])
async def test_queued_chunks_leave_as_one_when_the_handler_merges(merging: bool) -> None:
    async with served_stage(BurstHandler(merging), EngineLoop("burst")) as served:
        s = await served.client.open("r1")
        await s.send(StageChunk(tensors={"x": torch.ones(1)}, final=True))
        out = await collect(s)  # the client checks that seq numbers are contiguous
        assert "".join(c.text for c in out) == "abcde"
        assert torch.cat([c.tensors["y"] for c in out]).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
        assert len(out) == (1 if merging else 5) and out[-1].final
        assert s.done is not None and s.done.finish_reason == "stop"


@pytest.mark.parametrize("deadline", [float("nan"), float("inf"), float("-inf")])
async def test_a_deadline_no_timer_can_take_is_refused_and_the_stage_serves_on(stage, deadline: float):
    """A NaN deadline reached the engine loop's timer and stopped the loop for good (every later request of the
    stage hung while its health said SERVING): found by fuzzing a stage's own gRPC API."""
    client, engine, _, _ = stage
    s = await client.open("bad-deadline", deadline_unix_s=deadline)
    await s.send(StageChunk(tensors={"x": torch.ones(1)}, final=True))
    with pytest.raises(StageCallError) as err:
        await asyncio.wait_for(collect(s), 10)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "deadline_unix_s" in err.value.message
    for rid, far in (("after", 0.0), ("far-off", 1e300), ("years-off", time.time() + 1e9)):  # far ones are capped
        good = await client.open(rid, deadline_unix_s=far)
        await good.send(StageChunk(tensors={"x": torch.ones(1)}, final=True))
        assert (await asyncio.wait_for(collect(good), 10))[0].tensors["y"].tolist() == [2.0]
    assert engine.num_requests == 0


class _RaisingTask(DoubleTask):
    def ready(self) -> bool:
        raise RuntimeError("ready broke")


async def test_a_task_that_raises_outside_its_step_fails_alone():
    """A bug in a task's `feed` or `ready` (the engine calls them between steps) fails that request with
    INTERNAL; before, it ended the engine loop, and the stage answered nothing more."""
    handler = DoubleHandler()
    opened = handler.open
    handler.open = lambda msg: (_RaisingTask(msg.request_id, 0, False, handler.log)  # type: ignore[method-assign]
                                if msg.options.get("raise") == "1" else opened(msg))
    engine = EngineLoop("double")
    async with served_stage(handler, engine) as served:
        bad = await served.client.open("raises", options={"raise": "1"})
        await bad.send(StageChunk(tensors={"x": torch.ones(1)}, final=True))
        with pytest.raises(StageCallError) as err:
            await asyncio.wait_for(collect(bad), 10)
        assert err.value.code == grpc.StatusCode.INTERNAL and "ready broke" in err.value.message
        good = await served.client.open("good")
        await good.send(StageChunk(tensors={"x": torch.ones(1)}, final=True))
        assert (await asyncio.wait_for(collect(good), 10))[0].tensors["y"].tolist() == [2.0]


async def test_an_engine_loop_that_dies_fails_its_requests_refuses_more_and_says_so(monkeypatch):
    """Should a bug end the loop anyway, nothing hangs: its requests fail, new ones are refused (UNAVAILABLE),
    and `on_crash` hears why (the stage server turns its health NOT_SERVING, so the stage is restarted)."""
    handler = DoubleHandler()
    engine = EngineLoop("double")
    crashed: list[str] = []
    engine.on_crash = crashed.append
    async with served_stage(handler, engine) as served:
        waiting = await served.client.open("waiting", whole_input=True)  # held: it never steps
        await waiting.send(StageChunk(tensors={"x": torch.ones(1)}))
        await asyncio.sleep(0.1)

        def broken_plan(*_: object) -> list:
            raise RuntimeError("planner bug")

        monkeypatch.setattr(engine, "_plan", broken_plan)
        ready = await served.client.open("ready")
        await ready.send(StageChunk(tensors={"x": torch.ones(1)}, final=True))
        for stream in (waiting, ready):
            with pytest.raises(StageCallError) as err:
                await asyncio.wait_for(collect(stream), 10)
            assert err.value.code == grpc.StatusCode.UNAVAILABLE and "engine stopped" in err.value.message
            assert "planner bug" in err.value.message
        assert crashed == ["its engine loop stopped (RuntimeError: planner bug)"]
        later = await served.client.open("later")
        await later.send(StageChunk(tensors={"x": torch.ones(1)}, final=True))
        with pytest.raises(StageCallError) as err:
            await asyncio.wait_for(collect(later), 10)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE and "must be restarted" in err.value.message


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
async def test_a_non_finite_input_tensor_is_refused(stage, bad: float):
    """A NaN reaching a model spreads through the batch's arithmetic and the KV blocks it writes: a caller's
    non-finite floating-point tensor is INVALID_ARGUMENT, naming it; the stage serves on."""
    client, engine, _, _ = stage
    s = await client.open("nan-in")
    await s.send(StageChunk(tensors={"x": torch.tensor([1.0, bad])}, final=True))
    with pytest.raises(StageCallError) as err:
        await asyncio.wait_for(collect(s), 10)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "input tensor 'x' has NaN or infinite values" in err.value.message
    good = await client.open("finite")
    await good.send(StageChunk(tensors={"x": torch.ones(1)}, final=True))
    assert (await asyncio.wait_for(collect(good), 10))[0].tensors["y"].tolist() == [2.0]
    assert engine.num_requests == 0


async def test_a_caller_that_cancels_mid_input_counts_as_a_cancel_not_lost_data(stage, monkeypatch):
    """A client that goes away mid-answer makes the gateway cancel the talker's and the vocoder's calls while
    their input still streams; the stage saw the input end without its final chunk and failed the request as
    DATA_LOSS, so `request_failure_total{code="DATA_LOSS"}` rose with every disconnect (found under random
    disconnects on a real mesh). A cancelled call is a cancel."""
    client, engine, _, _ = stage
    failed: list[grpc.StatusCode] = []
    fail = engine.fail
    monkeypatch.setattr(engine, "fail", lambda rid, code, message: (failed.append(code), fail(rid, code, message)))
    for i in range(10):
        s = await client.open(f"mid-{i}", options={"steps": "100000"})
        await s.send(StageChunk(tensors={"x": torch.ones(1)}))  # more input would follow
        await asyncio.sleep(0.02)
        await s.cancel()
    deadline = time.monotonic() + 10
    while engine.num_requests and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert engine.num_requests == 0 and failed == []


async def test_input_that_ends_without_its_final_chunk_is_data_loss(stage):
    """A caller that half-closes before its final chunk (not a cancel) lost input: DATA_LOSS, within the moment
    the stage waits to tell it from a cancel."""
    client, engine, _, _ = stage
    s = await client.open("no-final", options={"steps": "100000"})
    await s.send(StageChunk(tensors={"x": torch.ones(1)}))
    await s._call.done_writing()
    with pytest.raises(StageCallError) as err:
        await asyncio.wait_for(collect(s), 10)
    assert err.value.code == grpc.StatusCode.DATA_LOSS and "without a final chunk" in err.value.message
    assert engine.num_requests == 0


@pytest.mark.parametrize("timeout_s", [float("nan"), float("inf")])
async def test_the_engine_itself_refuses_a_timeout_its_timer_cannot_take(timeout_s: float):
    """Below the servicer's check of `deadline_unix_s`: the engine keeps its loop alive on its own, for any caller."""
    engine = EngineLoop("double")
    engine.start()
    try:
        with pytest.raises(StageRequestError, match="timeout must be finite") as err:
            engine.submit(DoubleTask("t", 0, False, []), timeout_s=timeout_s)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and engine.num_requests == 0
    finally:
        await engine.stop()


async def test_a_message_protobuf_cannot_parse_is_invalid_argument(stage):
    """Corrupt bytes as the first message, later in a stream, or as a unary request: INVALID_ARGUMENT naming the
    type (grpcio's own answer was UNKNOWN "Unexpected DecodeError", and mid-stream the stage said INTERNAL)."""
    client, engine, _, port = stage
    corrupt = b"\x0a\xff\xff"  # field 1 declares far more bytes than follow
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        process = channel.stream_stream("/omnimesh.v1.Stage/Process", request_serializer=None,
                                        response_deserializer=stage_pb2.StageResponse.FromString)
        opened = stage_pb2.StageRequest(open=stage_pb2.Open(request_id="corrupt-later")).SerializeToString()
        for rid, messages in [("", [corrupt]), ("corrupt-later", [opened, corrupt])]:
            answers = [r async for r in process(iter(messages), timeout=10)]
            assert [a.WhichOneof("kind") for a in answers] == ["error"], answers
            assert answers[0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert "not a valid omnimesh.v1.StageRequest" in answers[0].error.message
            assert answers[0].error.message.startswith("request corrupt-later: ") == bool(rid)
        info = channel.unary_unary("/omnimesh.v1.Stage/Info", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await info(corrupt, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid omnimesh.v1.InfoRequest" in (err.value.details() or "")
    good = await client.open("after")
    await good.send(StageChunk(tensors={"x": torch.ones(1)}, final=True))
    assert (await asyncio.wait_for(collect(good), 10))[0].tensors["y"].tolist() == [2.0]
    assert engine.num_requests == 0
