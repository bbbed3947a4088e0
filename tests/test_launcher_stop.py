"""`MeshLauncher.stop` drains in order: the gateway gets SIGTERM and is waited for (it finishes the streams
in flight) while every stage still runs; only then do the stages get theirs. A child that outlives the
grace period is killed. Fake processes record the order of events."""

from __future__ import annotations

import subprocess

from omnimesh.config.serve_args import ServeArgs
from omnimesh.launcher import Child, MeshLauncher


class FakeProc:
    def __init__(self, name: str, log: list[str], hangs: bool = False) -> None:
        self.name, self.log, self.hangs, self.done = name, log, hangs, False

    def poll(self) -> int | None:
        return 0 if self.done else None

    def terminate(self) -> None:
        self.log.append(f"term {self.name}")

    def kill(self) -> None:
        self.log.append(f"kill {self.name}")
        self.done = True

    def wait(self, timeout: float | None = None) -> int:
        if self.hangs and not self.done:
            raise subprocess.TimeoutExpired(self.name, timeout or 0)
        self.log.append(f"exited {self.name}")
        self.done = True
        return 0


def test_gateway_drains_before_the_stages_stop(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr("omnimesh.launcher.STOP_GRACE_S", 0.01)
    log: list[str] = []
    launcher = MeshLauncher(ServeArgs(), tmp_path)
    for name in ("encoder", "thinker", "talker", "vocoder", "gateway"):
        launcher.children.append(Child(name, FakeProc(name, log, hangs=name == "talker"), "x", []))  # type: ignore[arg-type]
    launcher.stop()
    assert log[:2] == ["term gateway", "exited gateway"]  # waited for before any stage is told to stop
    assert set(log[2:6]) == {f"term {s}" for s in ("encoder", "thinker", "talker", "vocoder")}
    assert "kill talker" in log and "exited talker" in log  # the one past its grace period is killed
    assert all(f"exited {s}" in log for s in ("encoder", "thinker", "vocoder"))
