"""proc_utils.tune_malloc: glibc keeps freed message buffers (mallopt succeeds), and an operator's own
GLIBC_TUNABLES wins (nothing is changed). proc_utils.freeze_startup_heap: what start-up left is out of later
collections' scans, and what serving makes afterwards is still collected."""

from __future__ import annotations

import subprocess
import sys

import pytest

CODE = "from omnimesh.proc_utils import tune_malloc; print(tune_malloc())"


def _run(env_extra: dict[str, str]) -> str:
    import os

    env = {**os.environ, **env_extra}
    return subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=env, timeout=60).stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_tune_malloc_applies_and_yields_to_the_operator() -> None:
    assert _run({}) == "True"
    assert _run({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1048576"}) == "False"


FREEZE = """
import gc, json, time, weakref
from omnimesh.proc_utils import freeze_startup_heap

class Node:
    pass

kept = [[i] for i in range(300_000)]  # what a server keeps from its start-up

def full_collect_ms():
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter(); gc.collect(); best = min(best, time.perf_counter() - t)
    return best * 1e3

before = full_collect_ms()
frozen = freeze_startup_heap()
after = full_collect_ms()
scanned = {id(o) for o in gc.get_objects(2)}
a, b = Node(), Node()  # a cycle made while serving
a.other, b.other = b, a
ref = weakref.ref(a)
del a, b
gc.collect()
print(json.dumps({"frozen": frozen, "before": before, "after": after, "kept_scanned": id(kept[7]) in scanned,
                  "cycle_collected": ref() is None}))
"""


def test_freeze_startup_heap_takes_start_up_objects_out_of_collections() -> None:
    import json

    out = subprocess.run([sys.executable, "-c", FREEZE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["frozen"] >= 300_000
    assert not got["kept_scanned"]
    assert got["cycle_collected"]  # garbage made after the freeze is still found
    assert got["after"] < got["before"] / 3, got


def test_free_port_skips_the_ports_a_launcher_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """The OS may hand a stage's port out again before the stage binds it (after its load): free_port skips
    `avoid` and $OMNIMESH_RESERVED_PORTS, as each stage's rank rendezvous must."""
    import omnimesh.proc_utils as proc_utils

    offered = iter([50100, 50101, 50102, 50103])

    class FakeSocket:
        def __enter__(self) -> FakeSocket:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def bind(self, address: tuple[str, int]) -> None:
            self.port = next(offered)

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(proc_utils.socket, "socket", FakeSocket)
    monkeypatch.setenv(proc_utils.RESERVED_PORTS_ENV, "50100, 50102,")
    assert proc_utils.free_port(avoid=[50101]) == 50103
