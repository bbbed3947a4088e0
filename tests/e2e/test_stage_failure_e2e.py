"""A stage dying under load, and a stage that cannot start, on a mesh of this module's own (never the shared
`mesh`, so killing processes cannot break other tests).

Killing the talker mid-request (with `--stage-restarts 0`, so it stays down): the requests that need it fail
promptly with 503 (an SSE `error` event then `[DONE]` for a stream that already started), nothing hangs, the
gateway keeps serving what does not need the talker, `/health` names the stage that is down, the launcher
reports it, and SIGTERM still stops the whole mesh cleanly. Killing the vocoder with restarts on: the launcher
starts it again on its port, the gateway finds it, and the same request gets the same audio; a killed gateway is
restarted the same way and answers the same; one exit more than `--stage-restarts` allows stops the mesh with
code 1. A checkpoint missing a talker weight makes
`omnimesh serve` fail at start-up, naming the stage and the key; a stage whose settings its loaded model
refuses exits 2 with the reason, its ranks stopped cleanly. Every wait is bounded."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from mesh_harness import REPO, Proc, free_port, start_mesh
from mesh_harness import alive as _alive
from mesh_harness import children as _children
from mesh_harness import stage_pid as _stage_pid

MODEL = "tiny-qwen3-omni"
ALLOWED_DOMAIN = "media.example.com"
TIMEOUT_S = 60.0
FAIL_WITHIN_S = 10.0  # a request that needs a dead stage must be answered within this
STOP_WITHIN_S = 30.0
START_FAIL_WITHIN_S = 180.0


# ------------------------------------------------------------------------------------------- request helpers
def _body(prompt: str, voice: str, *, talker_max: int, stream: bool = False, modalities=("text", "audio"),
          **over) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "modalities": list(modalities),
            "max_tokens": 12, "temperature": 0, "stream": stream,
            "stage_params": {"talker": {"max_tokens": talker_max}}}
    if "audio" in modalities:
        body["audio"] = {"voice": voice, "format": "wav"}
    body.update(over)
    return body


def _openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, f"want {status}, got {r.status_code}: {r.text}"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


@pytest.fixture(scope="module")
def own_mesh(tiny_model_dir: Path):
    m = start_mesh(tiny_model_dir, "--allowed-media-domains", ALLOWED_DOMAIN, "--stage-restarts", "0")
    try:
        yield m
    finally:
        m.proc.stop()


# --------------------------------------------------------------------------------------------------- tests
def test_image_from_a_domain_not_allowed_is_400(own_mesh):
    """With allowed media domains configured, a URL on another host is refused (without fetching it)."""
    url = "http://evil.example.org/cat.png"
    body = _body("What is this?", "ethan", talker_max=10, modalities=("text",),
                 messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                        {"type": "text", "text": "What is this?"}]}])
    r = httpx.post(f"{own_mesh.rest}/v1/chat/completions", json=body, timeout=TIMEOUT_S)
    err = _openai_error(r, 400)
    assert "evil.example.org" in err["message"] and ALLOWED_DOMAIN in err["message"], err["message"]
    assert "not in this server's allowed media domains" in err["message"]


def test_talker_killed_mid_request(own_mesh):
    mesh = own_mesh
    url = f"{mesh.rest}/v1/chat/completions"
    stage_pids = {name: pid for name, pid in _children(mesh.proc.proc.pid).items()}
    assert set(stage_pids) == {"stage encoder", "stage thinker", "stage talker", "stage vocoder", "gateway"}, stage_pids
    talker_pid = _stage_pid(mesh, "talker")

    # greedy, these run ~860 and ~580 talker steps before the codec's end token (seconds of work here)
    stream_body = _body("Who are you?", "aiden", talker_max=2000, stream=True)
    plain_body = _body("Read me a poem.", "ethan", talker_max=2000)
    first_audio = threading.Event()
    plain_started = threading.Event()
    stream_result: dict = {"events": []}
    plain_result: dict = {}

    def streaming() -> None:
        try:
            with httpx.stream("POST", url, json=stream_body, timeout=TIMEOUT_S) as r:
                stream_result["status"] = r.status_code
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    payload = line[6:]
                    stream_result["events"].append(payload)
                    if payload != "[DONE]":
                        event = json.loads(payload)
                        if event.get("choices") and (event["choices"][0]["delta"].get("audio") or {}).get("data"):
                            first_audio.set()
            stream_result["ended"] = time.monotonic()
        except BaseException as e:  # noqa: BLE001 (reported by the main thread)
            stream_result["exception"] = e
        finally:
            first_audio.set()

    def plain() -> None:
        try:
            plain_started.set()
            r = httpx.post(url, json=plain_body, timeout=TIMEOUT_S)
            plain_result["response"] = r
            plain_result["ended"] = time.monotonic()
        except BaseException as e:  # noqa: BLE001 (reported by the main thread)
            plain_result["exception"] = e

    threads = [threading.Thread(target=plain, daemon=True), threading.Thread(target=streaming, daemon=True)]
    for t in threads:
        t.start()
    assert plain_started.wait(TIMEOUT_S)
    assert first_audio.wait(TIMEOUT_S), "the stream delivered no audio"
    assert "exception" not in stream_result, stream_result
    assert "ended" not in stream_result and "response" not in plain_result, \
        "both requests must still be running when the talker is killed (make them longer)"
    os.kill(talker_pid, signal.SIGKILL)
    killed = time.monotonic()
    for t in threads:
        t.join(TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a request hung after the talker died"

    # the non-streaming request: 503 in OpenAI's shape, naming the talker, promptly
    assert "exception" not in plain_result, plain_result
    err = _openai_error(plain_result["response"], 503)
    assert "talker" in err["message"], err
    assert err["type"] == "service_unavailable"
    assert plain_result["ended"] - killed < FAIL_WITHIN_S

    # the stream: audio, then an SSE error event naming the talker, then [DONE]; not a hang, not a cut
    assert "exception" not in stream_result, stream_result
    events = stream_result["events"]
    assert stream_result["status"] == 200
    assert events[-1] == "[DONE]", events[-3:]
    last = json.loads(events[-2])
    assert set(last) == {"error"}, last
    assert "talker" in last["error"]["message"] and last["error"]["type"] == "service_unavailable", last
    chunks = [json.loads(e) for e in events[:-2]]
    assert any((c["choices"][0]["delta"].get("audio") or {}).get("data") for c in chunks if c.get("choices"))
    assert not any(c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")), \
        "a failed stream must not claim to have finished"
    assert stream_result["ended"] - killed < FAIL_WITHIN_S

    # the launcher names the dead stage, and says it stays down
    mesh.proc.wait_for_line(rf"stage talker \(pid {talker_pid}\) exited with code -9; requests that need it fail "
                            rf"with 503 \(--stage-restarts 0: it is not restarted\)", timeout_s=FAIL_WITHIN_S)

    # the gateway stays up: /health says which stage is down
    t0 = time.monotonic()
    health = httpx.get(f"{mesh.rest}/health", timeout=TIMEOUT_S)
    assert health.status_code == 503, health.text
    assert health.json()["down"] == ["talker"], health.json()
    assert "talker" in health.json()["message"]
    assert time.monotonic() - t0 < FAIL_WITHIN_S

    # text only does not need the talker
    r = httpx.post(url, json=_body("Hello there", "ethan", talker_max=10, modalities=("text",)), timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] and r.json()["choices"][0]["message"].get("audio") is None

    # text + audio does: 503 promptly, streaming or not
    for stream in (False, True):
        t0 = time.monotonic()
        with httpx.stream("POST", url, json=_body("Hello there", "ethan", talker_max=10, stream=stream),
                          timeout=TIMEOUT_S) as r:
            r.read()
        err = _openai_error(r, 503)
        assert "talker" in err["message"], err
        assert time.monotonic() - t0 < FAIL_WITHIN_S

    # the other processes are untouched
    assert mesh.proc.proc.poll() is None, mesh.proc.output()
    for name, pid in stage_pids.items():
        assert _alive(pid) == (name != "stage talker"), name

    # SIGTERM to the launcher alone: it stops every child and exits 0 within the bound
    os.kill(mesh.proc.proc.pid, signal.SIGTERM)
    try:
        code = mesh.proc.proc.wait(timeout=STOP_WITHIN_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"omnimesh serve did not exit within {STOP_WITHIN_S}s of SIGTERM:\n{mesh.proc.output()}")
    assert code == 0, mesh.proc.output()
    deadline = time.monotonic() + 5.0
    while any(_alive(pid) for pid in stage_pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = {name: pid for name, pid in stage_pids.items() if _alive(pid)}
    assert not left, f"children left running after the launcher exited: {left}"


def test_a_dead_stage_is_restarted_until_the_limit(tiny_model_dir: Path):
    mesh = start_mesh(tiny_model_dir, "--stage-restarts", "1")
    try:
        url = f"{mesh.rest}/v1/chat/completions"
        body = _body("Sing a song.", "chelsie", talker_max=30)

        def audio() -> str:
            r = httpx.post(url, json=body, timeout=TIMEOUT_S)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["audio"]["data"]

        before = audio()
        first = _stage_pid(mesh, "vocoder")
        os.kill(first, signal.SIGKILL)
        mesh.proc.wait_for_line(rf"stage vocoder \(pid {first}\) exited with code -9; restarting it in 1s \(restart 1 "
                                r"of at most 1 in 10 minutes\)", timeout_s=FAIL_WITHIN_S)
        second = int(mesh.proc.wait_for_line(r"stage vocoder restarted \(pid (\d+)\)", timeout_s=FAIL_WITHIN_S).group(1))
        assert second != first and _stage_pid(mesh, "vocoder") == second  # on the same port (stage_pid checks)
        mesh.proc.wait_for_line(rf"stage vocoder \(pid {second}\) is serving again", timeout_s=START_FAIL_WITHIN_S)
        deadline = time.monotonic() + FAIL_WITHIN_S  # the gateway's channel reconnects within ~2 s
        while (health := httpx.get(f"{mesh.rest}/health", timeout=TIMEOUT_S)).status_code != 200:
            assert time.monotonic() < deadline, f"the gateway did not find the restarted vocoder: {health.text}"
            time.sleep(0.2)
        assert audio() == before, "the restarted vocoder must give the same audio for the same greedy request"

        # the gateway dies too (an OOM kill, say): it is restarted on its ports, finds the stages, answers the same
        gateway = _children(mesh.proc.proc.pid)["gateway"]
        os.kill(gateway, signal.SIGKILL)
        mesh.proc.wait_for_line(rf"the gateway \(pid {gateway}\) exited with code -9; restarting it in 1s \(restart 1 "
                                r"of at most 1 in 10 minutes\); no request is answered", timeout_s=FAIL_WITHIN_S)
        new = int(mesh.proc.wait_for_line(r"the gateway restarted \(pid (\d+)\)", timeout_s=FAIL_WITHIN_S).group(1))
        mesh.proc.wait_for_line(rf"the gateway \(pid {new}\) is serving again", timeout_s=START_FAIL_WITHIN_S)
        assert _children(mesh.proc.proc.pid)["gateway"] == new and audio() == before

        # a second exit within 10 minutes is one more than --stage-restarts 1 allows: the mesh stops, code 1
        others = {name: pid for name, pid in _children(mesh.proc.proc.pid).items() if name != "stage vocoder"}
        os.kill(second, signal.SIGKILL)
        try:
            code = mesh.proc.proc.wait(timeout=STOP_WITHIN_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"omnimesh serve did not stop after the restart limit:\n{mesh.proc.output()}")
        assert code == 1, mesh.proc.output()
        said = re.compile(rf"stage vocoder \(pid {second}\) exited with code -9 after 1 restart\(s\) in the last 10 "
                          r"minutes \(--stage-restarts 1\); stopping the mesh")
        deadline = time.monotonic() + 5.0  # the output pump drains what the launcher wrote before it exited
        while not any(said.search(line) for line in mesh.proc.lines):
            assert time.monotonic() < deadline, mesh.proc.output()
            time.sleep(0.1)
        while any(_alive(pid) for pid in others.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in others.values()), others
    finally:
        mesh.proc.stop()


def test_missing_weight_fails_start_up(tiny_model_dir: Path, tmp_path: Path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    broken = tmp_path / MODEL
    shutil.copytree(tiny_model_dir, broken)
    removed = "talker.model.layers.0.self_attn.q_proj.weight"
    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as f:
        metadata = f.metadata()
        names = list(f.keys())
        assert removed in names
        tensors = {k: f.get_tensor(k) for k in names if k != removed}
    (broken / "model.safetensors").unlink()
    save_file(tensors, str(broken / "model.safetensors"), metadata=metadata)

    proc = Proc(["serve", str(broken), "--host", "127.0.0.1", "--port", str(free_port()),
                 "--grpc-port", str(free_port()), "--stage-base-port", "0"])
    try:
        code = proc.proc.wait(timeout=START_FAIL_WITHIN_S)
    except subprocess.TimeoutExpired:
        proc.stop()
        pytest.fail(f"omnimesh serve neither started nor failed within {START_FAIL_WITHIN_S}s:\n{proc.output()}")
    finally:
        proc.stop()
    time.sleep(0.2)  # let the output pump drain
    out = "\n".join(proc.lines)
    assert code != 0, out
    assert not any("omnimesh serving" in line for line in proc.lines), out
    assert re.search(r"talker exited with code [1-9]\d* during start-up", out), out
    assert removed in out, f"the error must name the missing key {removed}:\n{out}"


def test_a_stage_refusing_its_settings_after_its_ranks_start_exits_2_cleanly(tiny_model_dir: Path,
                                                                             tmp_path: Path) -> None:
    """A check the thinker can make only once loaded (a --tokenizer with more tokens than its vocabulary), on a
    thinker of 2 pipeline ranks: `omnimesh stage` exits 2 with one error line naming the stage and the reason,
    no traceback, and no abort at exit: its ranks are stopped (they never report a lost driver) and the process
    group ends before the interpreter does (before, the exit aborted: code -6, "terminate called")."""
    from transformers import AutoTokenizer

    bigger = tmp_path / "bigger"
    tok = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    tok.add_tokens(["<|not_in_the_model|>"])
    tok.save_pretrained(bigger)
    done = subprocess.run([sys.executable, "-m", "omnimesh.cli", "stage", "thinker", "--model", str(tiny_model_dir),
                           "--host", "127.0.0.1", "--port", "0", "--tokenizer", str(bigger), "--max-model-len", "64",
                           "--kv-cache-memory", "1MiB", "--stage-overrides", '{"thinker": {"pp": 2}}'],
                          cwd=REPO, capture_output=True, text=True, timeout=START_FAIL_WITHIN_S)
    errors = [line for line in done.stderr.splitlines() if line.startswith("omnimesh: error:")]
    assert done.returncode == 2 and errors == [
        f"omnimesh: error: stage thinker: the tokenizer in {bigger} has {len(tok)} tokens, more than the thinker's "
        f"vocabulary of {len(tok) - 1}: it is not this model's (--tokenizer)"], done.stderr
    assert "stage ranks up: pp=2" in done.stderr  # the refusal came after the ranks started
    for sign in ("Traceback", "terminate called", "lost the stage's driver"):
        assert sign not in done.stderr, done.stderr
