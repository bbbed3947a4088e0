"""StageServicer: the thin gRPC face of a stage — one bidirectional `Process` stream per request.

Data flow: the first message must be `open` -> `StageHandler.open` builds a `StageTask` -> the engine
loop runs it; a reader coroutine decodes incoming chunks (checking that seq numbers are contiguous,
so a lost chunk is an error, never silence) and feeds them to the engine; engine events are written
back as `chunk` / `done` / `error` messages. Errors travel inside the stream, so one bad request never
touches the others. A `cancel` message, or the client cancelling the RPC, frees the request at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Protocol

import grpc

from omnimesh.engine.loop import EngineDone, EngineFailed, EngineLoop
from omnimesh.engine.task import StageRequestError, StageTask
from omnimesh.transport.frames import FrameError, StageChunk, chunk_from_proto, chunk_to_proto
from omnimesh.v1 import stage_pb2, stage_pb2_grpc

log = logging.getLogger(__name__)


class StageHandler(Protocol):
    """What a stage service provides to the generic servicer."""

    name: str

    def info(self) -> stage_pb2.StageInfo:
        """Called by the Info RPC."""
        ...

    def open(self, msg: stage_pb2.Open) -> StageTask:
        """Called once per request with its `open` message; raise ValueError for bad parameters."""
        ...


def _error(code: grpc.StatusCode, message: str) -> stage_pb2.StageResponse:
    return stage_pb2.StageResponse(error=stage_pb2.Error(code=code.value[0], message=message))


class StageServicer(stage_pb2_grpc.StageServicer):
    def __init__(self, handler: StageHandler, engine: EngineLoop):
        self.handler = handler
        self.engine = engine

    async def Info(self, request: stage_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> stage_pb2.StageInfo:
        return self.handler.info()

    async def Process(
        self, request_iterator: AsyncIterator[stage_pb2.StageRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[stage_pb2.StageResponse]:
        try:
            first = await anext(aiter(request_iterator))
        except StopAsyncIteration:
            yield _error(grpc.StatusCode.INVALID_ARGUMENT, "empty stream: the first message must be `open`")
            return
        if first.WhichOneof("kind") != "open":
            yield _error(grpc.StatusCode.INVALID_ARGUMENT, f"the first message must be `open`, got `{first.WhichOneof('kind')}`")
            return
        opened = first.open
        rid = opened.request_id
        if not rid:
            yield _error(grpc.StatusCode.INVALID_ARGUMENT, "open.request_id is empty")
            return
        try:
            task = self.handler.open(opened)
            timeout = opened.deadline_unix_s - time.time() if opened.deadline_unix_s else None
            if timeout is not None and timeout <= 0:
                raise StageRequestError(grpc.StatusCode.DEADLINE_EXCEEDED, f"request {rid} arrived past its deadline")
            queue = self.engine.submit(task, timeout_s=timeout, whole_input=opened.whole_input)
        except StageRequestError as exc:
            yield _error(exc.code, exc.message)
            return
        except ValueError as exc:
            yield _error(grpc.StatusCode.INVALID_ARGUMENT, f"{self.handler.name}: {exc}")
            return

        reader = asyncio.create_task(self._read_inputs(request_iterator, rid))
        try:
            while True:
                event = await queue.get()
                if isinstance(event, StageChunk):
                    yield stage_pb2.StageResponse(chunk=chunk_to_proto(event))
                elif isinstance(event, EngineDone):
                    usage = stage_pb2.Usage(prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens)
                    yield stage_pb2.StageResponse(done=stage_pb2.Done(finish_reason=event.finish_reason, usage=usage))
                    return
                elif isinstance(event, EngineFailed):
                    yield _error(event.code, event.message)
                    return
        finally:
            reader.cancel()
            self.engine.cancel(rid)  # no-op when already finished; frees state when the client left

    async def _read_inputs(
        self, request_iterator: AsyncIterator[stage_pb2.StageRequest], rid: str
    ) -> None:
        expected = 0
        got_final = False

        def fail(code: grpc.StatusCode, message: str) -> None:
            self.engine.fail(rid, code, message)

        try:
            async for msg in request_iterator:
                kind = msg.WhichOneof("kind")
                if kind == "cancel":
                    self.engine.cancel(rid)
                    return
                if kind != "chunk":
                    fail(grpc.StatusCode.INVALID_ARGUMENT, f"request {rid}: unexpected `{kind}` after open")
                    return
                if got_final:
                    fail(grpc.StatusCode.INVALID_ARGUMENT, f"request {rid}: chunk {msg.chunk.seq} after the final chunk")
                    return
                if msg.chunk.seq != expected:
                    fail(
                        grpc.StatusCode.DATA_LOSS,
                        f"request {rid}: input chunk {expected} is missing (got seq {msg.chunk.seq})",
                    )
                    return
                expected += 1
                got_final = msg.chunk.final
                self.engine.feed(rid, chunk_from_proto(msg.chunk, rid))
            if not got_final:
                fail(grpc.StatusCode.DATA_LOSS, f"request {rid}: the input stream ended after {expected} chunks without a final chunk")
        except FrameError as exc:
            fail(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError:
            self.engine.cancel(rid)
