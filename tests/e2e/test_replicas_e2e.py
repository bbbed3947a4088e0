"""Stage replicas on a real mesh of this module's own: `omnimesh serve` with two talker and two vocoder
replicas (vLLM's `-dp 2`, with `--stage-overrides '{"encoder": {"num_replicas": 1}, "thinker": {"num_replicas": 1}}'`
keeping one encoder and one thinker).

Requests sent together spread over both replicas of each stage (the stages' own metrics, labelled
`replica` by the gateway's scrape, say who served what) and answer exactly what the shared one-replica
`mesh` answers. A replica killed outright costs no request: the gateway passes it over (or runs a request
that hit it again on the other replica, before the client got anything), `/health` stays 200 and names the
replica that is down, the launcher restarts it on its port, and it takes requests again. A gateway that
names its stages by DNS (dns:///localhost:PORT) finds them as replicas. Bounded waits."""

from __future__ import annotations

import base64
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from mesh_harness import cmdline, ppid, start_mesh
from prometheus_client.parser import text_string_to_metric_families

MODEL = "tiny-qwen3-omni"
TIMEOUT_S = 120.0
PCM16_TOLERANCE = 1  # batched vocoder windows may round one sample by one step (test_concurrency_e2e.py)
PROMPTS = [("Tell me about the sea.", "ethan"), ("What is 2+2?", "aiden"), ("Count to ten.", "chelsie"),
           ("Describe a forest.", "ethan")]
OVERRIDES = '{"encoder": {"num_replicas": 1}, "thinker": {"num_replicas": 1}}'  # under -dp 2


def _body(prompt: str, voice: str) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "modalities": ["text", "audio"],
            "audio": {"voice": voice, "format": "pcm16"}, "max_tokens": 10, "temperature": 0,
            "stage_params": {"talker": {"max_tokens": 40}}}


def _complete(rest: str, body: dict) -> tuple[str, np.ndarray]:
    r = httpx.post(f"{rest}/v1/chat/completions", json=body, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    return msg["content"], np.frombuffer(base64.b64decode(msg["audio"]["data"]), dtype="<i2")


def _same(got: tuple[str, np.ndarray], want: tuple[str, np.ndarray], what: str) -> None:
    assert got[0] == want[0], f"{what}: text differs"
    assert got[1].shape == want[1].shape and got[1].size > 0, f"{what}: audio length differs"
    diff = np.abs(got[1].astype(np.int32) - want[1].astype(np.int32))
    assert diff.max(initial=0) <= PCM16_TOLERANCE, f"{what}: audio differs by {diff.max()} LSB"


def _served(rest: str) -> dict[tuple[str, str], float]:
    """Requests each (stage, replica) finished, from the gateway's /metrics."""
    text = httpx.get(f"{rest}/metrics", timeout=TIMEOUT_S).text
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "omnimesh:request_success":
            for s in family.samples:
                if s.name.endswith("_total") and "replica" in s.labels:
                    key = (s.labels["stage"], s.labels["replica"])
                    out[key] = out.get(key, 0.0) + s.value
    return out


@pytest.fixture(scope="module")
def replica_mesh(tiny_model_dir: Path):
    m = start_mesh(tiny_model_dir, "-dp", "2", "--stage-overrides", OVERRIDES, "--stage-restarts", "1")
    try:
        yield m
    finally:
        m.proc.stop()


@pytest.fixture(scope="module")
def expected(mesh) -> list[tuple[str, np.ndarray]]:
    """What the shared one-replica mesh answers, one request at a time."""
    return [_complete(mesh.rest, _body(p, v)) for p, v in PROMPTS]


def test_requests_spread_over_replicas_and_answer_as_one_replica_does(replica_mesh, expected):
    assert set(replica_mesh.stages) == {"encoder", "thinker", "talker#0", "talker#1", "vocoder#0", "vocoder#1"}
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda pv: _complete(replica_mesh.rest, _body(*pv)), PROMPTS, timeout=TIMEOUT_S))
    for (prompt, _), got, want in zip(PROMPTS, together, expected):
        _same(got, want, prompt)
    for i, (prompt, voice) in enumerate(PROMPTS):  # one at a time: the replicas take turns
        _same(_complete(replica_mesh.rest, _body(prompt, voice)), expected[i], f"{prompt} (alone)")
    served = _served(replica_mesh.rest)
    for stage in ("talker", "vocoder"):
        assert served.get((stage, "0"), 0) > 0 and served.get((stage, "1"), 0) > 0, served
        assert served[(stage, "0")] + served[(stage, "1")] == 2 * len(PROMPTS), served
    assert served[("thinker", "0")] == 2 * len(PROMPTS)
    health = httpx.get(f"{replica_mesh.rest}/health", timeout=TIMEOUT_S)
    assert health.status_code == 200 and health.json()["down"] == []
    assert [len(health.json()["replicas"][s]) for s in ("thinker", "talker", "vocoder")] == [1, 2, 2]
    assert all(all(states.values()) for states in health.json()["replicas"].values()), health.json()


def test_a_killed_replica_costs_no_request_and_comes_back(replica_mesh, expected):
    address = replica_mesh.stages["talker#1"]
    pid = next(p for name, p in _stage_children(replica_mesh).items() if name == address)
    before = _served(replica_mesh.rest)
    os.kill(pid, signal.SIGKILL)
    for i, (prompt, voice) in enumerate(PROMPTS):  # the talker's replica 0 answers them all
        _same(_complete(replica_mesh.rest, _body(prompt, voice)), expected[i], f"{prompt} (a replica down)")
    health = httpx.get(f"{replica_mesh.rest}/health", timeout=TIMEOUT_S)
    body = health.json()
    if not body["replicas"]["talker"][address]:  # not restarted yet (it takes seconds to load)
        assert health.status_code == 200 and body["down"] == [], body
        assert f"talker {address}" in body["message"], body
    replica_mesh.proc.wait_for_line(rf"stage talker#1 \(pid {pid}\) exited with code -9; restarting it in 1s .*; "
                                    r"the gateway sends its requests to the stage's other replicas until it serves "
                                    r"again", timeout_s=30)
    replica_mesh.proc.wait_for_line(r"stage talker#1 \(pid \d+\) is serving again", timeout_s=TIMEOUT_S)
    after = _served(replica_mesh.rest)
    assert after[("talker", "0")] - before[("talker", "0")] == len(PROMPTS)
    # the restarted replica takes requests again (its counters start from 0 in its new process)
    deadline = time.monotonic() + TIMEOUT_S
    while _served(replica_mesh.rest).get(("talker", "1"), 0) == 0:
        assert time.monotonic() < deadline, "the restarted replica never took a request"
        _same(_complete(replica_mesh.rest, _body(*PROMPTS[0])), expected[0], "after the restart")
    assert json.loads(httpx.get(f"{replica_mesh.rest}/health", timeout=TIMEOUT_S).text)["status"] == "ok"


def test_a_gateway_finds_its_stages_by_dns(mesh, tiny_model_dir, expected):
    """`omnimesh gateway --stages NAME=dns:///localhost:PORT,...` on the shared mesh's stages: each name's
    address (127.0.0.1 here) is the stage's replica, and the answers are the mesh's own."""
    from mesh_harness import start_gateway

    stages = {name: f"dns:///localhost:{addr.rsplit(':', 1)[1]}" for name, addr in mesh.stages.items()}
    proc, url = start_gateway(tiny_model_dir, stages, "--stage-dns-refresh", "1")
    try:
        _same(_complete(url, _body(*PROMPTS[1])), expected[1], "via DNS")
        replicas = httpx.get(f"{url}/health", timeout=TIMEOUT_S).json()["replicas"]
        assert replicas == {name: {addr: True} for name, addr in mesh.stages.items()}, replicas
        assert _served(url)[("vocoder", "0")] >= 1
    finally:
        proc.stop()


def _stage_children(mesh) -> dict[str, int]:
    """The launcher's stage processes by the address they listen on."""
    out = {}
    for pid in _all_children(mesh.proc.proc.pid):
        argv = cmdline(pid)
        if "stage" in argv and "--port" in argv:
            out[f"127.0.0.1:{argv[argv.index('--port') + 1]}"] = pid
    return out


def _all_children(launcher_pid: int) -> list[int]:
    return [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit() and ppid(int(e.name)) == launcher_pid]

