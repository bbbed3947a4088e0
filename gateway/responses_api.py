"""OpenAI's `POST /v1/responses` (the Responses API, as vLLM serves it): text, images and audio in, text out,
stateless unless --responses-store-memory keeps the answers (gateway/response_store.py).

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
  ...) at the top level; `text.format` json_schema / json_object becomes the thinker's structured output;
  `top_logprobs` / `include: ["message.output_text.logprobs"]` put the answer tokens' logprobs on its
  `output_text` part and its text deltas (a thought's tokens are left out).
- Function calling (gateway/responses_tools.py): `tools` / `tool_choice` / `parallel_tool_calls` by the chat's
  rules, `function_call` / `function_call_output` input items as the chat's calls and tool turns; the calls the
  thinker makes are `function_call` output items after the message (no message when the answer is only calls;
  streamed: `response.output_item.added`, `response.function_call_arguments.delta` / `.done`,
  `response.output_item.done` as each call's block closes).
- Stored responses (gateway/response_store.py, with --responses-store-memory): each answer is kept unless the
  request says `store: false`; `previous_response_id` continues a stored conversation (its instructions not
  carried over, as OpenAI's); `GET` / `DELETE /v1/responses/{id}` and `GET /v1/responses/{id}/input_items`.
  Without the flag nothing is kept: `store` is answered false and `previous_response_id` is a 400 naming the
  flag. `background` (with the store): answered "queued" at once, run in a task, polled by GET, stopped by
  `POST /v1/responses/{id}/cancel`. `conversation` (OpenAI's Conversations API) is a 400 naming it. `reasoning.effort` becomes the chat template's `reasoning_effort`
  variable (as vLLM passes it; chat's `reasoning_effort` too); `reasoning.summary` is accepted, and no summary
  is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, cast

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, field_validator

from gateway.choices import Indexed, close_events, fan_out
from gateway.events import (
    ChatRequest,
    Finished,
    PipelineError,
    TemplateOptions,
    TextDelta,
    ToolCall,
    check_request_id,
)
from gateway.http_errors import error_json, internal_error
from gateway.media import invalid_request
from gateway.openai_schema import (
    check_turns,
    choice_logprobs,
    ContentPart,
    FunctionCall,
    ImageURL,
    InputAudio,
    Message,
    MessageToolCall,
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
from gateway.response_store import ResponseStore, StoredResponse
from gateway.responses_tools import call_item, item_messages, responses_tool_plan
from gateway.sse import DONE, StreamState, chain, run_to_end, sse
from gateway.structured_request import require_llguidance, structured_spec
from gateway.tool_calls import NO_TOOLS, ToolAnswer, ToolPlan
from omnimesh.v1 import stage_pb2
from services.llm.structured_output import grammar_for

if TYPE_CHECKING:
    from gateway.rest import Answer, RestGateway

log = logging.getLogger(__name__)

# fields of the Responses API omnimesh cannot honour, each with the test that its value asks for nothing
UNSUPPORTED: dict[str, Any] = {
    "conversation": lambda v: v is None,
    "prompt": lambda v: v is None,
    "prompt_logprobs": lambda v: v is None,
}
LOGPROBS = "message.output_text.logprobs"  # the `include` value that asks for the answer's logprobs
INCLUDABLE = (LOGPROBS, "reasoning.encrypted_content", "message.input_image.image_url", "file_search_call.results",
              "web_search_call.action.sources", "code_interpreter_call.outputs",
              "computer_call_output.output.image_url")  # OpenAI's values (only the first changes the answer here)
METADATA_LIMITS = (16, 64, 512)  # OpenAI's: pairs, characters per key, characters per value
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
    input: Any  # a string, or items: messages (`InputItem`) and function calls / outputs (`item_messages`)
    reasoning: ReasoningOptions | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    text: TextOptions | None = None
    store: bool | None = None  # kept (--responses-store-memory) unless false; the answer says whether it was
    previous_response_id: str | None = None  # a stored response whose conversation this one continues
    background: bool | None = None  # answer at once ("queued"); the response runs on, polled by GET (needs the store)
    top_logprobs: int | None = None  # alternatives per token in the answer's logprobs (0-20, --max-logprobs)
    include: list[str] | None = None  # "message.output_text.logprobs": each answer token's logprob (others: ignored)
    metadata: dict[str, str] | None = None  # echoed back (OpenAI's limits: 16 pairs, keys <= 64, values <= 512 chars)
    truncation: Literal["auto", "disabled"] | None = None  # answered as "disabled": a prompt too long is a 400
    user: str | None = None
    tools: list[Any] | None = None  # function tools, checked one by one (gateway/responses_tools.py)
    tool_choice: Any = None  # "none" / "auto" / "required" / {"type": "function", "name": ...}
    parallel_tool_calls: bool | None = None

    @field_validator("input")
    @classmethod
    def _not_empty(cls, v: Any) -> str | list[Any]:
        if not isinstance(v, (str, list)) or (isinstance(v, list) and not v):
            raise ValueError("give a string or at least one message")
        return v


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
    tools: ToolPlan = NO_TOOLS  # what the answer's function calls are (gateway/tool_calls.py)
    conversation: list[Message] = field(default_factory=list)  # the chat so far without instructions (stored)
    stored: bool = False  # the answer will be kept (gateway/response_store.py)
    kept_bytes: int = 0  # the stored conversation's bytes with this request's body (response_store.py)

    def next_sequence(self) -> int:
        self.sequence += 1
        return self.sequence - 1


class ResponsesRoutes:
    """`POST /v1/responses` on one `RestGateway` (its pipeline, media loader, model names, metrics)."""

    def __init__(self, gw: RestGateway, store: ResponseStore | None = None) -> None:
        self.gw = gw
        self.store = store  # --responses-store-memory (None: nothing is kept)
        self._running: dict[str, tuple[asyncio.Task, _Response]] = {}  # background responses in flight, by id

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
            call = await self.build(body, client_id, started, len(raw))
            return Answer(call.request.request_id, (call.request,), body.stream,
                          lambda first, events: self._complete(call, first, events),
                          lambda first, state: self._stream(call, first, state),
                          # background: answered now, "queued"; the run goes on in a task
                          immediate=self._start_background(call) if body.background else None)

        return await self.gw.answer("responses", request, prepare)

    async def build(self, body: ResponsesRequest, client_id: str | None, started: float,
                    body_bytes: int) -> _Response:
        """The chat the body stands for; `body_bytes` (the request's size) is what a stored answer's input takes."""
        gw = self.gw
        model = resolve_model(body.model, gw.served_model_names)
        if body.n not in (None, 1):
            raise invalid_request("n: the Responses API answers one output; use /v1/chat/completions for choices", "n")
        if unknown := [i for i in body.include or () if i not in INCLUDABLE]:
            raise invalid_request(f"include: {unknown[0]!r} is not one of {', '.join(INCLUDABLE)}", "include")
        pairs, key_chars, value_chars = METADATA_LIMITS
        if body.metadata is not None and (len(body.metadata) > pairs or any(
                len(k) > key_chars or len(v) > value_chars for k, v in body.metadata.items())):
            raise invalid_request(f"metadata: at most {pairs} pairs, keys of at most {key_chars} characters and values "
                                  f"of at most {value_chars}", "metadata")
        sampling = body.overrides(body.max_output_tokens)
        if body.top_logprobs is not None or LOGPROBS in (body.include or ()):  # the answer's tokens' logprobs
            sampling = replace(sampling, logprobs=body.top_logprobs or 0)
        try:
            check_sampling(sampling, "", gw.max_logprobs)
        except PipelineError as e:  # the Responses API's names for max_tokens and logprobs
            name = {"max_tokens": "max_output_tokens", "logprobs": "top_logprobs"}.get(e.param or "")
            if name is not None:
                raise invalid_request(e.message.replace(str(e.param), name, 1), name) from None
            raise
        previous = self._previous(body.previous_response_id)
        items: dict[int, int] = {}  # id(message) -> the input item it came from
        conversation = self._messages(body, previous.conversation if previous is not None else [],
                                      previous.call_ids() if previous is not None else set(), items)
        system = [Message(role="system", content=[ContentPart(type="text", text=body.instructions)])] \
            if body.instructions else []
        from gateway.rest import MessageNames  # rest imports this module to route it

        names = ["instructions"] * len(system) + [f"input[{items[id(m)]}]" if id(m) in items
                                                  else "previous_response_id" for m in conversation]
        messages = await gw.chat_messages(system + conversation, names=MessageNames("input", names, "image_url"))
        structured = await asyncio.to_thread(_structured, body)
        other = await asyncio.to_thread(structured_spec, body)  # vLLM's structured_outputs / guided_* too
        if structured is not None and other is not None:
            raise invalid_request("text.format: give one structured output per request", "text.format")
        suffix = check_request_id(client_id, "X-Request-Id") if client_id else uuid.uuid4().hex
        pipeline_model = model if model in gw.pipeline.served_models else gw.pipeline.served_models[0]
        tools = responses_tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls, gw.auto_tool_choice)
        if (structured or other) is not None and (tools.parse or tools.structured is not None):
            raise invalid_request("text.format: a structured output and function calls (tool_choice \"auto\") "
                                  "cannot both shape one answer; send tool_choice \"none\" or leave one out",
                                  "text.format")
        thinking = thinks(gw.reasoning, {}, audio_out=False)  # --reasoning-parser: a reasoning item first
        effort = body.reasoning.effort if body.reasoning is not None else None
        chat = ChatRequest(request_id=f"resp_{suffix}", model=pipeline_model, messages=messages, modalities=("text",),
                           sampling=sampling, priority=check_priority(body.priority),
                           structured=tools.structured or structured or other, tools=tools.tools,
                           truncate_prompt_tokens=body.truncate_prompt_tokens, reasoning_end=END if thinking else None,
                           template=TemplateOptions(kwargs=with_effort(None, effort) or {}),
                           media_param="input", conversation_param="input")
        if body.background:
            if self.store is None:
                raise invalid_request("background: a background response is polled from the store; start the "
                                      "server with --responses-store-memory SIZE", "background")
            if body.store is False:
                raise invalid_request("background: a background response must be stored (store: true)", "store")
            if body.stream:
                raise invalid_request("stream: a background response is polled (GET /v1/responses/{id}), not "
                                      "streamed, here", "stream")
        return _Response(chat, body, model, body.stream, int(time.time()), started, tools=tools,
                         conversation=conversation, stored=self.store is not None and body.store is not False,
                         kept_bytes=(previous.conversation_bytes if previous is not None else 0) + body_bytes)

    def _start_background(self, call: _Response) -> Response:
        """A background response: stored "queued" and answered so; a task runs it and stores how it ended."""
        rid = call.request.request_id
        queued = self._object(call, "queued", None, [])
        self._keep(call, queued)
        task = asyncio.create_task(self._background(call), name=f"background-{rid}")
        self._running[rid] = (task, call)
        task.add_done_callback(lambda _: self._running.pop(rid, None))
        return JSONResponse(queued, headers={"X-Request-Id": rid})

    async def _background(self, call: _Response) -> None:
        """Run it as a whole answer (`_complete` stores it); a failure or a cancel is stored as its status."""
        self.gw.metrics.running.inc()
        events = aiter(fan_out(self.gw.pipeline, (call.request,)))
        try:
            first = await anext(events)
            self._keep(call, self._object(call, "in_progress", None, []))
            await self._complete(call, first, events)
        except asyncio.CancelledError:
            self._keep(call, self._object(call, "cancelled", None, []))
            self.gw._finish("responses", 499, call.started)
        except Exception as e:  # noqa: BLE001  # the client reads the failure from the stored response
            err = e if isinstance(e, PipelineError) else internal_error(e)
            if not isinstance(e, PipelineError):
                log.exception("background response %s failed", call.request.request_id)
            failed = self._object(call, "failed", None, [])
            failed["error"] = {"code": error_response(err).error.code, "message": err.message}
            self._keep(call, failed)
            self.gw._finish("responses", err.http_status, call.started)
            del err  # held by this frame, which its traceback holds: a cycle that would keep the request's media
        finally:
            await close_events(events)
            self.gw.metrics.running.dec()

    async def close(self) -> None:
        """The gateway stops: background responses still running end "cancelled" (their runs stop in the stages)."""
        await asyncio.gather(*(self._stop(rid) for rid in list(self._running)))

    async def _stop(self, response_id: str) -> None:
        """Cancel a running background response and wait for it; one cancelled before its task ever ran is
        stored "cancelled" here (its coroutine never started, so it could not say so itself)."""
        running = self._running.get(response_id)
        if running is None:
            return
        task, call = running
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        stored = self.store.get(response_id) if self.store is not None else None
        if stored is not None and stored.response["status"] in ("queued", "in_progress"):
            self._keep(call, self._object(call, "cancelled", None, []))

    async def cancel(self, request: Request) -> Response:
        """`POST /v1/responses/{id}/cancel`: a background response still running stops (status "cancelled"); one
        that ended is answered as it is."""
        response_id = request.path_params["response_id"]
        await self._stop(response_id)
        stored = self._stored(response_id)
        if isinstance(stored, PipelineError):
            return error_json(stored)
        if not stored.response.get("background"):
            return error_json(invalid_request("only a background response can be cancelled", "response_id"))
        return JSONResponse(stored.response)

    def _previous(self, response_id: str | None) -> StoredResponse | None:
        if response_id is None:
            return None
        if self.store is None:
            raise invalid_request("previous_response_id: this server keeps no responses; start it with "
                                  "--responses-store-memory SIZE (e.g. 512MiB), or send the whole conversation as "
                                  "input", "previous_response_id")
        stored = self.store.get(response_id)
        if stored is None:
            raise invalid_request(f"previous_response_id: no stored response {response_id!r} (responses are kept in "
                                  "this gateway's memory, the least recently used dropped past "
                                  "--responses-store-memory; send the whole conversation as input)",
                                  "previous_response_id")
        return stored

    @staticmethod
    def _messages(body: ResponsesRequest, before: list[Message], calls: set[str],
                  items: dict[int, int] | None = None) -> list[Message]:
        """The conversation (`before`: a stored one's, whose call ids are `calls`) and the chat messages the input
        stands for after it; the instructions are not among them. `items` gets each message's input item index
        (by `id`) for the message items (those that can carry media)."""
        out = [m.model_copy() for m in before]  # the stored turns stay as they were kept
        calls = set(calls)  # the call ids of the function_call items so far
        raw_items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
        for i, raw in enumerate(raw_items):
            if item_messages(raw, i, out, calls):  # function calls, their outputs, earlier reasoning
                continue
            item = validate_body(InputItem, raw, ("input", i))  # a bad one: a 400 naming `input[2].content[0].type`
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
            if item.role == "assistant" and out and _thought_only(out[-1]):  # its reasoning came just before
                out[-1].content = content
            else:
                out.append(Message(role=item.role, content=content))
            if items is not None:
                items[id(out[-1])] = i
        return [m for m in out if not _thought_only(m)]  # a reasoning item that no answer followed says nothing

    # ---------------------------------------------------------------------------------------- answers
    def _object(self, call: _Response, status: str, finished: Finished | None, output: list[dict[str, Any]],
                reasoning_tokens: int = 0) -> dict[str, Any]:
        """The `response` object (OpenAI's shape) with its `output` items (none while in progress)."""
        b = call.body
        usage = None
        if finished is not None:
            usage = {"input_tokens": finished.prompt_tokens,
                     "input_tokens_details": {"cached_tokens": finished.cached_tokens},
                     "output_tokens": finished.completion_tokens,
                     "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                     "total_tokens": finished.prompt_tokens + finished.completion_tokens}
        fmt = b.text.format.model_dump(by_alias=True, exclude_none=True) if b.text and b.text.format else {"type": "text"}
        tools = [{"type": "function", **t["function"]} for t in call.tools.tools]
        return {"id": call.request.request_id, "object": "response", "created_at": call.created, "status": status,
                "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": call.model,
                "output": output, "parallel_tool_calls": b.parallel_tool_calls is not False,
                "background": bool(b.background),
                "previous_response_id": b.previous_response_id,
                "reasoning": b.reasoning.model_dump(exclude_none=True) if b.reasoning is not None else None,
                "store": call.stored, "temperature": b.temperature, "text": {"format": fmt},
                "tool_choice": b.tool_choice if b.tool_choice is not None else ("auto" if tools else "none"),
                "tools": tools, "top_p": b.top_p, "truncation": "disabled", "usage": usage, "user": b.user,
                "metadata": b.metadata or {}}

    def _split(self, call: _Response) -> AnswerSplit:
        return AnswerSplit(self.gw.reasoning, call.request.reasoning_end is not None)

    @staticmethod
    def _reasoning_item(call: _Response, thought: str) -> dict[str, Any]:
        return {"type": "reasoning", "id": call.reasoning_id, "summary": [], "status": "completed",
                "content": [{"type": "reasoning_text", "text": thought}]}

    @staticmethod
    def _message_item(call: _Response, done: str, text: str, logprobs: list[dict[str, Any]] | None = None
                      ) -> dict[str, Any]:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
        return {"type": "message", "id": call.item_id, "status": "completed" if done == "completed" else "incomplete",
                "role": "assistant", "content": [part]}

    def _logprobs(self, entries: list[stage_pb2.TokenLogprob]) -> list[dict[str, Any]]:
        """The thinker's entries in the Responses API's shape (the chat's: token, logprob, bytes, top_logprobs)."""
        content = choice_logprobs(entries, as_ids=self.gw.tokens_as_ids).content or []
        return [t.model_dump() for t in content]

    async def _complete(self, call: _Response, first: Indexed, events: AsyncIterator[Indexed]) -> Response:
        thoughts: list[str] = []
        answers: list[str] = []
        entries: list[stage_pb2.TokenLogprob] = []  # the answer's tokens' (a thought's are left out)
        split = ThoughtTokens(self._split(call))  # delta by delta: what `AnswerSplit.whole` gives the whole text

        def take(ev: object) -> None:
            self.gw._observe(call, ev)  # type: ignore[arg-type]
            if isinstance(ev, TextDelta):
                thought, answer = split.push(ev.text, ev.usage)
                thoughts.append(thought)
                answers.append(answer)
                if split.in_answer:  # a thought's logprobs stay out
                    entries.extend(ev.logprobs)

        finished = await run_to_end(first, events, take)
        done = "incomplete" if finished.finish_reason == "length" else "completed"
        self.gw._finish("responses", 200, call.started)
        thought, answer = split.finish()
        shaped = ToolAnswer(call.tools)  # function calls out of the answer (parsed or forced), else all text
        text, calls = shaped.push("".join(answers) + answer)
        tail, more = shaped.finish()
        text, calls = text + tail, calls + more
        thought = "".join(thoughts) + thought
        output = ([self._reasoning_item(call, thought)] if thought else []) \
            + ([self._message_item(call, done, text, self._logprobs(entries))] if text.strip() or not calls else []) \
            + [call_item(c) for c in calls]
        response = self._object(call, done, finished, output, split.total(finished.completion_tokens))
        self._keep(call, response)
        return JSONResponse(response, headers={"X-Request-Id": call.request.request_id})

    def _keep(self, call: _Response, answer: dict[str, Any]) -> None:
        """A response to store (`call.stored`): its object, its input items, and the conversation with this answer
        (its text as an assistant turn, its calls and its reasoning on it)."""
        if not call.stored or self.store is None:
            return
        said: list[Message] = []
        thought: str | None = None
        for item in answer["output"]:
            if item["type"] == "reasoning":
                thought = "".join(p["text"] for p in item["content"]) or None
            elif item["type"] == "message":
                text = "".join(p["text"] for p in item["content"])
                said.append(Message(role="assistant", content=[ContentPart(type="text", text=text)], reasoning=thought))
            elif item["type"] == "function_call":
                made = MessageToolCall(id=item["call_id"], function=FunctionCall(name=item["name"],
                                                                                 arguments=item["arguments"]))
                if said:
                    said[-1].tool_calls = [*(said[-1].tool_calls or []), made]
                else:
                    said.append(Message(role="assistant", content=[], tool_calls=[made], reasoning=thought))
        given = call.body.input
        items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": given}]}] \
            if isinstance(given, str) else given
        items = [{**i, "id": i.get("id") or f"msg_{uuid.uuid4().hex}"} if isinstance(i, dict) else i for i in items]
        grown = call.kept_bytes + len(json.dumps(answer["output"]))
        if not self.store.put(call.request.request_id, StoredResponse(answer, items, [*call.conversation, *said], grown)):
            log.warning("response %s not stored: larger than --responses-store-memory", call.request.request_id)

    def _stored(self, response_id: str) -> StoredResponse | PipelineError:
        stored = self.store.get(response_id) if self.store is not None else None
        if stored is not None:
            return stored
        why = "" if self.store is not None else " (this server keeps none: --responses-store-memory)"
        return PipelineError(f"Response with id '{response_id}' not found{why}", http_status=404, grpc_code=5,
                             kind="not_found_error", param="response_id")

    async def retrieve(self, request: Request) -> Response:
        """`GET /v1/responses/{id}`: a stored response as it was answered."""
        stored = self._stored(request.path_params["response_id"])
        return error_json(stored) if isinstance(stored, PipelineError) else JSONResponse(stored.response)

    async def delete(self, request: Request) -> Response:
        """`DELETE /v1/responses/{id}`: forget it."""
        response_id = request.path_params["response_id"]
        if self.store is None or not self.store.delete(response_id):
            return error_json(cast(PipelineError, self._stored(response_id)))
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def input_items(self, request: Request) -> Response:
        """`GET /v1/responses/{id}/input_items` (`order` desc by default, `limit` 1-100, `after` an item id)."""
        stored = self._stored(request.path_params["response_id"])
        if isinstance(stored, PipelineError):
            return error_json(stored)
        q = request.query_params
        order, after = q.get("order", "desc"), q.get("after")
        try:
            limit = int(q.get("limit", "20"))
        except ValueError:
            limit = 0
        if order not in ("asc", "desc") or not 1 <= limit <= 100:
            return error_json(invalid_request("order must be asc or desc and limit a whole number in [1, 100]",
                                              "order" if order not in ("asc", "desc") else "limit"))
        items = stored.input_items if order == "asc" else stored.input_items[::-1]
        if after is not None:
            at = next((k for k, i in enumerate(items) if i.get("id") == after), None)
            if at is None:
                return error_json(invalid_request(f"after: no input item {after!r} in this response", "after"))
            items = items[at + 1:]
        page = items[:limit]
        return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})

    def _event(self, call: _Response, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": call.next_sequence(), **fields}
        return f"event: {kind}\n".encode() + sse(data)

    async def _stream(self, call: _Response, first: Indexed, state: StreamState) -> AsyncIterator[bytes]:
        status = 499  # client closed, unless the stream gets to its end
        split = ThoughtTokens(self._split(call))  # also counts the reasoning tokens
        out = _StreamedOutput(self, call)
        try:
            yield self._event(call, "response.created", response=self._object(call, "in_progress", None, []))
            yield self._event(call, "response.in_progress", response=self._object(call, "in_progress", None, []))
            if call.request.reasoning_end is None and not out.shaping:  # plain text to come: the message at once
                for event in out.open_message():
                    yield event
            finished = None
            async for _, ev in chain(first, state.events):
                self.gw._observe(call, ev)
                if isinstance(ev, Finished):
                    finished = ev
                    break
                if isinstance(ev, TextDelta) and ev.text:
                    piece = split.push(ev.text, ev.usage)
                    for event in out.push(piece, ev.logprobs if split.in_answer else ()):  # a thought's stay out
                        yield event
            if finished is None:
                raise internal_error(RuntimeError("the pipeline ended without a Finished event"))
            done = "incomplete" if finished.finish_reason == "length" else "completed"
            for event in out.finish(split.finish(), done):
                yield event
            answer = self._object(call, done, finished, out.items, split.total(finished.completion_tokens))
            self._keep(call, answer)
            yield self._event(call, f"response.{done}", response=answer)
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


class _StreamedOutput:
    """A streamed response's output items, in the order they open: the reasoning (--reasoning-parser) first, then
    the message and the function calls as the answer gives them. The message opens at once for plain text; with
    tools (`shaping`) at the answer's first text that is not blank, so an answer that is only calls has none.
    `items` holds each closed item at its output index (what `response.completed` carries)."""

    def __init__(self, routes: ResponsesRoutes, call: _Response) -> None:
        self.routes, self.call = routes, call
        self.shaping = call.tools.parse or call.tools.forced is not None
        self.tools = ToolAnswer(call.tools)
        self.items: list[dict[str, Any]] = []
        self.thoughts: list[str] = []
        self.reasoning_open = False
        self.text: list[str] = []
        self.message: dict[str, Any] | None = None  # the open message's item_id / output_index / content_index
        self.blank = ""  # blank answer text held while no message is open (with tools there may be none)
        self.entries: list[stage_pb2.TokenLogprob] = []  # the answer's tokens' logprobs (when asked), all of them
        self.unsent: list[stage_pb2.TokenLogprob] = []  # of those, the ones no text delta carried yet

    def _event(self, kind: str, **fields: Any) -> bytes:
        return self.routes._event(self.call, kind, **fields)

    def push(self, piece: tuple[str, str], entries: Sequence[stage_pb2.TokenLogprob] = ()) -> list[bytes]:
        """One delta's (reasoning, answer) as events; `entries`: the answer's tokens' logprobs in it (they go with
        the next text delta)."""
        self.entries.extend(entries)
        self.unsent.extend(entries)
        thought, answer = piece
        out = self._thought(thought) if thought else []
        content, calls = self.tools.push(answer) if answer else ("", [])
        return out + self._content(content) + [e for c in calls for e in self._call(c)]

    def finish(self, piece: tuple[str, str], done: str) -> list[bytes]:
        """The split's and the tool parser's tails, then every open item closed."""
        out = self.push(piece)
        content, calls = self.tools.finish()
        out += self._content(content) + [e for c in calls for e in self._call(c)]
        if self.message is None and not self.tools.calls:  # no answer text and no call: the message still comes, empty
            out += self._content(self.blank, force=True)
        out += self._close_reasoning()
        if self.message is not None:
            where, whole = self.message, "".join(self.text)
            item = self.routes._message_item(self.call, done, whole, self.routes._logprobs(self.entries))
            out += [self._event("response.output_text.done", **where, text=whole,
                                logprobs=item["content"][0]["logprobs"]),
                    self._event("response.content_part.done", **where, part=item["content"][0]),
                    self._event("response.output_item.done", output_index=where["output_index"], item=item)]
            self.items[where["output_index"]] = item
        return out

    def open_message(self) -> list[bytes]:
        out = self._close_reasoning()
        self.message = {"item_id": self.call.item_id, "output_index": len(self.items), "content_index": 0}
        self.items.append({})  # filled when it closes
        return out + [self._event("response.output_item.added", output_index=self.message["output_index"], item={
                          "type": "message", "id": self.call.item_id, "status": "in_progress", "role": "assistant",
                          "content": []}),
                      self._event("response.content_part.added", **self.message,
                                  part={"type": "output_text", "text": "", "annotations": []})]

    def _content(self, content: str, force: bool = False) -> list[bytes]:
        if self.message is None and not force:
            if not content or (self.shaping and not (self.blank + content).strip()):
                self.blank += content
                return []
        content, self.blank = self.blank + content, ""
        out = self.open_message() if self.message is None else []
        if content:
            self.text.append(content)
            carried, self.unsent = self.unsent, []
            out.append(self._event("response.output_text.delta", **self.message, delta=content,  # type: ignore[arg-type]
                                   logprobs=self.routes._logprobs(carried)))
        return out

    def _thought(self, thought: str) -> list[bytes]:
        where = {"item_id": self.call.reasoning_id, "output_index": 0, "content_index": 0}
        out = []
        if not self.reasoning_open and not self.thoughts:  # its item first (output 0, before everything else)
            self.reasoning_open = True
            self.items.append({})
            out = [self._event("response.output_item.added", output_index=0, item={
                       "type": "reasoning", "id": self.call.reasoning_id, "summary": [], "status": "in_progress",
                       "content": []}),
                   self._event("response.content_part.added", **where, part={"type": "reasoning_text", "text": ""})]
        self.thoughts.append(thought)
        return out + [self._event("response.reasoning_text.delta", **where, delta=thought)]

    def _close_reasoning(self) -> list[bytes]:
        if not self.reasoning_open:
            return []
        self.reasoning_open = False
        thought = "".join(self.thoughts)
        where = {"item_id": self.call.reasoning_id, "output_index": 0, "content_index": 0}
        item = self.routes._reasoning_item(self.call, thought)
        self.items[0] = item
        return [self._event("response.reasoning_text.done", **where, text=thought),
                self._event("response.content_part.done", **where, part={"type": "reasoning_text", "text": thought}),
                self._event("response.output_item.done", output_index=0, item=item)]

    def _call(self, made: ToolCall) -> list[bytes]:
        """One finished call as its item's events (its arguments in one delta: the block closed whole)."""
        out = self._close_reasoning()
        item, index = call_item(made), len(self.items)
        self.items.append(item)
        where = {"item_id": item["id"], "output_index": index}
        return out + [self._event("response.output_item.added", output_index=index,
                                  item={**item, "arguments": "", "status": "in_progress"}),
                      self._event("response.function_call_arguments.delta", **where, delta=made.arguments),
                      self._event("response.function_call_arguments.done", **where, arguments=made.arguments),
                      self._event("response.output_item.done", output_index=index, item=item)]


def _thought_only(m: Message) -> bool:
    """An assistant turn that has its reasoning and nothing else yet."""
    return m.role == "assistant" and m.reasoning is not None and not m.content and not m.tool_calls


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
