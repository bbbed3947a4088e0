"""The stages' half of the gateway's `/metrics`: every replica of every stage, scraped at each request.

Data flow: `scrape_stages(sources, up, timeout_s)` asks each replica's Stage `Metrics` RPC at once (bounded
by `timeout_s`) -> its Prometheus text -> families whose samples gain a `replica` label (the replica's
index in the stage's address list, as vLLM labels its engines `engine="0"`; the stages already label
theirs `stage`) -> `merge_families` with the gateway's own. A replica that does not answer in time, or
answers garbage, is left out of this scrape and `omnimesh:stage_scrape_up{stage,replica}` says 0.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Protocol

from prometheus_client import Gauge
from prometheus_client.core import Metric

from gateway.replicas import ReplicaSet
from omnimesh.engine.metrics import parse_exposition

log = logging.getLogger(__name__)


class MetricsSource(Protocol):
    """A stage replica whose metrics /metrics includes (a `StageClient`)."""

    async def metrics(self, timeout_s: float = ...) -> str: ...


StageSources = Mapping[str, "MetricsSource | Sequence[MetricsSource] | ReplicaSet"]


def replicas_of(entry: MetricsSource | Sequence[MetricsSource] | ReplicaSet) -> list[tuple[str, MetricsSource]]:
    """(replica label, source) of one stage: a ReplicaSet's current replicas by their index, a list by position."""
    if isinstance(entry, ReplicaSet):
        return [(str(r.index), r.client) for r in entry.active()]
    if isinstance(entry, Sequence):
        return [(str(i), source) for i, source in enumerate(entry)]
    return [("0", entry)]


async def scrape_stages(sources: StageSources, up: Gauge, timeout_s: float) -> list[list[Metric]]:
    """Each answering replica's families, `replica`-labelled; `up` set per stage and replica."""
    jobs = [(stage, label, src) for stage, entry in sources.items() for label, src in replicas_of(entry)]
    scraped = await asyncio.gather(*(_scrape(stage, src, timeout_s) for stage, _, src in jobs))
    out = []
    up.clear()  # a replica that has left (DNS) leaves no stale series; no await between this and the sets below
    for (stage, label, _), families in zip(jobs, scraped):
        up.labels(stage=stage, replica=label).set(0 if families is None else 1)
        if families is not None:
            out.append([_labelled(f, label) for f in families])
    return out


async def _scrape(stage: str, source: MetricsSource, timeout_s: float) -> list[Metric] | None:
    try:
        text = await asyncio.wait_for(source.metrics(timeout_s=timeout_s), timeout_s + 0.5)
        return parse_exposition(text)
    except Exception as e:
        log.debug("scraping the metrics of stage %s failed: %s", stage, e)
        return None


def _labelled(family: Metric, replica: str) -> Metric:
    family.samples = [s._replace(labels={**s.labels, "replica": replica}) for s in family.samples]
    return family
