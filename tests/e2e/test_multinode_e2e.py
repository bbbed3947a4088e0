"""Stages over two "nodes" on 127.0.0.1, each node its own process tree (as two hosts would run them).

`omnimesh stage thinker --num-nodes 2`: node 0 (server + driver) and node 1 (headless ranks), split pp = 2 (one
pipeline rank per host) and tp = 2 (a TP pair across the hosts: advice, still exact), answer a greedy chat
through a gateway exactly like `transformers` generate. Node 0 stopped with SIGTERM ends node 1 with 0; node 0
killed outright ends node 1 non-zero, saying it lost node 0, within a bound. Nodes that disagree on pp both fail
at the rendezvous naming the values; a node whose master does not answer and a node 0 whose other node never
comes fail within --rendezvous-timeout. `omnimesh serve --num-nodes 2` on both nodes, every stage split over
them: node 0 runs the mesh and the gateway, node 1 only the stages' headless ranks, and text and audio are again
the reference's. Every wait is bounded. This module runs its own processes (never the shared `mesh`)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from mesh_harness import Proc, children, free_port, start_gateway, start_mesh
from reference import chat_request, png_bytes, sine_wav
from test_parity import MAX_TOKENS, TALKER_MAX, run_pipeline

PROMPT = "Tell me about the sea."
SERVE_LAYOUT = '{"encoder": {"pp": 2}, "thinker": {"pp": 2}, "talker": {"pp": 2}, "vocoder": {"tp": 2}}'
EXIT_WITHIN_S = 45.0  # a headless node's end after node 0's (process start-up included on a busy host)


def _node(model_dir: Path, rank: int, master_port: int, *extra: str) -> Proc:
    argv = ["stage", "thinker", "--model", str(model_dir), "--num-nodes", "2", "--node-rank", str(rank),
            "--master-addr", "127.0.0.1", "--master-port", str(master_port), *extra]
    return Proc(argv)


def _exit_code(proc: Proc, timeout_s: float = EXIT_WITHIN_S) -> int:
    try:
        return proc.proc.wait(timeout=timeout_s)
    except Exception:
        proc.stop()
        raise AssertionError(f"{proc.argv[:2]} did not exit within {timeout_s}s:\n{proc.output()}") from None


def _chat(rest: str) -> dict:
    body = {"messages": [{"role": "user", "content": PROMPT}], "modalities": ["text"], "max_tokens": MAX_TOKENS,
            "temperature": 0}
    r = httpx.post(f"{rest}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def expected(reference) -> tuple[str, int]:
    req = chat_request(PROMPT, None, None, max_tokens=MAX_TOKENS, talker_max=1, modalities=("text",))
    ref = reference.generate(req, max_tokens=MAX_TOKENS, talker_max=1, audio=False)
    return ref.text, len(ref.token_ids)


@pytest.mark.parametrize("layout, node0_end", [(("-pp", "2"), signal.SIGTERM), (("-tp", "2"), signal.SIGKILL)])
def test_thinker_over_two_nodes_answers_like_generate(tiny_model_dir, expected, layout, node0_end) -> None:
    master, port = free_port(), free_port()
    node0 = _node(tiny_model_dir, 0, master, "--port", str(port), *layout)
    node1 = _node(tiny_model_dir, 1, master, *layout)
    gateway = None
    try:
        node0.wait_for_line(r"omnimesh stage thinker listening")
        node1.wait_for_line(r"ranks \[1\] ready; serving node 0's commands", timeout_s=30)
        gateway, rest = start_gateway(tiny_model_dir, {"thinker": f"127.0.0.1:{port}"})
        for _ in range(2):  # the second on warm KV state: still the same answer
            answer = _chat(rest)
            assert answer["choices"][0]["message"]["content"] == expected[0]
            assert answer["usage"]["completion_tokens"] == expected[1]
        assert any("over 2 nodes" in line for line in node0.lines), node0.output()
        if layout[0] == "-tp":
            assert any("the tp = 2 ranks of a pipeline rank are split across hosts" in line for line in node0.lines)
        t0 = time.monotonic()
        os.killpg(node0.proc.pid, node0_end)
        code = _exit_code(node1)
        if node0_end == signal.SIGTERM:
            assert code == 0 and any("node 0 shut the stage down" in line for line in node1.lines), node1.output()
        else:
            assert code == 1, node1.output()
            assert any("lost node 0 (the stage's driver)" in line or "lost the stage's driver" in line
                       for line in node1.lines), node1.output()
        assert time.monotonic() - t0 < EXIT_WITHIN_S
    finally:
        if gateway is not None:
            gateway.stop()
        node0.stop()
        node1.stop()


def test_nodes_that_disagree_fail_at_the_rendezvous(tiny_model_dir) -> None:
    master = free_port()
    node0 = _node(tiny_model_dir, 0, master, "--port", str(free_port()), "-pp", "2")
    node1 = _node(tiny_model_dir, 1, master, "-pp", "4")  # 4 ranks over 2 nodes: valid alone, not with node 0
    try:
        assert _exit_code(node0, 90) == 1 and _exit_code(node1, 90) == 1
        assert "omnimesh: error: stage thinker: the nodes disagree at the rendezvous" in node0.output()
        assert "stage thinker, node 1: the nodes disagree at the rendezvous" in node1.output()
        for proc in (node0, node1):
            text = proc.output()
            assert "pp: node 0 (" in text and "has 2, node 1 (" in text and "has 4" in text, text
    finally:
        node0.stop()
        node1.stop()


def test_a_missing_master_or_node_fails_within_the_rendezvous_timeout(tiny_model_dir) -> None:
    t0 = time.monotonic()
    orphan = _node(tiny_model_dir, 1, free_port(), "-pp", "2", "--rendezvous-timeout", "5")  # nobody at that port
    alone = _node(tiny_model_dir, 0, free_port(), "--port", str(free_port()), "-pp", "2", "--rendezvous-timeout", "5")
    try:
        assert _exit_code(orphan, 90) == 4, orphan.output()
        assert "could not reach node 0's rendezvous at 127.0.0.1:" in orphan.output()
        assert _exit_code(alone, 90) == 1, alone.output()
        assert "omnimesh: error: stage thinker: node(s) [1] of 2 did not join the rendezvous" in alone.output()
        assert time.monotonic() - t0 < 90
    finally:
        orphan.stop()
        alone.stop()


def test_serve_over_two_nodes(tiny_model_dir, reference) -> None:
    """Node 1 first (it waits for node 0), then node 0's whole mesh; every stage spans both nodes, each on its own
    rendezvous port (--master-port + stage index); text and audio (from audio + image input) equal generate's."""
    base = free_port()
    spread = ("--num-nodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(base),
              "--stage-overrides", SERVE_LAYOUT, "--rendezvous-timeout", "90")
    node1 = Proc(["serve", str(tiny_model_dir), "--node-rank", "1", *spread])
    mesh = None
    try:
        mesh = start_mesh(tiny_model_dir, "--node-rank", "0", *spread)
        node1.wait_for_line(rf"node 1 of 2: headless ranks of encoder \(rendezvous 127.0.0.1:{base}\), thinker "
                            rf"\(rendezvous 127.0.0.1:{base + 1}\), talker .*:{base + 2}\), vocoder .*:{base + 3}\); "
                            r"no gateway here")
        req = chat_request(PROMPT, sine_wav(), png_bytes(), max_tokens=MAX_TOKENS, talker_max=TALKER_MAX)
        ref = reference.generate(req, max_tokens=MAX_TOKENS, talker_max=TALKER_MAX)
        text, audio, finished = run_pipeline(mesh, tiny_model_dir, req, async_chunk=True)
        assert text == ref.text and finished.completion_tokens == len(ref.token_ids)
        assert audio.shape == ref.audio.shape and audio.size > 0
        np.testing.assert_allclose(audio, ref.audio, atol=1e-4, rtol=0)
        stages = {"stage encoder", "stage thinker", "stage talker", "stage vocoder"}
        assert set(children(node1.proc.pid)) == stages  # headless stage processes only: no gateway on node 1
        assert set(children(mesh.proc.proc.pid)) == stages | {"gateway"}
        assert mesh.proc.stop() == 0
        mesh = None
        # node 1's ranks end with node 0's stop (code 0), and it waits for each stage's next start
        for stage in ("encoder", "thinker", "talker", "vocoder"):
            node1.wait_for_line(rf"node 0 stopped stage {stage}; waiting up to 90s for its next start", timeout_s=60)
        assert node1.stop() == 0
    finally:
        if mesh is not None:
            mesh.proc.stop()
        node1.stop()
