"""Function calls in a spoken answer: the talker says the words before a call, never the call.

Role: with tools and tool_choice "auto" (--enable-auto-tool-choice), a spoken request (`ChatRequest.spoken_calls`)
runs in two parts, so the talker, which voices whatever text the thinker writes, never reads a call's JSON aloud:

1. speech: the request as asked, with the Hermes call's opening token (`<tool_call>`, one token in the Qwen
   vocabularies) as one more stop id. The thinker's final token is never spoken, so the talker says the
   answer up to the call and ends there; text and audio stream as usual.
2. calls, only when part 1 stopped on that token: a text-only continuation of the same conversation (the
   words so far and `<tool_call>` as the open assistant message, vLLM's continue_final_message), whose
   text follows. Greedy, it is the text the model writes uninterrupted (the e2e test checks it).

The client sees one answer: part 1's deltas (`TextDelta.spoken`), `<tool_call>` and part 2's deltas
(`spoken=False`: the fronts keep them out of the audio transcript), then one `Finished` with both parts'
tokens (the prompt counted once; part 2 may take what part 1 left of max_tokens). The fronts parse the
calls out of that text as they do for a text answer (gateway/tool_calls.py).

Data flow: `StagePipeline.run(request)` -> `spoken_with_calls(run one, request, token)` -> run one (speech part)
-> [run one (calls part)] -> events.
Part 2 prefills the prompt again (the thinker's prefix cache, --enable-prefix-caching, saves that).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from gateway.events import ChatMessage, ChatRequest, Event, Finished, PipelineError, TextDelta, TextPart

TOOL_CALL = "<tool_call>"


def call_token(tokenizer: object) -> int | None:
    """The id of `<tool_call>` when the tokenizer has it as one token (the Qwen vocabularies), else None."""
    try:
        ids = tokenizer.encode(TOOL_CALL, add_special_tokens=False)  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001  # a tokenizer that cannot say: no spoken calls
        return None
    return int(ids[0]) if len(ids) == 1 else None


def no_call_token(model: str) -> PipelineError:
    return PipelineError(f"tools with audio out: {model}'s tokenizer has no single {TOOL_CALL} token to stop the "
                         "speech at a call; ask for modalities [\"text\"] with tools", http_status=400, grpc_code=3,
                         kind="invalid_request_error", param="tools")


async def spoken_with_calls(run: Callable[[ChatRequest], AsyncIterator[Event]], request: ChatRequest,
                            token: int) -> AsyncIterator[Event]:
    """`request`'s events with its calls kept out of the speech (the module docstring)."""
    s = request.sampling
    speech = replace(request, spoken_calls=False,
                     sampling=replace(s, stop_token_ids=(*(s.stop_token_ids or ()), token)))
    said: list[str] = []
    first: Finished | None = None
    async with contextlib.aclosing(run(speech)) as events:  # type: ignore[type-var]
        async for ev in events:
            if isinstance(ev, Finished):
                first = ev
                break
            if isinstance(ev, TextDelta):
                said.append(ev.text)
            yield ev
    if first is None:
        return
    if first.stop_reason != token or (s.stop_token_ids and token in s.stop_token_ids):
        yield first  # no call (or the client's own stop id): the answer is whole
        return
    yield TextDelta(TOOL_CALL, usage=(first.prompt_tokens, first.completion_tokens), spoken=False)
    left = None if s.max_tokens is None else s.max_tokens - first.completion_tokens
    if left is not None and left < 1:
        yield replace(first, finish_reason="length", stop_reason=None)
        return
    async with contextlib.aclosing(run(continuation(request, "".join(said) + TOOL_CALL, left))) as events:  # type: ignore[type-var]
        async for ev in events:
            if isinstance(ev, TextDelta):
                usage = None if ev.usage is None else (first.prompt_tokens, first.completion_tokens + ev.usage[1])
                yield replace(ev, usage=usage, spoken=False, prompt_logprobs=())
            elif isinstance(ev, Finished):
                yield Finished(ev.finish_reason, first.prompt_tokens, first.completion_tokens + ev.completion_tokens,
                               first.cached_tokens, ev.stop_reason)
                return


def continuation(request: ChatRequest, written: str, left: int | None) -> ChatRequest:
    """Part 2: the conversation with `written` as the open assistant message (joined to a continued one),
    text out, the rest of max_tokens."""
    messages = list(request.messages)
    if request.template.continue_final_message and messages and messages[-1].role == "assistant":
        last = messages.pop()
        content = (*last.content, TextPart(written))
    else:
        content = (TextPart(written),)
    messages.append(ChatMessage(role="assistant", content=content))
    thinker = request.stage_params.get("thinker")
    return replace(request, request_id=f"{request.request_id}-calls", messages=tuple(messages), modalities=("text",),
                   voice=None, spoken_calls=False, sampling=replace(request.sampling, max_tokens=left, prompt_logprobs=None),
                   stage_params={"thinker": thinker} if thinker is not None else {},
                   template=replace(request.template, add_generation_prompt=False, continue_final_message=True))
