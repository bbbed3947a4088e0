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
  a generated special token, which the text skips, takes no room). The values are the thinker's raw
  distribution, as the chat route's. With `echo` the prompt's tokens come first (the thinker scores the
  prompt as it prefills, as for `prompt_logprobs`; the first token has no context: null), and vLLM's
  `max_tokens: 0` answers the prompt alone (what lm-eval's loglikelihood requests send).
- vLLM's `prompt_logprobs: k`: each choice's `prompt_logprobs` in vLLM's shape (gateway/prompt_logprobs.py);
  not with `stream` (a 400, as vLLM).
- `usage` counts each prompt once and every choice's completion tokens; `stream_options` as in a chat.
- The thinker's sampling fields, `stop`, structured outputs and `priority` work as in a chat completion;
  `suffix`, `best_of` > 1 and beam search are 400s naming the field.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, field_validator

from gateway.choices import MAX_CHOICES, Indexed, choice_requests, close_events, total_usage
from gateway.events import ChatRequest, Finished, TextDelta, check_request_id
from gateway.http_errors import internal_error
from gateway.media import invalid_request
from gateway.openai_schema import (
    SamplingBody,
    Usage,
    check_priority,
    check_sampling,
    parse_json_object,
    refuse_unsupported,
    resolve_model,
    validate_body,
)
from gateway.prompt import PromptBuilder
from gateway.prompt_logprobs import prompt_logprobs_json, token_text
from gateway.sse import DONE, StreamState, chain, guarded, sse
from gateway.structured_request import structured_spec
from omnimesh.v1 import stage_pb2
from services.llm.token_logprobs import TokenBytes

if TYPE_CHECKING:
    from gateway.rest import Answer, RestGateway

MAX_RUNS = 64  # prompts x n in one request: beyond this a 400 (one request must not flood the stages)
DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's completions default

# fields vLLM's completions define that omnimesh does not implement, each with the test that its value asks
# for nothing (then it is accepted and changes nothing; anything else is a 400)
UNSUPPORTED: dict[str, Any] = {
    "suffix": lambda v: not v,
    "best_of": lambda v: v is None or v == 1,
    "use_beam_search": lambda v: not v,
    "prompt_embeds": lambda v: v is None,
}


def prompt_token_ids(tokenizer: Any, prompt: str | Sequence[int], add_special_tokens: bool, where: str) -> list[int]:
    """One raw prompt (text, tokenized; or token ids, each checked against the vocabulary) -> its ids; an
    empty prompt or an id outside the vocabulary is a 400 naming `where` (REST's `prompt[i]`, gRPC's fields)."""
    if isinstance(prompt, str):
        ids = list(tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])
    else:
        ids, size = list(prompt), len(tokenizer)
        for j, t in enumerate(ids):
            if not 0 <= t < size:
                raise invalid_request(f"{where}[{j}]: {t} is not a token id of this model (0 to {size - 1})",
                                      f"{where}[{j}]")
    if not ids:
        raise invalid_request(f"{where}: the prompt is empty; send at least one token", where)
    return ids


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
    token_logprobs: list[float | None]  # None: an echoed prompt's first token (no context)
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # vLLM's, when asked


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
    logprobs: int | None  # the legacy logprobs' alternatives per token
    prompt_logprobs: int | None  # vLLM's, as asked (the runs may score more: echo with logprobs)
    first_tokens: tuple[int, ...]  # per choice: its prompt's first token (echoed logprobs start with it)
    prompt_only: bool  # echo with max_tokens 0: the answer is the prompt (the runs generate one token, dropped)
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
        self.token_bytes = TokenBytes(tokenizer)  # an echoed prompt's first token (the thinker sends the rest)

    async def completions(self, request: Request) -> Response:
        from gateway.rest import Answer  # rest imports this module to route it

        async def prepare(raw: bytes, client_id: str | None, started: float) -> Answer:
            body = await asyncio.to_thread(parse_completion_request, raw)  # off the loop: a big body takes a while
            call = await self.build(body, client_id, started)
            return Answer(call.request_id, call.runs, call.stream,
                          lambda first, events: self._complete(call, first, events),
                          lambda first, state: guarded(self._stream(call, first, state), state, "completion"))

        return await self.gw.answer("completions", request, prepare)

    # ------------------------------------------------------------------------------ request building
    async def build(self, body: CompletionRequest, client_id: str | None, started: float) -> _Completion:
        gw = self.gw
        model = resolve_model(body.model, gw.served_model_names)
        n = 1 if body.n is None else body.n
        if not 1 <= n <= MAX_CHOICES:
            raise invalid_request(f"n: must be in [1, {MAX_CHOICES}] choices, got {n}", "n")
        if body.stream and body.prompt_logprobs is not None:
            raise invalid_request("prompt_logprobs: not available with stream: true (as in vLLM); ask without "
                                  "streaming, or use echo with logprobs", "prompt_logprobs")
        prompt_only = body.echo and body.max_tokens == 0
        if body.max_tokens == 0 and not body.echo:
            raise invalid_request("max_tokens: 0 asks for no text; it is only for echo (the prompt alone)", "max_tokens")
        sampling = replace(body.overrides(1 if prompt_only else body.max_tokens), logprobs=body.logprobs)
        check_sampling(sampling, "", gw.max_logprobs)
        scored = body.prompt_logprobs
        if body.echo and body.logprobs is not None:  # the echoed prompt's tokens carry theirs
            scored = max(body.logprobs, scored or 0)
        sampling = replace(sampling, prompt_logprobs=scored)
        prompts = _prompts(body.prompt)
        if len(prompts) * n > MAX_RUNS:
            raise invalid_request(f"prompt: {len(prompts)} prompts x n={n} is {len(prompts) * n} runs; at most "
                                  f"{MAX_RUNS} per request: split them over several requests", "prompt")
        structured = await asyncio.to_thread(structured_spec, body)
        listed = not isinstance(body.prompt, str) and not all(isinstance(p, int) for p in body.prompt)
        ids = await asyncio.to_thread(self._token_ids, prompts, body.add_special_tokens, listed,
                                      body.truncate_prompt_tokens is None)
        if body.truncate_prompt_tokens is not None:  # vLLM's: the last k tokens; an echo shows what ran
            kept = [self.builder.truncated(torch.tensor(i), body.truncate_prompt_tokens).tolist() for i in ids]
            prompts = [p if len(k) == len(i) else k for p, i, k in zip(prompts, ids, kept, strict=True)]
            ids = kept
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
                           n=n, stream=body.stream, logprobs=body.logprobs, prompt_logprobs=body.prompt_logprobs,
                           first_tokens=tuple(i[0] for i in ids for _ in range(n)), prompt_only=prompt_only,
                           include_usage=self.gw.force_include_usage or bool(so and so.include_usage),
                           continuous_usage=bool(so and so.include_usage and so.continuous_usage_stats),
                           created=int(time.time()), started=started,
                           offsets=[len(e) for e in echo for _ in range(n)])

    def _token_ids(self, prompts: list[str | list[int]], add_special_tokens: bool, listed: bool,
                   whole: bool) -> list[list[int]]:
        """`listed`: the body's prompt is a list of prompts (each named `prompt[i]`), not one (`prompt`); `whole`:
        no truncate_prompt_tokens, so a text too long to fit max_model_len is refused before it is tokenized."""
        tokenizer = self.builder.processor.tokenizer
        names = [f"prompt[{i}]" if listed else "prompt" for i in range(len(prompts))]
        if whole:
            for p, name in zip(prompts, names, strict=True):
                if isinstance(p, str):
                    self.builder.check_chars(p, name)
        return [prompt_token_ids(tokenizer, p, add_special_tokens, name) for p, name in zip(prompts, names, strict=True)]

    def _echo_texts(self, prompts: list[str | list[int]], ids: list[list[int]]) -> list[str]:
        tokenizer = self.builder.processor.tokenizer
        return [p if isinstance(p, str) else str(tokenizer.decode(i)) for p, i in zip(prompts, ids, strict=True)]

    # ---------------------------------------------------------------------------------------- answers
    def _logprobs(self, call: _Completion, i: int, entries: Sequence[stage_pb2.TokenLogprob]
                  ) -> CompletionLogprobs | None:
        """The legacy `logprobs` of choice `i`'s next generated tokens (advancing its text offsets), or None."""
        if call.logprobs is None:
            return None
        out = CompletionLogprobs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
        for e in entries:
            out.text_offset.append(call.offsets[i])
            self._add(out, e, call.logprobs)
            if e.token_id not in self.silent:
                call.offsets[i] += len(out.tokens[-1])
        return out

    def _echoed(self, call: _Completion, i: int, prompt: Sequence[stage_pb2.TokenLogprob]) -> CompletionLogprobs | None:
        """The legacy `logprobs` of choice `i`'s echoed prompt: its first token (no context: null), then the
        thinker's entries for the others; offsets over the tokens' texts from 0."""
        if call.logprobs is None or not call.echo[i]:
            return None
        first = stage_pb2.TokenLogprob(token_id=call.first_tokens[i], token=self.token_bytes(call.first_tokens[i]))
        out = CompletionLogprobs(text_offset=[0], token_logprobs=[None], tokens=[self._token_text(first)],
                                 top_logprobs=[None])
        at = len(out.tokens[0])
        for e in prompt:
            out.text_offset.append(at)
            self._add(out, e, call.logprobs)
            at += len(out.tokens[-1])
        return out

    def _add(self, out: CompletionLogprobs, e: stage_pb2.TokenLogprob, k: int) -> None:
        token = self._token_text(e)
        out.tokens.append(token)
        out.token_logprobs.append(e.logprob)
        out.top_logprobs.append({**{self._token_text(t): t.logprob for t in e.top[:k]}, token: e.logprob})

    def _token_text(self, e: stage_pb2.TokenLogprob | stage_pb2.TopLogprob) -> str:
        return token_text(e, self.gw.tokens_as_ids)

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
        prompt: list[list[stage_pb2.TokenLogprob]] = [[] for _ in range(runs)]
        finished: dict[int, Finished] = {}
        try:
            async for i, ev in chain(first, events):
                self.gw._observe(call, ev)
                if isinstance(ev, TextDelta):
                    prompt[i].extend(ev.prompt_logprobs)
                    if not call.prompt_only:
                        text[i].append(ev.text)
                        entries[i].extend(ev.logprobs)
                elif isinstance(ev, Finished):
                    finished[i] = _settled(call, ev)
                    if len(finished) == runs:
                        break
        finally:
            await close_events(events)
        if len(finished) < runs:
            raise internal_error(RuntimeError("the pipeline ended without a Finished event"))
        choices = [CompletionChoice(index=i, text="".join(text[i]), finish_reason=finished[i].finish_reason,
                                    stop_reason=finished[i].stop_reason,
                                    logprobs=_joined(self._echoed(call, i, prompt[i]),
                                                     self._logprobs(call, i, entries[i])),
                                    prompt_logprobs=self._prompt_logprobs(call, prompt[i]))
                   for i in range(runs)]
        body = Completion(id=call.request_id, created=call.created, model=call.model, choices=choices,
                          usage=self._usage(call, finished))
        self.gw._finish("completions", 200, call.started)
        data = body.model_dump(mode="json")
        if call.prompt_logprobs is None:
            for c in data["choices"]:
                del c["prompt_logprobs"]
        return JSONResponse(data, headers={"X-Request-Id": call.request_id})

    def _prompt_logprobs(self, call: _Completion, entries: Sequence[stage_pb2.TokenLogprob]
                         ) -> list[dict[str, Any] | None] | None:
        k = call.prompt_logprobs
        return None if k is None else prompt_logprobs_json(entries, k, self.gw.tokens_as_ids)

    async def _stream(self, call: _Completion, first: Indexed, state: StreamState) -> AsyncIterator[bytes]:
        runs = len(call.runs)
        so_far: list[tuple[int, int] | None] = [None] * runs  # continuous_usage_stats: (prompt, completion)
        # echoed prompts not sent yet: with logprobs they wait for the prompt's entries (the first delta's)
        echo = [e if call.logprobs is not None else "" for e in call.echo]

        def chunk(i: int, text: str, logprobs: CompletionLogprobs | None = None, finish: str | None = None,
                  stop_reason: str | int | None = None) -> bytes:
            usage = None
            if call.continuous_usage and (known := so_far[i]) is not None:
                usage = Usage(prompt_tokens=known[0], completion_tokens=known[1], total_tokens=sum(known))
            c = Completion(id=call.request_id, created=call.created, model=call.model, usage=usage,
                           choices=[CompletionChoice(index=i, text=text, logprobs=logprobs, finish_reason=finish,
                                                     stop_reason=stop_reason)])
            data = c.model_dump(mode="json")
            for choice in data["choices"]:
                del choice["prompt_logprobs"]  # never streamed (a 400 up front)
            if usage is None:
                del data["usage"]
            return sse(data)

        for i, text in enumerate(call.echo):
            if text and not echo[i]:
                yield chunk(i, text)
        finished: dict[int, Finished] = {}
        async for i, ev in chain(first, state.events):
            self.gw._observe(call, ev)
            if isinstance(ev, TextDelta):
                if ev.usage is not None:
                    so_far[i] = ev.usage
                if echo[i]:
                    yield chunk(i, echo[i], self._echoed(call, i, ev.prompt_logprobs))
                    echo[i] = ""
                if (ev.text or ev.logprobs) and not call.prompt_only:
                    yield chunk(i, ev.text, self._logprobs(call, i, ev.logprobs))
            elif isinstance(ev, Finished):
                finished[i] = ev = _settled(call, ev)
                so_far[i] = (ev.prompt_tokens, ev.completion_tokens)
                if echo[i]:  # no delta came (a stop id first): the prompt has no entries then
                    yield chunk(i, echo[i], self._echoed(call, i, ()))
                    echo[i] = ""
                yield chunk(i, "", finish=ev.finish_reason, stop_reason=ev.stop_reason)
                if len(finished) == runs:
                    break
        if len(finished) < runs:
            raise internal_error(RuntimeError("the pipeline ended without a Finished event"))
        if call.include_usage:
            yield sse(Completion(id=call.request_id, created=call.created, model=call.model, choices=[],
                                 usage=self._usage(call, finished)).model_dump(mode="json"))
        yield DONE


def _settled(call: _Completion, f: Finished) -> Finished:
    """A run's end as the client sees it: with `max_tokens: 0` (echo) its one generated token is not theirs."""
    return replace(f, completion_tokens=0, finish_reason="length", stop_reason=None) if call.prompt_only else f


def _joined(a: CompletionLogprobs | None, b: CompletionLogprobs | None) -> CompletionLogprobs | None:
    """Two runs of legacy logprobs (the echoed prompt's, the generated tokens') as one."""
    if a is None or b is None:
        return a if b is None else b
    return CompletionLogprobs(text_offset=a.text_offset + b.text_offset, token_logprobs=a.token_logprobs + b.token_logprobs,
                              tokens=a.tokens + b.tokens, top_logprobs=a.top_logprobs + b.top_logprobs)


def _prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    """The request's prompts, one per run group: a string, a list of strings, token ids or lists of them."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise invalid_request("prompt: send a string, token ids, or a non-empty list of either", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]
