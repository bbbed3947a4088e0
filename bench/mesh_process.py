"""Starts `omnimesh serve` on free loopback ports for a benchmark and stops it afterwards."""

from __future__ import annotations

import collections
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MeshProcess:
    """`with MeshProcess(model_dir, *extra_serve_flags) as mesh:` -> `mesh.url` answers `GET /health` with 200.

    The server's output (stdout and stderr) is read in the background, so its pipe never fills up; the last
    lines are kept for the error message when it does not come up. Once healthy it waits for the mesh to fall
    quiet (`settle`): the gateway goes on starting its video decoders' process server for ~2 s after it
    answers /health, and a measurement taken meanwhile shares the cores with that start (it made the first
    concurrency of bench/throughput.py look slower than it is)."""

    def __init__(self, model_dir: Path, *extra: str, timeout_s: float = 300.0):
        self.model_dir = model_dir
        self.extra = extra
        self.timeout_s = timeout_s
        self.url = ""
        self.stages: dict[str, str] = {}
        self.settled_s = 0.0  # how long the mesh took to fall quiet after answering /health (`settle`)
        self.lines: collections.deque[str] = collections.deque(maxlen=200)

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def output(self, n: int = 40) -> str:
        return "\n".join(list(self.lines)[-n:])

    def __enter__(self) -> "MeshProcess":
        port = _free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "omnimesh.cli", "serve", str(self.model_dir), "--host", "127.0.0.1",
             "--port", str(port), "--grpc-port", str(_free_port()), "--stage-base-port", "0", *self.extra],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        threading.Thread(target=self._pump, daemon=True).start()
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + self.timeout_s
        seen = 0
        while not self.stages and time.monotonic() < deadline and self.proc.poll() is None:
            lines = list(self.lines)
            for line in lines[seen:]:
                m = re.search(r"omnimesh serving .* stages (.*)$", line)
                if m:
                    self.stages = dict(item.split("@") for item in m.group(1).strip().split(", "))
            seen = len(lines)
            time.sleep(0.1)
        healthy = False
        while self.stages and not healthy and time.monotonic() < deadline and self.proc.poll() is None:
            try:
                healthy = httpx.get(f"{self.url}/health", timeout=10).status_code == 200
            except httpx.HTTPError:
                pass
            if not healthy:
                time.sleep(0.5)
        if not healthy:
            code = self.proc.poll()
            self.__exit__()
            raise RuntimeError(f"omnimesh serve did not come up (exit code {code}); last output:\n{self.output()}")
        self.settled_s = self.settle()
        return self

    def settle(self, quiet_cores: float = 0.05, window_s: float = 1.0, timeout_s: float = 60.0) -> float:
        """Wait until the mesh's processes together use less than `quiet_cores` of a core over `window_s`
        (bounded by `timeout_s`; not on a system without /proc); returns the seconds waited."""
        from bench import process_cpu

        t0 = time.monotonic()
        if not process_cpu.available():
            return 0.0
        while time.monotonic() - t0 < timeout_s and self.proc.poll() is None:
            meter = process_cpu.CpuMeter(self.proc.pid)
            meter.start()
            time.sleep(window_s)
            if sum(meter.stop().values()) < quiet_cores * window_s:
                break
        return time.monotonic() - t0

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        # the stage processes are in the same group: wait (bounded) until they are gone too, so a benchmark
        # that goes on measuring after the mesh does not share the CPUs with a mesh still shutting down
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
