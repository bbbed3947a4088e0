"""A stage's replicas from DNS (`--stages thinker=dns:///HOST:PORT`): the name's addresses become replicas,
new ones join as the answer grows, gone ones retire (no new requests; dropped once idle), a failed lookup
keeps what is known. Real thinker replicas on loopback, with the lookups answered by a scripted resolver
(nothing but 127.0.0.1 resolves here); one real lookup of `localhost`."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from gateway import stage_mesh
from gateway.pipeline import StagePipeline
from gateway.stage_discovery import DnsTarget, StageDiscovery, parse_dns_target, resolve
from omnimesh.cli import parse_stage_addresses
from omnimesh.engine.loop import EngineLoop
from omnimesh.transport.stage_client import StageClient
from tests.gateway.test_replicas import WordThinker, _answer, _prompt
from tests.stage_harness import served_stage


def test_dns_targets_parse_and_mixing_them_with_addresses_is_refused() -> None:
    assert parse_dns_target("dns:///omnimesh-vocoder:50054") == DnsTarget("omnimesh-vocoder", 50054)
    assert parse_dns_target("10.0.0.1:50054") is None
    for bad in ("dns://x:1", "dns:///x", "dns:///:50054", "dns:///x:99999"):
        with pytest.raises(ValueError, match="dns:///HOST:PORT"):
            parse_dns_target(bad)
    assert parse_stage_addresses("thinker=dns:///t:1,vocoder=v:2") == {"thinker": ["dns:///t:1"], "vocoder": ["v:2"]}
    assert parse_stage_addresses("thinker=[::1]:50052,encoder=omni-enc:1") == {"thinker": ["[::1]:50052"],
                                                                              "encoder": ["omni-enc:1"]}
    for bad in ("thinker=x:y", "thinker=:1", "thinker=127.0.0.1:99999", "thinker=127.0.0.1:0", "thinker=h:"):
        with pytest.raises(ValueError, match="the address must be HOST:PORT with a port in 1-65535"):
            parse_stage_addresses(bad)
    for mixed in ("thinker=dns:///t:1,thinker=a:2", "thinker=a:2,thinker=dns:///t:1"):
        with pytest.raises(ValueError, match="stage thinker is named by DNS"):
            parse_stage_addresses(mixed)


async def test_resolving_localhost_gives_its_loopback_addresses() -> None:
    got = await resolve(DnsTarget("localhost", 50054))
    assert "127.0.0.1:50054" in got and got == sorted(set(got))
    with pytest.raises(socket.gaierror):
        await resolve(DnsTarget("no-such-host.invalid", 1))


class ScriptedDns:
    def __init__(self) -> None:
        self.answer: list[str] | Exception = []
        self.asked = 0

    async def __call__(self, target: DnsTarget) -> list[str]:
        self.asked += 1
        if isinstance(self.answer, Exception):
            raise self.answer
        return list(self.answer)


async def test_replicas_join_and_retire_with_the_dns_answer(caplog) -> None:
    a, b = WordThinker("a"), WordThinker("b")
    async with served_stage(a, EngineLoop("thinker")) as sa, served_stage(b, EngineLoop("thinker")) as sb:
        addr_a, addr_b = f"127.0.0.1:{sa.port}", f"127.0.0.1:{sb.port}"
        dns = ScriptedDns()
        dns.answer = [addr_a]
        pipe = StagePipeline({"thinker": []}, _prompt, served_models=("m",))
        discovery = StageDiscovery({"thinker": DnsTarget("thinkers", 1)}, pipe.stages,
                                   lambda stage, addr: StageClient(stage, addr), refresh_s=60.0, resolver=dns)
        discovery.start()
        await pipe.connect(timeout_s=10.0, late_grace_s=0.1)
        assert [await _answer(pipe, f"r{i}") for i in range(2)] == ["a1 a2 "] * 2
        dns.answer = [addr_a, addr_b]  # scaled up
        await discovery.refresh()
        rs = pipe.stages["thinker"]
        await pipe.mesh._upkeep_once()
        assert [r.address for r in rs.known()] == [addr_a, addr_b]
        assert sorted([await _answer(pipe, f"s{i}") for i in range(2)]) == ["a1 a2 ", "b1 b2 "]
        dns.answer = OSError("the DNS server is down")  # a failed lookup keeps what is known
        await discovery.refresh()
        assert len(rs.known()) == 2 and "keeping its 2 known replica(s)" in caplog.text
        dns.answer = [addr_b]  # a is gone from the answer: retired, while a request still holds it
        replica_a, replica_b = rs.replicas
        held = rs.pick(exclude=frozenset({replica_b.index}))
        assert held.replica is replica_a
        await discovery.refresh()
        assert rs.known() == [replica_b] and replica_a.retired
        assert [await _answer(pipe, f"t{i}") for i in range(3)] == ["b1 b2 "] * 3
        await rs.prune()
        assert rs.replicas == [replica_a, replica_b]  # still held by a request in flight
        held.done()
        await rs.prune()
        assert [r.address for r in rs.replicas] == [addr_b]  # dropped once nothing holds it
        # replica labels are never reused: a joins again as a new replica
        dns.answer = [addr_a, addr_b]
        await discovery.refresh()
        assert sorted(r.index for r in rs.replicas) == [1, 2]
        await discovery.stop()
        await pipe.close()


async def test_a_stage_whose_name_resolves_to_nothing_is_named_at_start_up(monkeypatch, caplog) -> None:
    """The bounded wait names the flag that bounds it, and says meanwhile what it waits for (a stage may take
    minutes to load its weights: the log is not silent until then)."""
    monkeypatch.setattr(stage_mesh, "WAIT_NOTE_S", 0.3)
    caplog.set_level(logging.INFO, logger="gateway.stage_mesh")
    dns = ScriptedDns()
    pipe = StagePipeline({"thinker": []}, _prompt, served_models=("m",))
    discovery = StageDiscovery({"thinker": DnsTarget("thinkers", 1)}, pipe.stages,
                               lambda stage, addr: StageClient(stage, addr), refresh_s=0.2, resolver=dns)
    discovery.start()
    with pytest.raises(RuntimeError, match=r"stage thinker did not answer within 1s \(--stage-start-timeout\): stage "
                                           r"thinker has no replica \(its DNS name resolves to no address yet\)"):
        await pipe.connect(timeout_s=1.0)
    assert dns.asked >= 3  # looked up again and again meanwhile
    notes = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
    assert notes and notes[0].startswith("gateway: still waiting for the stages: stage thinker has no replica (its DNS"), notes
    assert notes[0].endswith("s left (--stage-start-timeout)")
    await discovery.stop()
    await asyncio.sleep(0)
    await pipe.close()
