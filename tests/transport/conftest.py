"""Fixtures of the transport tests: small transports/arenas that are always closed, and a check after
every test that none of the shared-memory regions it created is left in /dev/shm."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator

import pytest
from transport_testlib import TAG, our_region_files

from omnimesh.transport.host_id import shm_available
from omnimesh.transport.shm_arena import ShmArena
from omnimesh.transport.transport import Transport

if not shm_available():
    pytest.skip("no writable /dev/shm", allow_module_level=True)


@pytest.fixture(autouse=True)
def no_region_left() -> Iterator[None]:
    before = set(our_region_files())  # a crashed earlier run's leftovers are not this test's fault
    yield
    gc.collect()
    left = sorted(set(our_region_files()) - before)
    assert not left, f"test left shared-memory regions behind: {left}"


@pytest.fixture()
def make_transport() -> Iterator[Callable[..., Transport]]:
    made: list[Transport] = []

    def make(name: str = "t", preference: str = "shm", arena_bytes: int = 4 * 2**20, min_ref_bytes: int = 0) -> Transport:
        t = Transport(f"{TAG}-{name}", preference, arena_bytes, min_ref_bytes)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


@pytest.fixture()
def make_arena() -> Iterator[Callable[..., ShmArena]]:
    made: list[ShmArena] = []

    def make(name: str = "a", size: int = 2**20, max_slots: int = 64) -> ShmArena:
        a = ShmArena(f"{TAG}-{name}", size, max_slots)
        made.append(a)
        return a

    yield make
    for a in made:
        a.close()
