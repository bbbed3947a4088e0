"""Start and stop real omnimesh processes on 127.0.0.1 for end-to-end tests (bounded waits throughout)."""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 240.0
REALTIME_BETA = {"OpenAI-Beta": "realtime=v1"}  # the Realtime beta interface's header (without it: GA)


def free_port(host: str = "127.0.0.1") -> int:
    """A free port BELOW the host's ephemeral range, for a server a test starts later: an ephemeral port (what
    binding port 0 gives) can be taken in the meantime as the source port of any outgoing connection, and a
    mesh starting up opens many (its ranks, its health probes); this race made a gateway fail to listen."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for port in random.sample(range(max(1024, low - 12000), low), 200):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # a host with a crowded low range: the OS's choice
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    """A child process whose output is collected in the background (so pipes never fill up)."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # over this process's environment
    proc: subprocess.Popen = field(init=False)
    lines: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "omnimesh.cli", *self.argv], cwd=REPO, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def output(self) -> str:
        return "\n".join(self.lines[-80:])

    def wait_for_line(self, pattern: str, timeout_s: float = START_TIMEOUT_S) -> re.Match:
        deadline = time.monotonic() + timeout_s
        regex = re.compile(pattern)
        seen = 0
        while time.monotonic() < deadline:
            while seen < len(self.lines):
                m = regex.search(self.lines[seen])
                seen += 1
                if m:
                    return m
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.argv[0]} exited with {self.proc.returncode}:\n{self.output()}")
            time.sleep(0.1)
        raise TimeoutError(f"no line matching {pattern!r} within {timeout_s}s:\n{self.output()}")

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        return self.proc.returncode


@dataclass
class Mesh:
    proc: Proc
    rest: str  # http://127.0.0.1:PORT
    grpc: str  # 127.0.0.1:PORT
    stages: dict[str, str]  # name -> host:port


def start_mesh(model_dir: Path, *extra: str, env: dict[str, str] | None = None) -> Mesh:
    port, grpc_port = free_port(), free_port()
    proc = Proc(["serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--grpc-port", str(grpc_port),
                 "--stage-base-port", "0", *extra], env or {})
    try:
        m = proc.wait_for_line(r"omnimesh serving .* stages (.*)$")
    except Exception:
        proc.stop()
        raise
    stages = dict(item.split("@") for item in m.group(1).split(", "))
    return Mesh(proc, f"http://127.0.0.1:{port}", f"127.0.0.1:{grpc_port}", stages)


def start_gateway(model_dir: Path, stages: dict[str, str], *extra: str, **client: object) -> tuple[Proc, str]:
    """A second `omnimesh gateway` on these stages; its base URL (https with --ssl-keyfile). `client`: httpx
    options the readiness probe needs (verify=, cert= under TLS)."""
    port = free_port()
    spec = ",".join(f"{k}={v}" for k, v in stages.items())
    proc = Proc(["gateway", "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
                 "--grpc-port", str(free_port()), "--stages", spec, *extra])
    url = f"{'https' if '--ssl-keyfile' in extra else 'http'}://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            raise RuntimeError(f"gateway exited with {proc.proc.returncode}:\n{proc.output()}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0, **client).status_code in (200, 503):  # type: ignore[arg-type]
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.stop()
    raise TimeoutError(f"gateway did not come up:\n{proc.output()}")


def refused_stage(model_dir: Path, stage: str) -> str:
    """`omnimesh stage STAGE` on a model that lacks it: checks it exits 2 before serving; returns its stderr."""
    out = subprocess.run([sys.executable, "-m", "omnimesh.cli", "stage", stage, "--model", str(model_dir)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    return out.stderr


def start_stage(model_dir: Path, stage: str) -> tuple[Proc, str]:
    port = free_port()
    proc = Proc(["stage", stage, "--model", str(model_dir), "--port", str(port)])
    proc.wait_for_line(rf"omnimesh stage {stage} listening")
    return proc, f"127.0.0.1:{port}"


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _stat(pid: int, tid: int | None = None) -> list[str] | None:
    """The fields of /proc/<pid>/stat (or of its thread <tid>) after the command name (state, ppid, ...),
    None once it is gone."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        return Path(path).read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def ppid(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[1]) if fields else None


def nice(pid: int) -> int:
    """The process's nice value (field 19 of /proc/<pid>/stat)."""
    fields = _stat(pid)
    assert fields is not None, f"process {pid} is gone"
    return int(fields[16])


def thread_nices(pid: int) -> dict[str, set[int]]:
    """The nice values of a process's threads, by thread name."""
    out: dict[str, set[int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
        except OSError:  # the thread ended
            continue
        fields = _stat(pid, int(task.name))
        if fields is not None:
            out.setdefault(name, set()).add(int(fields[16]))
    return out


def alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped, counts as gone)."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def children(launcher_pid: int) -> dict[str, int]:
    """The launcher's child processes by role: 'stage talker' -> pid, 'gateway' -> pid."""
    out: dict[str, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or ppid(int(entry.name)) != launcher_pid:
            continue
        argv = cmdline(int(entry.name))
        if "omnimesh.cli" not in argv:
            continue
        i = argv.index("omnimesh.cli")
        if argv[i + 1:i + 2] == ["stage"]:
            out[f"stage {argv[i + 2]}"] = int(entry.name)
        elif argv[i + 1:i + 2] == ["gateway"]:
            out["gateway"] = int(entry.name)
    return out


def stage_pid(mesh: Mesh, stage: str) -> int:
    pid = children(mesh.proc.proc.pid)[f"stage {stage}"]
    argv = cmdline(pid)
    port = mesh.stages[stage].rsplit(":", 1)[1]
    assert argv[argv.index("--port") + 1] == port, (argv, mesh.stages)
    return pid




def rank_pids(stage_pid_: int) -> list[int]:
    """The rank processes a stage spawned (its pp x tp ranks beyond rank 0, which is the stage itself)."""
    return sorted(int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit() and ppid(int(e.name)) == stage_pid_
                  and "spawn_main" in " ".join(cmdline(int(e.name))) and alive(int(e.name)))


def kill_rank_mid_request(mesh: Mesh, stage: str, victim: int) -> int:
    """SIGKILL `victim` (a worker rank of `stage`) while a long request decodes: that request fails promptly with
    503 naming the stage and the pid, /health names the stage, the next request is a 503 too; then `omnimesh
    serve` restarts the stage with all its ranks and it answers as before. Returns the restarted stage's pid."""
    body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 3000,
            "temperature": 0}
    result: dict = {}

    def long_request() -> None:
        t0 = time.monotonic()
        r = httpx.post(f"{mesh.rest}/v1/chat/completions", json=body, timeout=120)
        result.update(status=r.status_code, body=r.json(), seconds=time.monotonic() - t0)

    hi = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    before = httpx.post(f"{mesh.rest}/v1/chat/completions", json=hi, timeout=30)
    assert before.status_code == 200, before.text
    old = stage_pid(mesh, stage)
    thread = threading.Thread(target=long_request)
    thread.start()
    time.sleep(1.5)  # the request is decoding
    assert thread.is_alive(), result
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    thread.join(timeout=60)
    assert not thread.is_alive(), "the request hung after a rank died"
    assert result["status"] == 503, result
    assert stage in result["body"]["error"]["message"] and f"pid {victim}" in result["body"]["error"]["message"]
    assert time.monotonic() - killed_at < 30
    health = httpx.get(f"{mesh.rest}/health", timeout=10)
    assert health.status_code == 503 and stage in health.json()["down"]
    again = httpx.post(f"{mesh.rest}/v1/chat/completions", timeout=30, json=hi)
    assert again.status_code == 503 and stage in again.json()["error"]["message"], again.text

    # the launcher reads NOT_SERVING, stops the stage and starts it again with all its ranks (the next
    # restart is >= 1 s after the kill, so the checks above always saw it down); then it answers as before
    mesh.proc.wait_for_line(rf"stage {stage} \(pid {old}\) reports NOT_SERVING", timeout_s=30)
    mesh.proc.wait_for_line(rf"stage {stage} \(pid {old}\) exited with code -?\d+; restarting it", timeout_s=30)
    mesh.proc.wait_for_line(rf"stage {stage} \(pid \d+\) is serving again", timeout_s=180)
    deadline = time.monotonic() + 15
    while httpx.get(f"{mesh.rest}/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the gateway did not find the restarted stage"
        time.sleep(0.2)
    after = httpx.post(f"{mesh.rest}/v1/chat/completions", json=hi, timeout=30)
    assert after.status_code == 200, after.text
    assert after.json()["choices"][0]["message"] == before.json()["choices"][0]["message"]
    return stage_pid(mesh, stage)
