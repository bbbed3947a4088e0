"""StageChunk <-> wire parts: where each tensor's bytes travel, and putting chunks back together.

Role: `ChunkEncoder` turns one StageChunk into one or more `Chunk` parts (all but the last with
more=True) for a request's chosen transport:
    grpc      inline bytes; a tensor larger than `piece_bytes` is split into pieces, one per part;
    shm       CPU tensors copied once into the producer's arena, the frame carries the ShmRef (CUDA tensors
              are copied to the host first); a full arena sends that tensor inline, and so does a CPU
              tensor under `min_ref_bytes` (--shm-min-tensor-size: a slot's locks cost more than its bytes);
    cuda-ipc  CUDA tensors as IPC handles (no copy at all, whatever their size), CPU tensors as with shm.
`ChunkAssembler` is the consumer's half: it collects a chunk's parts (reassembling pieces in order, mapping
shm slots without copying, opening IPC handles) and returns the StageChunk when the last part is in.
Every frame is checked (dtype, shape, byte count, piece order) and a mismatch is a FrameError naming the
tensor and the request; a refused part gives back the references it carried that were not yet claimed.
`discard` releases the references of parts a consumer drops unread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

from omnimesh.transport.frames import FrameError, StageChunk, StaleFrame, dtype_name, frame_layout, frame_where
from omnimesh.transport.shm_region import RegionError, RegionReader, StaleSlot
from omnimesh.v1 import stage_pb2, tensor_pb2

TRANSPORTS = ("grpc", "shm", "cuda-ipc")
M = TypeVar("M", stage_pb2.Chunk, stage_pb2.StageResponse, stage_pb2.StageRequest)
# inline bytes per message: far below the gRPC limit; 1 MiB streams about twice as fast as 4 MiB between
# two processes (bench/handoff.py: each message's copies stay small enough for the caches and the allocator
# to reuse their memory), while 256 KiB and less pay per-message overhead
PIECE_BYTES = 1 * 2**20


class Publisher:
    """What a ChunkEncoder needs from the stage's shared-memory side (`Transport` provides it)."""

    def publish_shm(self, tensor: torch.Tensor, request_id: str, deadline: float) -> tensor_pb2.ShmRef | None: ...

    def publish_ipc(self, tensor: torch.Tensor, request_id: str, deadline: float) -> tensor_pb2.CudaIpcRef | None: ...


@dataclass
class ChunkEncoder:
    mode: str
    publisher: Publisher | None = None
    request_id: str = ""
    deadline: float = 0.0
    piece_bytes: int = PIECE_BYTES
    min_ref_bytes: int = 0  # a CPU tensor smaller than this goes inline on a shm / cuda-ipc edge too

    def __post_init__(self) -> None:
        if self.mode not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {self.mode!r}")
        if self.mode != "grpc" and self.publisher is None:
            raise ValueError(f"transport {self.mode} needs shared memory, and this process has none")

    def parts(self, chunk: StageChunk) -> list[stage_pb2.Chunk]:
        return self._build(chunk, stage_pb2.Chunk, lambda msg: msg)

    def responses(self, chunk: StageChunk) -> list[stage_pb2.StageResponse]:
        """The parts already inside the stage's response messages (built in place: no copy of the bytes)."""
        return self._build(chunk, stage_pb2.StageResponse, lambda msg: msg.chunk)

    def requests(self, chunk: StageChunk) -> list[stage_pb2.StageRequest]:
        """The parts already inside the caller's request messages."""
        return self._build(chunk, stage_pb2.StageRequest, lambda msg: msg.chunk)

    def _build(self, chunk: StageChunk, message: Callable[[], M], part_of: Callable[[M], stage_pb2.Chunk]) -> list[M]:
        def new_part() -> stage_pb2.Chunk:
            msgs.append(message())
            part = part_of(msgs[-1])
            part.seq = chunk.seq
            return part

        msgs: list[M] = []
        part = new_part()
        part.text = chunk.text
        if chunk.logprobs:
            part.logprobs.extend(chunk.logprobs)
        if chunk.prompt_logprobs:
            part.prompt_logprobs.extend(chunk.prompt_logprobs)
        inline = 0  # inline bytes in the current part
        for name, tensor in chunk.tensors.items():
            if self._by_reference(part, name, tensor):
                continue
            # inline frames are built in place in their part (`tensors.add`): appending a finished frame
            # would copy its bytes twice more (upb's MergeFrom serializes and parses)
            for fields, size in self._pieces(name, tensor):
                if inline and inline + size > self.piece_bytes:
                    part.more = True
                    part = new_part()
                    inline = 0
                part.tensors.add(**fields)
                inline += size
        part.final = chunk.final
        return msgs

    def _by_reference(self, part: stage_pb2.Chunk, name: str, tensor: torch.Tensor) -> bool:
        """Publish the tensor in shared memory (or by CUDA IPC) and add its frame to `part`; False when it
        goes inline (grpc, an empty tensor, a small CPU tensor, a full arena)."""
        if self.mode == "grpc" or tensor.numel() == 0 or self.publisher is None:
            return False
        if tensor.device.type == "cpu" and tensor.numel() * tensor.element_size() < self.min_ref_bytes:
            return False
        dtype = dtype_name(tensor.dtype, frame_where(name, self.request_id))
        if tensor.device.type == "cuda" and self.mode == "cuda-ipc":
            ipc = self.publisher.publish_ipc(tensor, self.request_id, self.deadline)
            if ipc is not None:
                part.tensors.add(name=name, dtype=dtype, shape=tensor.shape).cuda_ipc.CopyFrom(ipc)
                return True
        ref = self.publisher.publish_shm(tensor.detach().to("cpu"), self.request_id, self.deadline)
        if ref is None:
            return False
        part.tensors.add(name=name, dtype=dtype, shape=tensor.shape).shm.CopyFrom(ref)
        return True

    def _pieces(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[dict[str, Any], int]]:
        """The inline frames of one tensor, as TensorFrame fields, and their byte counts: one frame when it
        fits in a piece, else pieces of `piece_bytes`. Lazily, so only one piece's bytes exist outside its
        part at a time. Bytes via a uint8 view: works for bfloat16 too, which numpy cannot represent."""
        t = tensor.detach().to("cpu").contiguous()
        dtype = dtype_name(t.dtype, frame_where(name, self.request_id))
        flat = t.view(-1).view(torch.uint8).numpy()
        for start in range(0, max(flat.size, 1), self.piece_bytes):  # an empty tensor: one empty frame
            data = flat[start: start + self.piece_bytes].tobytes()
            yield {"name": name, "dtype": dtype, "shape": list(t.shape), "piece_offset": start, "data": data}, len(data)


@dataclass
class _Partial:
    frame: tensor_pb2.TensorFrame  # the first piece (header)
    dtype: torch.dtype
    shape: tuple[int, ...]
    buffer: np.ndarray
    received: int = 0


@dataclass
class ChunkAssembler:
    """Collects one request's parts into StageChunks (the consumer side)."""

    reader: RegionReader | None = None
    request_id: str = ""
    _tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    _partial: dict[str, _Partial] = field(default_factory=dict)
    _text: list[str] = field(default_factory=list)
    _logprobs: list[stage_pb2.TokenLogprob] = field(default_factory=list)
    _prompt_logprobs: list[stage_pb2.TokenLogprob] = field(default_factory=list)

    def add(self, part: stage_pb2.Chunk) -> StageChunk | None:
        """Take one part; the whole chunk once its last part (more=False) is in, else None. A FrameError drops
        the chunk collected so far and releases the part's unclaimed references."""
        if part.text:
            self._text.append(part.text)
        if part.logprobs:
            self._logprobs.extend(part.logprobs)
        if part.prompt_logprobs:
            self._prompt_logprobs.extend(part.prompt_logprobs)
        try:
            for frame in part.tensors:
                self._frame(frame, part.seq)
        except BaseException:
            # the chunk is lost: give the part's unclaimed references back to their producers at once (the
            # claimed ones are kept until their tensors go) and drop what was collected of the chunk
            discard_refs(self.reader, part)
            self._tensors, self._partial, self._text, self._logprobs, self._prompt_logprobs = {}, {}, [], [], []
            raise
        if part.more:
            return None
        for name, partial in self._partial.items():
            raise FrameError(f"{frame_where(name, self.request_id)}: chunk {part.seq} ended after {partial.received} "
                             f"of {partial.buffer.nbytes} bytes")
        chunk = StageChunk(tensors=self._tensors, text="".join(self._text), seq=part.seq, final=part.final,
                           logprobs=self._logprobs, prompt_logprobs=self._prompt_logprobs)
        self._tensors, self._text, self._logprobs, self._prompt_logprobs = {}, [], [], []
        return chunk

    def _frame(self, frame: tensor_pb2.TensorFrame, seq: int) -> None:
        name, rid = frame.name, self.request_id
        kind = frame.WhichOneof("payload")
        if name in self._tensors:
            raise FrameError(f"request {rid}: tensor {name!r} appears twice in chunk {seq}")
        dtype, shape, nbytes = frame_layout(frame, rid)
        if kind in ("shm", "cuda_ipc"):
            if name in self._partial:
                raise FrameError(f"{frame_where(name, rid)}: a reference in the middle of inline pieces")
            self._tensors[name] = self._by_reference(frame, kind, dtype, shape, nbytes)
            return
        data = frame.data
        partial = self._partial.get(name)
        if partial is None:
            if frame.piece_offset != 0:
                raise FrameError(f"{frame_where(name, rid)}: its first piece starts at byte {frame.piece_offset}, not 0")
            if len(data) == nbytes:  # a whole frame, from the bytes read once (each read of `frame.data`
                # copies them out of the message); a bytearray, so the tensor owns memory torch may write to
                self._tensors[name] = (torch.empty(shape, dtype=dtype) if nbytes == 0 else
                                       torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape))
                return
            if len(data) > nbytes:
                raise FrameError(f"{frame_where(name, rid)}: {len(data)} bytes do not match dtype {frame.dtype} x shape "
                                 f"{list(shape)} = {nbytes} bytes")
            partial = self._partial[name] = _Partial(frame, dtype, shape, np.empty(nbytes, dtype=np.uint8))
        elif frame.dtype != partial.frame.dtype or tuple(frame.shape) != partial.shape:
            raise FrameError(f"{frame_where(name, rid)}: a piece says {frame.dtype} {list(frame.shape)}, the first said "
                             f"{partial.frame.dtype} {list(partial.shape)}")
        if frame.piece_offset != partial.received or partial.received + len(data) > nbytes:
            raise FrameError(f"{frame_where(name, rid)}: piece at byte {frame.piece_offset} ({len(data)} bytes) does not "
                             f"continue the {partial.received} of {nbytes} bytes received")
        partial.buffer[partial.received: partial.received + len(data)] = np.frombuffer(data, dtype=np.uint8)
        partial.received += len(data)
        if partial.received == nbytes:
            del self._partial[name]
            self._tensors[name] = torch.from_numpy(partial.buffer).view(dtype).reshape(shape)

    def _by_reference(self, frame: tensor_pb2.TensorFrame, kind: str, dtype: torch.dtype, shape: tuple[int, ...],
                      nbytes: int) -> torch.Tensor:
        what = frame_where(frame.name, self.request_id)
        if self.reader is None:
            raise FrameError(f"{what}: sent by reference, but this process reads inline frames only")
        try:
            if kind == "shm":
                ref = frame.shm
                if ref.nbytes != nbytes:
                    raise FrameError(f"{what}: the slot holds {ref.nbytes} bytes; dtype {frame.dtype} x shape "
                                     f"{list(shape)} = {nbytes} bytes")
                view = self.reader.view(ref.region, ref.host_id, ref.slot, ref.generation, ref.offset, ref.nbytes, what)
                return torch.frombuffer(view, dtype=torch.uint8).view(dtype).reshape(shape)
            from omnimesh.transport.cuda_ipc import import_tensor

            ipc = frame.cuda_ipc
            if ipc.nbytes != nbytes:
                raise FrameError(f"{what}: the IPC handle covers {ipc.nbytes} bytes; dtype {frame.dtype} x shape "
                                 f"{list(shape)} = {nbytes} bytes")
            tensor = import_tensor(self.reader, ipc, what)
            if tensor.dtype != dtype or tuple(tensor.shape) != shape:
                raise FrameError(f"{what}: the IPC tensor is {tensor.dtype} {list(tensor.shape)}, the header says "
                                 f"{frame.dtype} {list(shape)}")
            return tensor
        except RegionError as exc:
            raise (StaleFrame if isinstance(exc, StaleSlot) else FrameError)(str(exc)) from exc

    def discard(self, part: stage_pb2.Chunk) -> None:
        """Release the references of a part that will not be read (its request failed or was cancelled)."""
        discard_refs(self.reader, part)


def discard_refs(reader: RegionReader | None, part: stage_pb2.Chunk) -> None:
    if reader is None:
        return
    for frame in part.tensors:
        kind = frame.WhichOneof("payload")
        ref = frame.shm if kind == "shm" else frame.cuda_ipc if kind == "cuda_ipc" else None
        if ref is not None:
            reader.discard(ref.region, ref.host_id, ref.slot, ref.generation)

