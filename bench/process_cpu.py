"""Where a benchmark's CPU goes: CPU seconds of every process of a running mesh, by role, from /proc.

Role: the benchmarks' accounting of a CPU-bound run (which stage spends the cores). `CpuMeter(root_pid)`
snapshots user + system time of the root process and all its descendants; `stop()` returns the seconds
spent since `start()`, summed per role: the stage a process is (or whose ranks it runs: a process counts
for its nearest ancestor whose command line names `stage <name>`), `gateway`, or `serve` (the launcher).
A process that ended between the snapshots is missed (its time is gone from /proc). Linux only: elsewhere
`available()` is False and the benchmarks skip the table.

`waits()` tells how long the threads waited for a core: per role and thread class (`urgent`: a stage's
"X-compute" threads, where steps with a request waiting for its first output run; `bulk`: its "X-bulk"
threads; `other`: the rest, event loops and gRPC), the seconds they ran and the seconds they sat runnable on
a run queue since `start()` (/proc/PID/task/TID/schedstat; empty where the kernel keeps no schedstat).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_PROC = Path("/proc")
_STAGE = re.compile(r"\bstage (\w+)")
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def available() -> bool:
    return (_PROC / "self" / "stat").exists()


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, user + system CPU seconds) of a process, None once it is gone."""
    try:
        fields = (_PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK


def _role(pid: int) -> str | None:
    try:
        cmd = (_PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    stage = _STAGE.search(cmd)
    if stage:
        return stage.group(1)
    return "gateway" if " gateway " in f" {cmd} " else None


def _tree(root: int) -> dict[int, str]:
    """Every live descendant of `root` (root included) -> its role."""
    parents: dict[int, int] = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit():
            st = _stat(int(entry.name))
            if st is not None:
                parents[int(entry.name)] = st[0]
    roles: dict[int, str] = {}

    def role_of(pid: int) -> str | None:
        if pid in roles:
            return roles[pid]
        if pid == root:
            return "serve"
        parent = parents.get(pid)
        if parent is None or parent <= 1:
            return None  # not under root
        up = role_of(parent)
        if up is None:
            return None
        own = _role(pid)
        roles[pid] = own if own is not None else up
        return roles[pid]

    for pid in parents:
        r = role_of(pid)
        if r is not None:
            roles[pid] = r
    roles[root] = "serve"
    return roles


def allocators(root_pid: int) -> dict[str, str]:
    """role -> the malloc its processes run on (`omnimesh.allocator.loaded`; several joined by '+')."""
    from omnimesh.allocator import loaded

    found: dict[str, set[str]] = {}
    for pid, role in _tree(root_pid).items():
        found.setdefault(role, set()).add(loaded(pid))
    return {role: "+".join(sorted(names)) for role, names in sorted(found.items())}


def thread_class(comm: str) -> str:
    """A thread's class from its OS name (the engine names its compute threads, see EngineLoop)."""
    if comm.endswith("-compute"):
        return "urgent"
    return "bulk" if comm.endswith("-bulk") else "other"


def _schedstats(pid: int) -> dict[int, tuple[str, float, float]]:
    """Every thread of `pid` -> (its class, seconds run, seconds waited runnable); {} when unreadable."""
    out: dict[int, tuple[str, float, float]] = {}
    try:
        tids = [int(t) for t in os.listdir(_PROC / str(pid) / "task")]
    except OSError:
        return out
    for tid in tids:
        task = _PROC / str(pid) / "task" / str(tid)
        try:
            comm = (task / "comm").read_text().strip()
            run_ns, wait_ns = (task / "schedstat").read_text().split()[:2]
        except (OSError, ValueError):
            continue
        out[tid] = (thread_class(comm), int(run_ns) / 1e9, int(wait_ns) / 1e9)
    return out


class CpuMeter:
    """CPU seconds per role of `root_pid`'s process tree between `start()` and `stop()`."""

    def __init__(self, root_pid: int) -> None:
        self.root = root_pid
        self._start: dict[int, float] = {}
        self._threads: dict[tuple[int, int], tuple[str, float, float]] = {}

    def start(self) -> None:
        tree = _tree(self.root)
        self._start = {pid: st[1] for pid in tree if (st := _stat(pid)) is not None}
        self._threads = {(pid, tid): v for pid in tree for tid, v in _schedstats(pid).items()}

    def waits(self) -> dict[str, dict[str, tuple[float, float]]]:
        """role -> thread class -> (seconds run, seconds waited for a core) since `start()`, over the threads
        alive now (one that ended has no schedstat left to read; the engine's live as long as their stage)."""
        out: dict[str, dict[str, tuple[float, float]]] = {}
        for pid, role in _tree(self.root).items():
            for tid, (cls, run, wait) in _schedstats(pid).items():
                _, run0, wait0 = self._threads.get((pid, tid), (cls, 0.0, 0.0))
                r, w = out.setdefault(role, {}).get(cls, (0.0, 0.0))
                out[role][cls] = (r + run - run0, w + wait - wait0)
        return out

    def stop(self) -> dict[str, float]:
        spent: dict[str, float] = {}
        for pid, role in _tree(self.root).items():
            st = _stat(pid)
            if st is not None:
                spent[role] = spent.get(role, 0.0) + st[1] - self._start.get(pid, 0.0)
        return spent
