"""StageClient / StageStream: the caller's side of the Stage RPC (used by the gateway).

Data flow: `client.open(request_id, sampling, options, transport=...)` opens one bidirectional `Process`
stream and sends `open` (with where the stage should put its output tensors); `stream.send(chunk)`
encodes and writes an input chunk (the last with final=True) and `stream.send_part(part)` relays one
part another stage produced, unchanged but for its seq (the gateway's pass-through: shm references stay
references, inline pieces stay pieces). `stream.parts()` yields the output parts as they arrive (seq
numbers checked contiguous; `received_bytes` counts what came over the wire, `tensor_bytes` what the
frames describe); iterating the stream assembles them into `StageChunk`s. Either ends with the stage's
`Done`. `client.release(request_id)` hands a given-up request's frames back to their producer. Every failure — an error inside the stream, the stage being unreachable,
a missing chunk — is raised as `StageCallError` naming the stage and carrying a gRPC status code.
`client.metrics()` fetches the stage's Prometheus text (the gateway's /metrics scrape).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omnimesh.server.grpc_server import GRPC_OPTIONS
from omnimesh.transport.chunk_codec import ChunkAssembler, ChunkEncoder
from omnimesh.transport.frames import FrameError, StageChunk, frame_layout
from omnimesh.transport.transport import Transport
from omnimesh.v1 import stage_pb2, stage_pb2_grpc


class StageCallError(Exception):
    def __init__(self, stage: str, code: grpc.StatusCode, message: str):
        super().__init__(f"{stage}: {message}")
        self.stage = stage
        self.code = code
        self.message = message


def _code(value: int) -> grpc.StatusCode:
    for code in grpc.StatusCode:
        if code.value[0] == value:
            return code
    return grpc.StatusCode.UNKNOWN


class StageStream:
    def __init__(self, stage: str, request_id: str, call: grpc.aio.StreamStreamCall, assembler: ChunkAssembler):
        self.stage = stage
        self.request_id = request_id
        self._call = call
        self._assembler = assembler
        self._send_seq = 0
        self._recv_seq = 0
        self.done: stage_pb2.Done | None = None
        self.received_bytes = 0  # serialized size of every message read from the stage
        self.tensor_bytes = 0  # bytes of the tensors those messages describe (inline or by reference)
        self.inline_bytes = 0  # tensor bytes that came inline (0 when the stage hands off by reference)

    async def send(self, chunk: StageChunk, piece_bytes: int | None = None) -> None:
        """Encode and write one input chunk (inline frames; pieces when large)."""
        encoder = ChunkEncoder("grpc", request_id=self.request_id)
        if piece_bytes is not None:
            encoder.piece_bytes = piece_bytes
        chunk.seq = self._send_seq
        for request in encoder.requests(chunk):
            await self._write(request)

    async def send_part(self, part: stage_pb2.Chunk) -> None:
        """Write one part another stage produced (renumbered to this stream's seq)."""
        await self._write(stage_pb2.StageRequest(chunk=part))

    async def _write(self, request: stage_pb2.StageRequest) -> None:
        """The last part of the final chunk half-closes the stream."""
        part = request.chunk
        part.seq = self._send_seq
        if not part.more:
            self._send_seq += 1
        try:
            await self._call.write(request)
            if part.final and not part.more:
                await self._call.done_writing()
        except grpc.aio.AioRpcError as exc:
            raise self._rpc_error(exc) from exc
        except asyncio.InvalidStateError as exc:
            if self._call.done() and await self._call.code() == grpc.StatusCode.OK:
                # the stage already answered (an in-stream error, or done) and ended the RPC: that answer, not
                # this write, is the request's outcome, and whoever reads the stream gets it
                return
            raise StageCallError(self.stage, grpc.StatusCode.ABORTED, f"stream closed while sending: {exc}") from exc

    async def cancel(self, reason: str = "") -> None:
        self._call.cancel()

    def _rpc_error(self, exc: grpc.aio.AioRpcError) -> StageCallError:
        code = exc.code()
        if code == grpc.StatusCode.UNAVAILABLE:
            msg = f"stage {self.stage} is unavailable ({exc.details()})"
        else:
            msg = f"stage {self.stage} failed the call: {exc.details()}"
        return StageCallError(self.stage, code, msg)

    async def parts(self) -> AsyncIterator[stage_pb2.Chunk]:
        """The stage's output parts as they arrive, until its `done` (an `error` is raised)."""
        while True:
            try:
                item = await self._call.read()
            except grpc.aio.AioRpcError as exc:
                raise self._rpc_error(exc) from exc
            if item is grpc.aio.EOF:
                raise StageCallError(
                    self.stage, grpc.StatusCode.DATA_LOSS, f"stage {self.stage} closed request {self.request_id} without done"
                )
            size, msg = item  # the wire size comes with the message (`_counted`): counting it copies nothing
            self.received_bytes += size
            kind = msg.WhichOneof("kind")
            if kind == "error":
                raise StageCallError(self.stage, _code(msg.error.code), msg.error.message)
            if kind == "done":
                self.done = msg.done
                return
            part = msg.chunk
            if part.seq != self._recv_seq:
                raise StageCallError(
                    self.stage,
                    grpc.StatusCode.DATA_LOSS,
                    f"stage {self.stage}: output chunk {self._recv_seq} of request {self.request_id} is missing (got {part.seq})",
                )
            if not part.more:
                self._recv_seq += 1
            for frame in part.tensors:  # from the headers: reading `data` here would copy it
                by_reference = frame.WhichOneof("payload") in ("shm", "cuda_ipc")
                if not by_reference and frame.piece_offset:
                    continue  # a later piece: its tensor was counted at its first piece
                try:
                    nbytes = frame_layout(frame, self.request_id)[2]
                except FrameError as exc:
                    raise StageCallError(self.stage, grpc.StatusCode.DATA_LOSS, str(exc)) from exc
                self.tensor_bytes += nbytes
                if not by_reference:
                    self.inline_bytes += nbytes
            yield part

    def assemble(self, part: stage_pb2.Chunk) -> StageChunk | None:
        """Add one part read from `parts()`; the whole chunk once its last part is in."""
        try:
            return self._assembler.add(part)
        except FrameError as exc:
            raise StageCallError(self.stage, grpc.StatusCode.DATA_LOSS, str(exc)) from exc

    async def __aiter__(self) -> AsyncIterator[StageChunk]:
        async for part in self.parts():
            chunk = self.assemble(part)
            if chunk is not None:
                yield chunk


PROCESS_METHOD = "/omnimesh.v1.Stage/Process"
# gRPC's default reconnect backoff grows to 120 s; a stage that comes back (restarted by `omnimesh serve`, or by
# its orchestrator) is found again within ~2 s instead
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 250), ("grpc.min_reconnect_backoff_ms", 250),
                     ("grpc.max_reconnect_backoff_ms", 2000)]


def _counted(data: bytes) -> tuple[int, stage_pb2.StageResponse]:
    return len(data), stage_pb2.StageResponse.FromString(data)


class StageClient:
    def __init__(self, stage: str, address: str, transport: Transport | None = None):
        self.stage = stage
        self.address = address
        self.transport = transport if transport is not None else Transport(f"client-{stage}", "grpc")
        self._channel = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS + RECONNECT_OPTIONS)
        self._stub = stage_pb2_grpc.StageStub(self._channel)
        self._process = self._channel.stream_stream(  # Process, with each response's wire size kept
            PROCESS_METHOD, request_serializer=stage_pb2.StageRequest.SerializeToString, response_deserializer=_counted)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def open(
        self,
        request_id: str,
        sampling: stage_pb2.SamplingParams | None = None,
        options: Mapping[str, str] | None = None,
        deadline_unix_s: float = 0.0,
        whole_input: bool = False,
        transport: str = "",
        metadata: Mapping[str, str] | None = None,
    ) -> StageStream:
        """Open a request; `transport` says where the stage puts its output tensors (grpc | shm | cuda-ipc);
        `metadata` goes with the call (the trace context: omnimesh/tracing.py)."""
        call = self._process(metadata=tuple(metadata.items())) if metadata else self._process()
        opened = stage_pb2.Open(
            request_id=request_id, sampling=sampling, options=dict(options or {}), deadline_unix_s=deadline_unix_s,
            whole_input=whole_input, transport=transport,
        )
        stream = StageStream(self.stage, request_id, call, self.transport.assembler(request_id))
        try:
            await call.write(stage_pb2.StageRequest(open=opened))
        except grpc.aio.AioRpcError as exc:
            raise stream._rpc_error(exc) from exc
        return stream

    async def info(self, timeout_s: float = 5.0) -> stage_pb2.StageInfo:
        try:
            return await self._stub.Info(stage_pb2.InfoRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise StageCallError(self.stage, exc.code(), f"stage {self.stage} at {self.address}: {exc.details()}") from exc

    async def metrics(self, timeout_s: float = 2.0) -> str:
        """The stage's metrics, Prometheus text (every series labelled with its stage)."""
        try:
            reply = await self._stub.Metrics(stage_pb2.MetricsRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise StageCallError(self.stage, exc.code(), f"stage {self.stage} at {self.address}: {exc.details()}") from exc
        return reply.text

    async def release(self, request_id: str, timeout_s: float = 2.0) -> int:
        """Tell the stage the caller gave up on `request_id`: it frees the request's unclaimed frames."""
        try:
            reply = await self._stub.Release(stage_pb2.ReleaseRequest(request_id=request_id), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise StageCallError(self.stage, exc.code(), f"stage {self.stage} at {self.address}: {exc.details()}") from exc
        return reply.released

    async def serving(self, timeout_s: float = 2.0) -> bool:
        try:
            resp = await self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    def unreachable(self) -> bool:
        """True while gRPC cannot connect to the stage (its channel is in TRANSIENT_FAILURE, between reconnect
        attempts); an idle channel starts connecting, so the next look can tell."""
        state = self._channel.get_state(try_to_connect=True)
        return state == grpc.ChannelConnectivity.TRANSIENT_FAILURE

    async def close(self) -> None:
        await self._channel.close()
