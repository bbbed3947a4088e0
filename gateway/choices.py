"""OpenAI's `n`: one chat request answered with `n` choices, each its own run through the stages.

Data flow: the request -> `choice_requests` (choice 0 keeps the request's id, choice i runs as `<id>-<i>`;
a seed, top level or per stage, becomes seed + i, so the choices differ yet a seeded request is
reproducible; all of them share one prompt build, gateway/shared_build.py) -> `fan_out` runs them at once
and yields `(choice index, event)` pairs in arrival order -> the REST front end builds `choices[i]` (whole,
or as streamed chunks with their index). The first error of any choice ends the whole request (the other
runs are cancelled in their stages); it ends after every choice's `Finished`. With n = 1 `fan_out` is a
plain pass-through. The runs own their media: `fan_out` lets them go once every run has built
(gateway/media_release.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

from gateway.events import ChatRequest, Event, Finished, Pipeline, SamplingOverrides
from gateway.media_release import own_media
from gateway.shared_build import SharedBuild

Indexed = tuple[int, Event]  # (choice index, event)
MAX_CHOICES = 16  # `n` beyond this is a 400: one request must not fan out into unbounded stage work
_END = object()  # a choice's run is over
log = logging.getLogger(__name__)


def choice_requests(request: ChatRequest, n: int) -> tuple[ChatRequest, ...]:
    """The `n` runs of `request` (see the module docstring)."""
    if n == 1:
        return (request,)

    def seeded(s: SamplingOverrides, i: int) -> SamplingOverrides:
        return s if s.seed is None or i == 0 else replace(s, seed=(s.seed + i + 2**63) % 2**64 - 2**63)  # int64

    shared = SharedBuild(request, n)  # one prompt build for all of them (gateway/shared_build.py)
    return tuple(replace(request, request_id=request.request_id if i == 0 else f"{request.request_id}-{i}",
                         sampling=seeded(request.sampling, i), shared_build=shared,
                         stage_params={name: seeded(s, i) for name, s in request.stage_params.items()})
                 for i in range(n))


async def fan_out(pipeline: Pipeline, requests: Sequence[ChatRequest]) -> AsyncIterator[Indexed]:
    """Every request's events tagged with its index, as they come; the first exception is raised here. The
    requests own their media: once each has built its prompt they are let go (gateway/media_release.py)."""
    requests = own_media(requests)
    if len(requests) == 1:
        events = aiter(pipeline.run(requests[0]))
        try:
            async for event in events:
                yield 0, event
        finally:
            await close_events(events)  # at once: a client gone cancels the run in the stages now
        return
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

    async def pump(i: int, request: ChatRequest) -> None:
        events = aiter(pipeline.run(request))
        try:
            async for event in events:
                queue.put_nowait((i, event))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001  # handed to the reader, which raises it
            queue.put_nowait((i, exc))
        finally:
            try:
                await close_events(events)
            finally:
                queue.put_nowait((i, _END))  # only now: the reader's cleanup must not cut this close short

    tasks = [asyncio.create_task(pump(i, r), name=f"choice-{i}") for i, r in enumerate(requests)]
    try:
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if item is _END:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()  # a run still going is cancelled in its stages (its generator's cleanup)
        await asyncio.gather(*tasks, return_exceptions=True)


def total_usage(finished: Sequence[Finished]) -> Finished:
    """The choices' `Finished` as one, for `usage`: the prompt once, every choice's completion tokens."""
    return Finished(finish_reason=finished[0].finish_reason, prompt_tokens=finished[0].prompt_tokens,
                    completion_tokens=sum(f.completion_tokens for f in finished),
                    cached_tokens=finished[0].cached_tokens)


async def close_events(events: AsyncIterator[Any]) -> None:
    """Tell the pipeline we stopped reading (it cancels the request in the stages)."""
    aclose = getattr(events, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:  # the request already failed or finished; closing must not mask that
            log.debug("closing the pipeline's event iterator failed", exc_info=True)
