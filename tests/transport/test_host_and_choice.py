"""Host identity and the per-edge transport choice.

- `host_id()` is stable in a process and the same in another process of this host (one /dev/shm);
- a reference from another host is refused with a FrameError naming host, tensor and request, and is
  not claimed (its producer can still take it back);
- `remove_stale_regions()` removes the region of a producer process that died without unlinking it,
  never one whose producer lives (in this process or another);
- `choose_transport`: auto -> shm (cpu) / cuda-ipc (cuda) on one host, grpc across hosts; a forced shm or
  cuda-ipc across hosts is a ValueError that says what to do; grpc stays grpc; a grpc-only Transport
  has no arena and encodes inline;
- a /dev/shm too small for the arena: `auto` starts without one (inline gRPC, Info says grpc) and leaves
  no file behind, a forced `shm` refuses to start with a message naming the fix."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import torch
from transport_testlib import REPO, TAG, over_wire, python_child, read_line

from omnimesh.transport.chunk_codec import ChunkAssembler
from omnimesh.transport.frames import FrameError, StageChunk
from omnimesh.transport.host_id import SHM_DIR, host_id
from omnimesh.transport.shm_region import PUBLISHED, RegionError, RegionReader, remove_stale_regions
from omnimesh.transport.transport import Transport, check_preference, choose_transport


def test_host_id_stable_and_shared_with_another_process() -> None:
    hid = host_id()
    assert hid and hid == host_id() and not hid.startswith("private-")
    assert (SHM_DIR / "omnimesh-host-id").read_text().strip() == hid
    out = subprocess.run([sys.executable, "-c", "from omnimesh.transport.host_id import host_id; print(host_id())"],
                         capture_output=True, text=True, cwd=REPO, timeout=60, check=True)
    assert out.stdout.strip() == hid


def test_reference_from_another_host_is_refused(make_transport) -> None:
    producer = make_transport("host")
    arena = producer.arena
    assert arena is not None
    part = over_wire(producer.encoder("shm", "req-far").parts(StageChunk(tensors={"latents": torch.ones(8)}))[0])
    ref = part.tensors[0].shm
    assert ref.host_id == host_id()
    ref.host_id = "f" * 32
    with pytest.raises(FrameError, match=r"tensor 'latents' of request req-far: .*host ffffffffffff.*--transport grpc"):
        ChunkAssembler(RegionReader(), "req-far").add(part)
    assert int(arena.region.table["state"][ref.slot]) == PUBLISHED  # never claimed
    arena.end_request("req-far", cancelled=True)
    assert arena.free_bytes() == arena.size and arena.live_slots == 0


_CREATE = """
import json, os, sys, time
from omnimesh.transport.shm_region import Region
tag, wait = json.loads(sys.argv[1])
region = Region.create(tag, max_slots=4, data_size=4096)
print(region.name, flush=True)
if wait:
    time.sleep(60)
os._exit(0)  # no unlink, no cleanup: as if the process crashed
"""


def test_remove_stale_regions_spares_live_ones(make_arena) -> None:
    ours = make_arena("live-here")
    alive = python_child(_CREATE, f"{TAG}-stale-alive", True)
    try:
        alive_name = read_line(alive)  # created first: its own start-up sweep must not meet the dead one
        dead = python_child(_CREATE, f"{TAG}-stale-dead", False)
        dead_name = read_line(dead)
        dead.communicate(timeout=30)
        assert dead.returncode == 0
        assert (SHM_DIR / dead_name).exists() and (SHM_DIR / alive_name).exists()
        remove_stale_regions()  # (another process may have removed the dead one first: check the files)
        assert not (SHM_DIR / dead_name).exists()
        assert (SHM_DIR / alive_name).exists()
        assert (SHM_DIR / ours.name).exists()
    finally:
        alive.send_signal(signal.SIGKILL)
        alive.communicate(timeout=30)
        remove_stale_regions()
    assert not (SHM_DIR / alive_name).exists()
    assert (SHM_DIR / ours.name).exists()


@pytest.mark.parametrize(("preference", "device", "same_host", "expected"), [
    ("auto", "cpu", True, "shm"),
    ("auto", "cuda", True, "cuda-ipc"),
    ("auto", "cpu", False, "grpc"),
    ("auto", "cuda", False, "grpc"),
    ("grpc", "cpu", True, "grpc"),
    ("grpc", "cuda", True, "grpc"),
    ("grpc", "cuda", False, "grpc"),
    ("shm", "cuda", True, "shm"),
    ("cuda-ipc", "cuda", True, "cuda-ipc"),
])
def test_choose_transport(preference: str, device: str, same_host: bool, expected: str) -> None:
    assert choose_transport("thinker", preference, "host-a", device, "talker", "host-a" if same_host else "host-b") \
        == expected


@pytest.mark.parametrize("preference", ["shm", "cuda-ipc"])
def test_forced_shared_memory_across_hosts_is_an_error(preference: str) -> None:
    with pytest.raises(ValueError, match=rf"stage thinker is set to --transport {preference}.*talker.*"
                                         r"use --transport auto or grpc"):
        choose_transport("thinker", preference, "aaaa", "cpu", "talker", "bbbb")


def test_unknown_preference() -> None:
    with pytest.raises(ValueError, match="must be one of auto, grpc, shm, cuda-ipc, got 'tcp'"):
        choose_transport("thinker", "tcp", "h", "cpu", "talker", "h")
    with pytest.raises(ValueError, match="--transport must be one of"):
        check_preference("nvlink")


def test_grpc_transport_has_no_arena(make_transport) -> None:
    t = make_transport("grpc-only", preference="grpc")
    assert t.arena is None and t.effective == "grpc"
    parts = t.encoder("shm", "req-g").parts(StageChunk(tensors={"x": torch.ones(3)}))
    assert parts[0].tensors[0].WhichOneof("payload") == "data"
    assert t.release("req-g") == 0


def test_no_room_in_dev_shm(monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import os

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    before = {p.name for p in SHM_DIR.iterdir()}
    auto = Transport(f"{TAG}-full", "auto", 2**20)
    assert auto.arena is None and auto.effective == "grpc"
    assert auto.encoder("shm", "r").mode == "grpc"  # a caller asking for shm still gets correct (inline) frames
    with pytest.raises(RegionError, match=r"cannot reserve .* --shm-arena-size.*--shm-size"):
        Transport(f"{TAG}-full", "shm", 2**20)
    assert {p.name for p in SHM_DIR.iterdir()} == before  # the half-built region file is gone
