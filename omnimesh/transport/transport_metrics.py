"""Prometheus series of a process's hand-off resources (its shm arena and CUDA IPC slots).

The CUDA IPC series appear once the process has exported a device tensor (a CUDA stage's first hand-off):
`cuda_ipc_slots_in_use` and `cuda_ipc_held_bytes` (device tensors kept alive for consumers that have not
released them) and `cuda_ipc_reclaimed` (taken back without a release: cancelled, dead consumer, expired).

Read at scrape time from the `Transport`; registered into the stage's engine registry, so they travel with
the stage's other series through the Metrics RPC to the gateway's /metrics.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from omnimesh.transport.transport import Transport


class _TransportCollector(Collector):
    def __init__(self, transport: Transport, labels: Mapping[str, str]):
        self.transport = transport
        self.labels = dict(labels)

    def collect(self) -> Iterable[Metric]:
        out: list[Metric] = []

        def add(kind: type[GaugeMetricFamily] | type[CounterMetricFamily], name: str, doc: str, value: float) -> None:
            family = kind(name, doc, labels=list(self.labels))
            family.add_metric(list(self.labels.values()), float(value))
            out.append(family)

        arena = self.transport.arena
        if arena is not None:
            arena.sweep_due()
            add(GaugeMetricFamily, "omnimesh:shm_arena_size_bytes", "Data bytes of the stage's shm arena", arena.size)
            add(GaugeMetricFamily, "omnimesh:shm_arena_free_bytes", "Free data bytes of the stage's shm arena",
                arena.free_bytes_now)
            add(GaugeMetricFamily, "omnimesh:shm_arena_slots_in_use", "Published tensors not yet released",
                arena.live_slots)
            add(CounterMetricFamily, "omnimesh:shm_arena_fallbacks", "Tensors sent inline because the arena was full",
                arena.fallbacks)
            add(CounterMetricFamily, "omnimesh:shm_arena_reclaimed", "Slots taken back without their consumer's "
                "release (cancelled, dead consumer, expired)", arena.reclaimed_unreleased)
        ipc = self.transport.ipc
        if ipc is not None:
            ipc.sweep_due()
            add(GaugeMetricFamily, "omnimesh:cuda_ipc_slots_in_use", "Exported device tensors not yet released",
                ipc.live_slots)
            add(GaugeMetricFamily, "omnimesh:cuda_ipc_held_bytes", "Bytes of the device tensors kept alive for "
                "consumers that have not released them", ipc.live_bytes)
            add(CounterMetricFamily, "omnimesh:cuda_ipc_reclaimed", "Device tensors taken back without their "
                "consumer's release (cancelled, dead consumer, expired)", ipc.reclaimed_unreleased)
        return out


def register_transport_metrics(registry: CollectorRegistry, transport: Transport, labels: Mapping[str, str]) -> None:
    registry.register(_TransportCollector(transport, labels))
