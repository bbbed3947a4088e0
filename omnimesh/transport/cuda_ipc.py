"""CUDA IPC hand-off: a device tensor goes to a co-located consumer as a handle, never through the host.

Role: the producer exports a CUDA tensor with torch.multiprocessing's CUDA IPC reduction (the CUDA runtime's
cudaIpcGetMemHandle plus torch's cross-process reference counter and event), keeps the tensor alive in a
slot of its slot table until the consumer releases it, and sends the handle in the frame. The consumer
opens the handle (`import_tensor`): its tensor is the producer's device memory, no copy in either
direction. torch's own IPC reference counter keeps the memory valid while any consumer view lives; the slot
table adds what torch lacks: per-request take-back on cancel, a release signal that survives a dead
consumer, and accounting (`live_slots`).

The handle travels as a small JSON record of the rebuild arguments (sizes, strides, dtype, device, handle
bytes) — never pickle, so a frame cannot run code in its consumer.
"""

from __future__ import annotations

import json
import weakref
from typing import Any

import torch

from omnimesh.transport.frames import FrameError
from omnimesh.transport.host_id import host_id
from omnimesh.transport.shm_region import Region, RegionReader
from omnimesh.transport.slot_owner import Live, SlotOwner
from omnimesh.v1 import tensor_pb2

DEFAULT_IPC_SLOTS = 4096


def _hex(value: bytes | None) -> str | None:
    return None if value is None else value.hex()


def _unhex(value: str | None) -> bytes | None:
    return None if value is None else bytes.fromhex(value)


def encode_handle(tensor: torch.Tensor) -> tuple[bytes, int]:
    """The IPC rebuild arguments of a CUDA tensor as JSON bytes, and its device index."""
    from torch.multiprocessing.reductions import reduce_tensor

    _rebuild, args = reduce_tensor(tensor)
    (_cls, size, stride, offset, _storage_cls, dtype, device, handle, storage_bytes, storage_offset,
     _requires_grad, ref_handle, ref_offset, event_handle, event_sync) = args
    record = {"size": list(size), "stride": list(stride), "offset": int(offset), "dtype": str(dtype).removeprefix("torch."),
              "device": int(device), "handle": _hex(handle), "storage_bytes": int(storage_bytes),
              "storage_offset": int(storage_offset), "ref_handle": _hex(ref_handle), "ref_offset": int(ref_offset),
              "event_handle": _hex(event_handle), "event_sync": bool(event_sync)}
    return json.dumps(record).encode(), int(device)


def decode_handle(data: bytes) -> torch.Tensor:
    """Open the IPC handle -> the producer's device memory as a tensor (no copy)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    r: dict[str, Any] = json.loads(data)
    dtype = getattr(torch, r["dtype"])
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size(r["size"]), tuple(r["stride"]), r["offset"], torch.storage.TypedStorage, dtype,
        r["device"], _unhex(r["handle"]), r["storage_bytes"], r["storage_offset"], False, _unhex(r["ref_handle"]),
        r["ref_offset"], _unhex(r["event_handle"]), r["event_sync"],
    )


class CudaIpcExporter(SlotOwner):
    def __init__(self, tag: str, max_slots: int = DEFAULT_IPC_SLOTS):
        super().__init__(Region.create(f"{tag}-ipc", max_slots=max_slots, data_size=0))
        self.host_id = host_id()
        self._held: dict[int, torch.Tensor] = {}

    def publish(self, tensor: torch.Tensor, request_id: str, deadline_unix_s: float = 0.0) -> tensor_pb2.CudaIpcRef | None:
        """Export a CUDA tensor; None when every slot is taken (the caller copies it out instead)."""
        if tensor.device.type != "cuda":
            raise ValueError(f"CUDA IPC needs a CUDA tensor, got one on {tensor.device}")
        slot = self._take_slot()
        if slot is None:
            return None
        handle, device = encode_handle(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        generation = self._publish(slot, request_id, 0, nbytes, deadline_unix_s)
        self._held[slot] = tensor
        return tensor_pb2.CudaIpcRef(host_id=self.host_id, region=self.name, slot=slot, generation=generation,
                                     device=device, handle=handle, nbytes=nbytes)

    def _on_free(self, slot: int, live: Live) -> None:
        self._held.pop(slot, None)


def import_tensor(reader: RegionReader, ref: tensor_pb2.CudaIpcRef, what: str) -> torch.Tensor:
    """Claim the slot, open the handle; the slot is released when the returned tensor is dropped. A handle
    that cannot be opened (malformed, or no such device here) is a FrameError naming `what`."""
    region = reader.claim_only(ref.region, ref.host_id, ref.slot, ref.generation, ref.nbytes, what)
    try:
        tensor = decode_handle(ref.handle)
    except BaseException as exc:
        region.release(ref.slot)
        if isinstance(exc, Exception):
            raise FrameError(f"{what}: cannot open its CUDA IPC handle: {exc!r}") from exc
        raise
    weakref.finalize(tensor, region.release, ref.slot)
    return tensor
