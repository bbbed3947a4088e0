"""`MeshLauncher` start and stop, on fake processes that record the order of events. Start: the gateway is
spawned with the stages, and its exit while they load fails the start at once; a stage that never serves
fails it at --stage-start-timeout. Stop drains in order: the
gateway gets SIGTERM and is waited for (it finishes the streams in flight) while every stage still runs; only
then do the stages get theirs. A child that outlives the grace period is killed. Watch: a gateway that dies
is restarted like a stage (the stages keep running), within --stage-restarts; past it, or with 0, the mesh stops."""

from __future__ import annotations

import subprocess
import time

import pytest

from omnimesh.config.serve_args import ServeArgs
from omnimesh.config.stage_config import STAGES
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


def test_the_gateway_starts_with_the_stages_and_its_exit_fails_the_start_at_once(tmp_path, monkeypatch) -> None:
    """The gateway is spawned right after the stages, not once they serve (its imports, tokenizer and processor
    load meanwhile; it waits for them itself, as long as the launcher does); a gateway that exits while the
    stages still load fails the start by name, without waiting for them."""
    log: list[str] = []
    spawned: list[list[str]] = []

    envs: list[dict[str, str] | None] = []

    def popen(argv: list[str], env: dict[str, str] | None = None) -> FakeProc:
        spawned.append(argv)
        envs.append(env)
        proc = FakeProc(argv[0] if argv[0] == "gateway" else argv[1], log)
        if argv[0] == "gateway":
            proc.poll = lambda: 1  # type: ignore[method-assign]  # it exits at once
        return proc

    monkeypatch.setattr("omnimesh.launcher._popen", popen)
    monkeypatch.setattr("omnimesh.launcher.model_stages", lambda model_dir: STAGES)
    monkeypatch.setattr("omnimesh.launcher._grpc_serving", lambda address: False)  # the stages never serve
    launcher = MeshLauncher(ServeArgs(stage_start_timeout=30.0), tmp_path)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^gateway exited with code 1 during start-up"):
        launcher._run()
    assert time.monotonic() - t0 < 5
    assert [argv[0] if argv[0] == "gateway" else argv[1] for argv in spawned] == [*STAGES, "gateway"]
    gateway = spawned[-1]
    assert gateway[gateway.index("--stage-start-timeout") + 1] == "30.0"
    # every stage knows all the stage ports (free_port never hands one to a rank rendezvous); they differ
    ports = [int(argv[argv.index("--port") + 1]) for argv in spawned[:-1]]
    assert len(set(ports)) == len(STAGES)
    assert all(env == {"OMNIMESH_RESERVED_PORTS": ",".join(map(str, ports))} for env in envs[:-1])


def test_a_stage_that_never_serves_fails_the_start_at_the_flags_bound(tmp_path, monkeypatch) -> None:
    """Past --stage-start-timeout the start fails naming the stage, the probe and the flag (the children stay up
    until then: none exited)."""
    log: list[str] = []
    monkeypatch.setattr("omnimesh.launcher._popen", lambda argv, env=None: FakeProc(argv[0], log))
    monkeypatch.setattr("omnimesh.launcher.model_stages", lambda model_dir: STAGES)
    monkeypatch.setattr("omnimesh.launcher._grpc_serving", lambda address: False)
    launcher = MeshLauncher(ServeArgs(stage_start_timeout=0.5), tmp_path)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^encoder did not become ready within 0.5s \(gRPC health; "
                                           r"--stage-start-timeout\)$"):
        launcher._run()
    assert 0.5 <= time.monotonic() - t0 < 5


class DyingProc(FakeProc):
    """A child that has exited with `code`."""

    def __init__(self, name: str, log: list[str], code: int) -> None:
        super().__init__(name, log)
        self.code, self.pid = code, 4242

    def poll(self) -> int | None:
        return self.code


def _watched(tmp_path, monkeypatch, restarts: int, gateway_codes: list[int]) -> tuple[MeshLauncher, list[str]]:
    """A launcher whose stages run and whose gateway process exits with each of `gateway_codes` in turn (the
    launcher's restarts get the next one; after the last, the gateway runs)."""
    monkeypatch.setattr("omnimesh.launcher.MAX_RESTART_BACKOFF_S", 0.0)  # restart at once
    monkeypatch.setattr("omnimesh.launcher._grpc_status", lambda address: "SERVING")
    monkeypatch.setattr("omnimesh.launcher._http_ok", lambda url, uds=None: True)
    log: list[str] = []
    codes = list(gateway_codes)

    def popen(argv: list[str], env: dict[str, str] | None = None) -> FakeProc:
        log.append("spawn gateway")
        proc = DyingProc("gateway", log, codes.pop(0)) if codes else FakeProc("gateway", log)
        proc.pid = 4243  # type: ignore[attr-defined]
        return proc

    monkeypatch.setattr("omnimesh.launcher._popen", popen)
    launcher = MeshLauncher(ServeArgs(stage_restarts=restarts), tmp_path)
    for name in STAGES:
        launcher.children.append(Child(name, FakeProc(name, log), "x", []))  # type: ignore[arg-type]
    launcher.children.append(Child("gateway", DyingProc("gateway", log, codes.pop(0)), "x", []))  # type: ignore[arg-type]
    return launcher, log


def test_a_gateway_that_dies_is_restarted_and_the_stages_keep_running(tmp_path, monkeypatch, capsys) -> None:
    import threading

    launcher, log = _watched(tmp_path, monkeypatch, restarts=2, gateway_codes=[-9])
    result: list[int] = []
    watch = threading.Thread(target=lambda: result.append(launcher._watch()))
    watch.start()
    deadline = time.monotonic() + 10
    while "spawn gateway" not in log:
        assert time.monotonic() < deadline, log
        time.sleep(0.05)
    time.sleep(1.2)  # a few polls: the restarted gateway answers /health
    launcher._stopping = True
    watch.join(5)
    err = capsys.readouterr().err
    assert result == [0] and log.count("spawn gateway") == 1 and not any(e.startswith("term ") for e in log)
    assert "the gateway (pid 4242) exited with code -9; restarting it in 0s (restart 1 of at most 2" in err
    assert "no request is answered until it serves again" in err
    assert "the gateway restarted (pid 4243)" in err and "the gateway (pid 4243) is serving again" in err


def test_a_gateway_past_the_restart_limit_or_with_none_allowed_stops_the_mesh(tmp_path, monkeypatch, capsys) -> None:
    launcher, log = _watched(tmp_path, monkeypatch, restarts=0, gateway_codes=[1])
    assert launcher._watch() == 1 and "spawn gateway" not in log
    assert "the gateway exited with code 1; stopping the mesh (--stage-restarts 0)" in capsys.readouterr().err
    launcher, log = _watched(tmp_path, monkeypatch, restarts=2, gateway_codes=[1, 1, 1])
    assert launcher._watch() == 1 and log.count("spawn gateway") == 2
    assert "after 2 restart(s) in the last 10 minutes (--stage-restarts 2); stopping the mesh" in capsys.readouterr().err


def test_a_signal_while_the_stages_are_spawned_spawns_no_more(tmp_path, monkeypatch) -> None:
    """Ctrl-C / SIGTERM during the spawns (on a host slowed by many stage processes each spawn took seconds):
    the launcher starts no further process and stops those it started, exiting 128 + the signal."""
    log: list[str] = []
    spawned: list[str] = []
    launcher = MeshLauncher(ServeArgs(stage_overrides='{"vocoder": {"num_replicas": 8}}'), tmp_path)

    def popen(argv: list[str], env: dict[str, str] | None = None) -> FakeProc:
        spawned.append(argv[1])
        if len(spawned) == 3:
            launcher._on_signal(15, None)  # SIGTERM arrives while the third process starts
        return FakeProc(argv[1], log)

    monkeypatch.setattr("omnimesh.launcher._popen", popen)
    monkeypatch.setattr("omnimesh.launcher.model_stages", lambda model_dir: STAGES)
    monkeypatch.setattr("omnimesh.launcher.signal.signal", lambda *a: None)  # pytest keeps its own handlers
    monkeypatch.setattr("omnimesh.launcher.STOP_GRACE_S", 0.01)
    assert launcher.run() == 128 + 15  # stopped before it served: not the 0 of a stop asked of a serving mesh
    assert spawned == ["encoder", "thinker", "talker"]
    assert sorted(line for line in log if line.startswith("term")) == ["term encoder", "term talker", "term thinker"]
