"""SlotOwner: the producer's side of a slot table — publish, track per request, and take slots back.

Role: shared by the shm arena (slots hold bytes in the region) and the CUDA IPC exporter (slots stand
for device tensors the producer keeps alive). A slot comes back to the producer when
  - its consumer released it (state RELEASED; found by `sweep`, a vectorised scan of the table);
  - the request was cancelled and the frame never reached a consumer (`end_request(cancelled=True)`);
  - the caller dropped the frame undelivered and said so (`release`, the Stage `Release` RPC);
  - its consumer died holding it, or its request's deadline passed unclaimed (`sweep(deep=True)`); a request
    without a deadline (`--request-timeout 0`) gets one when its stream ends, UNCLAIMED_TTL_S later, for the
    frames still unclaimed then: their consumer has long had them, unless it died before claiming them (a
    gateway killed between a stage's answer and its read, a `Release` RPC that failed), and such a slot
    would otherwise stay taken until the producer exits.
Every take-back of a slot that a consumer might touch goes through the slot's exclusive lock, so a slot
being read is never reused (see `shm_region`). Single-threaded: the stage's event loop calls all of it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from omnimesh.transport.shm_region import FREE, MAPPED, PUBLISHED, RELEASED, Region

DEEP_SWEEP_EVERY_S = 2.0  # how often publishing also looks for dead consumers and expired slots
UNCLAIMED_TTL_S = 3600.0  # a deadline-less request's frames unclaimed this long after its stream ended are orphans


@dataclass(slots=True)
class Live:
    request_id: str
    generation: int
    offset: int
    nbytes: int


class SlotOwner:
    def __init__(self, region: Region):
        self.region = region
        self.name = region.name
        self._free_slots: deque[int] = deque(range(region.max_slots))
        self._live: dict[int, Live] = {}
        self._by_request: dict[str, set[int]] = {}
        self._last_deep = time.monotonic()
        self.reclaimed_unreleased = 0  # slots taken back without their consumer's release (cancel, death, expiry)

    @property
    def live_slots(self) -> int:
        return len(self._live)

    @property
    def live_bytes(self) -> int:
        """Bytes the published, not yet released slots stand for."""
        return sum(live.nbytes for live in self._live.values())

    def _take_slot(self) -> int | None:
        if not self._free_slots:
            self.sweep(deep=True)
        return self._free_slots.popleft() if self._free_slots else None

    def _publish(self, slot: int, request_id: str, offset: int, nbytes: int, deadline_unix_s: float) -> int:
        """Write the slot's entry (under its exclusive lock: a barrier for the consumer's read) -> generation."""
        region = self.region
        table = region.table
        region.lock_exclusive(slot)
        try:
            generation = int(table["generation"][slot]) + 1
            table[slot] = (PUBLISHED, 0, generation, offset, nbytes, deadline_unix_s, 0)
        finally:
            region.unlock(slot)
        self._live[slot] = Live(request_id, generation, offset, nbytes)
        self._by_request.setdefault(request_id, set()).add(slot)
        if time.monotonic() - self._last_deep > DEEP_SWEEP_EVERY_S:
            self.sweep(deep=True)
        return generation

    def _on_free(self, slot: int, live: Live) -> None:
        """Subclass hook: the slot's resources (bytes, a held tensor) are free again."""

    def _free(self, slot: int) -> None:
        live = self._live.pop(slot)
        self.region.table["state"][slot] = FREE
        slots = self._by_request.get(live.request_id)
        if slots is not None:
            slots.discard(slot)
            if not slots:
                del self._by_request[live.request_id]
        self._free_slots.append(slot)
        self._on_free(slot, live)

    def _reclaim(self, slot: int, states: tuple[int, ...]) -> bool:
        """Take back a slot nobody holds whose state is one of `states`; False when a consumer holds it."""
        region = self.region
        if not region.try_lock_exclusive(slot):
            return False
        try:
            state = int(region.table["state"][slot])
            if state == RELEASED:
                self._free(slot)
                return True
            if state not in states:
                return False
            self._free(slot)
            self.reclaimed_unreleased += 1
            return True
        finally:
            region.unlock(slot)

    def sweep(self, deep: bool = False) -> int:
        """Free released slots; `deep` also takes back those of dead consumers and of expired requests."""
        table = self.region.table
        freed = 0
        for slot in np.flatnonzero(table["state"] == RELEASED).tolist():
            if slot in self._live:
                self._free(slot)
                freed += 1
        if deep:
            self._last_deep = time.monotonic()
            now = time.time()
            for slot in np.flatnonzero(table["state"] == MAPPED).tolist():
                if slot in self._live and self._reclaim(slot, (MAPPED,)):
                    freed += 1
            deadline = table["deadline"]
            expired = np.flatnonzero((table["state"] == PUBLISHED) & (deadline > 0) & (deadline < now))
            for slot in expired.tolist():
                if slot in self._live and self._reclaim(slot, (PUBLISHED,)):
                    freed += 1
        return freed

    def sweep_due(self) -> int:
        """A sweep, deep when the last deep one is DEEP_SWEEP_EVERY_S old (a metrics scrape: a stage that publishes
        nothing more still reports the slots of a dead consumer or an expired request as free)."""
        return self.sweep(deep=time.monotonic() - self._last_deep > DEEP_SWEEP_EVERY_S)

    def end_request(self, request_id: str, cancelled: bool) -> None:
        """The request's stream ended. Cancelled: frames still unclaimed will never be read; take them back.
        Else they are on their way; those without a deadline get one, UNCLAIMED_TTL_S from now."""
        slots = self._by_request.get(request_id)
        if not slots:
            return
        if cancelled:
            for slot in list(slots):
                self._reclaim(slot, (PUBLISHED,))
            return
        table = self.region.table  # the deadline is the producer's field alone: no lock needed to set it
        late = [s for s in slots if table["deadline"][s] == 0 and table["state"][s] == PUBLISHED]
        table["deadline"][late] = time.time() + UNCLAIMED_TTL_S

    def release(self, slot: int, generation: int) -> bool:
        """A frame the caller dropped undelivered (the Release RPC); False when unknown or held."""
        live = self._live.get(slot)
        if live is None or live.generation != generation:
            return False
        return self._reclaim(slot, (PUBLISHED,))

    def requests_holding(self) -> int:
        return len(self._by_request)

    def close(self) -> None:
        """Remove the region's name (consumers that mapped it keep their views: POSIX semantics)."""
        self.region.unlink()
