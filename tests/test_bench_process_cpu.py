"""bench/process_cpu.py: a mesh's CPU by role — a stage's rank processes count for that stage.

Run: python -m pytest tests/test_bench_process_cpu.py -q
"""

from __future__ import annotations

import subprocess
import sys
import time

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
