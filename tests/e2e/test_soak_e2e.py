"""scripts/soak.py against the shared mesh: one round of every kind of traffic (streams cut short, clients
timing out, a cancelled gRPC call, a Realtime turn, bad input, audio in and out) gets only the answers each
kind expects, and the mesh settles afterwards: no request running, no shared-memory slot held, no KV block in
use in any stage."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SOAK = Path(__file__).resolve().parents[2] / "scripts" / "soak.py"


def test_a_round_of_mixed_traffic_gets_expected_answers_and_settles(mesh):
    out = subprocess.run([sys.executable, str(SOAK), "--url", mesh.rest, "--grpc", mesh.grpc, "--rounds", "1",
                          "--requests", "45", "--concurrency", "12", "--drain-s", "30"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "round 1/1: 45 requests" in out.stdout and "settled in" in out.stdout
    # 15 kinds, 3 of each: refused with a 400 (not crashed), every gRPC choice done, the Realtime turn answered
    assert "broken_image 400x3" in out.stdout and "too_long 400x3" in out.stdout
    assert "grpc_choices 200x3" in out.stdout and "realtime_turn 200x3" in out.stdout
    assert "stage thinker" in out.stdout  # its processes' memory, read from /proc
