"""Transport: one process's hand-off resources, and the per-edge choice of where tensor bytes travel.

Role: a stage (or the gateway) builds one `Transport` at start-up. As a producer it owns a pooled shm
arena (created and reserved once) and, on CUDA, an IPC exporter (created on first use); as a consumer it
owns a `RegionReader` that maps other producers' arenas. `choose_transport` is the rule the gateway applies
per edge from both ends' Info: co-located (same host id) -> shm for CPU stages, cuda-ipc for CUDA stages;
otherwise inline gRPC pieces. A stage's `--transport` overrides `auto`; forcing shm/cuda-ipc across hosts
is a configuration error named at connect time.

Data flow: Open.transport -> `encoder(mode, request)` -> ChunkEncoder parts out; incoming parts ->
`assembler(request)`; a request's end -> `end_request`; the caller's `Release` RPC -> `release`.
"""

from __future__ import annotations

import logging

import torch

from omnimesh.transport.chunk_codec import TRANSPORTS, ChunkAssembler, ChunkEncoder, Publisher
from omnimesh.transport.cuda_ipc import CudaIpcExporter
from omnimesh.transport.host_id import host_id, shm_available
from omnimesh.transport.shm_arena import DEFAULT_ARENA_BYTES, ShmArena
from omnimesh.transport.shm_region import RegionError, RegionReader
from omnimesh.transport.slot_owner import SlotOwner
from omnimesh.v1 import tensor_pb2

log = logging.getLogger(__name__)

PREFERENCES = ("auto", *TRANSPORTS)


def check_preference(value: str, what: str = "--transport") -> str:
    if value not in PREFERENCES:
        raise ValueError(f"{what} must be one of {', '.join(PREFERENCES)}, got {value!r}")
    return value


def choose_transport(producer: str, preference: str, producer_host: str, device: str, consumer: str,
                     consumer_host: str) -> str:
    """How `producer` sends tensors to `consumer`: grpc | shm | cuda-ipc (ValueError for an impossible setting)."""
    check_preference(preference, f"stage {producer}'s transport")
    if preference == "grpc":
        return "grpc"
    if producer_host != consumer_host:
        if preference == "auto":
            return "grpc"
        raise ValueError(f"stage {producer} is set to --transport {preference}, but its consumer {consumer} does not "
                         f"share its shared memory (host ids {producer_host[:12]} and {consumer_host[:12]}); "
                         f"use --transport auto or grpc, or run them on one host (one IPC namespace)")
    if preference == "auto":
        return "cuda-ipc" if device == "cuda" else "shm"
    return preference


class Transport(Publisher):
    def __init__(self, tag: str, preference: str = "auto", arena_bytes: int = DEFAULT_ARENA_BYTES,
                 min_ref_bytes: int = 0):
        """`min_ref_bytes`: CPU tensors under this size go inline even where the edge is shm / cuda-ipc."""
        self.tag = tag
        self.min_ref_bytes = min_ref_bytes
        self.host_id = host_id()
        self.reader = RegionReader()
        self.arena: ShmArena | None = None
        self._ipc: CudaIpcExporter | None = None
        self.preference = check_preference(preference)
        if preference != "grpc" and arena_bytes > 0:
            if not shm_available():
                if preference != "auto":
                    raise RegionError(f"--transport {preference} needs /dev/shm, which this host does not have")
            else:
                try:
                    self.arena = ShmArena(tag, arena_bytes)
                except RegionError as exc:
                    if preference != "auto":
                        raise
                    log.warning("%s; tensors go inline over gRPC", exc)

    @property
    def effective(self) -> str:
        """What this process can offer (its Info.transport): the preference, or grpc without an arena."""
        return self.preference if self.arena is not None or self.preference == "grpc" else "grpc"

    def encoder(self, mode: str, request_id: str, deadline: float = 0.0) -> ChunkEncoder:
        if mode in ("", "grpc") or self.arena is None:
            return ChunkEncoder("grpc", None, request_id, deadline)
        return ChunkEncoder(mode, self, request_id, deadline, min_ref_bytes=self.min_ref_bytes)

    def assembler(self, request_id: str) -> ChunkAssembler:
        return ChunkAssembler(self.reader, request_id)

    def publish_shm(self, tensor: torch.Tensor, request_id: str, deadline: float) -> tensor_pb2.ShmRef | None:
        return self.arena.publish(tensor, request_id, deadline) if self.arena is not None else None

    def publish_ipc(self, tensor: torch.Tensor, request_id: str, deadline: float) -> tensor_pb2.CudaIpcRef | None:
        if self._ipc is None:
            self._ipc = CudaIpcExporter(self.tag)
        return self._ipc.publish(tensor, request_id, deadline)

    @property
    def ipc(self) -> CudaIpcExporter | None:
        """The CUDA IPC exporter, once this process exported a device tensor (None before, and on CPU)."""
        return self._ipc

    def _owners(self) -> list[SlotOwner]:
        return [o for o in (self.arena, self._ipc) if o is not None]

    def end_request(self, request_id: str, cancelled: bool) -> None:
        for owner in self._owners():
            owner.end_request(request_id, cancelled)

    def release(self, request_id: str) -> int:
        """The caller gave up on `request_id`: take back its frames no consumer claimed -> slots freed."""
        freed = 0
        for owner in self._owners():
            before = owner.live_slots
            owner.end_request(request_id, cancelled=True)
            freed += before - owner.live_slots
        return freed

    def close(self) -> None:
        for owner in self._owners():
            owner.close()
