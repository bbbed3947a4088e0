"""Starts `omnimesh serve` on free loopback ports for a benchmark and stops it afterwards."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MeshProcess:
    def __init__(self, model_dir: Path, *extra: str, timeout_s: float = 300.0):
        self.model_dir = model_dir
        self.extra = extra
        self.timeout_s = timeout_s
        self.url = ""
        self.stages: dict[str, str] = {}

    def __enter__(self) -> "MeshProcess":
        port = _free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "omnimesh.cli", "serve", str(self.model_dir), "--host", "127.0.0.1",
             "--port", str(port), "--grpc-port", str(_free_port()), "--stage-base-port", "0", *self.extra],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        deadline = time.monotonic() + self.timeout_s
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            m = re.search(r"omnimesh serving .* stages (.*)$", line)
            if m:
                self.stages = dict(item.split("@") for item in m.group(1).strip().split(", "))
                break
            if time.monotonic() > deadline:
                break
        if not self.stages:
            self.__exit__()
            raise RuntimeError("omnimesh serve did not come up")
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
