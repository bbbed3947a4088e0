"""A client that disconnects before its answer stops the work (gateway/client_gone.py, as vLLM's
`with_cancellation`): a non-streaming answer's run is closed at once instead of generating the whole abandoned
answer, a streaming one's while it waits for its first event too; counted as status 499. A client that stays
gets its answer as before."""

from __future__ import annotations

import time

import httpx
import pytest

from gateway.events import Finished, TextDelta
from gateway_harness import RestServer, ScriptedPipeline


def _slow(pipeline: ScriptedPipeline, events: int = 40, delay_s: float = 0.1) -> None:
    """An answer of `events` deltas, `delay_s` apart (4 s in all by default)."""
    pipeline.script = lambda request: [*[TextDelta(f"w{i} ") for i in range(events)],
                                       Finished(finish_reason="stop", prompt_tokens=3, completion_tokens=events)]
    pipeline.event_delay_s = delay_s


def _closed_within(pipeline: ScriptedPipeline, seconds: float) -> float:
    started = time.monotonic()
    while not pipeline.closed:
        assert time.monotonic() - started < seconds, "the run was not closed"
        time.sleep(0.01)
    return time.monotonic() - started


def _gone(server: RestServer) -> float:
    """omnimesh:requests_total{endpoint="chat",status="499"} (0 before the first)."""
    for line in httpx.get(f"{server.base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith('omnimesh:requests_total{endpoint="chat",status="499"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_stops_its_run(rest_server: RestServer, pipeline: ScriptedPipeline, stream: bool) -> None:
    _slow(pipeline)
    if stream:  # the stream would start at the first event: the client leaves before it
        pipeline.script = lambda request: [TextDelta("late"), Finished(finish_reason="stop", prompt_tokens=3,
                                                                        completion_tokens=1)]
        pipeline.event_delay_s = 4.0
    before = _gone(rest_server)
    sent = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{rest_server.base_url}/v1/chat/completions", timeout=httpx.Timeout(10.0, read=0.5),
                   json={"model": "tiny-omni", "stream": stream, "messages": [{"role": "user", "content": "hi"}]})
    _closed_within(pipeline, 2.0)
    assert time.monotonic() - sent < 2.5  # not the 4 s the whole answer takes
    deadline = time.monotonic() + 2.0
    while _gone(rest_server) != before + 1:
        assert time.monotonic() < deadline, "not counted as a 499"
        time.sleep(0.01)


def test_a_client_that_stays_gets_the_whole_answer(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    _slow(pipeline, events=5, delay_s=0.05)
    r = httpx.post(f"{rest_server.base_url}/v1/chat/completions", timeout=30,
                   json={"model": "tiny-omni", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "w0 w1 w2 w3 w4 "
