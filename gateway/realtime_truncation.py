"""The Realtime session's `truncation` (OpenAI's GA session field): when a conversation's prompt no longer fits the
model's context, the response reads it without its oldest messages (the items stay in the conversation), so a long
call keeps being answered instead of every response failing.

Settings (`gateway.realtime_settings.parse_truncation`): "auto" (the default) keeps as much as fits;
{"type": "retention_ratio", "retention_ratio": r} cuts deeper, to r x what fits, so the next turns fit again
without a new cut (and, with --enable-prefix-caching, keep the cached prefix longer); "disabled": a prompt that
does not fit fails the response, as before.

Data flow: RealtimeSession._respond -> `fitted_run(pipeline, chat, ratio)`: the pipeline runs the chat as it is
(nothing is counted twice while it fits) -> its prompt-length 400 (`too_long`, raised before any output) -> `fit`
off the event loop: the prompt's tokens (`PromptBuilder.encode`: the chat template and the processor, media
included) for the fewest oldest messages left out (the leading system turn, the session's instructions, always
kept), found by bisection over that count (about log2(messages) encodes) against the budget (max_model_len less
the response's max_output_tokens, else 1) x r -> the pipeline runs that chat. When even the last message alone
does not fit, the first error stands.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import replace

from gateway.events import ChatRequest, Event, Pipeline, PipelineError
from gateway.prompt import PromptBuilder

log = logging.getLogger(__name__)

TOO_LONG = "maximum context length (max_model_len)"  # in PromptBuilder.check_length's two messages


def too_long(error: PipelineError) -> bool:
    return error.http_status == 400 and TOO_LONG in error.message


def fit(builder: PromptBuilder, chat: ChatRequest, ratio: float) -> tuple[ChatRequest, int] | None:
    """The chat without its fewest oldest messages (after the leading system turns) whose prompt takes at most
    `ratio` x the budget (else, the most left out if that fits the budget itself), and how many were left out;
    None when leaving out all but the last message does not fit."""
    budget = builder.max_model_len - (chat.sampling.max_tokens or 1)
    target = int(budget * ratio)
    lead = next((i for i, m in enumerate(chat.messages) if m.role != "system"), len(chat.messages))
    sizes: dict[int, int] = {}

    def without(k: int) -> ChatRequest:
        return replace(chat, messages=chat.messages[:lead] + chat.messages[lead + k:])

    def size(k: int) -> int:  # the prompt's tokens without the k oldest messages (fewer as k grows)
        if k not in sizes:
            sizes[k] = int(builder.encode(without(k)).numel())
        return sizes[k]

    most = len(chat.messages) - lead - 1  # the last message always stays
    if most < 1 or size(most) > budget:
        return None
    if size(most) > target:
        return without(most), most
    lo, hi = 1, most  # size(hi) <= target: bisect for the smallest such k
    while lo < hi:
        mid = (lo + hi) // 2
        if size(mid) <= target:
            hi = mid
        else:
            lo = mid + 1
    return without(lo), lo


async def fitted_run(pipeline: Pipeline, chat: ChatRequest, ratio: float | None) -> AsyncIterator[Event]:
    """`pipeline.run(chat)`; a prompt too long for the context is run again truncated (`fit`), unless `ratio` is
    None (truncation disabled) or the pipeline has no prompt builder to count with."""
    builder = getattr(pipeline, "prepare", None)
    started = False
    try:
        async with contextlib.aclosing(pipeline.run(chat)) as events:  # type: ignore[type-var]
            async for event in events:
                started = True
                yield event
    except PipelineError as e:
        if started or ratio is None or not isinstance(builder, PromptBuilder) or not too_long(e):
            raise
        shorter = await asyncio.to_thread(fit, builder, chat, ratio)
        if shorter is None:
            raise
        log.info("realtime %s: the conversation's prompt is over the context; its %d oldest message(s) left out "
                 "(truncation)", chat.request_id, shorter[1])
        async with contextlib.aclosing(pipeline.run(shorter[0])) as events:  # type: ignore[type-var]
            async for event in events:
                yield event
