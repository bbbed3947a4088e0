"""TensorFrame headers, and StageChunk, the in-process form of a chunk.

Role: the one place where a tensor's header (name, dtype, shape) is named and checked. Checking names the offending tensor and request: an unknown dtype,
a negative dimension, a byte count that does not match dtype x shape. `StageChunk` is what engines
produce and consume (named tensors, a text delta, sequence number, final flag). Where the bytes travel
(inline pieces, shared memory, CUDA IPC) is `chunk_codec`'s business.

Data flow: engine output StageChunk -> ChunkEncoder (frames) -> gRPC -> ChunkAssembler -> next engine.
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
_ITEMSIZE: dict[torch.dtype, int] = {d: torch.empty((), dtype=d).element_size() for d in _DTYPES.values()}


class FrameError(ValueError):
    """A frame whose header and bytes disagree, or whose dtype is unknown."""


class StaleFrame(FrameError):
    """A frame by reference whose slot its producer took back: released, expired, or its request cancelled (a
    consumer reading it while the caller cancels both calls is a cancel, not the caller's mistake)."""


@dataclass(slots=True)
class StageChunk:
    """One chunk of a request's stream inside a process."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    text: str = ""
    seq: int = 0
    final: bool = False
    logprobs: list[stage_pb2.TokenLogprob] = field(default_factory=list)  # the thinker's, when asked
    prompt_logprobs: list[stage_pb2.TokenLogprob] = field(default_factory=list)  # the thinker's first chunk's, when asked


def dtype_name(dtype: torch.dtype, what: str) -> str:
    if dtype not in _NAMES:
        raise FrameError(f"{what}: dtype {dtype} cannot travel in a frame")
    return _NAMES[dtype]


def frame_layout(frame: tensor_pb2.TensorFrame, request_id: str = "") -> tuple[torch.dtype, tuple[int, ...], int]:
    """Check a frame's header -> (dtype, shape, byte count)."""
    where = frame_where(frame.name, request_id)
    dtype = _DTYPES.get(frame.dtype)
    if dtype is None:
        raise FrameError(f"{where}: unknown dtype {frame.dtype!r}; known: {sorted(_DTYPES)}")
    if any(d < 0 for d in frame.shape):
        raise FrameError(f"{where}: negative dimension in shape {list(frame.shape)}")
    numel = 1
    for d in frame.shape:
        numel *= d
    return dtype, tuple(frame.shape), numel * _ITEMSIZE[dtype]


def frame_where(name: str, request_id: str) -> str:
    return f"tensor {name!r}" + (f" of request {request_id}" if request_id else "")
