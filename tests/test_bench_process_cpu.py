"""bench/process_cpu.py: a mesh's CPU by role — a stage's rank processes count for that stage.

Run: python -m pytest tests/test_bench_process_cpu.py -q
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import process_cpu

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\ntime.sleep(30)"


@pytest.mark.skipif(not process_cpu.available(), reason="needs /proc")
def test_cpu_of_a_stage_and_its_ranks_counts_for_the_stage() -> None:
    # serve -> "stage thinker" -> a rank process with no role of its own; both burn 0.4 s of CPU
    rank = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {BURN!r}]); exec({BURN!r})"
    stage = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {rank!r}, 'stage', 'thinker']); time = __import__('time'); time.sleep(30)"
    root = subprocess.Popen([sys.executable, "-c", stage], start_new_session=True)
    try:
        meter = process_cpu.CpuMeter(root.pid)
        meter.start()
        deadline = time.monotonic() + 20
        spent: dict[str, float] = {}
        while time.monotonic() < deadline:
            time.sleep(0.2)
            spent = meter.stop()
            if spent.get("thinker", 0.0) >= 0.8:
                break
        assert spent.get("thinker", 0.0) >= 0.8, spent  # the stage's 0.4 s and its rank's 0.4 s
        assert set(spent) <= {"serve", "thinker"}
    finally:
        subprocess.run(["pkill", "-KILL", "-s", str(root.pid)], check=False)
        root.wait()


def test_thread_classes_follow_the_engine_thread_names() -> None:
    assert process_cpu.thread_class("talker-compute") == "urgent"
    assert process_cpu.thread_class("thinker-bulk") == "bulk"
    assert [process_cpu.thread_class(n) for n in ("python", "event_engine", "vocoder-compute_0")] == ["other"] * 3


NAMED_BURN = ("import threading, time\n"
              "from omnimesh.proc_utils import name_thread\n"
              "def burn():\n"
              "    name_thread('thinker-compute')\n"  # as EngineLoop names its compute threads
              "    t = time.thread_time()\n"
              "    while time.thread_time() - t < 0.4: pass\n"
              # the meter reads live threads only (as the engine's, which live as long as the stage): stay
              "    time.sleep(30)\n"
              "threading.Thread(target=burn, daemon=True).start()\n"
              "time.sleep(30)")


@pytest.mark.skipif(not process_cpu.available() or not Path("/proc/self/task").exists()
                    or not any(Path("/proc/self/task").glob("*/schedstat")), reason="needs /proc schedstat")
def test_waits_count_a_named_threads_run_time_under_its_stage_and_class() -> None:
    # serve -> "stage thinker", whose thread named thinker-compute burns 0.4 s of CPU
    stage = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {NAMED_BURN!r}, 'stage', "
             "'thinker']); time.sleep(30)")
    root = subprocess.Popen([sys.executable, "-c", stage], start_new_session=True)
    try:
        meter = process_cpu.CpuMeter(root.pid)
        meter.start()
        deadline = time.monotonic() + 20
        waits: dict[str, dict[str, tuple[float, float]]] = {}
        while time.monotonic() < deadline:
            time.sleep(0.2)
            waits = meter.waits()
            if waits.get("thinker", {}).get("urgent", (0.0, 0.0))[0] >= 0.35:
                break
        run, wait = waits["thinker"]["urgent"]
        assert 0.35 <= run < 5 and wait >= 0.0, waits
        assert waits["thinker"].get("other", (0.0, 0.0))[0] < 0.3  # the main thread only sleeps
    finally:
        subprocess.run(["pkill", "-KILL", "-s", str(root.pid)], check=False)
        root.wait()
