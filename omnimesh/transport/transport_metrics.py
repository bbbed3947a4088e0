"""Prometheus series of a process's hand-off resources (its shm arena and CUDA IPC slots).

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
        names, values = list(self.labels), list(self.labels.values())
        arena = self.transport.arena
        out: list[Metric] = []
        if arena is not None:
            arena.sweep_due()
            for name, doc, value in (("omnimesh:shm_arena_size_bytes", "Data bytes of the stage's shm arena", arena.size),
                                     ("omnimesh:shm_arena_free_bytes", "Free data bytes of the stage's shm arena",
                                      arena.free_bytes_now),
                                     ("omnimesh:shm_arena_slots_in_use", "Published tensors not yet released",
                                      arena.live_slots)):
                g = GaugeMetricFamily(name, doc, labels=names)
                g.add_metric(values, float(value))
                out.append(g)
            for name, doc, value in (("omnimesh:shm_arena_fallbacks", "Tensors sent inline because the arena was full",
                                      arena.fallbacks),
                                     ("omnimesh:shm_arena_reclaimed", "Slots taken back without their consumer's "
                                      "release (cancelled, dead consumer, expired)", arena.reclaimed_unreleased)):
                c = CounterMetricFamily(name, doc, labels=names)
                c.add_metric(values, float(value))
                out.append(c)
        return out


def register_transport_metrics(registry: CollectorRegistry, transport: Transport, labels: Mapping[str, str]) -> None:
    registry.register(_TransportCollector(transport, labels))
