"""StageClient / StageStream: the caller's side of the Stage RPC (used by the gateway).

Data flow: `client.open(request_id, sampling, options)` opens one bidirectional `Process` stream and
sends `open`; `stream.send(chunk)` numbers and writes input chunks (the last with final=True);
iterating the stream yields output `StageChunk`s, checks that their seq numbers are contiguous, and
ends with the stage's `Done`. Every failure — an error inside the stream, the stage being unreachable,
a missing chunk — is raised as `StageCallError` naming the stage and carrying a gRPC status code.
`client.metrics()` fetches the stage's Prometheus text (the gateway's /metrics scrape).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omnimesh.server.grpc_server import GRPC_OPTIONS
from omnimesh.transport.frames import FrameError, StageChunk, chunk_from_proto, chunk_to_proto
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
    def __init__(self, stage: str, request_id: str, call: grpc.aio.StreamStreamCall):
        self.stage = stage
        self.request_id = request_id
        self._call = call
        self._send_seq = 0
        self._recv_seq = 0
        self.done: stage_pb2.Done | None = None

    async def send(self, chunk: StageChunk) -> None:
        chunk.seq = self._send_seq
        self._send_seq += 1
        try:
            await self._call.write(stage_pb2.StageRequest(chunk=chunk_to_proto(chunk)))
            if chunk.final:
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

    async def __aiter__(self) -> AsyncIterator[StageChunk]:
        while True:
            try:
                msg = await self._call.read()
            except grpc.aio.AioRpcError as exc:
                raise self._rpc_error(exc) from exc
            if msg is grpc.aio.EOF:
                raise StageCallError(
                    self.stage, grpc.StatusCode.DATA_LOSS, f"stage {self.stage} closed request {self.request_id} without done"
                )
            kind = msg.WhichOneof("kind")
            if kind == "error":
                raise StageCallError(self.stage, _code(msg.error.code), msg.error.message)
            if kind == "done":
                self.done = msg.done
                return
            if msg.chunk.seq != self._recv_seq:
                raise StageCallError(
                    self.stage,
                    grpc.StatusCode.DATA_LOSS,
                    f"stage {self.stage}: output chunk {self._recv_seq} of request {self.request_id} is missing (got {msg.chunk.seq})",
                )
            self._recv_seq += 1
            try:
                yield chunk_from_proto(msg.chunk, self.request_id)
            except FrameError as exc:
                raise StageCallError(self.stage, grpc.StatusCode.DATA_LOSS, str(exc)) from exc


class StageClient:
    def __init__(self, stage: str, address: str):
        self.stage = stage
        self.address = address
        self._channel = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
        self._stub = stage_pb2_grpc.StageStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def open(
        self,
        request_id: str,
        sampling: stage_pb2.SamplingParams | None = None,
        options: Mapping[str, str] | None = None,
        deadline_unix_s: float = 0.0,
        whole_input: bool = False,
    ) -> StageStream:
        call = self._stub.Process()
        opened = stage_pb2.Open(
            request_id=request_id, sampling=sampling, options=dict(options or {}), deadline_unix_s=deadline_unix_s,
            whole_input=whole_input,
        )
        stream = StageStream(self.stage, request_id, call)
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

    async def serving(self, timeout_s: float = 2.0) -> bool:
        try:
            resp = await self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        await self._channel.close()
