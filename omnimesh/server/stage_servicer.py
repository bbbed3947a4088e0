"""StageServicer: the thin gRPC face of a stage — one bidirectional `Process` stream per request.

Data flow: the first message must be `open` -> `StageHandler.open` builds a `StageTask` -> the engine
loop runs it; a reader coroutine assembles incoming chunk parts (`ChunkAssembler`: inline pieces, shm
slots mapped without copying; seq numbers must be contiguous, so a lost chunk is an error, never
silence; a floating-point tensor with a NaN or an infinity is refused, as it would spread through the model
and the KV blocks it writes) and feeds them to the engine; engine events are written back as `chunk` parts
(through the request's `ChunkEncoder`: tensors inline or in this stage's shm arena, per `open.transport`), then
`done` / `error`; chunks that queued up while the writer was busy leave as one when the handler can merge
them (`merge_outputs`). Errors travel inside the stream, so one bad request never touches the others; a
message protobuf cannot parse (`Undecodable`) is INVALID_ARGUMENT. A `cancel` message, or the client
cancelling the RPC, frees the request at once.
After its answer (done or error) a stream stays open, dropping input, until the caller half-closes or
cancels: a caller still writing (the gateway relaying the thinker into a talker that already failed)
then reads the stage's own answer instead of a transport error.
The call's `traceparent` metadata (the gateway's span, omnimesh/tracing.py) is the parent of the request's
span in this stage, which the engine writes when the request ends.
`Metrics` answers the engine's Prometheus text (`EngineMetrics.render`), scraped by the gateway.
`Release` takes back the shared-memory frames of a request its caller gave up on, and a stream the
caller cancels does the same for its own unclaimed frames (see `SlotOwner`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator
from typing import Protocol

import grpc
import torch

from omnimesh import tracing
from omnimesh.engine.loop import EngineDone, EngineEvent, EngineFailed, EngineLoop
from omnimesh.engine.metrics import EngineMetrics
from omnimesh.engine.task import StageRequestError, StageTask
from omnimesh.queue_runs import take_run
from omnimesh.server.grpc_decode import Undecodable
from omnimesh.transport.chunk_codec import TRANSPORTS, ChunkAssembler
from omnimesh.transport.frames import FrameError, StageChunk, StaleFrame
from omnimesh.transport.transport import Transport
from omnimesh.v1 import stage_pb2, stage_pb2_grpc

log = logging.getLogger(__name__)

MAX_DEADLINE_S = 30 * 86400.0  # a deadline further off than this counts as this far
CANCEL_MARK_S = 0.5  # how long an input that ended without its final chunk waits to learn the call was cancelled
SETTLE_CAP_S = 600.0  # the longest a finished request's stream waits for its caller to half-close


class StageHandler(Protocol):
    """What a stage service provides to the generic servicer."""

    name: str

    def info(self) -> stage_pb2.StageInfo:
        """Called by the Info RPC."""
        ...

    def open(self, msg: stage_pb2.Open) -> StageTask:
        """Called once per request with its `open` message; raise ValueError for bad parameters."""
        ...

    # Optional: `merge_outputs(chunks: list[StageChunk]) -> StageChunk`, one chunk equivalent to several
    # consecutive ones of a request. With it, chunks that queued up while the writer was busy (the reader
    # is slower than the engine) leave as ONE message: no delay when the writer keeps up, fewer messages
    # when it does not (what vLLM's output collector does with deltas).


def _error(code: grpc.StatusCode, message: str) -> stage_pb2.StageResponse:
    return stage_pb2.StageResponse(error=stage_pb2.Error(code=code.value[0], message=message))


class StageServicer(stage_pb2_grpc.StageServicer):
    def __init__(self, handler: StageHandler, engine: EngineLoop, metrics: EngineMetrics | None = None,
                 transport: Transport | None = None):
        self.handler = handler
        self.engine = engine
        self.metrics = metrics  # the same object the engine records into; None = no series
        self.transport = transport if transport is not None else Transport(handler.name, "grpc")

    async def Info(self, request: stage_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> stage_pb2.StageInfo:
        info = self.handler.info()
        info.host_id = self.transport.host_id
        info.transport = self.transport.effective
        return info

    async def Release(self, request: stage_pb2.ReleaseRequest, context: grpc.aio.ServicerContext) -> stage_pb2.ReleaseReply:
        return stage_pb2.ReleaseReply(released=self.transport.release(request.request_id))

    async def Metrics(self, request: stage_pb2.MetricsRequest, context: grpc.aio.ServicerContext) -> stage_pb2.MetricsReply:
        return stage_pb2.MetricsReply(text=self.metrics.render() if self.metrics is not None else "")

    async def Process(
        self, request_iterator: AsyncIterator[stage_pb2.StageRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[stage_pb2.StageResponse]:
        try:
            first = await anext(aiter(request_iterator))
        except StopAsyncIteration:
            yield _error(grpc.StatusCode.INVALID_ARGUMENT, "empty stream: the first message must be `open`")
            return
        if isinstance(first, Undecodable):
            yield _error(grpc.StatusCode.INVALID_ARGUMENT, first.message)
            return
        if first.WhichOneof("kind") != "open":
            yield _error(grpc.StatusCode.INVALID_ARGUMENT, f"the first message must be `open`, got `{first.WhichOneof('kind')}`")
            return
        opened = first.open
        rid = opened.request_id
        if not rid:
            yield _error(grpc.StatusCode.INVALID_ARGUMENT, "open.request_id is empty")
            return
        deadline = opened.deadline_unix_s
        if not math.isfinite(deadline):  # NaN or infinity: no timer can take it
            yield _error(grpc.StatusCode.INVALID_ARGUMENT,
                         f"open.deadline_unix_s must be a Unix time in seconds (0: none), got {deadline}")
            return
        # one far in the future waits as long as MAX_DEADLINE_S does (a finite time for every timer and sweep)
        deadline = min(deadline, time.time() + MAX_DEADLINE_S) if deadline else 0.0
        timeout = deadline - time.time() if deadline else None
        try:
            if opened.transport and opened.transport not in TRANSPORTS:
                raise ValueError(f"open.transport must be one of {', '.join(TRANSPORTS)}, got {opened.transport!r}")
            encoder = self.transport.encoder(opened.transport, rid, deadline)
            if timeout is not None and timeout <= 0:  # before `open`, which may count it in the engine: only a
                # submitted task is ever closed, and closing is what gives that count back
                raise StageRequestError(grpc.StatusCode.DEADLINE_EXCEEDED, f"request {rid} arrived past its deadline")
            task = self.handler.open(opened)
            queue = self.engine.submit(task, timeout_s=timeout, whole_input=opened.whole_input,
                                       trace=_trace_parent(context))
        except (StageRequestError, ValueError) as exc:
            if isinstance(exc, StageRequestError):
                yield _error(exc.code, exc.message)
            else:
                yield _error(grpc.StatusCode.INVALID_ARGUMENT, f"{self.handler.name}: {exc}")
            await _settle(asyncio.ensure_future(_drain(request_iterator)), timeout)
            return

        reader = asyncio.create_task(self._read_inputs(request_iterator, rid, context))
        cancelled = True  # until the stream ends the normal way: a caller that cancels gave up on our frames
        merge = getattr(self.handler, "merge_outputs", None)
        held: EngineEvent | None = None  # taken off the queue while merging, handled next
        sent = 0  # output chunks are numbered here, as they leave (after any merging)
        try:
            while True:
                event = held if held is not None else await queue.get()
                held = None
                if isinstance(event, StageChunk):
                    if merge is not None and not queue.empty():
                        run, rest = take_run(event, queue, lambda _, nxt: isinstance(nxt, StageChunk))
                        event, held = merge(run), (rest[0] if rest else None)
                    event.seq, sent = sent, sent + 1
                    try:
                        responses = encoder.responses(event)
                    except FrameError as exc:
                        self.engine.cancel(rid)
                        yield _error(grpc.StatusCode.INTERNAL, f"{self.handler.name}: output of request {rid}: {exc}")
                        break
                    for response in responses:
                        yield response
                elif isinstance(event, EngineDone):
                    usage = stage_pb2.Usage(prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens,
                                            cached_tokens=event.cached_tokens)
                    done = stage_pb2.Done(finish_reason=event.finish_reason, usage=usage)
                    if isinstance(event.stop_reason, str):
                        done.stop_string = event.stop_reason
                    elif event.stop_reason is not None:
                        done.stop_token_id = event.stop_reason
                    yield stage_pb2.StageResponse(done=done)
                    break
                elif isinstance(event, EngineFailed):
                    yield _error(event.code, event.message)
                    break
            await _settle(reader, timeout)
            cancelled = False
        finally:
            reader.cancel()
            self.engine.cancel(rid)  # no-op when already finished; frees state when the client left
            self.transport.end_request(rid, cancelled)

    async def _read_inputs(
        self, request_iterator: AsyncIterator[stage_pb2.StageRequest], rid: str, context: grpc.aio.ServicerContext
    ) -> None:
        """Check and feed input chunks until the caller half-closes. After a fault (or a cancel) it keeps
        reading and drops what comes: the caller may still be writing, and its writes must not hit a closed
        stream (gRPC would then turn the call's status into INTERNAL and hide the stage's real answer)."""
        expected = 0
        got_final = False
        dropping = False
        assembler: ChunkAssembler = self.transport.assembler(rid)

        def fail(code: grpc.StatusCode, message: str) -> None:
            nonlocal dropping
            dropping = True
            self.engine.fail(rid, code, message)

        try:
            async for msg in request_iterator:
                if isinstance(msg, Undecodable):  # what it carried cannot be known: the request cannot go on
                    if not dropping:
                        fail(grpc.StatusCode.INVALID_ARGUMENT, f"request {rid}: {msg.message}")
                    continue
                kind = msg.WhichOneof("kind")
                if dropping:
                    if kind == "chunk":
                        assembler.discard(msg.chunk)  # frees its shared-memory slots at once
                    continue
                if kind == "cancel":
                    self.engine.cancel(rid)
                    dropping = True
                elif kind != "chunk":
                    fail(grpc.StatusCode.INVALID_ARGUMENT, f"request {rid}: unexpected `{kind}` after open")
                elif got_final:
                    fail(grpc.StatusCode.INVALID_ARGUMENT, f"request {rid}: chunk {msg.chunk.seq} after the final chunk")
                elif msg.chunk.seq != expected:
                    fail(
                        grpc.StatusCode.DATA_LOSS,
                        f"request {rid}: input chunk {expected} is missing (got seq {msg.chunk.seq})",
                    )
                else:
                    try:
                        chunk = assembler.add(msg.chunk)
                    except StaleFrame as exc:  # its producer took the slot back: because the caller cancels?
                        if await _cancelled_soon(context):  # then it cancelled this call too: no one's mistake
                            self.engine.cancel(rid)
                            dropping = True
                        else:
                            fail(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                        continue
                    except FrameError as exc:
                        fail(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                        continue
                    except MemoryError:
                        sizes = ", ".join(f"{f.name!r} {list(f.shape)} {f.dtype}" for f in msg.chunk.tensors)
                        fail(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"request {rid}: input chunk {msg.chunk.seq} declares tensors larger than "
                             f"{self.handler.name} can allocate ({sizes})")
                        continue
                    if chunk is None:
                        continue  # more parts of this chunk follow
                    bad = _non_finite(chunk)
                    if bad is not None:  # a NaN would spread through the model (and the KV blocks it writes)
                        fail(grpc.StatusCode.INVALID_ARGUMENT,
                             f"request {rid}: input tensor {bad!r} has NaN or infinite values")
                        continue
                    expected += 1
                    got_final = chunk.final
                    self.engine.feed(rid, chunk)
            if not got_final and not dropping and await _cancelled_soon(context):  # the caller gave up: no data lost
                self.engine.cancel(rid)
            elif not got_final and not dropping:
                fail(grpc.StatusCode.DATA_LOSS, f"request {rid}: the input stream ended after {expected} chunks without a final chunk")
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError:
            self.engine.cancel(rid)
        except Exception as exc:  # a reader that dies silently would leave the request waiting for its deadline
            log.exception("%s: reading the input of request %s failed", self.handler.name, rid)
            self.engine.fail(rid, grpc.StatusCode.INTERNAL, f"{self.handler.name}: reading input failed: {exc!r}")


async def _cancelled_soon(context: grpc.aio.ServicerContext) -> bool:
    """Was the call cancelled? A caller's cancel can end its input stream a moment before gRPC marks the call
    cancelled: wait up to CANCEL_MARK_S for the mark (only an input that ended without its final chunk, or a
    frame whose slot its producer took back, waits)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + CANCEL_MARK_S
    while not context.cancelled():
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(0.01)
    return True


def _non_finite(chunk: StageChunk) -> str | None:
    """The name of a floating-point input tensor holding a NaN or an infinity (one pass over it), else None."""
    for name, tensor in chunk.tensors.items():
        if tensor.dtype.is_floating_point and tensor.numel() and not bool(torch.isfinite(tensor).all()):
            return name
    return None


def _trace_parent(context: grpc.aio.ServicerContext) -> object:
    """The caller's trace context from the call's metadata (None when tracing is off or none came)."""
    if not tracing.enabled():
        return None
    return tracing.extract([(m[0], m[1]) for m in context.invocation_metadata() or ()
                            if isinstance(m[1], str)])


async def _drain(request_iterator: AsyncIterator[stage_pb2.StageRequest]) -> None:
    """Read and drop the caller's remaining messages (see `_read_inputs`)."""
    try:
        async for _ in request_iterator:
            pass
    except grpc.aio.AioRpcError:
        pass


async def _settle(reader: asyncio.Future, timeout_s: float | None) -> None:
    """After the answer is written, keep the stream open until the caller half-closes (or cancels, as the
    gateway does on an error), bounded by the request's deadline or `SETTLE_CAP_S`."""
    limit = SETTLE_CAP_S if timeout_s is None else max(0.0, min(timeout_s, SETTLE_CAP_S))
    done, _ = await asyncio.wait({reader}, timeout=limit)
    if not done:
        reader.cancel()
