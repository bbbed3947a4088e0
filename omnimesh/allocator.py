"""Which malloc an omnimesh process runs on: tcmalloc where it is installed, else glibc's.

Role: on CPU every engine step and every gRPC message allocates and frees many small buffers (tensors of a
few KiB, protobuf messages), so the allocator sits on the hot path. tcmalloc's per-thread caches measured
+6-13% requests/s at 1, 8 and 16 concurrent requests on the tiny model here, in paired runs (time to first
audio within the noise; `transformers` gains ~11% too: README "Benchmarks"); vLLM's CPU guide preloads it.

A process cannot change its allocator once it runs, so the choice is made at start: `omnimesh stage`,
`omnimesh gateway` and the benchmarks call `use_allocator` before any other work. When the mode asks for
tcmalloc and the process does not run on it yet, it re-executes itself (same pid, same argv) with the
library in LD_PRELOAD; the processes it starts later (a stage's rank workers) inherit that. `--malloc`:
  * auto (default): tcmalloc if installed, for the gateway and for stages on CPU; stages on CUDA keep
    glibc's (their host allocations are off the hot path, and tcmalloc is not measured there);
  * tcmalloc: required (the process fails at start, saying what to install, when it is missing);
  * system: whatever the process was started with (an operator's own LD_PRELOAD included).
Data flow: mode + device -> `wanted` -> `find_tcmalloc` -> LD_PRELOAD + execve -> `loaded()` in the start-up
log (read from /proc/self/maps, so it reports what really runs).
"""

from __future__ import annotations

import ctypes.util
import logging
import os
import sys

log = logging.getLogger(__name__)

MALLOC_CHOICES = ("auto", "tcmalloc", "system")
INSTALL_HINT = "install it with `apt-get install libtcmalloc-minimal4` (Debian/Ubuntu) or gperftools' package"
_REEXEC_MARK = "OMNIMESH_MALLOC_REEXEC"  # set across the re-exec: never loop when the preload does not take
_KNOWN = ("tcmalloc", "jemalloc", "mimalloc")


def find_tcmalloc() -> str | None:
    """The tcmalloc library's name as the dynamic loader finds it (the minimal build first), or None."""
    for name in ("tcmalloc_minimal", "tcmalloc"):
        found = ctypes.util.find_library(name)
        if found:
            return found
    return None


def loaded(pid: int | str = "self") -> str:
    """The allocator process `pid` runs on: tcmalloc, jemalloc or mimalloc when one of them is mapped into it,
    else glibc (unknown where /proc is missing)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            maps = f.read()
    except OSError:
        return "unknown"
    for name in _KNOWN:
        if f"lib{name}" in maps:
            return name
    return "glibc"


def release_free_memory() -> str | None:
    """Hand the pages the allocator keeps free back to the OS: tcmalloc's `MallocExtension_ReleaseFreeMemory`
    (it keeps what was freed for reuse: a gateway that built eight 10-minute clips' features stayed at 3.2 GB),
    glibc's `malloc_trim(0)`. Returns which ran (None: neither is there). ~30 ms for 400 MB."""
    process = ctypes.CDLL(None)
    release = getattr(process, "MallocExtension_ReleaseFreeMemory", None)
    if release is not None:
        release()
        return "tcmalloc"
    trim = getattr(process, "malloc_trim", None)
    if trim is not None:
        trim(0)
        return "glibc"
    return None


def check_mode(mode: str) -> None:
    """ValueError naming the choices unless `mode` is one of MALLOC_CHOICES (ServeArgs checks --malloc here)."""
    if mode not in MALLOC_CHOICES:
        raise ValueError(f"--malloc must be one of {', '.join(MALLOC_CHOICES)}, got {mode!r}")


def wanted(mode: str, device: str | None) -> bool:
    """Whether a process in `mode` on `device` (None: no model device, the gateway) should run on tcmalloc."""
    check_mode(mode)
    if mode == "tcmalloc":
        return True
    return mode == "auto" and (device is None or not device.startswith("cuda"))


def reexec_with_allocator(mode: str, device: str | None) -> None:
    """Re-execute this process on tcmalloc when `wanted` and it is not on it yet; returns when nothing is to
    be done (or it cannot be done: auto without the library goes on with glibc's, logged). Raises
    RuntimeError when mode is tcmalloc and the library is missing."""
    if not wanted(mode, device):
        return
    current = loaded()
    if current == "tcmalloc":
        return
    if current in _KNOWN and mode == "auto":
        return  # the operator preloaded another allocator on purpose
    library = find_tcmalloc()
    if library is None:
        if mode == "tcmalloc":
            raise RuntimeError(f"--malloc tcmalloc: the tcmalloc library is not installed; {INSTALL_HINT}")
        log.info("tcmalloc is not installed: running on %s's malloc (%s for faster CPU serving)", current, INSTALL_HINT)
        return
    if os.environ.get(_REEXEC_MARK):
        log.warning("LD_PRELOAD=%s did not load %s; running on %s's malloc", os.environ.get("LD_PRELOAD"), library,
                    current)
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join(p for p in (library, env.get("LD_PRELOAD", "")) if p)
    env[_REEXEC_MARK] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)  # same interpreter options and argv


def use_allocator(mode: str, device: str | None, role: str = "this process") -> str:
    """`reexec_with_allocator`, then the allocator this process runs on, logged once at start-up as `role`'s."""
    reexec_with_allocator(mode, device)
    name = loaded()
    log.info("%s runs on %s's malloc (--malloc %s)", role, name, mode)
    return name
