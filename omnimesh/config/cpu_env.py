"""The CPU tuning environment variables, parsed in one place without importing torch.

`OMNIMESH_CPU_KERNELS` (auto | 0 | 1, with on/off spellings): whether the fused CPU kernels are built and used
(omnimesh/kernels/cpu_kernels.py); `OMNIMESH_CPU_THREADS` (a whole number >= 1): each CPU stage's intra-op
threads (omnimesh/server/stage_server.py, default: the cores shared evenly by the four stages).
`ServeArgs` reads both when the flags are read, so a wrong value stops `omnimesh serve` / `stage` with exit 2
before any stage starts, instead of each stage failing with a traceback once it is up.
"""

from __future__ import annotations

import os

KERNELS_ENV = "OMNIMESH_CPU_KERNELS"
THREADS_ENV = "OMNIMESH_CPU_THREADS"
STAGES_PER_HOST = 4  # the cores are shared by a mesh's four stages


def kernels_mode() -> str:
    """auto (default: build, warn and run eager if that fails), off or on (required); ValueError otherwise."""
    value = os.environ.get(KERNELS_ENV, "auto").strip().lower()
    if value in ("", "auto"):
        return "auto"
    if value in ("0", "off", "false", "no"):
        return "off"
    if value in ("1", "on", "true", "yes"):
        return "on"
    raise ValueError(f"{KERNELS_ENV}={os.environ[KERNELS_ENV]!r}: use auto, 0 (eager PyTorch) or 1 (required)")


def cpu_threads() -> int:
    """Intra-op threads for a CPU stage: OMNIMESH_CPU_THREADS, else an even share of the cores between the
    four stages of a mesh on this host (oversubscribed OpenMP threads make small ops ~20x slower)."""
    text = os.environ.get(THREADS_ENV)
    if text:
        if not text.strip().isdigit() or int(text) < 1:
            raise ValueError(f"{THREADS_ENV} must be a whole number >= 1, got {text!r}")
        return int(text)
    return max(1, (os.cpu_count() or 1) // STAGES_PER_HOST)
