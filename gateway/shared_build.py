"""One prompt build for all of a request's `n` choices.

Role: each of `n` choices is its own run through the stages (gateway/choices.py), and each run used to build its
prompt itself: the template, the tokenizer and, with media, the processor (resizing a minute of 720p video into
float32 patches takes the gateway seconds of CPU and ~0.9 GB for a moment). The choices differ only in their
id and seed, which the build does not read, so `choice_requests` gives them one `SharedBuild`: the first run to
ask starts the build (in its media budget share, gateway/media_budget.py), the others wait for the same
result, and every run gets the same `PromptInputs` (read-only from then on: the stages are sent copies). A
failed build fails every choice with its error. The build stops only when every run waiting for it has left;
a run that comes later then builds again. Once every run has its prompt, this lets it go, so the prompt lives
only as long as the runs hold it (each lets it go at its first event: gateway/pipeline.py `_HeldPrompt`).

A request derived from a choice with other messages (a spoken answer's calls part, gateway/spoken_calls.py)
carries the object along but is not served by it: `serves` checks that the request is the one it was made for,
and any other builds alone.

Data flow: `choice_requests(request, n)` -> `ChatRequest.shared_build` on each run -> `StagePipeline._built`
-> `SharedBuild.get(build)` -> the one build's prompt, to each run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.events import ChatRequest
    from gateway.prompt import PromptInputs


class SharedBuild:
    """The prompt of `runs` choices of `basis`, built once (the module docstring). On the event loop only."""

    def __init__(self, basis: ChatRequest, runs: int) -> None:
        self._basis = basis
        self._left = runs  # the runs still to take the prompt
        self._waiting = 0  # the runs waiting for it now
        self._task: asyncio.Future[PromptInputs] | None = None

    def serves(self, request: ChatRequest) -> bool:
        """Is `request` one of the choices this was made for (what the build reads is theirs)?"""
        b = self._basis
        return (request.messages is b.messages and request.template is b.template and request.tools is b.tools
                and request.prompt_ids is b.prompt_ids and request.processor_kwargs == b.processor_kwargs
                and request.truncate_prompt_tokens == b.truncate_prompt_tokens
                and request.sampling.max_tokens == b.sampling.max_tokens and request.media_param == b.media_param)

    async def get(self, build: Callable[[], Awaitable[PromptInputs]]) -> PromptInputs:
        """The prompt: `build()` run once, by the first run to ask (again when every earlier asker left)."""
        if self._task is None or self._task.cancelled():
            self._task = asyncio.ensure_future(build())
        task = self._task
        self._waiting += 1
        try:
            prompt = await asyncio.shield(task)
        finally:
            self._waiting -= 1
            if not self._waiting and not task.done():
                task.cancel()  # no run waits for it any more
        self._left -= 1
        if self._left <= 0:
            self._task = None  # every run has it: only the runs hold it now
        return prompt
