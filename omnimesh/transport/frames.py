"""TensorFrame <-> torch.Tensor, and StageChunk <-> the wire `Chunk`.

Role: the one place where tensors become bytes and back. A frame is a header (name, dtype, shape) plus
raw little-endian row-major bytes; decoding checks that the byte count matches dtype x shape and names
the offending tensor and request when it does not. `StageChunk` is the in-process form of a chunk
(named tensors, a text delta, sequence number, final flag) that engines produce and consume.

Data flow: engine output StageChunk -> chunk_to_proto -> gRPC -> chunk_from_proto -> next engine.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from omnimesh.v1 import stage_pb2, tensor_pb2

if sys.byteorder != "little":  # the wire format is little-endian; we never byte-swap silently
    raise RuntimeError("omnimesh frames need a little-endian host")

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES: dict[torch.dtype, str] = {v: k for k, v in _DTYPES.items()}


class FrameError(ValueError):
    """A frame whose header and bytes disagree, or whose dtype is unknown."""


@dataclass(slots=True)
class StageChunk:
    """One chunk of a request's stream inside a process."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    text: str = ""
    seq: int = 0
    final: bool = False


def tensor_to_frame(name: str, tensor: torch.Tensor) -> tensor_pb2.TensorFrame:
    if tensor.dtype not in _NAMES:
        raise FrameError(f"tensor {name!r}: dtype {tensor.dtype} cannot travel in a frame")
    t = tensor.detach().to("cpu").contiguous()
    # bytes via a uint8 view: works for bfloat16 too, which numpy cannot represent
    data = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return tensor_pb2.TensorFrame(name=name, dtype=_NAMES[t.dtype], shape=list(t.shape), data=data)


def frame_to_tensor(frame: tensor_pb2.TensorFrame, request_id: str = "") -> torch.Tensor:
    where = f"tensor {frame.name!r}" + (f" of request {request_id}" if request_id else "")
    dtype = _DTYPES.get(frame.dtype)
    if dtype is None:
        raise FrameError(f"{where}: unknown dtype {frame.dtype!r}; known: {sorted(_DTYPES)}")
    if any(d < 0 for d in frame.shape):
        raise FrameError(f"{where}: negative dimension in shape {list(frame.shape)}")
    numel = 1
    for d in frame.shape:
        numel *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(frame.data) != numel * itemsize:
        raise FrameError(
            f"{where}: {len(frame.data)} bytes do not match dtype {frame.dtype} x shape {list(frame.shape)}"
            f" = {numel * itemsize} bytes"
        )
    if numel == 0:
        return torch.empty(tuple(frame.shape), dtype=dtype)
    # bytearray: a writable buffer, so the tensor owns memory torch may write to
    flat = torch.frombuffer(bytearray(frame.data), dtype=torch.uint8)
    return flat.view(dtype).reshape(tuple(frame.shape))


def chunk_to_proto(chunk: StageChunk) -> stage_pb2.Chunk:
    return stage_pb2.Chunk(
        seq=chunk.seq,
        final=chunk.final,
        text=chunk.text,
        tensors=[tensor_to_frame(name, t) for name, t in chunk.tensors.items()],
    )


def chunk_from_proto(msg: stage_pb2.Chunk, request_id: str = "") -> StageChunk:
    tensors: dict[str, torch.Tensor] = {}
    for frame in msg.tensors:
        if frame.name in tensors:
            raise FrameError(f"request {request_id}: tensor {frame.name!r} appears twice in chunk {msg.seq}")
        tensors[frame.name] = frame_to_tensor(frame, request_id)
    return StageChunk(tensors=tensors, text=msg.text, seq=msg.seq, final=msg.final)
