"""`omnimesh stage`'s own server (`stage_server._serve`, what the launcher and Kubernetes run) in this process:
it says it listens, serves health SERVING, and when its engine loop dies its health turns NOT_SERVING (the
launcher's and a liveness probe's cue to restart it) while the request in flight fails UNAVAILABLE; SIGTERM
stops it."""

from __future__ import annotations

import asyncio
import os
import re
import signal

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omnimesh.engine.loop import EngineLoop
from omnimesh.server import stage_server
from omnimesh.transport.frames import StageChunk
from omnimesh.transport.stage_client import StageCallError, StageClient
from omnimesh.transport.transport import Transport
from tests.server.test_stage_servicer import DoubleHandler, collect


async def _health(address: str) -> list[int]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return [(await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)).status
                for name in ("", stage_server.STAGE_SERVICE)]


async def _listening(capsys: pytest.CaptureFixture[str], task: asyncio.Task) -> str:
    for _ in range(200):
        m = re.search(r"omnimesh stage double listening on (\S+)", capsys.readouterr().out)
        if m:
            return m.group(1)
        assert not task.done(), task
        await asyncio.sleep(0.05)
    raise AssertionError("the stage never said it listens")


async def test_a_dead_engine_loop_turns_the_stage_not_serving(monkeypatch, capsys) -> None:
    def broken_plan(*_: object) -> list:
        raise RuntimeError("planner bug")

    served = asyncio.create_task(stage_server._serve(DoubleHandler(), "127.0.0.1", 0, Transport("double", "grpc"),
                                                     bulk_nice=0, yield_steps=0, log_stats=False))
    client = None
    try:
        address = await _listening(capsys, served)
        serving = health_pb2.HealthCheckResponse.SERVING
        for _ in range(100):  # SERVING once the server has started
            if await _health(address) == [serving, serving]:
                break
            await asyncio.sleep(0.05)
        assert await _health(address) == [serving, serving]
        monkeypatch.setattr(EngineLoop, "_plan", broken_plan)  # the next step the loop plans kills it
        client = StageClient("double", address)
        stream = await client.open("doomed")
        await stream.send(StageChunk(tensors={"x": torch.ones(1)}, final=True))
        with pytest.raises(StageCallError) as err:
            await asyncio.wait_for(collect(stream), 10)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE and "planner bug" in err.value.message
        down = health_pb2.HealthCheckResponse.NOT_SERVING
        for _ in range(100):
            if await _health(address) == [down, down]:
                break
            await asyncio.sleep(0.05)
        assert await _health(address) == [down, down]
    finally:
        if client is not None:
            await client.close()
        if served.done():
            served.result()
        elif signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:  # serve_forever's handler on this loop is set
            os.kill(os.getpid(), signal.SIGTERM)  # a graceful stop, as the launcher's
            await asyncio.wait_for(served, 15)
        else:  # it never got that far (the test failed): no signal that would stop pytest itself
            served.cancel()


def test_a_refusal_from_outside_omnimesh_says_where_it_was_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    """A start-up ValueError is a refusal (exit 2, no traceback). One of omnimesh's own checks names the setting
    and is passed on as it is; one a library raised (which may be a bug, not a setting) says where."""
    import transformers

    from omnimesh.config.stage_config import parse_size

    monkeypatch.setattr(stage_server, "tune_malloc", lambda: None)  # this test's process keeps its allocator
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)

    def refused(factory) -> str:  # type: ignore[no-untyped-def]
        with pytest.raises(stage_server.StageStartRefused) as e:
            stage_server.run_stage(factory, "127.0.0.1", 0)
        return str(e.value)

    own = refused(lambda: parse_size("lots", "--kv-cache-memory"))
    assert "--kv-cache-memory" in own and "raised in" not in own
    theirs = refused(lambda: transformers.AutoConfig.for_model("no-such-model-type"))
    assert re.search(r"\(raised in transformers/models/auto/configuration_auto\.py:\d+ while the stage loaded; "
                     r"--log-level DEBUG shows the traceback\)$", theirs), theirs
