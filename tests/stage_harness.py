"""One in-process stage behind a real gRPC server on loopback, for the tests that drive a handler and its
engine through `StageClient` (what the gateway and the next stage use).

`async with served_stage(handler, engine) as stage:` starts the engine, serves `StageServicer(handler,
engine, ...)` on a free 127.0.0.1 port and yields `stage.client` (a `StageClient`), `stage.engine`, `stage.port`
and `stage.health` (the server's health servicer); on the way out it closes the client, stops the server and
the engine, whatever the test did.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from omnimesh.engine.loop import EngineLoop
from omnimesh.server.grpc_server import make_server
from omnimesh.server.grpc_decode import add_service
from omnimesh.server.stage_server import STAGE_DESCRIPTOR, STAGE_SERVICE
from omnimesh.server.stage_servicer import StageHandler, StageServicer
from omnimesh.transport.stage_client import StageClient


@dataclass
class ServedStage:
    client: StageClient
    engine: EngineLoop
    port: int
    health: Any


@asynccontextmanager
async def served_stage(handler: StageHandler, engine: EngineLoop, **servicer: Any) -> AsyncIterator[ServedStage]:
    """`servicer`: StageServicer's other arguments (metrics, transport)."""
    engine.start()
    server, health = make_server([STAGE_SERVICE])
    add_service(server, StageServicer(handler, engine, **servicer), STAGE_DESCRIPTOR)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = StageClient(handler.name, f"127.0.0.1:{port}")
    try:
        yield ServedStage(client, engine, port, health)
    finally:
        await client.close()
        await server.stop(0)
        await engine.stop()
