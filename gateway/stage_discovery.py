"""StageDiscovery: a stage's replicas from DNS, for stages scaled by an orchestrator.

`--stages vocoder=dns:///omnimesh-vocoder:50054` names a stage by a DNS name instead of fixed addresses:
every address the name resolves to is one replica (a Kubernetes headless Service lists one per ready pod;
Docker Compose's DNS one per container of a scaled service). The name is resolved at start-up and again
every `--stage-dns-refresh` seconds: a new address becomes a replica (it takes requests once it answers
Info, `StagePipeline`'s upkeep), an address gone from the answer is retired (no new requests; its client
closes once its requests in flight are done). A failed lookup keeps the replicas already known.

Data flow: `StageDiscovery.start()` -> `_loop` -> `refresh()` -> `resolve(host, port)` (the event loop's
getaddrinfo, so /etc/hosts and the platform's resolver apply) -> `ReplicaSet.add` / `ReplicaSet.retire`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from gateway.replicas import ReplicaSet
from omnimesh.transport.stage_client import StageClient

log = logging.getLogger(__name__)

DNS_PREFIX = "dns:///"
DEFAULT_REFRESH_S = 10.0


@dataclass(frozen=True, slots=True)
class DnsTarget:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{DNS_PREFIX}{self.host}:{self.port}"


def parse_dns_target(address: str) -> DnsTarget | None:
    """`dns:///HOST:PORT` -> DnsTarget; None for a plain HOST:PORT; ValueError for a malformed one."""
    if not address.startswith("dns:"):
        return None
    rest = address[len(DNS_PREFIX):] if address.startswith(DNS_PREFIX) else ""
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r}: a DNS name is written dns:///HOST:PORT, e.g. dns:///omnimesh-vocoder:50054")
    return DnsTarget(host, int(port))


Resolver = Callable[[DnsTarget], Awaitable[list[str]]]


async def resolve(target: DnsTarget) -> list[str]:
    """Every address `target` resolves to, as HOST:PORT ([v6]:PORT), sorted and without repeats."""
    infos = await asyncio.get_running_loop().getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
    out = set()
    for family, _, _, _, sockaddr in infos:
        ip = str(sockaddr[0])
        out.add(f"[{ip}]:{target.port}" if family == socket.AF_INET6 else f"{ip}:{target.port}")
    return sorted(out)


class StageDiscovery:
    def __init__(self, targets: Mapping[str, DnsTarget], stages: Mapping[str, ReplicaSet],
                 make_client: Callable[[str, str], StageClient], refresh_s: float = DEFAULT_REFRESH_S,
                 resolver: Resolver = resolve) -> None:
        if refresh_s <= 0:
            raise ValueError(f"--stage-dns-refresh must be > 0 seconds, got {refresh_s}")
        self.targets = dict(targets)
        self.stages = stages
        self.make_client = make_client
        self.refresh_s = refresh_s
        self.resolver = resolver
        self._task: asyncio.Task | None = None

    async def refresh(self) -> None:
        """Resolve every target once and bring its stage's replicas in line with the answer."""
        for stage, target in self.targets.items():
            try:
                addresses = await self.resolver(target)
            except OSError as exc:  # socket.gaierror included: keep what is known
                log.warning("gateway: resolving %s for stage %s failed (%s); keeping its %d known replica(s)",
                            target, stage, exc, len(self.stages[stage].active()))
                continue
            rs = self.stages[stage]
            current = {r.address for r in rs.active()}
            for address in addresses:
                if address not in current:
                    replica = rs.add(self.make_client(stage, address))
                    log.info("gateway: %s resolves to %s: %s joins", target, address, replica.label)
            for replica in rs.active():
                if replica.address not in addresses:
                    rs.retire(replica, f"no longer in the answer for {target}")

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.refresh_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
