"""ReplicaSet: one stage's replicas as the gateway sees them, and which one takes a new request.

A stage can run as several independent copies (`--stage-overrides '{"vocoder": {"num_replicas": 2}}'`
under `omnimesh serve`, the gateway's `--stages vocoder=A,vocoder=B` for stages started on their own, or
`vocoder=dns:///NAME:PORT`, whose addresses come and go: gateway/stage_discovery.py).
Every request talks to exactly one replica of each stage it needs — the stages keep per-request state,
and a producer's shared-memory frames are handed back to the replica that wrote them — so the gateway
balances per request, not per RPC (gRPC's own round_robin would split one request's calls).

Data flow: `StageMesh.connect()` reads every replica's Info (`refresh` -> `adopt`; replicas of one stage
must agree on what they serve, SHARED_INFO_FIELDS); a replica that does not answer at start-up is adopted
later, by the mesh's upkeep. For each request `pick()` leases the replica with the fewest requests in
flight from this gateway, ties going to one on the `near` host (a co-located consumer gets its tensors
through shared memory), then, for a stage whose replicas keep work by content (StageInfo.prefix_caching: the
thinker's prefix cache, the encoder's cache), to the request's own replica by its content `key` (rendezvous
hashing: the same media or the same prompt start goes where it was computed before), then round-robin; `Lease.done()` returns it. A retired replica (gone from DNS) gets
no new requests and is dropped by `prune()` once none holds it. A replica whose call failed with UNAVAILABLE
or RESOURCE_EXHAUSTED is passed over for a backoff (0.5 s, doubling to 30 s; `mark_down`), and so is one
whose channel is in TRANSIENT_FAILURE (gRPC cannot reach it); when every replica looks down the pick
takes one anyway, so the request fails with the stage's own answer instead of a guess.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from omnimesh.transport.stage_client import StageCallError, StageClient
from omnimesh.v1 import stage_pb2

log = logging.getLogger(__name__)

DOWN_BACKOFF_S = 0.5  # the first pass-over after a failed call; doubles per failure in a row
MAX_DOWN_BACKOFF_S = 30.0
# StageInfo fields every replica of one stage must agree on: what it serves, not where or how it runs
SHARED_INFO_FIELDS = ("stage", "model", "family", "speakers", "sample_rate", "window_codes", "first_window_codes",
                      "window_schedule")


class NoReplica(Exception):
    """No replica of the stage has answered yet (none was ever reachable, or all disagreed)."""


def _affinity(key: bytes | None, replica: Replica) -> int:
    """Rendezvous hashing: the replica with the highest score is the key's own, and the key moves only when its
    replica comes or goes."""
    digest = hashlib.blake2b((key or b"") + replica.address.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@dataclass(eq=False)
class Replica:
    stage: str
    index: int  # position in the stage's address list: the `replica` label of its metrics
    client: StageClient
    info: stage_pb2.StageInfo | None = None  # None until it answers Info: not picked before
    refused: str | None = None  # why it is never used (it disagrees with its peers); None: usable
    in_flight: int = 0  # requests of this gateway holding it
    down_until: float = 0.0  # monotonic; passed over until then after a failed call
    failures: int = 0  # failed calls in a row (the backoff's exponent)
    retired: bool = False  # gone from its DNS name: no new requests, dropped once idle

    @property
    def address(self) -> str:
        return self.client.address

    @property
    def host(self) -> str:
        return self.info.host_id if self.info is not None else ""

    @property
    def label(self) -> str:
        """How logs and errors name it: `vocoder replica 1 (HOST:PORT)`."""
        return f"{self.stage} replica {self.index} ({self.address})"

    def looks_down(self, now: float) -> bool:
        return now < self.down_until or self.client.unreachable()


class Lease:
    """One request's hold on a replica; `done(ok)` exactly once (later calls do nothing)."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self._open = True
        replica.in_flight += 1

    def done(self, ok: bool = True) -> None:
        if self._open:
            self._open = False
            self.replica.in_flight -= 1
            if ok:
                self.replica.failures = 0


class ReplicaSet:
    def __init__(self, stage: str, clients: Sequence[StageClient], clock: Callable[[], float] = time.monotonic) -> None:
        """`clients`: one per replica; none for a stage whose replicas come from DNS (gateway/stage_discovery.py)."""
        addresses = [c.address for c in clients]
        if len(set(addresses)) != len(addresses):
            raise ValueError(f"stage {stage}: an address is listed twice ({', '.join(addresses)})")
        self.stage = stage
        self.replicas = [Replica(stage, i, c) for i, c in enumerate(clients)]
        self._next_index = len(self.replicas)  # a replica added later gets a new index, never a reused one
        self._turn = 0  # round-robin start among equally loaded replicas
        self.clock = clock

    def __len__(self) -> int:
        return len(self.replicas)

    def active(self) -> list[Replica]:
        """Replicas not retired (answered or not)."""
        return [r for r in self.replicas if not r.retired]

    def known(self) -> list[Replica]:
        """Replicas that answered Info, agree with their peers and are not retired: the ones picked from."""
        return [r for r in self.replicas if r.info is not None and r.refused is None and not r.retired]

    def add(self, client: StageClient) -> Replica:
        """A new replica (discovered): picked once it answers Info (`refresh`)."""
        if any(r.address == client.address for r in self.active()):
            raise ValueError(f"stage {self.stage}: {client.address} is a replica already")
        replica = Replica(self.stage, self._next_index, client)
        self._next_index += 1
        self.replicas.append(replica)
        return replica

    def retire(self, replica: Replica, why: str) -> None:
        """No new requests for `replica`; `prune` drops it once its requests in flight are done."""
        if not replica.retired:
            replica.retired = True
            log.info("gateway: %s retires (%s); %d request(s) in flight finish there", replica.label, why,
                     replica.in_flight)

    async def prune(self) -> None:
        """Drop the retired replicas nothing holds any more, closing their channels."""
        gone = [r for r in self.replicas if r.retired and r.in_flight == 0]
        if gone:
            self.replicas = [r for r in self.replicas if r not in gone]
            for replica in gone:
                await replica.client.close()

    def reference_info(self) -> stage_pb2.StageInfo | None:
        known = self.known()
        return known[0].info if known else None

    def adopt(self, replica: Replica, info: stage_pb2.StageInfo) -> bool:
        """Take a replica's Info; False (and it is never used) when it serves something else than its peers."""
        if info.stage and info.stage != self.stage:
            replica.refused = f"{replica.address} answers as stage {info.stage!r}, not {self.stage!r}"
        elif (reference := self.reference_info()) is not None and (diff := _differences(reference, info)):
            replica.refused = f"{replica.label} disagrees with the other replicas: {diff}"
        replica.info = info
        if replica.refused is not None:
            log.error("gateway: %s; it is not used (start every replica of a stage from the same model and "
                      "--audio-windows)", replica.refused)
            return False
        return True

    def pick(self, near: str | None = None, exclude: frozenset[int] = frozenset(), key: bytes | None = None) -> Lease:
        """Lease the replica a new request should use (see the module docstring); `key`: the request's content
        (its media, its prompt's start), whose own replica wins a tie before the round-robin."""
        usable = [r for r in self.known() if r.index not in exclude]
        if not usable:
            raise NoReplica(self.why_none(exclude))
        now = self.clock()
        pool = [r for r in usable if not r.looks_down(now)] or usable
        n = len(self.replicas)
        caching = key is not None and any(r.info is not None and r.info.prefix_caching for r in pool)
        best = min(pool, key=lambda r: (r.in_flight, r.host != near, -_affinity(key, r) if caching else 0,
                                        (r.index - self._turn) % n))
        self._turn = best.index + 1
        return Lease(best)

    def why_none(self, exclude: frozenset[int] = frozenset()) -> str:
        """Why no replica can take a request (the 503's message)."""
        if exclude and len(exclude) >= len(self.known()) > 0:
            return f"every replica of stage {self.stage} failed this request"
        active = self.active()
        if not active:
            return f"stage {self.stage} has no replica (its DNS name resolves to no address yet)"
        refused = [r.refused for r in active if r.refused is not None]
        why = f"; {'; '.join(refused)}" if refused else ""
        return f"no replica of stage {self.stage} has answered ({', '.join(r.address for r in active)}){why}"

    def mark_down(self, replica: Replica, why: str) -> None:
        """A call to `replica` failed in a way another replica may not (it is unreachable, or full)."""
        delay = min(MAX_DOWN_BACKOFF_S, DOWN_BACKOFF_S * 2 ** replica.failures)
        replica.failures += 1
        replica.down_until = self.clock() + delay
        if len(self.replicas) > 1:
            log.warning("gateway: %s failed a call (%s); new requests go to the other replicas for %.1f s",
                        replica.label, why, delay)

    async def refresh(self, timeout_s: float = 2.0) -> list[Replica]:
        """Read Info from the replicas that have not answered yet (late starters) -> the ones adopted now."""
        adopted = []
        for replica in self.active():
            if replica.info is not None:
                continue
            try:
                info = await replica.client.info(timeout_s=timeout_s)
            except StageCallError:
                continue
            if self.adopt(replica, info):
                adopted.append(replica)
        return adopted

    async def serving(self) -> dict[str, bool]:
        """Each replica's gRPC health, by address."""
        replicas = self.active()
        states = await asyncio.gather(*(r.client.serving() for r in replicas))
        return {r.address: bool(ok) and r.refused is None for r, ok in zip(replicas, states)}

    async def close(self) -> None:
        for replica in self.replicas:
            await replica.client.close()


def _differences(a: stage_pb2.StageInfo, b: stage_pb2.StageInfo) -> str:
    out = []
    for name in SHARED_INFO_FIELDS:
        va, vb = getattr(a, name), getattr(b, name)
        if name in ("speakers", "window_schedule"):
            va, vb = list(va), list(vb)
        if va != vb:
            out.append(f"{name} {vb!r} vs {va!r}")
    return ", ".join(out)


RETRY_CODES = frozenset({grpc.StatusCode.UNAVAILABLE.value[0], grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]})
