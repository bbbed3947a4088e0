"""The multi-node handshake and liveness watch, both ends in this process over a real TCPStore on 127.0.0.1
(no process group, no model): agreeing nodes meet; a disagreement (pp, num_nodes, model), a --node-rank claimed
twice, a node that never comes, an unreachable master, a taken port and a --master-addr that is not node 0's own
are errors on every node within the bound, naming the values and the nodes; after start-up a silent or failed
node reaches node 0's `on_failure`, and node 0's stop reaches the others."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest

from omnimesh.parallel import node_rendezvous
from omnimesh.parallel.node_rendezvous import NodeHost, NodeLost, NodeMember, NodeSpec, RendezvousError
from omnimesh.proc_utils import free_port

ADDR = "127.0.0.1"


def _spec(node_rank: int, num_nodes: int = 2, timeout_s: float = 20.0, **over: Any) -> NodeSpec:
    return NodeSpec(**{"stage": "thinker", "num_nodes": num_nodes, "node_rank": node_rank, "model": "abc123",
                       "timeout_s": timeout_s, **over})


def _in_thread(fn) -> tuple[threading.Thread, dict]:  # noqa: ANN001
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except Exception as exc:  # the test reads it
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def _join(port: int, spec: NodeSpec, pp: int = 2, tp: int = 1) -> NodeMember:
    member = NodeMember(ADDR, port, spec, pp, tp, "gloo")
    member.handshake()
    return member


def test_agreeing_nodes_meet_report_ready_and_hear_the_stop() -> None:
    port = free_port()
    host = NodeHost(ADDR, port, _spec(0, num_nodes=3), 4, 1, "gloo")
    thread, out = _in_thread(host.handshake)
    joins = [_in_thread(lambda r=r: _join(port, _spec(r, num_nodes=3), pp=4)) for r in (2, 1)]  # any order
    for t, _ in joins:
        t.join(timeout=10)
    thread.join(timeout=10)
    assert "error" not in out and not thread.is_alive()
    members = [o["value"] for _, o in joins]
    assert sorted(host.members) == [1, 2]
    for m in members:
        m.ready(None)
    host.wait_ready(time.monotonic() + 5)
    failures: list[str] = []
    host.watch(failures.append)
    assert members[0].beat() == "serving"
    host.stopping()
    assert [m.beat() for m in members] == ["stopping", "stopping"]
    assert failures == []


@pytest.mark.parametrize("theirs, words", [
    ({"pp": 4}, ["pp: node 0", "has 2, node 1", "has 4"]),
    ({"num_nodes": 3}, ["num_nodes: node 0", "has 2, node 1", "has 3"]),
    ({"model": "ffff00"}, ["model: node 0", "'abc123'", "'ffff00'"]),
])
def test_a_disagreement_is_an_error_on_both_nodes_naming_the_values(theirs: dict, words: list[str]) -> None:
    port = free_port()
    host = NodeHost(ADDR, port, _spec(0), 2, 1, "gloo")
    thread, out = _in_thread(host.handshake)
    pp = theirs.pop("pp", 2)
    t0 = time.monotonic()
    with pytest.raises(RendezvousError) as member_error:
        _join(port, _spec(1, **theirs), pp=pp)
    thread.join(timeout=10)
    assert time.monotonic() - t0 < 10
    host_error = out["error"]
    assert isinstance(host_error, RendezvousError) and str(host_error) == str(member_error.value)
    text = str(host_error)
    assert text.startswith(f"stage thinker: the nodes disagree at the rendezvous {ADDR}:{port}: ")
    assert all(w in text for w in words), text
    assert "--node-rank" in text  # the fix


def test_a_node_rank_claimed_twice_fails_every_node() -> None:
    port = free_port()
    host = NodeHost(ADDR, port, _spec(0, num_nodes=3), 3, 1, "gloo")
    thread, out = _in_thread(host.handshake)
    first, first_out = _in_thread(lambda: _join(port, _spec(1, num_nodes=3), pp=3))
    with pytest.raises(RendezvousError, match=r"two nodes claim --node-rank 1: node 1 \(.*\) and node 1 \(.*\); give "
                                              r"every host its own rank 1..2"):
        _join(port, _spec(1, num_nodes=3), pp=3)
    first.join(timeout=10)
    thread.join(timeout=10)
    assert "two nodes claim --node-rank 1" in str(first_out["error"])
    assert "two nodes claim --node-rank 1" in str(out["error"])


def test_a_node_that_never_comes_is_named_within_the_timeout() -> None:
    host = NodeHost(ADDR, free_port(), _spec(0, num_nodes=3, timeout_s=1.5), 3, 1, "gloo")
    t0 = time.monotonic()
    with pytest.raises(RendezvousError, match=r"node\(s\) \[1, 2\] of 3 did not join the rendezvous .* within 2s"):
        host.handshake()
    assert time.monotonic() - t0 < 5


def test_an_unreachable_master_is_an_error_within_the_timeout() -> None:
    port = free_port()  # nobody listens there
    t0 = time.monotonic()
    with pytest.raises(RendezvousError, match=rf"could not reach node 0's rendezvous at {ADDR}:{port} within 2s "
                                              r"\(.*refused.*\); check --master-addr and --master-port"):
        NodeMember(ADDR, port, _spec(1, timeout_s=2.0), 2, 1, "gloo")
    assert 1.9 < time.monotonic() - t0 < 6


def test_a_taken_port_is_an_error_at_node_0() -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RendezvousError, match=rf"node 0 could not listen .* on port {port} .* choose another "
                                                  r"--master-port"):
            NodeHost(ADDR, port, _spec(0), 2, 1, "gloo")


def test_a_master_addr_that_is_not_node_0s_own_is_an_error_at_once() -> None:
    t0 = time.monotonic()
    with pytest.raises(RendezvousError, match=r"--master-addr 192.0.2.7 is not an address of node 0 itself .*give "
                                              r"this host's address"):
        NodeHost("192.0.2.7", free_port(), _spec(0), 2, 1, "gloo")  # TEST-NET-1: never this host's
    assert time.monotonic() - t0 < 2


def test_a_late_node_is_refused_after_the_handshake() -> None:
    port = free_port()
    host = NodeHost(ADDR, port, _spec(0), 2, 1, "gloo")
    thread, out = _in_thread(host.handshake)
    _join(port, _spec(1))
    thread.join(timeout=10)
    host.watch(lambda message: None)
    with pytest.raises(RendezvousError, match=r"already has its 2 nodes .* came late — is --node-rank 1 given twice"):
        _join(port, _spec(1))
    host.stopping()


def test_a_silent_or_failed_node_reaches_on_failure_and_the_others_hear_it(monkeypatch) -> None:
    monkeypatch.setattr(node_rendezvous, "HEARTBEAT_TIMEOUT_S", 2.0)
    monkeypatch.setattr(node_rendezvous, "HEARTBEAT_S", 0.2)
    port = free_port()
    host = NodeHost(ADDR, port, _spec(0, num_nodes=3), 3, 1, "gloo")
    thread, out = _in_thread(host.handshake)
    joins = [_in_thread(lambda r=r: _join(port, _spec(r, num_nodes=3), pp=3)) for r in (1, 2)]
    for t, _ in joins:
        t.join(timeout=10)
    thread.join(timeout=10)
    two = joins[1][1]["value"]
    failures: list[str] = []
    host.watch(failures.append)
    deadline = time.monotonic() + 10
    while not failures and time.monotonic() < deadline:
        two.beat()  # node 1 stays silent
        time.sleep(0.1)
    assert len(failures) == 1 and "node 1 (" in failures[0] and "sent no heartbeat for 2s" in failures[0], failures
    assert two.beat().startswith("failed: node 1 (")  # the other nodes hear that the stage failed

    port = free_port()
    host = NodeHost(ADDR, port, _spec(0), 2, 1, "gloo")
    thread, out = _in_thread(host.handshake)
    member = _join(port, _spec(1))
    thread.join(timeout=10)
    failures.clear()
    host.watch(failures.append)
    member.fail("rank 1 (pid 42) exited with code 1")
    deadline = time.monotonic() + 5
    while not failures and time.monotonic() < deadline:
        time.sleep(0.05)
    assert failures and failures[0].endswith(": rank 1 (pid 42) exited with code 1") and "node 1 (" in failures[0]


def test_a_member_hears_node_0_go(monkeypatch) -> None:
    """Once node 0's store is gone, a heartbeat raises NodeLost naming the address (bounded by the store timeout)."""
    port = free_port()
    host = NodeHost(ADDR, port, _spec(0), 2, 1, "gloo")
    thread, out = _in_thread(host.handshake)
    member = _join(port, _spec(1))
    thread.join(timeout=10)
    del host, thread, out  # the last reference to the server: it stops listening
    import gc

    gc.collect()
    t0 = time.monotonic()
    with pytest.raises(NodeLost, match=rf"lost node 0 \(the stage's driver\) at {ADDR}:{port}"):
        for _ in range(100):
            member.beat()
            time.sleep(0.1)
    assert time.monotonic() - t0 < node_rendezvous.HEARTBEAT_TIMEOUT_S + 5
