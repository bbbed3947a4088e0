"""OpenAI's (legacy) `POST /v1/completions`, as vLLM serves it: raw prompts, no chat template, text out.

Data flow: body -> `CompletionRequest` (strict; `prompt` a string, a list of strings, token ids or a list of
token-id lists) -> each text prompt tokenized by the tokenizer alone (`add_special_tokens`, vLLM's, default
true) off the event loop, each id checked against the tokenizer's vocabulary -> one `ChatRequest` per prompt
holding its `prompt_ids` (no messages; `PromptBuilder.build` checks prompt + max_tokens against
max_model_len) x `n` choices (gateway/choices.py) -> the thinker alone (text out) -> one `text_completion`
JSON, or an SSE stream of `text_completion` chunks ending in `data: [DONE]` (gateway/sse.py).

- Choice index = prompt index x n + choice, vLLM's order; every run is its own request in the stages
  (`cmpl-<id>`, `cmpl-<id>-p<prompt>`, and `-<choice>` for n > 1).
- `max_tokens` defaults to 16, as OpenAI's and vLLM's completions (null: up to max_model_len).
- `echo`: the choice's text starts with the prompt (the string sent, or the ids decoded); streamed, it is the
  choice's first chunk.
- `logprobs: k` (0 to --max-logprobs): OpenAI's legacy shape per choice: `tokens`, `token_logprobs`,
  `top_logprobs` (the k likeliest and the sampled token, token text -> logprob) and `text_offset` (each
  token's character offset in the choice's text, counted over the tokens' texts as vLLM does, except that
  a special token, which the text skips, takes no room). The values
  are the thinker's raw distribution, as the chat route's. `echo` with `logprobs` needs the prompt's
  log-probabilities, which the thinker does not compute: a 400.
- `usage` counts each prompt once and every choice's completion tokens; `stream_options` as in a chat.
- The thinker's sampling fields, `stop`, structured outputs and `priority` work as in a chat completion;
  `suffix`, `best_of` > 1, beam search and `prompt_logprobs` are 400s naming the field.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, field_validator

from gateway.choices import MAX_CHOICES, Indexed, choice_requests, close_events, total_usage
from gateway.events import ChatRequest, Finished, PipelineError, TextDelta, check_request_id
from gateway.http_errors import internal_error
from gateway.media import invalid_request
from gateway.openai_schema import (
    SamplingBody,
    Usage,
    check_priority,
    check_sampling,
    error_response,
    parse_json_object,
    refuse_unsupported,
    resolve_model,
    validate_body,
)
from gateway.prompt import PromptBuilder
from gateway.sse import DONE, StreamState, chain, sse
from gateway.structured_request import structured_spec
from omnimesh.v1 import stage_pb2

if TYPE_CHECKING:
    from gateway.rest import Answer, RestGateway

log = logging.getLogger(__name__)
MAX_RUNS = 64  # prompts x n in one request: beyond this a 400 (one request must not flood the stages)
DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's completions default

# fields vLLM's completions define that omnimesh does not implement, each with the test that its value asks
# for nothing (then it is accepted and changes nothing; anything else is a 400)
UNSUPPORTED: dict[str, Any] = {
    "suffix": lambda v: not v,
    "best_of": lambda v: v is None or v == 1,
    "use_beam_search": lambda v: not v,
    "prompt_logprobs": lambda v: v is None,
    "prompt_embeds": lambda v: v is None,
}


class CompletionRequest(SamplingBody):
    prompt: Any  # a string, strings, token ids or token-id lists: `_one_prompt_shape`
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    logprobs: int | None = None  # the legacy API's: this many alternatives per token (and the sampled one)
    echo: bool = False
    add_special_tokens: bool = True  # vLLM's: the tokenizer's own special tokens around a text prompt


    @field_validator("prompt")
    @classmethod
    def _one_prompt_shape(cls, v: Any) -> str | list[Any]:
        def ids(x: Any) -> bool:
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if isinstance(v, str) or ids(v) or (isinstance(v, list) and (all(isinstance(p, str) for p in v)
                                                                      or all(ids(p) for p in v))):
            return v
        raise ValueError("must be a string, a list of strings, a list of token ids or a list of token-id lists "
                         "(one kind per request)")


def parse_completion_request(raw: bytes) -> CompletionRequest:
    req = validate_body(CompletionRequest, parse_json_object(raw))
    refuse_unsupported(req, UNSUPPORTED)
    return req


# ------------------------------------------------------------------------------------------ responses
class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CompletionLogprobs(_Out):
    text_offset: list[int]
    token_logprobs: list[float]
    tokens: list[str]
    top_logprobs: list[dict[str, float]]


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(_Out):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


@dataclass(slots=True)
class _Completion:
    """One completion request in flight: its runs (choice index order) and what each choice's text starts with."""

    request_id: str
    model: str
    runs: tuple[ChatRequest, ...]
    echo: tuple[str, ...]  # per choice: the prompt's text with `echo`, else ""
    n: int
    stream: bool
    logprobs: bool
    include_usage: bool
    continuous_usage: bool
    created: int
    started: float
    first_text: bool = False
    first_audio: bool = False
    offsets: list[int] = field(default_factory=list)  # per choice: the next token's text offset


class CompletionRoutes:
    """`POST /v1/completions` on one `RestGateway` (its pipeline, model names, limits, metrics)."""

    def __init__(self, gw: RestGateway, builder: PromptBuilder) -> None:
        self.gw, self.builder = gw, builder
        tokenizer = builder.processor.tokenizer
        # the thinker's text skips special tokens: they take no room in it (text_offset)
        self.silent = frozenset(i for i, t in tokenizer.added_tokens_decoder.items() if t.special)

    async def completions(self, request: Request) -> Response:
        from gateway.rest import Answer  # rest imports this module to route it

        async def prepare(raw: bytes, client_id: str | None, started: float) -> Answer:
            call = await self.build(parse_completion_request(raw), client_id, started)
            return Answer(call.request_id, call.runs, call.stream,
                          lambda first, events: self._complete(call, first, events),
                          lambda first, state: self._stream(call, first, state))

        return await self.gw.answer("completions", request, prepare)

    # ------------------------------------------------------------------------------ request building
    async def build(self, body: CompletionRequest, client_id: str | None, started: float) -> _Completion:
        gw = self.gw
        model = resolve_model(body.model, gw.served_model_names)
        n = 1 if body.n is None else body.n
        if not 1 <= n <= MAX_CHOICES:
            raise invalid_request(f"n: must be in [1, {MAX_CHOICES}] choices, got {n}", "n")
        if body.echo and body.logprobs is not None:
            raise invalid_request("logprobs: with echo, the answer would need the prompt's log-probabilities, which "
                                  "omnimesh does not compute; send echo or logprobs, not both", "logprobs")
        sampling = replace(body.overrides(body.max_tokens), logprobs=body.logprobs)
        check_sampling(sampling, "", gw.max_logprobs)
        prompts = _prompts(body.prompt)
        if len(prompts) * n > MAX_RUNS:
            raise invalid_request(f"prompt: {len(prompts)} prompts x n={n} is {len(prompts) * n} runs; at most "
                                  f"{MAX_RUNS} per request: split them over several requests", "prompt")
        structured = await asyncio.to_thread(structured_spec, body)
        ids = await asyncio.to_thread(self._token_ids, prompts, body.add_special_tokens)
        echo = await asyncio.to_thread(self._echo_texts, prompts, ids) if body.echo else [""] * len(prompts)
        suffix = check_request_id(client_id, "X-Request-Id") if client_id else uuid.uuid4().hex
        rid = f"cmpl-{suffix}"
        pipeline_model = model if model in gw.pipeline.served_models else gw.pipeline.served_models[0]
        runs: list[ChatRequest] = []
        for p, prompt_ids in enumerate(ids):
            base = ChatRequest(request_id=rid if p == 0 else f"{rid}-p{p}", model=pipeline_model, messages=(),
                               modalities=("text",), sampling=sampling, priority=check_priority(body.priority),
                               structured=structured, prompt_ids=tuple(prompt_ids))
            runs.extend(choice_requests(base, n))
        so = body.stream_options
        return _Completion(request_id=rid, model=model, runs=tuple(runs), echo=tuple(e for e in echo for _ in range(n)),
                           n=n, stream=body.stream, logprobs=body.logprobs is not None,
                           include_usage=bool(so and so.include_usage),
                           continuous_usage=bool(so and so.include_usage and so.continuous_usage_stats),
                           created=int(time.time()), started=started,
                           offsets=[len(e) for e in echo for _ in range(n)])

    def _token_ids(self, prompts: list[str | list[int]], add_special_tokens: bool) -> list[list[int]]:
        tokenizer = self.builder.processor.tokenizer
        size = len(tokenizer)
        single = len(prompts) == 1
        out = []
        for i, prompt in enumerate(prompts):
            where = "prompt" if single else f"prompt[{i}]"
            if isinstance(prompt, str):
                ids = list(tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])
            else:
                ids = prompt
                for j, t in enumerate(ids):
                    if not 0 <= t < size:
                        raise invalid_request(f"{where}[{j}]: {t} is not a token id of this model (0 to {size - 1})",
                                              f"{where}[{j}]")
            if not ids:
                raise invalid_request(f"{where}: the prompt is empty; send at least one token", where)
            out.append(ids)
        return out

    def _echo_texts(self, prompts: list[str | list[int]], ids: list[list[int]]) -> list[str]:
        tokenizer = self.builder.processor.tokenizer
        return [p if isinstance(p, str) else str(tokenizer.decode(i)) for p, i in zip(prompts, ids, strict=True)]

    # ---------------------------------------------------------------------------------------- answers
    def _logprobs(self, call: _Completion, i: int, entries: Sequence[stage_pb2.TokenLogprob]
                  ) -> CompletionLogprobs | None:
        """The legacy `logprobs` of choice `i`'s next tokens (advancing its text offsets), or None."""
        if not call.logprobs:
            return None
        out = CompletionLogprobs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
        for e in entries:
            token = self._token_text(e)
            out.tokens.append(token)
            out.token_logprobs.append(e.logprob)
            out.text_offset.append(call.offsets[i])
            if e.token_id not in self.silent:
                call.offsets[i] += len(token)
            out.top_logprobs.append({**{self._token_text(t): t.logprob for t in e.top}, token: e.logprob})
        return out

    def _token_text(self, e: stage_pb2.TokenLogprob | stage_pb2.TopLogprob) -> str:
        return f"token_id:{e.token_id}" if self.gw.tokens_as_ids else e.token.decode("utf-8", errors="replace")

    def _usage(self, call: _Completion, finished: dict[int, Finished]) -> Usage:
        """Each prompt's tokens once (its choices share it), every choice's completion tokens."""
        per_prompt = [total_usage([finished[p * call.n + c] for c in range(call.n)])
                      for p in range(len(call.runs) // call.n)]
        return self.gw._usage(Finished(finish_reason="", prompt_tokens=sum(f.prompt_tokens for f in per_prompt),
                                       completion_tokens=sum(f.completion_tokens for f in per_prompt),
                                       cached_tokens=sum(f.cached_tokens for f in per_prompt)))

    async def _complete(self, call: _Completion, first: Indexed, events: AsyncIterator[Indexed]) -> Response:
        runs = len(call.runs)
        text: list[list[str]] = [[e] for e in call.echo]
        entries: list[list[stage_pb2.TokenLogprob]] = [[] for _ in range(runs)]
        finished: dict[int, Finished] = {}
        try:
            async for i, ev in chain(first, events):
                self.gw._observe(call, ev)
                if isinstance(ev, TextDelta):
                    text[i].append(ev.text)
                    entries[i].extend(ev.logprobs)
                elif isinstance(ev, Finished):
                    finished[i] = ev
                    if len(finished) == runs:
                        break
        finally:
            await close_events(events)
        if len(finished) < runs:
            raise internal_error(RuntimeError("the pipeline ended without a Finished event"))
        choices = [CompletionChoice(index=i, text="".join(text[i]), logprobs=self._logprobs(call, i, entries[i]),
                                    finish_reason=finished[i].finish_reason) for i in range(runs)]
        body = Completion(id=call.request_id, created=call.created, model=call.model, choices=choices,
                          usage=self._usage(call, finished))
        self.gw._finish("completions", 200, call.started)
        return JSONResponse(body.model_dump(mode="json"), headers={"X-Request-Id": call.request_id})

    async def _stream(self, call: _Completion, first: Indexed, state: StreamState) -> AsyncIterator[bytes]:
        runs = len(call.runs)
        status = 499  # client closed, unless the stream gets to its end
        so_far: list[tuple[int, int] | None] = [None] * runs  # continuous_usage_stats: (prompt, completion)

        def chunk(i: int, text: str, logprobs: CompletionLogprobs | None = None, finish: str | None = None) -> bytes:
            usage = None
            if call.continuous_usage and (known := so_far[i]) is not None:
                usage = Usage(prompt_tokens=known[0], completion_tokens=known[1], total_tokens=sum(known))
            c = Completion(id=call.request_id, created=call.created, model=call.model, usage=usage,
                           choices=[CompletionChoice(index=i, text=text, logprobs=logprobs, finish_reason=finish)])
            data = c.model_dump(mode="json")
            if usage is None:
                del data["usage"]
            return sse(data)

        try:
            for i, echo in enumerate(call.echo):
                if echo:
                    yield chunk(i, echo)
            finished: dict[int, Finished] = {}
            async for i, ev in chain(first, state.events):
                self.gw._observe(call, ev)
                if isinstance(ev, TextDelta):
                    if ev.usage is not None:
                        so_far[i] = ev.usage
                    if ev.text or ev.logprobs:
                        yield chunk(i, ev.text, self._logprobs(call, i, ev.logprobs))
                elif isinstance(ev, Finished):
                    finished[i] = ev
                    so_far[i] = (ev.prompt_tokens, ev.completion_tokens)
                    yield chunk(i, "", finish=ev.finish_reason)
                    if len(finished) == runs:
                        break
            if len(finished) < runs:
                raise internal_error(RuntimeError("the pipeline ended without a Finished event"))
            if call.include_usage:
                yield sse(Completion(id=call.request_id, created=call.created, model=call.model, choices=[],
                                     usage=self._usage(call, finished)).model_dump(mode="json"))
            yield DONE
            status = 200
        except PipelineError as e:
            status = e.http_status
            yield sse(error_response(e).model_dump(mode="json"))
            yield DONE
        except Exception as e:
            log.exception("completion stream failed")
            status = 500
            yield sse(error_response(internal_error(e)).model_dump(mode="json"))
            yield DONE
        finally:
            state.settle(status)
            await state.close_events()


def _prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    """The request's prompts, one per run group: a string, a list of strings, token ids or lists of them."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise invalid_request("prompt: send a string, token ids, or a non-empty list of either", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]
