"""Builds, loads and dispatches omnimesh's fused CPU kernels (`omnimesh/csrc/cpu_kernels.cpp`).

Role: on CPU a small decoder step is mostly fixed per-op cost, so the model layers hand their small per-token
work to a handful of C++ kernels (`torch.ops.omnimesh.*`: RMSNorm, q/k norm + RoPE, M-RoPE tables, attention
over a small or paged cache, silu * up, a small MoE step, greedy sampling with a repetition penalty, and the
vocoder's SnakeBeta). This module compiles that file once per machine
with `torch.utils.cpp_extension` (g++ and ninja; ~10 s) into the omnimesh cache, keyed by the source, torch
and the CPU's instruction set, and loads it into every process that runs a model on the CPU.

Data flow: a model layer built for a CPU device calls `prepare(device)` (the first call builds or loads,
later calls return at once) and, per call, `use(x)` says whether the kernels take this tensor (loaded, CPU,
float32; the attention, paged-decode and MoE layers add a size limit past which aten's algorithm wins);
otherwise the layer runs its eager PyTorch code, which stays the reference (tests/kernels compare both).
A kernel spreads a large call over the process's intra-op threads and runs a small one inline.

`OMNIMESH_CPU_KERNELS`: `auto` (default: build, and on failure warn once and run eager), `0` (never: eager
PyTorch), `1` (required: a failed build is an error). `python -m omnimesh.kernels.cpu_kernels` builds ahead
of time (scripts/setup.sh does) and prints what it loaded.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import platform
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from omnimesh.config.cpu_env import KERNELS_ENV as ENV
from omnimesh.config.cpu_env import kernels_mode as mode
from omnimesh.tiny_cache import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parents[1] / "csrc" / "cpu_kernels.cpp"
_state: str | None = None  # None: not tried; "loaded"; else why not
ready = False  # the kernels are loaded in this process and not `disabled` (what `use` reads)
_off = 0  # `disabled` blocks open


class KernelsUnavailable(RuntimeError):
    """OMNIMESH_CPU_KERNELS=1 and the kernels could not be built or loaded."""


def cpu_flags() -> list[str]:
    """Compiler flags for this CPU: the x86-64 microarchitecture level its instruction set reaches, so the
    kernels use AVX-512 / AVX2 + FMA where present and the build is keyed by it (a cache shared by other
    hosts never loads code their CPU cannot run)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return ["-O3"]
    try:
        line = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags"))
        have = set(line.split(":", 1)[1].split())
    except (OSError, StopIteration):
        return ["-O3"]
    if {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma", "bmi2"} <= have:
        return ["-O3", "-march=x86-64-v4"]
    if {"avx2", "fma", "bmi2", "movbe"} <= have:
        return ["-O3", "-march=x86-64-v3"]
    return ["-O3", "-march=x86-64-v2"] if {"sse4_2", "popcnt"} <= have else ["-O3"]


def build_key(flags: list[str]) -> str:
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), " ".join(flags).encode(), sys.version.encode()):
        digest.update(part)
    return digest.hexdigest()[:16]


def load() -> bool:
    """Build (first time on this machine) or load the kernels into this process; True when they are in use.
    Never raises under `auto` (a failure is logged once and the layers stay eager)."""
    global _state, ready
    if _state is not None:
        return ready
    if mode() == "off":
        _state = f"{ENV}=0"
        log.info("omnimesh CPU kernels off (%s): eager PyTorch ops", _state)
        return False
    try:
        _load()
    except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, a build error: eager is always right
        _state = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        if mode() == "on":
            raise KernelsUnavailable(f"omnimesh CPU kernels could not be built or loaded ({_state}); install g++ "
                                     f"and ninja, or set {ENV}=auto to run eager PyTorch instead") from exc
        log.warning("omnimesh CPU kernels unavailable (%s); running eager PyTorch ops, slower on small steps. "
                    "Install g++ and ninja (pip install ninja) to build them, or set %s=0 to silence this",
                    _state, ENV)
        return False
    _state, ready = "loaded", _off == 0
    return ready


def _load() -> None:
    flags = cpu_flags()
    key = build_key(flags)
    name = f"omnimesh_cpu_kernels_{key}"
    build_dir = cache_root() / "kernels" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    library = build_dir / f"{name}.so"
    started = time.monotonic()
    # one builder per machine at a time; flock is released by the kernel if the builder dies, unlike the
    # lock file torch's builder leaves behind (removed here, under our lock, when a dead build left it)
    with open(build_dir / "omnimesh.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        built = library.exists()
        if not built:
            (build_dir / "lock").unlink(missing_ok=True)
            log.info("building omnimesh CPU kernels (once per machine, ~10 s): %s %s", SOURCE.name, " ".join(flags))
            from torch.utils.cpp_extension import load as build

            build(name=name, sources=[str(SOURCE)], extra_cflags=flags, build_directory=str(build_dir),
                  is_python_module=False, verbose=False)
        else:
            torch.ops.load_library(str(library))
    log.info("omnimesh CPU kernels %s in %.1fs (%s)", "loaded" if built else "built and loaded",
             time.monotonic() - started, " ".join(flags))


def prepare(device: torch.device | str) -> bool:
    """`load` when `device` is the CPU (model layers call it when built); False elsewhere."""
    return torch.device(device).type == "cpu" and load()


def status() -> str:
    """'loaded', or why the kernels are not in use ('not loaded' before `load`)."""
    return _state or "not loaded"


def ops() -> torch._ops._OpNamespace:
    """`torch.ops.omnimesh`, the kernels (after a successful `load`)."""
    return torch.ops.omnimesh


def use(x: torch.Tensor) -> bool:
    """Whether a kernel takes `x`: the kernels are loaded and `x` is a float32 CPU tensor. (Each layer adds
    its own size rule where aten's algorithm wins on large inputs: attention, the paged decode, the MoE.)"""
    return ready and x.dtype is torch.float32 and x.device.type == "cpu"


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Eager PyTorch inside the block, loaded or not (tests: the reference the kernels are checked against);
    `load` and `prepare` say False inside it."""
    global ready, _off
    _off += 1
    ready = False
    try:
        yield
    finally:
        _off -= 1
        ready = _off == 0 and _state == "loaded"


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        ok = load()
    except KernelsUnavailable as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"omnimesh CPU kernels: {status()}" + ("" if ok else " (eager PyTorch ops will run instead)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
