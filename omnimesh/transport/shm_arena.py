"""ShmArena: a producer's pooled shared-memory arena for CPU tensors handed to co-located consumers.

Role: one `/dev/shm` region per producer process, allocated (and reserved) once at start-up and reused for
every tensor: `publish` copies a tensor into a free extent (one memcpy; the consumer then maps it without
copying) and returns the `ShmRef` the frame carries. A full arena (or a tensor larger than it) returns
None: the caller sends that tensor inline instead — slower, never wrong, never blocking the engine.

Data flow: StageChunk tensor -> publish (extent + slot) -> ShmRef in the frame -> consumer claims and maps
(`RegionReader.view`) -> its tensor is dropped -> slot RELEASED -> `sweep` frees slot and extent.
"""

from __future__ import annotations

import bisect
import logging

import torch

from omnimesh.transport.host_id import host_id
from omnimesh.transport.shm_region import ALIGN, Region
from omnimesh.transport.slot_owner import Live, SlotOwner
from omnimesh.v1 import tensor_pb2

log = logging.getLogger(__name__)

DEFAULT_ARENA_BYTES = 256 * 2**20
DEFAULT_MAX_SLOTS = 16384


class Extents:
    """First-fit allocator over [0, size) in ALIGN-byte units, coalescing on free."""

    def __init__(self, size: int):
        self.size = size
        self._starts: list[int] = [0] if size else []
        self._lens: list[int] = [size] if size else []
        self.free_bytes = size

    def alloc(self, nbytes: int) -> int | None:
        n = (nbytes + ALIGN - 1) // ALIGN * ALIGN
        for i, length in enumerate(self._lens):
            if length >= n:
                start = self._starts[i]
                if length == n:
                    del self._starts[i], self._lens[i]
                else:
                    self._starts[i] += n
                    self._lens[i] -= n
                self.free_bytes -= n
                return start
        return None

    def free(self, start: int, nbytes: int) -> None:
        n = (nbytes + ALIGN - 1) // ALIGN * ALIGN
        i = bisect.bisect_left(self._starts, start)
        if i > 0 and self._starts[i - 1] + self._lens[i - 1] > start or i < len(self._starts) and start + n > self._starts[i]:
            raise RuntimeError(f"extent [{start}, {start + n}) overlaps free space: double free")
        self.free_bytes += n
        if i > 0 and self._starts[i - 1] + self._lens[i - 1] == start:  # merge with the left neighbour
            i -= 1
            self._lens[i] += n
        else:
            self._starts.insert(i, start)
            self._lens.insert(i, n)
        if i + 1 < len(self._starts) and self._starts[i] + self._lens[i] == self._starts[i + 1]:
            self._lens[i] += self._lens[i + 1]
            del self._starts[i + 1], self._lens[i + 1]

    @property
    def largest(self) -> int:
        return max(self._lens, default=0)


class ShmArena(SlotOwner):
    def __init__(self, tag: str, size_bytes: int = DEFAULT_ARENA_BYTES, max_slots: int = DEFAULT_MAX_SLOTS):
        region = Region.create(tag, max_slots=max_slots, data_size=size_bytes)
        super().__init__(region)
        self.host_id = host_id()
        self.size = size_bytes
        self._extents = Extents(size_bytes)
        start = region.data_offset
        self._data = torch.frombuffer(region.mm, dtype=torch.uint8, count=size_bytes, offset=start) if size_bytes else None
        self.fallbacks = 0  # tensors sent inline because the arena was full
        log.info("shm arena %s: %.0f MiB, %d slots", region.name, size_bytes / 2**20, max_slots)

    def publish(self, tensor: torch.Tensor, request_id: str, deadline_unix_s: float = 0.0) -> tensor_pb2.ShmRef | None:
        """Copy a CPU tensor into the arena -> its reference; None when it does not fit now, or is empty (send
        inline)."""
        src = tensor.detach()
        nbytes = src.numel() * src.element_size()
        if nbytes == 0:  # nothing to share; a 0-byte extent would alias the next tensor's offset
            return None
        offset = self._extents.alloc(nbytes) if self._data is not None else None
        if offset is None and self._data is not None and nbytes <= self.size:
            self.sweep(deep=True)
            offset = self._extents.alloc(nbytes)
        if offset is None:
            self.fallbacks += 1
            return None
        slot = self._take_slot()
        if slot is None:
            self._extents.free(offset, nbytes)
            self.fallbacks += 1
            return None
        assert self._data is not None
        # copy in the tensor's own dtype and layout: wider than bytes, and no extra copy for a strided source
        self._data[offset: offset + nbytes].view(src.dtype).view(src.shape).copy_(src)
        generation = self._publish(slot, request_id, offset, nbytes, deadline_unix_s)
        return tensor_pb2.ShmRef(host_id=self.host_id, region=self.name, slot=slot, generation=generation,
                                 offset=offset, nbytes=nbytes)

    def _on_free(self, slot: int, live: Live) -> None:
        self._extents.free(live.offset, live.nbytes)

    @property
    def free_bytes_now(self) -> int:
        return self._extents.free_bytes

    def free_bytes(self) -> int:
        """Free data bytes after a deep sweep (what a leak test compares with the start value)."""
        self.sweep(deep=True)
        return self._extents.free_bytes

    def close(self) -> None:
        super().close()
        self._data = None
