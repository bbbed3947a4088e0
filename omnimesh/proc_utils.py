"""Small process helpers shared by the mesh launcher and the rank executor."""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import socket
import sys
from collections.abc import Collection

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15


RESERVED_PORTS_ENV = "OMNIMESH_RESERVED_PORTS"  # the stage ports `omnimesh serve` handed out, comma-separated


def free_port(host: str = "127.0.0.1", avoid: Collection[int] = ()) -> int:
    """A port the OS says is free now (another process may still take it before it is bound), none of `avoid` nor
    of $OMNIMESH_RESERVED_PORTS: a stage binds the port the launcher gave it only once it has loaded, and until
    then the OS would hand it out again, e.g. to a stage's own rank rendezvous (seen: the talker's gRPC bind failed)."""
    reserved = set(avoid) | {int(p) for p in os.environ.get(RESERVED_PORTS_ENV, "").split(",") if p.strip().isdigit()}
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port: int = s.getsockname()[1]
        if port not in reserved:
            return port


def _prctl(option: int, arg: int | bytes) -> None:
    """Linux's prctl(2) on the calling thread or process; a no-op where there is no glibc."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, arg)
    except OSError:
        pass


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send `sig` to this process when its parent dies (no-op elsewhere)."""
    _prctl(PR_SET_PDEATHSIG, sig)


def name_thread(name: str) -> None:
    """Give the calling thread an OS name (Linux, 15 bytes at most), so `top -H` and `ps -L` tell the
    threads of a stage apart (no-op elsewhere)."""
    _prctl(PR_SET_NAME, name.encode()[:15])


def thread_priority_is_own() -> bool:
    """Whether the OS keeps a nice value per thread (Linux), so one thread can lower its own priority alone;
    elsewhere `setpriority` on "this process" would lower every thread of it."""
    return sys.platform.startswith("linux")


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MALLOC_MMAP_THRESHOLD = 32 * 2**20  # glibc's ceiling for it on 64-bit hosts
MALLOC_TRIM_THRESHOLD = 256 * 2**20


def tune_malloc() -> bool:
    """Keep freed message buffers in the heap (glibc): every gRPC message of a tensor stream allocates
    megabytes, and glibc's defaults hand them back to the OS, so each copy pays fresh page faults (inline
    gRPC hand-off ~0.5 GB/s here instead of >1 GB/s). Costs up to MALLOC_TRIM_THRESHOLD of freed memory kept
    per process. A GLIBC_TUNABLES / MALLOC_*_ environment set by the operator wins. False when not glibc.
    A process re-executed on tcmalloc (`--malloc`, omnimesh/allocator.py) does not allocate through glibc's
    malloc, so this changes nothing there; tcmalloc keeps freed memory in its own caches."""
    if os.environ.get("GLIBC_TUNABLES") or os.environ.get("MALLOC_MMAP_THRESHOLD_") or os.environ.get("MALLOC_TRIM_THRESHOLD_"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD)) and bool(
            libc.mallopt(M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD))
    except (OSError, AttributeError):
        return False


def freeze_startup_heap() -> int:
    """Once a server has loaded what it keeps for its whole life (imports, model modules, tokenizer,
    processor): collect once, then move every surviving object into Python's permanent generation
    (`gc.freeze`), so that no later collection scans them. A stage or gateway process holds ~400k tracked
    objects after start-up, and a full collection over them takes ~0.2 s on this CPU, with the GIL held:
    every thread of the process (the event loop, the steps) stops for it, once every few minutes under load.
    After the freeze a collection scans only what serving made. Returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()

