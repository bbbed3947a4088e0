"""--max-waiting-requests on a thinker stage (tiny model folder, --max-num-seqs 1): `open` refuses a request
with RESOURCE_EXHAUSTED and a message naming the flag once that many requests already wait beyond the free
seats; nothing already admitted is lost. What it proves:

- handler + batcher (stepped as the engine loop does): of three requests the third is refused, before and
  while the first runs; the first two finish with exactly their solo tokens; once they are done the third
  is admitted and finishes too, and every KV block and count comes back;
- a request closed before its prompt ever reached the engine (a cancel while it waited) gives its place
  back; with --max-waiting-requests 0 a request is admitted only into a free seat;
- through the real gRPC stage (EngineLoop + StageServicer + StageClient): of three concurrent streams
  exactly one is answered RESOURCE_EXHAUSTED in-stream, which the gateway turns into HTTP 429; the other two
  finish with their solo tokens, and the stage admits again afterwards;
- the talker's handler refuses past its cap the same way.

Run: python -m pytest tests/services/test_waiting_cap.py -q
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from gateway.pipeline import stage_error
from omnimesh.config.serve_args import ServeArgs
from omnimesh.engine.loop import EngineLoop
from omnimesh.engine.task import StageRequestError
from omnimesh.transport.frames import StageChunk
from omnimesh.transport.stage_client import StageCallError
from omnimesh.v1 import stage_pb2
from tests.stage_harness import served_stage
from services.llm.thinker_handler import build_handler as thinker_handler
from tests.services.test_lm_batching import Driver, assert_drained, open_thinker, prompts, token_ids

MAX_TOKENS = 10
FULL = "1 requests already waiting in thinker (--max-waiting-requests 1); retry later or raise it"


def capped(model_dir: Path, seqs: int = 1, waiting: int = 1) -> Any:
    return thinker_handler(model_dir, ServeArgs(max_model_len=64, kv_cache_memory="1MiB", max_num_seqs=seqs,
                                                max_waiting_requests=waiting))


def solo(handler: Any, ids: torch.Tensor) -> list[int]:
    d = Driver(handler)
    d.add(open_thinker(handler, "solo", ids, MAX_TOKENS))
    return token_ids(d.run()["solo"])


def refused(handler: Any, rid: str, ids: torch.Tensor) -> StageRequestError:
    with pytest.raises(StageRequestError) as err:
        open_thinker(handler, rid, ids, MAX_TOKENS)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    return err.value


def test_third_request_is_refused_and_the_first_two_finish(model_dir: Path) -> None:
    handler = capped(model_dir)
    engine = handler.batcher.engine
    ids = prompts([5, 6, 7], seed=8)
    alone = [solo(handler, p) for p in ids]
    assert all(len(a) > 2 for a in alone)

    d = Driver(handler)
    d.add(open_thinker(handler, "a", ids[0], MAX_TOKENS), open_thinker(handler, "b", ids[1], MAX_TOKENS))
    assert refused(handler, "c", ids[2]).message == FULL  # a takes the free seat, b waits: the queue is full
    d.step()
    assert engine.stats()["running"] == 1 and engine.stats()["waiting"] == 1
    assert refused(handler, "c", ids[2]).message == FULL  # still full while a runs
    assert "c" not in engine.seqs and "c" not in engine._admitted  # a refused request leaves nothing behind
    chunks = d.run()
    assert token_ids(chunks["a"]) == alone[0] and token_ids(chunks["b"]) == alone[1]
    assert solo(handler, ids[2]) == alone[2]  # admitted again once the others are done
    assert_drained(engine, engine.allocator.num_blocks)
    assert engine._admitted == set()


def test_a_request_closed_while_waiting_gives_its_place_back(model_dir: Path) -> None:
    handler = capped(model_dir)
    ids = prompts([4, 4, 4], seed=9)
    a = open_thinker(handler, "a", ids[0], MAX_TOKENS)
    waiting = handler.open(stage_pb2.Open(request_id="b"))  # its prompt never arrives
    refused(handler, "c", ids[2])
    waiting.close()  # what the engine loop does when the caller cancels
    c = open_thinker(handler, "c", ids[2], MAX_TOKENS)
    d = Driver(handler)
    d.add(a, c)
    d.run()
    assert handler.batcher.engine._admitted == set()

    never_queue = capped(model_dir, seqs=2, waiting=0)
    first = open_thinker(never_queue, "x", ids[0], MAX_TOKENS)
    second = open_thinker(never_queue, "y", ids[1], MAX_TOKENS)  # the second free seat
    err = refused(never_queue, "z", ids[2])
    assert err.message == ("no free seat in thinker (--max-num-seqs 2) (--max-waiting-requests 0); "
                           "retry later or raise it")
    for task in (first, second):
        task.close()


async def collect(stream: Any) -> list[StageChunk]:
    return [c async for c in stream]


async def test_stage_refuses_one_of_three_concurrent_streams(model_dir: Path) -> None:
    handler = capped(model_dir)
    ids = prompts([5, 6, 7], seed=10)
    alone = [solo(handler, p) for p in ids]
    engine = EngineLoop(handler.name, max_inflight=handler.max_inflight_steps, batcher=handler.batcher)
    sampling = stage_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    lm = handler.batcher.engine
    decided: list[str] = []  # every open admitted or refused before any prompt arrives (a fixed 0.5 s wait was
    inner = lm.admit  # not always enough on a loaded host: a prompt could finish before the third open was decided)

    def admit(task: Any) -> None:
        try:
            inner(task)
        finally:
            decided.append(task.key)

    lm.admit = admit
    async with served_stage(handler, engine) as served:
        client = served.client
        streams = [await client.open(f"r{i}", sampling) for i in range(3)]
        deadline = time.monotonic() + 30
        while len(decided) < 3:
            assert time.monotonic() < deadline, decided
            await asyncio.sleep(0.01)
        for stream, p in zip(streams, ids):
            await stream.send(StageChunk(tensors={"input_ids": p}, final=True))
        results = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams), return_exceptions=True), 60)
        errors = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
        assert len(errors) == 1, results
        i, err = errors[0]
        assert isinstance(err, StageCallError) and err.code == grpc.StatusCode.RESOURCE_EXHAUSTED, err
        assert err.message == FULL
        http = stage_error(err)  # what the gateway answers the client
        assert http.http_status == 429 and http.kind == "rate_limit_error" and "--max-waiting-requests" in http.message
        for j, result in enumerate(results):
            if j != i:
                assert token_ids(result) == alone[j] and streams[j].done.finish_reason in ("stop", "length")
        again = await client.open("again", sampling)  # the stage admits once they are done
        await again.send(StageChunk(tensors={"input_ids": ids[i]}, final=True))
        assert token_ids(await asyncio.wait_for(collect(again), 60)) == alone[i]


def test_the_talker_refuses_past_its_cap_too(model_dir: Path) -> None:
    """The talker's handler admits through the same engine check: with one seat and no waiting room its second
    request is refused at `open`; closing the first gives the seat back."""
    from services.llm.talker_handler import build_handler as talker_handler

    talker = talker_handler(model_dir, ServeArgs(max_model_len=64, max_num_seqs=1, max_waiting_requests=0))

    def open_talker(rid: str) -> Any:
        return talker.open(stage_pb2.Open(request_id=rid, options={"speaker": "ethan"},
                                          sampling=stage_pb2.SamplingParams(temperature=0, max_tokens=5)))

    first = open_talker("a")
    with pytest.raises(StageRequestError) as err:
        open_talker("b")
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "talker" in err.value.message and "--max-waiting-requests 0" in err.value.message
    first.close()
    open_talker("b").close()
