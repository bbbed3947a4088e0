"""Stage replicas in the gateway: `ReplicaSet.pick` (least busy, round-robin among equals, near host, a
failed replica passed over for a backoff, replicas that serve something else refused), and `StagePipeline`
over real in-process thinker replicas on loopback gRPC: requests spread over them, a replica that is
gone or full before the client got anything has the request run again on another one, and a failure
after output reached the client is not retried."""

from __future__ import annotations

import asyncio
import logging
import threading

import grpc
import pytest
import torch

from gateway.events import ChatMessage, ChatRequest, Finished, PipelineError, TextDelta
from gateway.pipeline import StagePipeline
from gateway.prompt import PromptInputs
from gateway.replicas import ReplicaSet
from omnimesh.engine.loop import EngineLoop
from omnimesh.engine.task import StageRequestError, StageTask
from omnimesh.proc_utils import free_port
from omnimesh.transport.frames import StageChunk
from omnimesh.transport.stage_client import StageClient
from omnimesh.v1 import stage_pb2
from tests.stage_harness import served_stage


class FakeClient:
    """Stands in for a StageClient where only the address and reachability matter."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.down = False

    def unreachable(self) -> bool:
        return self.down


def _set(n: int, hosts: list[str] | None = None, caching: bool = False) -> ReplicaSet:
    rs = ReplicaSet("talker", [FakeClient(f"h:{i}") for i in range(n)])  # type: ignore[list-item]
    for i, replica in enumerate(rs.replicas):
        assert rs.adopt(replica, stage_pb2.StageInfo(stage="talker", model="m", host_id=(hosts or ["a"] * n)[i],
                                                     prefix_caching=caching))
    return rs


def test_replicas_that_cache_by_content_take_a_keys_requests() -> None:
    """A stage whose replicas cache (prefix cache, encoder cache): among equally busy replicas a request goes to
    its key's own (the same key always to the same replica), keys spread over the replicas, load still comes
    first; without caching the key changes nothing (round-robin)."""
    rs = _set(3, caching=True)
    own = {k: _one(rs, key=f"conversation {k}".encode()) for k in range(30)}
    assert all(_one(rs, key=f"conversation {k}".encode()) == i for k, i in own.items())
    assert set(own.values()) == {0, 1, 2}  # rendezvous hashing spreads the keys
    held = rs.pick(key=b"conversation 0")  # its replica is busy now: the next request with that key goes elsewhere
    assert rs.pick(key=b"conversation 0").replica.index != own[0]
    held.done()
    plain = _set(2)
    assert [_one(plain, key=b"same") for _ in range(4)] == [0, 1, 0, 1]


def test_pick_takes_the_least_busy_and_rotates_among_equals() -> None:
    rs = _set(3)
    leases = [rs.pick() for _ in range(3)]
    assert [lease.replica.index for lease in leases] == [0, 1, 2]  # one each
    leases[1].done()
    assert rs.pick().replica.index == 1  # the only one with a free hand
    for lease in leases:
        lease.done()
    rs2 = _set(2)
    picked = []
    for _ in range(4):  # one request at a time: strict alternation
        lease = rs2.pick()
        picked.append(lease.replica.index)
        lease.done()
    assert picked == [0, 1, 0, 1]


def test_pick_prefers_the_near_host_among_equally_busy() -> None:
    rs = _set(2, hosts=["far", "near"])
    for _ in range(3):
        lease = rs.pick(near="near")
        assert lease.replica.host == "near"
        lease.done()
    busy = rs.pick(near="near")
    assert rs.pick(near="near").replica.host == "far"  # load first, then locality
    busy.done()


def _one(rs: ReplicaSet, **kwargs) -> int:
    """The replica one request (begun and ended) went to."""
    lease = rs.pick(**kwargs)
    lease.done(ok=False)
    return lease.replica.index


def test_a_failed_replica_is_passed_over_for_a_backoff_then_tried_again() -> None:
    now = [100.0]
    rs = _set(2)
    rs.clock = lambda: now[0]
    bad = rs.replicas[0]
    rs.mark_down(bad, "connection refused")
    assert [_one(rs) for _ in range(3)] == [1, 1, 1]
    now[0] += 0.6  # past the first backoff (0.5 s)
    assert {_one(rs) for _ in range(2)} == {0, 1}
    rs.mark_down(bad, "again")
    assert bad.down_until - now[0] == pytest.approx(1.0)  # doubled
    rs.replicas[1].client.down = True  # gRPC cannot reach the other one either: every replica looks down
    assert _one(rs) in (0, 1)  # a pick anyway: the call says what is wrong
    lease = rs.pick(exclude=frozenset({0}))
    assert lease.replica.index == 1
    lease.done(ok=True)
    assert rs.replicas[1].failures == 0


def test_replicas_that_serve_something_else_are_refused(caplog) -> None:
    rs = ReplicaSet("vocoder", [FakeClient(f"h:{i}") for i in range(3)])  # type: ignore[list-item]
    a, b, c = rs.replicas
    assert rs.adopt(a, stage_pb2.StageInfo(stage="vocoder", model="m", sample_rate=24000, window_schedule=[2, 6]))
    with caplog.at_level(logging.ERROR):
        assert not rs.adopt(b, stage_pb2.StageInfo(stage="vocoder", model="m", sample_rate=24000,
                                                   window_schedule=[4, 8]))
        assert not rs.adopt(c, stage_pb2.StageInfo(stage="talker", model="m"))
    assert "window_schedule [4, 8] vs [2, 6]" in caplog.text and "h:2 answers as stage 'talker'" in caplog.text
    assert {rs.pick().replica.index for _ in range(4)} == {0}
    with pytest.raises(ValueError, match="an address is listed twice"):
        ReplicaSet("vocoder", [FakeClient("h:1"), FakeClient("h:1")])  # type: ignore[list-item]


# ----------------------------------------------------------------------------- real replicas on loopback
class WordTask(StageTask):
    """Two text chunks naming its replica, then done; `fail_after_first`: an UNAVAILABLE after the first."""

    def __init__(self, rid: str, word: str, fail_after_first: bool, gate: threading.Event | None = None) -> None:
        super().__init__(rid)
        self.word, self.fail_after_first, self.gate = word, fail_after_first, gate
        self.fed, self.steps = False, 0

    def feed(self, chunk: StageChunk) -> None:
        self.prompt_tokens = int(chunk.tensors["input_ids"].numel())
        self.fed = True

    def ready(self) -> bool:
        return self.fed and not self.finished

    def step(self) -> list[StageChunk]:
        if self.gate is not None:  # held in its stage (still in flight) until the test opens the gate
            assert self.gate.wait(30.0), "the test never opened the gate"
        self.steps += 1
        if self.steps == 2 and self.fail_after_first:
            raise StageRequestError(grpc.StatusCode.UNAVAILABLE, "thinker: a rank died")
        self.completion_tokens = self.steps
        self.finished = self.steps == 2
        return [StageChunk(text=f"{self.word}{self.steps} ")]


class WordThinker:
    name = "thinker"

    def __init__(self, word: str, full: bool = False, fail_after_first: bool = False,
                 gate: threading.Event | None = None, prefix_caching: bool = False) -> None:
        self.word, self.full, self.fail_after_first, self.gate = word, full, fail_after_first, gate
        self.prefix_caching = prefix_caching
        self.broken = False
        self.opened: list[str] = []

    def info(self) -> stage_pb2.StageInfo:
        return stage_pb2.StageInfo(stage="thinker", model="m", host_id="h", prefix_caching=self.prefix_caching)

    def open(self, msg: stage_pb2.Open) -> StageTask:
        self.opened.append(msg.request_id)
        if self.broken:
            raise StageRequestError(grpc.StatusCode.UNAVAILABLE, "thinker: rank 1 died")
        if self.full:
            raise StageRequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, "thinker: 256 requests already wait")
        return WordTask(msg.request_id, self.word, self.fail_after_first, self.gate)


def _prompt(request: ChatRequest) -> PromptInputs:
    return PromptInputs(torch.arange(5), None, None, None, None, 5)


def _request(rid: str) -> ChatRequest:
    return ChatRequest(request_id=rid, model="m", messages=(ChatMessage(role="user", content=()),),
                       modalities=("text",))


async def _answer(pipe: StagePipeline, rid: str) -> str:
    text = ""
    async for event in pipe.run(_request(rid)):
        if isinstance(event, TextDelta):
            text += event.text
        assert not isinstance(event, Finished) or event.completion_tokens == 2
    return text


async def _pipeline(*clients: StageClient) -> StagePipeline:
    pipe = StagePipeline({"thinker": list(clients)}, _prompt, served_models=("m",))
    await pipe.connect(timeout_s=10.0, late_grace_s=0.5)
    return pipe


async def test_requests_spread_over_replicas_and_concurrent_ones_balance() -> None:
    gate = threading.Event()
    gate.set()
    a, b = WordThinker("a", gate=gate), WordThinker("b", gate=gate)
    async with served_stage(a, EngineLoop("thinker")) as sa, served_stage(b, EngineLoop("thinker")) as sb:
        pipe = await _pipeline(_client(sa), _client(sb))
        assert [await _answer(pipe, f"r{i}") for i in range(4)] == ["a1 a2 ", "b1 b2 ", "a1 a2 ", "b1 b2 "]
        gate.clear()  # the 6 below stay in flight until all are placed, however slowly the host runs them
        together = asyncio.gather(*(_answer(pipe, f"c{i}") for i in range(6)))
        deadline = asyncio.get_running_loop().time() + 30.0
        while len(a.opened) + len(b.opened) < 4 + 6:
            assert asyncio.get_running_loop().time() < deadline, (a.opened, b.opened)
            await asyncio.sleep(0.01)
        gate.set()
        answers = await together
        assert sorted(answers) == ["a1 a2 "] * 3 + ["b1 b2 "] * 3  # 6 at once: 3 in flight on each
        assert [r.in_flight for r in pipe.stages["thinker"].replicas] == [0, 0]
        health = await pipe.health_detail()
        assert health == {"thinker": {f"127.0.0.1:{sa.port}": True, f"127.0.0.1:{sb.port}": True}}
        await pipe.close()


def _client(stage) -> StageClient:
    """A client of the test's own (the harness closes its clients when its server stops)."""
    return StageClient("thinker", f"127.0.0.1:{stage.port}")


async def test_a_full_replica_has_the_request_run_on_another(caplog) -> None:
    a, full = WordThinker("a"), WordThinker("full", full=True)
    late = StageClient("thinker", f"127.0.0.1:{free_port()}")  # nothing listens: never answers Info
    async with served_stage(a, EngineLoop("thinker")) as sa, served_stage(full, EngineLoop("thinker")) as sf:
        pipe = await _pipeline(_client(sa), _client(sf), late)
        assert pipe.stages["thinker"].replicas[2].info is None  # started without it, after the grace
        with caplog.at_level(logging.WARNING):
            answers = [await _answer(pipe, f"r{i}") for i in range(4)]
        assert answers == ["a1 a2 "] * 4 and full.opened == ["r1"]  # full once, then passed over for a backoff
        assert "r1: thinker: 256 requests already wait; running it again on another thinker replica" in caplog.text
        # the second attempt runs in the stages as `r1#1`: the first attempt's id may still be known where it was
        assert a.opened == ["r0", "r1#1", "r2", "r3"]
        full.full = False
        await asyncio.sleep(0.6)  # the backoff ends: it takes requests again
        assert sorted([await _answer(pipe, f"s{i}") for i in range(2)]) == ["a1 a2 ", "full1 full2 "]
        full.full = a.full = True  # every replica full: the request fails with the stage's own 429
        with pytest.raises(PipelineError) as err:
            await _answer(pipe, "t0")
        assert err.value.http_status == 429
        await pipe.close()


async def test_a_replica_that_went_away_has_the_request_run_on_another(caplog) -> None:
    a, b = WordThinker("a"), WordThinker("b")
    async with served_stage(a, EngineLoop("thinker")) as sa:
        async with served_stage(b, EngineLoop("thinker")) as sb:
            pipe = await _pipeline(_client(sa), _client(sb))
            assert [await _answer(pipe, f"r{i}") for i in range(2)] == ["a1 a2 ", "b1 b2 "]
        # b's server has stopped: its channel cannot connect (passed over), or its next turn fails UNAVAILABLE
        # before any output and runs again on a
        assert [await _answer(pipe, f"s{i}") for i in range(4)] == ["a1 a2 "] * 4
        assert [rid.split("#")[0] for rid in a.opened[1:]] == ["s0", "s1", "s2", "s3"] and b.opened == ["r1"]
        b.broken = True  # a stage that serves but cannot run requests (a rank died: UNAVAILABLE)
        async with served_stage(b, EngineLoop("thinker"), ) as sb2:
            pipe2 = await _pipeline(_client(sa), _client(sb2))
            with caplog.at_level(logging.WARNING):
                assert [await _answer(pipe2, f"u{i}") for i in range(3)] == ["a1 a2 "] * 3
            assert "u1: thinker: rank 1 died; running it again on another thinker replica" in caplog.text
            assert a.opened[-3:] == ["u0", "u1#1", "u2"] and b.opened[-1] == "u1"
            await pipe2.close()
        health = await pipe.health_detail()
        assert list(health["thinker"].values()) == [True, False] and await pipe.health() == {"thinker": True}
    with pytest.raises(PipelineError) as err:  # no replica left: the stage's 503
        await _answer(pipe, "t0")
    assert err.value.http_status == 503
    await pipe.close()


async def test_a_replica_that_fails_after_output_reached_the_client_is_not_retried() -> None:
    bad, good = WordThinker("bad", fail_after_first=True), WordThinker("good")
    async with served_stage(bad, EngineLoop("thinker")) as s1, served_stage(good, EngineLoop("thinker")) as s2:
        pipe = await _pipeline(_client(s1), _client(s2))
        got: list[str] = []
        with pytest.raises(PipelineError) as err:
            async for event in pipe.run(_request("r0")):  # round-robin: the first request goes to `bad`
                if isinstance(event, TextDelta):
                    got.append(event.text)
        assert got == ["bad1 "] and err.value.http_status == 503 and "a rank died" in err.value.message
        assert good.opened == []  # the client had text already: running it again would repeat it
        assert await _answer(pipe, "r1") == "good1 good2 "  # `bad` is passed over for its backoff
        await pipe.close()


async def test_an_id_stays_taken_until_its_frames_are_taken_back() -> None:
    """A failed request's shared-memory frames are handed back in the background (Release); a new request
    under its id meanwhile would have its own frames taken back too, so it is a 409 until that is done."""
    from gateway.pipeline import _Leg
    from gateway.replicas import Replica

    a = WordThinker("a")
    async with served_stage(a, EngineLoop("thinker")) as sa:
        pipe = await _pipeline(_client(sa))
        gate = asyncio.Event()

        class SlowRelease:
            address = "h:1"

            async def release(self, request_id: str, timeout_s: float = 2.0) -> int:
                await gate.wait()
                return 1

        leg = _Leg(stream=None, replica=Replica("talker", 0, SlowRelease()), transport="shm")  # type: ignore[arg-type]
        pipe._release("again", "again#1", [leg])
        await asyncio.sleep(0)
        with pytest.raises(PipelineError) as err:
            await _answer(pipe, "again")
        assert err.value.http_status == 409
        gate.set()
        for _ in range(100):
            if "again" not in pipe._releasing:
                break
            await asyncio.sleep(0.01)
        assert await _answer(pipe, "again") == "a1 a2 "
        await pipe.close()


async def test_media_are_hashed_only_for_a_thinker_that_caches_prefixes() -> None:
    """The gateway names media items by their digests only when a thinker replica says (StageInfo) it caches
    prefixes; before any replica answered it does, to be safe."""
    plain, caching = WordThinker("a"), WordThinker("b", prefix_caching=True)
    async with served_stage(plain, EngineLoop("thinker")) as sa, served_stage(caching, EngineLoop("thinker")) as sb:
        pipe = await _pipeline(_client(sa))
        assert pipe.hashes_media() is False
        await pipe.close()
        pipe = await _pipeline(_client(sa), _client(sb))
        assert pipe.hashes_media() is True
        await pipe.close()
    unknown = StagePipeline({"thinker": [StageClient("thinker", f"127.0.0.1:{free_port()}")]}, _prompt,
                            served_models=("m",))
    assert unknown.hashes_media() is True  # nothing answered Info yet
    await unknown.close()


async def test_a_prompt_start_keeps_its_caching_thinker_replica() -> None:
    """Thinker replicas that cache prefixes: one request at a time, prompts that start alike go to one replica
    (its cache holds their blocks), and other starts spread over both."""
    a, b = WordThinker("a", prefix_caching=True), WordThinker("b", prefix_caching=True)
    async with served_stage(a, EngineLoop("thinker")) as sa, served_stage(b, EngineLoop("thinker")) as sb:
        starts: dict[str, int] = {}

        def prompt(request: ChatRequest) -> PromptInputs:
            first = starts[request.request_id.split("-")[0]]
            return PromptInputs(torch.arange(first, first + 300), None, None, None, None, 300)

        pipe = StagePipeline({"thinker": [_client(sa), _client(sb)]}, prompt, served_models=("m",))
        await pipe.connect(timeout_s=10.0, late_grace_s=0.5)
        try:
            starts.update({f"p{k}": k * 1000 for k in range(16)})
            same = {await _answer(pipe, f"p0-{i}") for i in range(4)}
            assert len(same) == 1  # every request with that start on one replica
            spread = {await _answer(pipe, f"p{k}-x") for k in range(16)}  # all on one: 2 in 65536
            assert spread == {"a1 a2 ", "b1 b2 "}
        finally:
            await pipe.close()


class WordEncoder(WordThinker):
    """An encoder replica as Info shows it: its cache keys media by the gateway's digests when it is on."""

    name = "encoder"

    def info(self) -> stage_pb2.StageInfo:
        return stage_pb2.StageInfo(stage="encoder", model="m", host_id="h", prefix_caching=self.prefix_caching)


async def test_media_are_hashed_for_an_encoder_that_caches() -> None:
    """An encoder replica with its cache on (--encoder-cache-memory, the default) also gets the digests."""
    plain = WordThinker("a")
    async with served_stage(plain, EngineLoop("thinker")) as st, \
            served_stage(WordEncoder("e", prefix_caching=True), EngineLoop("encoder")) as caching, \
            served_stage(WordEncoder("f"), EngineLoop("encoder")) as off:
        for encoder, hashed in ((caching, True), (off, False)):
            encoders = [StageClient("encoder", f"127.0.0.1:{encoder.port}")]
            pipe = StagePipeline({"thinker": [_client(st)], "encoder": encoders}, _prompt, served_models=("m",))
            await pipe.connect(timeout_s=10.0, late_grace_s=0.5)
            assert pipe.hashes_media() is hashed
            await pipe.close()


async def test_a_stage_whose_every_address_serves_another_stage_fails_the_start_at_once() -> None:
    """`--stages encoder=<a thinker's address>`: waiting would not change what it serves, so the gateway stops at
    once naming it (it waited out --stage-start-timeout, 600 s by default, logging the mismatch)."""
    import time

    async with served_stage(WordThinker("a"), EngineLoop("thinker")) as st:
        pipe = StagePipeline({"thinker": [_client(st)], "encoder": [StageClient("encoder", f"127.0.0.1:{st.port}")]},
                             _prompt, served_models=("m",))
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"^stage encoder: 127\.0\.0\.1:{st.port} answers as stage "
                                               r"'thinker', not 'encoder'; check the stage addresses \(--stages\): "
                                               r"none serves the encoder"):
            await pipe.connect(timeout_s=60.0)
        assert time.monotonic() - t0 < 10
        await pipe.close()


async def test_speech_from_a_pipeline_without_speech_stages_is_refused_before_any_stage() -> None:
    """The pipeline's own guard (the front ends refuse first): a request for audio on a chain with no talker /
    vocoder, or over a thinker-only model, is a 400 naming why, and no stage is dialled (the address is dead)."""
    speech = ChatRequest(request_id="r", model="m", messages=(ChatMessage("user", ()),), modalities=("text", "audio"),
                         voice="ethan")
    for no_audio, why in ((None, "given no talker / vocoder stage"), ("the model m has no audio output", "model m")):
        pipe = StagePipeline({"thinker": [StageClient("thinker", f"127.0.0.1:{free_port()}")]}, _prompt,
                             served_models=("m",), no_audio=no_audio)
        with pytest.raises(PipelineError, match=why) as refused:
            async for _ in pipe.run(speech):
                pass
        assert refused.value.http_status == 400 and refused.value.param == "modalities"
        await pipe.close()
