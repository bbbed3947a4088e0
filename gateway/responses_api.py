"""OpenAI's `POST /v1/responses` (the Responses API, as vLLM serves it): text, images and audio in, text out,
stateless.

Data flow: body -> `ResponsesRequest` (strict) -> `input` (a string: one user turn; or message items whose
`content` is a string or `input_text` / `input_image` / `input_audio` parts; an assistant turn's
`output_text`) and `instructions` (a system turn first) -> the same messages a chat completion builds
(`RestGateway.chat_messages`: media decoded, the request-wide limits checked) -> one `ChatRequest`, text out
-> one `response` object (`output`: one assistant `message` with one `output_text` part; `usage` with
input / output tokens, cached input tokens as `input_tokens_details.cached_tokens`; `status` "completed", or
"incomplete" with `incomplete_details.reason` "max_output_tokens"), or with `stream` the Responses event
stream: `response.created`, `response.in_progress`, `response.output_item.added`,
`response.content_part.added`, `response.output_text.delta` per text delta, the matching `.done` events and
`response.completed` (or `response.incomplete`), each with its `sequence_number`.

- A reasoning model (--reasoning-parser, gateway/reasoning.py): a `reasoning` item (its `reasoning_text`) before the
  message, streamed as `response.reasoning_text.delta` events at output 0 before the message opens at output 1.
- Sampling: `temperature`, `top_p`, `max_output_tokens`, vLLM's extras the chat takes (`top_k`, `seed`, `stop`,
  ...) at the top level; `text.format` json_schema / json_object becomes the thinker's structured output.
- omnimesh stores nothing: `previous_response_id`, `conversation`, `background` and `store: true` answered
  as stored are 400s naming the field (`store` is accepted and answered false), as are `tools` (function
  calling lives on /v1/chat/completions). `reasoning.effort` becomes the chat template's `reasoning_effort`
  variable (as vLLM passes it; chat's `reasoning_effort` too); `reasoning.summary` is accepted, and no summary
  is written.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, field_validator

from gateway.choices import Indexed
from gateway.events import ChatRequest, Finished, PipelineError, TemplateOptions, TextDelta, check_request_id
from gateway.http_errors import internal_error
from gateway.media import invalid_request
from gateway.openai_schema import (
    check_turns,
    ContentPart,
    ImageURL,
    InputAudio,
    Message,
    ReasoningEffort,
    SamplingBody,
    StrictBody,
    check_priority,
    check_sampling,
    error_response,
    parse_json_object,
    refuse_unsupported,
    resolve_model,
    validate_body,
    with_effort,
)
from gateway.reasoning import END, AnswerSplit, ThoughtTokens, thinks
from gateway.sse import DONE, StreamState, chain, run_to_end, sse
from gateway.structured_request import require_llguidance, structured_spec
from services.llm.structured_output import grammar_for

if TYPE_CHECKING:
    from gateway.rest import Answer, RestGateway

# fields of the Responses API omnimesh cannot honour, each with the test that its value asks for nothing
UNSUPPORTED: dict[str, Any] = {
    "previous_response_id": lambda v: v is None,
    "conversation": lambda v: v is None,
    "background": lambda v: not v,
    "tools": lambda v: not v,
    "prompt": lambda v: v is None,
    "prompt_logprobs": lambda v: v is None,
}
_PART_TYPES = ("input_text", "output_text", "input_image", "input_audio")


class InputPart(StrictBody):  # unknown keys are errors
    type: Literal["input_text", "output_text", "input_image", "input_audio"]
    text: str | None = None
    image_url: str | None = None  # a data: URL (http(s) only from --allowed-media-domains)
    input_audio: InputAudio | None = None  # as the chat's {"data": base64, "format": "wav" | "mp3" | ...}
    detail: str | None = None  # input_image's; accepted, the processor's own resolution applies
    annotations: list[Any] | None = None  # output_text's (none come back)


class InputItem(StrictBody):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputPart]
    id: str | None = None  # an earlier output item's (echoed back by clients)
    status: str | None = None


class TextFormat(StrictBody):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextOptions(StrictBody):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningOptions(StrictBody):
    effort: ReasoningEffort | None = None  # the chat template reads it (`reasoning_effort`), as vLLM passes it
    summary: Literal["auto", "concise", "detailed"] | None = None  # accepted; no summary is written (`summary: []`)
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # its former name


class ResponsesRequest(SamplingBody):
    input: Any  # a string, or message items (`InputItem`, checked one by one: `items`)
    reasoning: ReasoningOptions | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    text: TextOptions | None = None
    store: bool | None = None  # nothing is stored: the answer says false
    metadata: dict[str, str] | None = None  # echoed back
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _not_empty(cls, v: Any) -> str | list[Any]:
        if not isinstance(v, (str, list)) or (isinstance(v, list) and not v):
            raise ValueError("give a string or at least one message")
        return v

    def items(self) -> list[InputItem]:
        """The input as message items; a bad one is a 400 naming its path (`input[2].content[0].type`)."""
        if isinstance(self.input, str):
            return [InputItem(role="user", content=self.input)]
        return [validate_body(InputItem, item, ("input", i)) for i, item in enumerate(self.input)]


@dataclass(slots=True)
class _Response:
    request: ChatRequest
    body: ResponsesRequest
    model: str
    stream: bool
    created: int
    started: float
    item_id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    reasoning_id: str = field(default_factory=lambda: f"rs_{uuid.uuid4().hex}")
    first_text: bool = False
    first_audio: bool = False
    sequence: int = 0

    def next_sequence(self) -> int:
        self.sequence += 1
        return self.sequence - 1


class ResponsesRoutes:
    """`POST /v1/responses` on one `RestGateway` (its pipeline, media loader, model names, metrics)."""

    def __init__(self, gw: RestGateway) -> None:
        self.gw = gw

    def _parse(self, raw: bytes) -> ResponsesRequest:
        """The body, its input items counted before they are validated (as a chat's messages)."""
        obj = parse_json_object(raw)
        check_turns(obj.get("input"), self.gw.loader.limits, "input")
        return validate_body(ResponsesRequest, obj)

    async def responses(self, request: Request) -> Response:
        from gateway.rest import Answer  # rest imports this module to route it

        async def prepare(raw: bytes, client_id: str | None, started: float) -> Answer:
            body = await asyncio.to_thread(self._parse, raw)
            refuse_unsupported(body, UNSUPPORTED)
            call = await self.build(body, client_id, started)
            return Answer(call.request.request_id, (call.request,), body.stream,
                          lambda first, events: self._complete(call, first, events),
                          lambda first, state: self._stream(call, first, state))

        return await self.gw.answer("responses", request, prepare)

    async def build(self, body: ResponsesRequest, client_id: str | None, started: float) -> _Response:
        gw = self.gw
        model = resolve_model(body.model, gw.served_model_names)
        if body.n not in (None, 1):
            raise invalid_request("n: the Responses API answers one output; use /v1/chat/completions for choices", "n")
        sampling = body.overrides(body.max_output_tokens)
        try:
            check_sampling(sampling, "", gw.max_logprobs)
        except PipelineError as e:  # the Responses API's name for max_tokens
            if e.param == "max_tokens":
                raise invalid_request(e.message.replace("max_tokens", "max_output_tokens"), "max_output_tokens") from None
            raise
        messages = await gw.chat_messages(self._messages(body))
        structured = await asyncio.to_thread(_structured, body)
        other = await asyncio.to_thread(structured_spec, body)  # vLLM's structured_outputs / guided_* too
        if structured is not None and other is not None:
            raise invalid_request("text.format: give one structured output per request", "text.format")
        suffix = check_request_id(client_id, "X-Request-Id") if client_id else uuid.uuid4().hex
        pipeline_model = model if model in gw.pipeline.served_models else gw.pipeline.served_models[0]
        thinking = thinks(gw.reasoning, {}, audio_out=False)  # --reasoning-parser: a reasoning item first
        effort = body.reasoning.effort if body.reasoning is not None else None
        chat = ChatRequest(request_id=f"resp_{suffix}", model=pipeline_model, messages=messages, modalities=("text",),
                           sampling=sampling, priority=check_priority(body.priority), structured=structured or other,
                           truncate_prompt_tokens=body.truncate_prompt_tokens, reasoning_end=END if thinking else None,
                           template=TemplateOptions(kwargs=with_effort(None, effort) or {}))
        return _Response(chat, body, model, body.stream, int(time.time()), started)

    @staticmethod
    def _messages(body: ResponsesRequest) -> list[Message]:
        """The chat messages the input stands for (instructions first, as a system turn)."""
        out = [Message(role="system", content=[ContentPart(type="text", text=body.instructions)])] \
            if body.instructions else []
        for i, item in enumerate(body.items()):
            parts = [InputPart(type="input_text", text=item.content)] if isinstance(item.content, str) else item.content
            content = []
            for j, p in enumerate(parts):
                where = f"input[{i}].content[{j}]"
                if p.type in ("input_text", "output_text"):
                    if p.text is None:
                        raise invalid_request(f"{where}.text: a '{p.type}' part needs its text", f"{where}.text")
                    content.append(ContentPart(type="text", text=p.text))
                elif p.type == "input_image":
                    if not p.image_url:
                        raise invalid_request(f"{where}.image_url: an 'input_image' part needs its image_url "
                                              "(a data: URL; file ids are not stored here)", f"{where}.image_url")
                    content.append(ContentPart(type="image_url", image_url=ImageURL(url=p.image_url)))
                else:
                    if p.input_audio is None:
                        raise invalid_request(f"{where}.input_audio: an 'input_audio' part needs its input_audio "
                                              "({\"data\", \"format\"})", f"{where}.input_audio")
                    content.append(ContentPart(type="input_audio", input_audio=p.input_audio))
            out.append(Message(role=item.role, content=content))
        return out

    # ---------------------------------------------------------------------------------------- answers
    def _object(self, call: _Response, status: str, text: str, finished: Finished | None,
                thought: str | None = None, reasoning_tokens: int = 0) -> dict[str, Any]:
        """The `response` object (OpenAI's shape) as it stands: a reasoning item (--reasoning-parser) before the
        message when the model reasoned."""
        b = call.body
        output = [] if status == "in_progress" else [{
            "type": "message", "id": call.item_id, "status": "completed" if status == "completed" else "incomplete",
            "role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": []}]}]
        if thought is not None and status != "in_progress":
            output.insert(0, self._reasoning_item(call, thought))
        usage = None
        if finished is not None:
            usage = {"input_tokens": finished.prompt_tokens,
                     "input_tokens_details": {"cached_tokens": finished.cached_tokens},
                     "output_tokens": finished.completion_tokens,
                     "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                     "total_tokens": finished.prompt_tokens + finished.completion_tokens}
        fmt = b.text.format.model_dump(by_alias=True, exclude_none=True) if b.text and b.text.format else {"type": "text"}
        return {"id": call.request.request_id, "object": "response", "created_at": call.created, "status": status,
                "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": call.model,
                "output": output, "parallel_tool_calls": True, "previous_response_id": None,
                "reasoning": b.reasoning.model_dump(exclude_none=True) if b.reasoning is not None else None,
                "store": False, "temperature": b.temperature, "text": {"format": fmt}, "tool_choice": "auto",
                "tools": [], "top_p": b.top_p, "truncation": "disabled", "usage": usage, "user": b.user,
                "metadata": b.metadata or {}}

    def _split(self, call: _Response) -> AnswerSplit:
        return AnswerSplit(self.gw.reasoning, call.request.reasoning_end is not None)

    @staticmethod
    def _reasoning_item(call: _Response, thought: str) -> dict[str, Any]:
        return {"type": "reasoning", "id": call.reasoning_id, "summary": [], "status": "completed",
                "content": [{"type": "reasoning_text", "text": thought}]}

    async def _complete(self, call: _Response, first: Indexed, events: AsyncIterator[Indexed]) -> Response:
        thoughts: list[str] = []
        answers: list[str] = []
        split = ThoughtTokens(self._split(call))  # delta by delta: what `AnswerSplit.whole` gives the whole text

        def take(ev: object) -> None:
            self.gw._observe(call, ev)  # type: ignore[arg-type]
            if isinstance(ev, TextDelta):
                thought, answer = split.push(ev.text, ev.usage)
                thoughts.append(thought)
                answers.append(answer)

        finished = await run_to_end(first, events, take)
        status = "incomplete" if finished.finish_reason == "length" else "completed"
        self.gw._finish("responses", 200, call.started)
        thought, answer = split.finish()
        return JSONResponse(self._object(call, status, "".join(answers) + answer, finished,
                                         "".join(thoughts) + thought or None,
                                         split.total(finished.completion_tokens)),
                            headers={"X-Request-Id": call.request.request_id})

    def _event(self, call: _Response, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": call.next_sequence(), **fields}
        return f"event: {kind}\n".encode() + sse(data)

    def _open_message(self, call: _Response, where: dict[str, Any]) -> list[bytes]:
        return [self._event(call, "response.output_item.added", output_index=where["output_index"], item={
                    "type": "message", "id": call.item_id, "status": "in_progress", "role": "assistant", "content": []}),
                self._event(call, "response.content_part.added", **where,
                            part={"type": "output_text", "text": "", "annotations": []})]

    def _thought_events(self, call: _Response, thought: str, opened: bool) -> list[bytes]:
        """A piece of reasoning as events: its item opened first (output 0, before the message)."""
        where = {"item_id": call.reasoning_id, "output_index": 0, "content_index": 0}
        out = [] if opened else [
            self._event(call, "response.output_item.added", output_index=0, item={
                "type": "reasoning", "id": call.reasoning_id, "summary": [], "status": "in_progress", "content": []}),
            self._event(call, "response.content_part.added", **where, part={"type": "reasoning_text", "text": ""})]
        return out + [self._event(call, "response.reasoning_text.delta", **where, delta=thought)]

    def _close_thought(self, call: _Response, thought: str) -> list[bytes]:
        where = {"item_id": call.reasoning_id, "output_index": 0, "content_index": 0}
        return [self._event(call, "response.reasoning_text.done", **where, text=thought),
                self._event(call, "response.content_part.done", **where, part={"type": "reasoning_text", "text": thought}),
                self._event(call, "response.output_item.done", output_index=0, item=self._reasoning_item(call, thought))]

    def _text_events(self, call: _Response, piece: tuple[str, str], thoughts: list[str], text: list[str],
                     where: dict[str, Any], message: bool) -> list[bytes]:
        """One delta's (reasoning, answer) as events; the answer's first text closes the reasoning item and opens
        the message after it (`where` moves to output 1)."""
        thought, answer = piece
        out = self._thought_events(call, thought, opened=bool(thoughts)) if thought else []
        if thought:
            thoughts.append(thought)
        if answer:
            if not message:
                out += self._start_message(call, thoughts, where)
            text.append(answer)
            out.append(self._event(call, "response.output_text.delta", **where, delta=answer, logprobs=[]))
        return out

    def _start_message(self, call: _Response, thoughts: list[str], where: dict[str, Any]) -> list[bytes]:
        """After the reasoning (if any: its item is closed first) the message item, at the next output index."""
        out = self._close_thought(call, "".join(thoughts)) if thoughts else []
        where["output_index"] = 1 if thoughts else 0
        return out + self._open_message(call, where)

    async def _stream(self, call: _Response, first: Indexed, state: StreamState) -> AsyncIterator[bytes]:
        status = 499  # client closed, unless the stream gets to its end
        where: dict[str, Any] = {"item_id": call.item_id, "output_index": 0, "content_index": 0}
        split = ThoughtTokens(self._split(call))  # also counts the reasoning tokens
        thoughts: list[str] = []  # --reasoning-parser: the reasoning item (output 0), before the message
        message = False  # the message item is open (at its first answer text; at once without reasoning)
        try:
            yield self._event(call, "response.created", response=self._object(call, "in_progress", "", None))
            yield self._event(call, "response.in_progress", response=self._object(call, "in_progress", "", None))
            if call.request.reasoning_end is None:  # no reasoning to come: the message at once
                message = True
                for event in self._start_message(call, [], where):
                    yield event
            text: list[str] = []
            finished = None
            async for _, ev in chain(first, state.events):
                self.gw._observe(call, ev)
                if isinstance(ev, Finished):
                    finished = ev
                    break
                if not isinstance(ev, TextDelta) or not ev.text:
                    continue
                for event in self._text_events(call, split.push(ev.text, ev.usage), thoughts, text, where, message):
                    yield event
                message = message or bool(text)
            if finished is None:
                raise internal_error(RuntimeError("the pipeline ended without a Finished event"))
            for event in self._text_events(call, split.finish(), thoughts, text, where, message):
                yield event
            if not message:  # all reasoning: the message item still comes, empty
                for event in self._start_message(call, thoughts, where):
                    yield event
            whole, thought = "".join(text), "".join(thoughts) if thoughts else None
            done = "incomplete" if finished.finish_reason == "length" else "completed"
            part = {"type": "output_text", "text": whole, "annotations": []}
            yield self._event(call, "response.output_text.done", **where, text=whole, logprobs=[])
            yield self._event(call, "response.content_part.done", **where, part=part)
            yield self._event(call, "response.output_item.done", output_index=where["output_index"],
                              item=self._object(call, done, whole, finished)["output"][0])
            yield self._event(call, f"response.{done}", response=self._object(
                call, done, whole, finished, thought, split.total(finished.completion_tokens)))
            yield DONE
            status = 200
        except PipelineError as e:
            status = e.http_status
            yield self._event(call, "error", code=error_response(e).error.code, message=e.message, param=e.param)
        except Exception as e:
            status = 500
            err = internal_error(e)
            yield self._event(call, "error", code="internal_error", message=err.message, param=None)
        finally:
            state.settle(status)
            await state.close_events()


def _structured(body: ResponsesRequest) -> tuple[str, str] | None:
    """`text.format` json_schema / json_object -> the thinker's structured output (checked here: a 400 naming
    the field when the schema does not compile)."""
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    where = "text.format"
    if fmt.type == "json_schema" and fmt.schema_ is None:
        raise invalid_request(f"{where}.schema: a json_schema format needs its schema", f"{where}.schema")
    spec = json.dumps(fmt.schema_) if fmt.type == "json_schema" else '{"type": "object"}'
    require_llguidance(where)
    try:
        grammar_for("json", spec)
    except ValueError as e:
        raise invalid_request(f"{where}: {e}", where) from None
    return "json", spec
