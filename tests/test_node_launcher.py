"""The launcher side of --num-nodes, without starting a model: which stages spread and the flags each stage process
gets (they parse back to the same layout), the advice (tp across hosts, a host name that resolves to loopback),
and the headless node's supervision (rejoin after node 0's stop, end when node 0 does not come back, restarts
bounded by --stage-restarts)."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from omnimesh import node_launcher
from omnimesh.cli import build_parser
from omnimesh.config.serve_args import ServeArgs, from_namespace
from omnimesh.launcher import MeshLauncher
from omnimesh.node_launcher import HeadlessNode, _Child, check_nodes, gloo_address_advice, spread_stages
from omnimesh.parallel.headless_ranks import EXIT_NO_NODE0

SPREAD = dict(num_nodes=2, master_addr="10.0.0.1", master_port=29500,
              stage_overrides='{"thinker": {"pp": 2}, "talker": {"tp": 2, "num_nodes": 1}, "vocoder": {"tp": 2}}')


def test_spread_stages_get_their_own_port_and_flags_that_parse_back() -> None:
    args = ServeArgs(node_rank=0, **SPREAD)  # type: ignore[arg-type]
    assert spread_stages(args) == {"thinker": 29501, "vocoder": 29503}  # talker kept on node 0, encoder 1 rank
    launcher = MeshLauncher(args, Path("/models/m"))
    argv = launcher._stage_argv("thinker", 50052)
    assert argv[-10:] == ["--num-nodes", "2", "--node-rank", "0", "--master-addr", "10.0.0.1", "--master-port", "29501",
                          "--rendezvous-timeout", "120.0"]
    assert "--num-nodes" not in launcher._stage_argv("encoder", 50051)
    assert "--num-nodes" not in launcher._stage_argv("talker", 50053)
    ns = build_parser().parse_args(argv)
    stage_args = from_namespace(ns)
    cfg = stage_args.stage_configs()["thinker"]
    assert (cfg.pp, cfg.tp, cfg.num_nodes, cfg.ranks_per_node) == (2, 1, 2, 1)
    assert (stage_args.node_rank, stage_args.master_port) == (0, 29501)
    headless = MeshLauncher(ServeArgs(node_rank=1, **SPREAD), Path("/m"))._stage_argv("vocoder", 0)  # type: ignore[arg-type]
    assert headless[-10:-6] == ["--num-nodes", "2", "--node-rank", "1"] and "29503" in headless


@pytest.mark.parametrize("pp, tp, advice", [(2, 1, False), (2, 2, False), (1, 2, True), (1, 4, True)])
def test_tp_split_across_hosts_is_advice(pp: int, tp: int, advice: bool) -> None:
    args = ServeArgs(num_nodes=2, master_port=29500, pipeline_parallel_size=pp, tensor_parallel_size=tp)
    lines = [line for line in check_nodes(args, "thinker") if "split across hosts" in line]
    assert bool(lines) == advice, lines
    if tp == 2 and advice:
        assert "a tp that divides 1, e.g. -tp 1 -pp 2" in lines[0]


def test_a_host_name_on_loopback_is_advice_for_a_remote_master(monkeypatch) -> None:
    table = {"node-a": ["127.0.1.1"], "10.0.0.1": ["10.0.0.1"], "127.0.0.1": ["127.0.0.1"], "node-b": ["10.0.0.2"]}

    def getaddrinfo(host, port):  # noqa: ANN001, ANN202
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, 0)) for a in table[host]]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(socket, "gethostname", lambda: "node-a")
    line = gloo_address_advice("10.0.0.1")
    assert line is not None and "'node-a' resolves only to a loopback address" in line and "GLOO_SOCKET_IFNAME" in line
    assert gloo_address_advice("127.0.0.1") is None  # every node on this host
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    assert gloo_address_advice("10.0.0.1") is None
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setattr(socket, "gethostname", lambda: "node-b")
    assert gloo_address_advice("10.0.0.1") is None


class _Exited:
    """A child process that has already exited with `code`."""

    def __init__(self, code: int):
        self.returncode, self.pid = code, 4242

    def poll(self) -> int:
        return self.returncode


def _node(monkeypatch, codes: list[int], restarts: int) -> tuple[HeadlessNode, Callable, list[list[str]]]:
    """A headless node whose thinker process exits with codes[0], and a `popen` whose processes exit with the rest."""
    monkeypatch.setattr(node_launcher, "POLL_S", 0.01)
    node = HeadlessNode(ServeArgs(node_rank=1, stage_restarts=restarts, **SPREAD), Path("/m"))  # type: ignore[arg-type]
    later = [_Exited(c) for c in codes[1:]]
    started: list[list[str]] = []

    def popen(argv: list[str]) -> _Exited:
        started.append(argv)
        return later.pop(0)

    node.children = {"thinker": _Child(["stage", "thinker"], _Exited(codes[0]))}  # type: ignore[arg-type]
    return node, popen, started


def test_headless_node_rejoins_after_node_0s_stop_and_ends_when_it_does_not_return(monkeypatch, capsys) -> None:
    node, popen, started = _node(monkeypatch, [0, EXIT_NO_NODE0], restarts=3)
    assert node._watch(popen) == 0
    assert started == [["stage", "thinker"]]  # joined the next start once, at once
    err = capsys.readouterr().err
    assert "node 0 stopped stage thinker; waiting up to 120s for its next start" in err
    assert "stage thinker is over (node 0 did not start it again)" in err and "exiting" in err


def test_headless_node_restarts_a_failed_stage_within_stage_restarts(monkeypatch, capsys) -> None:
    node, popen, started = _node(monkeypatch, [1, 1], restarts=1)
    assert node._watch(popen) == 1
    assert len(started) == 1
    err = capsys.readouterr().err
    assert "headless stage thinker (pid 4242) exited with code 1; starting it again in 1s" in err
    assert "--stage-restarts 1 used up: stopping this node" in err
    node, popen, _ = _node(monkeypatch, [EXIT_NO_NODE0], restarts=0)  # never reached node 0, no restarts allowed
    assert node._watch(popen) == 1


def test_headless_node_stops_on_a_signal_without_restarting(monkeypatch, capsys) -> None:
    """SIGTERM only sets a flag (an exception raised inside a fork hook while spawning would be lost)."""
    node, popen, started = _node(monkeypatch, [1, 1], restarts=3)
    node.stopping = True
    assert node._watch(popen) == 0 and started == []
    assert "stopping its headless stages" in capsys.readouterr().err
