"""One prompt build for a request's n choices (gateway/shared_build.py): built once for every run, a failure
fails them all, a run that leaves does not stop the build for the others, the build stops when every waiting run
has left (and a later run builds again), and a request derived with other messages builds alone. Through real
stages: tests/gateway/test_prompt_release.py."""

from __future__ import annotations

import asyncio

import torch

from gateway.choices import choice_requests
from gateway.events import ChatMessage, ChatRequest, PipelineError, SamplingOverrides, TextPart
from gateway.prompt import PromptInputs
from gateway.spoken_calls import continuation

REQUEST = ChatRequest(request_id="r", model="m", modalities=("text",), sampling=SamplingOverrides(seed=7),
                      messages=(ChatMessage("user", (TextPart("hi"),)),))


class Builds:
    """A build the test releases (`go`) or fails; counts its starts and whether it was cancelled."""

    def __init__(self) -> None:
        self.started, self.cancelled, self.go = 0, 0, asyncio.Event()
        self.error: Exception | None = None

    async def __call__(self) -> PromptInputs:
        self.started += 1
        try:
            await self.go.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if self.error is not None:
            raise self.error
        return PromptInputs(torch.arange(3), None, None, None, None, 3)


async def test_the_choices_get_one_build_and_one_leaving_does_not_stop_it() -> None:
    runs = choice_requests(REQUEST, 3)
    shared, build = runs[0].shared_build, Builds()
    assert shared is not None and all(r.shared_build is shared and shared.serves(r) for r in runs)
    waits = [asyncio.ensure_future(shared.get(build)) for _ in runs]
    await asyncio.sleep(0.01)
    waits[0].cancel()  # its client's choice left; the others still wait
    await asyncio.sleep(0.01)
    build.go.set()
    prompts = await asyncio.gather(*waits[1:])
    assert build.started == 1 and build.cancelled == 0 and prompts[0] is prompts[1]
    assert waits[0].cancelled()


async def test_a_failed_build_fails_every_choice() -> None:
    runs = choice_requests(REQUEST, 2)
    shared, build = runs[0].shared_build, Builds()
    assert shared is not None
    build.error = PipelineError("the prompt is too long", http_status=400, grpc_code=3,
                                kind="invalid_request_error")
    build.go.set()
    results = await asyncio.gather(shared.get(build), shared.get(build), return_exceptions=True)
    assert build.started == 1 and all(isinstance(r, PipelineError) for r in results)


async def test_the_build_stops_when_every_waiting_run_left_and_a_later_one_builds_again() -> None:
    runs = choice_requests(REQUEST, 3)
    shared, build = runs[0].shared_build, Builds()
    assert shared is not None
    waits = [asyncio.ensure_future(shared.get(build)) for _ in range(2)]
    await asyncio.sleep(0.01)
    for w in waits:
        w.cancel()
    await asyncio.sleep(0.01)
    assert build.started == 1 and build.cancelled == 1  # nobody waits: the build stopped
    build.go.set()
    prompt = await shared.get(build)  # the third run, arriving later
    assert build.started == 2 and prompt.input_ids.tolist() == [0, 1, 2]


def test_a_request_with_other_messages_builds_alone() -> None:
    runs = choice_requests(REQUEST, 2)
    shared = runs[1].shared_build
    assert shared is not None
    calls = continuation(runs[1], "Let me check. <tool_call>", None)  # a spoken answer's calls part
    assert calls.shared_build is shared and not shared.serves(calls)
    assert not shared.serves(ChatRequest(request_id="x", model="m", messages=REQUEST.messages[:0]))
    assert choice_requests(REQUEST, 1) == (REQUEST,) and REQUEST.shared_build is None
