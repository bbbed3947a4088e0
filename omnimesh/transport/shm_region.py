"""A shared-memory region with a slot table: the common ground of the shm arena and CUDA IPC hand-offs.

Role: a producer publishes tensors into slots; consumers on the same host claim and release them; nothing
is ever freed while a consumer may still read it, and nothing leaks when a consumer dies.

Layout of `/dev/shm/<name>` (created once per producer process, reused for every tensor):
    header (4 KiB)  magic, max_slots, data offset and size
    slot table      max_slots x SLOT_DTYPE: state, generation, offset, nbytes, deadline
    data            (arena only) the tensors' bytes, 64-byte aligned

Slot life: FREE -> PUBLISHED (producer wrote it; a frame now references slot + generation) -> MAPPED
(a consumer claimed it) -> RELEASED (the consumer dropped it) -> FREE (the producer's sweep). Each
publication bumps the slot's generation, so a stale reference (a cancelled request's frame arriving late)
is refused instead of reading reused bytes.

Mutual exclusion uses open-file-description (OFD) byte-range locks on one byte per slot, far past the end
of the file: a consumer holds a shared lock while it maps a slot (and for as long as its tensor lives);
the producer takes an exclusive lock to publish a slot or to reclaim one nobody released. The kernel drops
a dead process's locks, so "MAPPED but lockable" means the consumer died: the producer's deep sweep takes
the slot back. An exclusive lock on the liveness byte, held by the producer for its lifetime, tells a later
process that a leftover region's owner is gone (`remove_stale_regions`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import re
import struct
import time
import weakref

import numpy as np

from omnimesh.transport.host_id import SHM_DIR, host_id

log = logging.getLogger(__name__)

MAGIC = b"OMNIRGN1"
HEADER_BYTES = 4096
ALIGN = 64
FREE, PUBLISHED, MAPPED, RELEASED = 0, 1, 2, 3
SLOT_DTYPE = np.dtype([("state", "<u4"), ("pad", "<u4"), ("generation", "<u8"), ("offset", "<u8"),
                       ("nbytes", "<u8"), ("deadline", "<f8"), ("reserved", "<u8")])
_HEADER = struct.Struct("<8sIIQQ")  # magic, version, max_slots, data_offset, data_size
_LOCK_BASE = 1 << 40  # lock bytes live past any real file size
_LIVENESS = _LOCK_BASE - 1
PREFIX = "omnimesh-rgn-"
_NAME_RE = re.compile(r"^omnimesh-rgn-[A-Za-z0-9_.-]{1,200}$")


class RegionError(RuntimeError):
    """A region that cannot be created or opened (no /dev/shm space, a foreign or corrupt file)."""


class StaleSlot(RegionError):
    """A reference to a slot its producer took back (its request cancelled, the frame released or expired)."""


def _flock(fd: int, kind: int, start: int, wait: bool) -> bool:
    """An OFD byte-range lock on one byte (kind: F_RDLCK, F_WRLCK or F_UNLCK); False when it is held."""
    arg = struct.pack("hhqqi4x", kind, os.SEEK_SET, start, 1, 0)
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK, arg)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def valid_name(name: str) -> bool:
    return bool(_NAME_RE.match(name))


class Region:
    """One mapped region file: header, slot table, optional data area, lock helpers. Both sides use it."""

    def __init__(self, name: str, fd: int, mm: mmap.mmap, max_slots: int, data_offset: int, data_size: int):
        self.name = name
        self.fd = fd
        self.mm = mm
        self.max_slots = max_slots
        self.data_offset = data_offset
        self.data_size = data_size
        self.table = self.new_table()
        # Slots this descriptor has claimed and not released. OFD locks do not count: one unlock drops the
        # lock however often it was taken, so a failed claim or a discard of a slot held here must not unlock.
        self._held: set[int] = set()

    def new_table(self) -> np.ndarray:
        """The slot table: a (max_slots,) structured view of the mapping."""
        return np.ndarray((self.max_slots,), dtype=SLOT_DTYPE, buffer=self.mm, offset=HEADER_BYTES)

    # -- creation / opening -------------------------------------------------------------------------------
    @classmethod
    def create(cls, tag: str, max_slots: int, data_size: int) -> Region:
        """A fresh region owned by this process (removed by `unlink`)."""
        remove_stale_regions()
        name = f"{PREFIX}{re.sub(r'[^A-Za-z0-9_.-]', '_', tag)}-{os.getpid()}-{os.urandom(4).hex()}"
        table_bytes = max_slots * SLOT_DTYPE.itemsize
        data_offset = _round_up(HEADER_BYTES + table_bytes, 4096)
        total = data_offset + _round_up(data_size, 4096)
        path = SHM_DIR / name
        building = SHM_DIR / f".{name}.new"  # not a region name until locked and complete: never taken for stale
        fd = os.open(building, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, total)  # reserve now: touching a page past a full tmpfs is SIGBUS
            except OSError as exc:
                raise RegionError(
                    f"cannot reserve {total / 2**20:.0f} MiB in {SHM_DIR} ({exc.strerror}): lower --shm-arena-size, "
                    f"free shared memory, or give the container more (docker: --shm-size; k8s: an emptyDir with "
                    f"medium: Memory at /dev/shm)") from exc
            mm = _map(fd, total)
            mm[: _HEADER.size] = _HEADER.pack(MAGIC, 1, max_slots, data_offset, data_size)
            _flock(fd, fcntl.F_WRLCK, _LIVENESS, wait=False)
            os.rename(building, path)
        except BaseException:
            os.close(fd)
            building.unlink(missing_ok=True)
            raise
        return cls(name, fd, mm, max_slots, data_offset, data_size)

    @classmethod
    def open(cls, name: str) -> Region:
        """Map a producer's region (consumer side)."""
        if not valid_name(name):
            raise RegionError(f"{name!r} is not an omnimesh shared-memory region name")
        try:
            fd = os.open(SHM_DIR / name, os.O_RDWR)
        except FileNotFoundError:
            raise RegionError(f"shared-memory region {name} does not exist (its producer stopped?)") from None
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                raise RegionError(f"shared-memory region {name} is truncated ({size} bytes)")
            mm = _map(fd, size)
            magic, _version, max_slots, data_offset, data_size = _HEADER.unpack(mm[: _HEADER.size])
            if magic != MAGIC or data_offset + data_size > size:
                mm.close()
                raise RegionError(f"shared-memory region {name} has a bad header")
        except BaseException:
            os.close(fd)
            raise
        return cls(name, fd, mm, max_slots, data_offset, data_size)

    def unlink(self) -> None:
        (SHM_DIR / self.name).unlink(missing_ok=True)

    # -- locks ------------------------------------------------------------------------------------------
    def lock_shared(self, slot: int) -> None:
        _flock(self.fd, fcntl.F_RDLCK, _LOCK_BASE + slot, wait=True)

    def lock_exclusive(self, slot: int) -> None:
        _flock(self.fd, fcntl.F_WRLCK, _LOCK_BASE + slot, wait=True)

    def try_lock_exclusive(self, slot: int) -> bool:
        return _flock(self.fd, fcntl.F_WRLCK, _LOCK_BASE + slot, wait=False)

    def unlock(self, slot: int) -> None:
        _flock(self.fd, fcntl.F_UNLCK, _LOCK_BASE + slot, wait=False)

    # -- consumer side ------------------------------------------------------------------------------------
    def claim(self, slot: int, generation: int, offset: int, nbytes: int, what: str) -> None:
        """Check that `slot` still holds this publication and mark it MAPPED; the shared lock stays held
        until `release`. Raises RegionError (naming `what`) when it was reclaimed or does not match."""
        if not 0 <= slot < self.max_slots:
            raise RegionError(f"{what}: slot {slot} is outside region {self.name} ({self.max_slots} slots)")
        held = slot in self._held  # a repeated or stale frame of a slot this process holds: keep its lock
        if not held:
            self.lock_shared(slot)
        entry = self.table[slot]
        state, gen = int(entry["state"]), int(entry["generation"])
        if held or state != PUBLISHED or gen != generation:
            if not held:
                self.unlock(slot)
            raise StaleSlot(f"{what}: slot {slot} of {self.name} no longer holds this tensor (publication "
                              f"{generation}, now {gen}, state {state}): it was released, cancelled or expired")
        if int(entry["offset"]) != offset or int(entry["nbytes"]) != nbytes:
            self.unlock(slot)
            raise RegionError(f"{what}: slot {slot} of {self.name} holds {int(entry['nbytes'])} bytes at "
                              f"{int(entry['offset'])}, the frame says {nbytes} at {offset}")
        entry["state"] = MAPPED
        self._held.add(slot)

    def release(self, slot: int) -> None:
        """The consumer is done with a claimed slot (may run on any thread: a tensor's finalizer). The slot
        leaves `_held` last, so `RegionReader.drop_dead` never closes a region under a release."""
        self.table[slot]["state"] = RELEASED
        self.unlock(slot)
        self._held.discard(slot)

    def discard(self, slot: int, generation: int) -> bool:
        """Release a publication without reading it (a frame its consumer drops); False when it was gone."""
        if not 0 <= slot < self.max_slots or slot in self._held:  # held here: its tensor still reads it
            return False
        self.lock_shared(slot)
        try:
            entry = self.table[slot]
            if int(entry["state"]) != PUBLISHED or int(entry["generation"]) != generation:
                return False
            entry["state"] = RELEASED
            return True
        finally:
            self.unlock(slot)

    def close(self) -> None:
        """Unmap (only once no tensor views it) and close: a consumer's locks go with the descriptor."""
        del self.table
        try:
            self.mm.close()
        except BufferError:
            log.warning("region %s is still viewed by tensors; leaving it mapped", self.name)
            return
        os.close(self.fd)


class RegionReader:
    """Consumer side: maps producers' regions on first use and claims / releases their slots. A region whose
    producer is gone (its liveness lock is free: it stopped, crashed or restarted under a new name) is
    unmapped once no tensor views it, and its name removed, so restarting a stage frees its arena's memory
    here too (checked when a new region appears and every `CHECK_EVERY_S`)."""

    CHECK_EVERY_S = 10.0

    def __init__(self) -> None:
        self.host_id = host_id()
        self._regions: dict[str, Region] = {}
        self._checked = time.monotonic()

    def region(self, name: str, ref_host: str, what: str) -> Region:
        if ref_host != self.host_id:
            raise RegionError(f"{what}: the tensor is in shared memory of host {ref_host[:12]}, but this process "
                              f"runs on host {self.host_id[:12]}; co-located stages only (use --transport grpc)")
        region = self._regions.get(name)
        if region is None or time.monotonic() - self._checked > self.CHECK_EVERY_S:
            self.drop_dead()
        if region is None:
            try:
                region = self._regions[name] = Region.open(name)
            except RegionError as exc:  # say which tensor of which request it was
                raise RegionError(f"{what}: {exc}") from exc
        return region

    def view(self, name: str, ref_host: str, slot: int, generation: int, offset: int, nbytes: int,
             what: str) -> memoryview:
        """A zero-copy view of a published slot (claimed); the slot is released once the view (and every
        tensor built on it) is gone."""
        region = self.region(name, ref_host, what)
        if offset % ALIGN or offset + nbytes > region.data_size:
            raise RegionError(f"{what}: bytes [{offset}, {offset + nbytes}) are outside the data of region {name}")
        region.claim(slot, generation, offset, nbytes, what)
        start = region.data_offset + offset
        view = memoryview(region.mm)[start: start + nbytes]
        weakref.finalize(view, region.release, slot)
        return view

    def drop_dead(self) -> int:
        """Unmap the regions whose producer is gone and that no tensor views any more (their names removed
        too); -> how many. A region still viewed stays until a later check."""
        self._checked = time.monotonic()
        dropped = 0
        for name, region in list(self._regions.items()):
            if not _flock(region.fd, fcntl.F_WRLCK, _LIVENESS, wait=False):
                continue  # its producer holds the liveness lock: alive
            try:
                region.unlink()  # a dead producer's leftover: nobody can publish there again
                if region._held:
                    continue  # a tensor here still holds a slot: keep it mapped for now
                del region.table  # the slot table is a view of the mapping too
                try:
                    region.mm.close()
                except BufferError:  # a tensor still views it: keep it mapped for now
                    region.table = region.new_table()
                    continue
                del self._regions[name]
                dropped += 1
            finally:
                with contextlib.suppress(OSError):
                    _flock(region.fd, fcntl.F_UNLCK, _LIVENESS, wait=False)
                if name not in self._regions:
                    os.close(region.fd)
        if dropped:
            log.info("unmapped %d shared-memory region(s) of stopped producers", dropped)
        return dropped

    def claim_only(self, name: str, ref_host: str, slot: int, generation: int, nbytes: int, what: str) -> Region:
        """Claim a slot whose bytes live elsewhere (CUDA IPC); the caller releases it with `region.release`."""
        region = self.region(name, ref_host, what)
        region.claim(slot, generation, 0, nbytes, what)
        return region

    def discard(self, name: str, ref_host: str, slot: int, generation: int) -> bool:
        try:
            region = self.region(name, ref_host, "discard")
        except RegionError:
            return False
        return region.discard(slot, generation)


def remove_stale_regions() -> int:
    """Unlink regions whose producer is gone (nobody holds their liveness lock); returns how many."""
    removed = 0
    try:
        entries = list(SHM_DIR.iterdir())
    except OSError:
        return 0
    for p in entries:  # a region whose creator died while building it (never named, never used)
        if p.name.startswith(f".{PREFIX}") and p.name.endswith(".new"):
            with contextlib.suppress(OSError):
                if time.time() - p.stat().st_mtime > 60:
                    p.unlink()
    names = [p.name for p in entries if p.name.startswith(PREFIX)]
    for name in names:
        try:
            fd = os.open(SHM_DIR / name, os.O_RDWR)
        except OSError:
            continue
        try:
            if _flock(fd, fcntl.F_WRLCK, _LIVENESS, wait=False):
                (SHM_DIR / name).unlink(missing_ok=True)
                removed += 1
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d shared-memory region(s) left by stopped processes", removed)
    return removed


def _map(fd: int, size: int) -> mmap.mmap:
    """Map shared, with the page tables filled up front (MAP_POPULATE) so no hand-off pays page faults."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to

