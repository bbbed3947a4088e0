"""MpExecutor over two "nodes" on this host: node 0 is this process (the driver, plus its local ranks), node 1 a
separate process running its ranks headless (toy_nodes.py). The toy program's answer equals the unsharded one for
pp, tp and pp x tp splits across the nodes; node 0's shutdown ends node 1 with 0; a headless node whose driver
is killed exits non-zero, saying so, within a bound; a headless node that dies fails the driver's stage (named,
never a hang); a rank that cannot start on node 1 fails node 0's start with its reason."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
import torch
import toy_nodes
import toy_program

from omnimesh.parallel import node_rendezvous
from omnimesh.parallel.mp_executor import RankFailure
from omnimesh.parallel.node_rendezvous import RendezvousError
from omnimesh.proc_utils import free_port

EXIT_WITHIN_S = 30.0


def _wait(proc: subprocess.Popen, timeout_s: float = EXIT_WITHIN_S) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate(timeout=10)
        raise AssertionError(f"the node did not exit within {timeout_s}s:\n{out}") from None
    return proc.returncode, out


@pytest.mark.parametrize("pp, tp", [(2, 1), (1, 2), (2, 2)])
def test_two_nodes_equal_the_unsharded_program(pp: int, tp: int) -> None:
    port = free_port()
    node1 = toy_nodes.start("headless", port, pp, tp)
    ex = None
    try:
        ex = toy_nodes.driver(port, pp, tp)
        assert len(ex.pids) == pp * tp // 2  # this host's ranks only; the others live on node 1
        x = torch.randn(3, toy_program.H, generator=torch.Generator().manual_seed(1))
        for _ in range(3):
            torch.testing.assert_close(ex.execute(("run", x)), toy_program.reference(x), rtol=1e-5, atol=1e-5)
        assert ex.execute(("whoami",)) == f"rank {(pp - 1) * tp}"  # on node 1 when pp = 2
        with pytest.raises(RankFailure, match="bad input on purpose"):
            ex.execute(("fail",))
        torch.testing.assert_close(ex.execute(("run", x)), toy_program.reference(x), rtol=1e-5, atol=1e-5)
    finally:
        if ex is not None:
            ex.shutdown()
        code, out = _wait(node1)
    assert code == 0, out
    assert "node 0 shut the stage down" in out and "headless node 1 of 2 for stage toy" in out, out


def test_a_headless_node_whose_driver_is_killed_exits_non_zero() -> None:
    port = free_port()
    node1 = toy_nodes.start("headless", port, 2, 1)
    node0 = toy_nodes.start("driver", port, 2, 1)
    try:
        assert node0.stdout is not None
        deadline = time.monotonic() + EXIT_WITHIN_S
        while "driver ready" not in node0.stdout.readline():
            assert time.monotonic() < deadline and node0.poll() is None, "the driver did not start"
        os.kill(node0.pid, signal.SIGKILL)
        t0 = time.monotonic()
        code, out = _wait(node1)
        assert code == 1, out
        assert time.monotonic() - t0 < node_rendezvous.HEARTBEAT_TIMEOUT_S + 10
        assert "lost node 0 (the stage's driver)" in out or "lost the stage's driver" in out, out
    finally:
        node0.kill()
        node0.communicate(timeout=10)


def test_the_driver_hears_a_headless_node_die(monkeypatch) -> None:
    monkeypatch.setattr(node_rendezvous, "HEARTBEAT_TIMEOUT_S", 3.0)
    port = free_port()
    node1 = toy_nodes.start("headless", port, 1, 2)  # tp = 2: rank 0 owns the results; only the watch can tell
    failures: list[str] = []
    ex = toy_nodes.driver(port, 1, 2, on_failure=failures.append)
    try:
        x = torch.randn(2, toy_program.H)
        torch.testing.assert_close(ex.execute(("run", x)), toy_program.reference(x), rtol=1e-5, atol=1e-5)
        os.kill(node1.pid, signal.SIGKILL)  # its ranks die with it (PR_SET_PDEATHSIG)
        node1.communicate(timeout=10)
        deadline = time.monotonic() + 15
        while not failures and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(failures) == 1 and "node 1 (" in failures[0] and "sent no heartbeat for 3s" in failures[0], failures
        with pytest.raises(RankFailure, match="lost a rank"):
            ex.execute(("run", x))
    finally:
        ex.shutdown()


def test_a_rank_that_never_reaches_the_rendezvous_on_node_1_fails_node_0s_start_at_once() -> None:
    """Node 1's rank dies at spawn (its factory does not unpickle there): node 0 joins the rendezvous only after
    every node said its ranks are about to, so it names node 1's failure within seconds instead of waiting out the
    rendezvous timeout (30 s here) and blaming the network."""
    port = free_port()
    node1 = toy_nodes.start("headless", port, 2, 1, "ParentOnly")
    t0 = time.monotonic()
    with pytest.raises(RendezvousError, match=r"node 1 \(.*\): rank 1 \(pid \d+\) exited with code 1"):
        toy_nodes.driver(port, 2, 1)
    assert time.monotonic() - t0 < toy_nodes.TIMEOUT_S / 2
    code, out = _wait(node1)
    assert code == 1 and "rank 1 (pid" in out, out


def test_a_rank_that_cannot_start_on_node_1_fails_node_0s_start() -> None:
    port = free_port()
    node1 = toy_nodes.start("headless", port, 2, 1, "make_broken")  # rank 1 (node 1's) raises in its factory
    with pytest.raises(RendezvousError, match=r"node 1 \(.*\): rank 1 failed to start: RuntimeError: weights for "
                                              r"rank 1 are missing"):
        toy_nodes.driver(port, 2, 1)
    code, out = _wait(node1)
    assert code == 1 and "rank 1 failed to start" in out, out
