"""vLLM's `POST /tokenize` and `POST /detokenize`, on the gateway's own tokenizer and chat template.

Data flow of /tokenize: body -> `TokenizeRequest` (strict: `messages` as in a chat completion, media
included, with the chat's template fields, or a plain `prompt`; exactly one) -> messages: the same
`ChatRequest` -> `PromptBuilder.encode`
as a chat would build (chat template, --chat-template when given, and every audio / image placeholder
expanded, so `count` is the chat's `usage.prompt_tokens`); prompt: the tokenizer alone ->
`{"count", "max_model_len", "tokens", "token_strs"}`. /detokenize: `{"tokens": [...]}` -> `{"prompt"}`;
an id outside the vocabulary is a 400 naming its index. The tokenizer runs off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import model_validator

from gateway.events import ChatRequest, PipelineError
from gateway.http_errors import error_json, internal_error, read_body
from gateway.media import invalid_request
from gateway.media_budget import mark_arrival
from gateway.input_limits import InputLimits
from gateway.openai_schema import (MMProcessorKwargs, Message, StrictBody, TemplateFields, ToolDef, check_turns,
                                    parse_json_object,
                                    resolve_model, validate_body)
from gateway.prompt import PromptBuilder

if TYPE_CHECKING:
    from gateway.rest import RestGateway

log = logging.getLogger(__name__)


class TokenizeRequest(TemplateFields):  # the template fields: messages only, as the chat's
    model: str | None = None
    messages: list[Message] | None = None
    prompt: str | None = None
    add_special_tokens: bool | None = None  # default: False for messages (the template has them), True for a prompt
    return_token_strs: bool = False
    mm_processor_kwargs: MMProcessorKwargs | None = None  # messages only: as the chat's (use_audio_in_video)
    tools: list[ToolDef] | None = None  # messages only: rendered as the chat renders them (vLLM's)

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give exactly one of messages (a chat, tokenized as the chat would be) or prompt (text)")
        if self.messages is not None and self.add_special_tokens:
            raise ValueError("add_special_tokens applies to prompt only: messages are tokenized exactly as a chat "
                             "completion's prompt (the template places the special tokens)")
        return self


class DetokenizeRequest(StrictBody):
    model: str | None = None
    tokens: list[int]


def parse_tokenize(raw: bytes, limits: InputLimits | None = None) -> TokenizeRequest:
    obj = parse_json_object(raw)
    check_turns(obj.get("messages"), limits, "messages")
    return validate_body(TokenizeRequest, obj)


def parse_detokenize(raw: bytes) -> DetokenizeRequest:
    return validate_body(DetokenizeRequest, parse_json_object(raw))


def tokenize_prompt(builder: PromptBuilder, prompt: str, add_special_tokens: bool) -> list[int]:
    return list(builder.processor.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])


def token_strs(builder: PromptBuilder, ids: list[int]) -> list[str]:
    return [str(t) for t in builder.processor.tokenizer.convert_ids_to_tokens(ids)]


def detokenize(builder: PromptBuilder, ids: list[int]) -> str:
    tokenizer = builder.processor.tokenizer
    size = len(tokenizer)
    for i, t in enumerate(ids):
        if not 0 <= t < size:
            raise invalid_request(f"tokens[{i}]: {t} is not a token id of this model (0 to {size - 1})", f"tokens[{i}]")
    return str(tokenizer.decode(ids))


class TokenizeRoutes:
    """The two handlers, on one `RestGateway` (its media loader, model names, metrics and error shape)."""

    def __init__(self, gw: RestGateway, builder: PromptBuilder) -> None:
        self.gw, self.builder = gw, builder

    async def tokenize(self, request: Request) -> Response:
        return await self._handle("tokenize", request, self._tokenize)

    async def detokenize(self, request: Request) -> Response:
        return await self._handle("detokenize", request, self._detokenize)

    async def _handle(self, endpoint: str, request: Request,
                      fn: Callable[[bytes], Awaitable[dict[str, Any]]]) -> Response:
        started = time.perf_counter()
        mark_arrival()  # its place in the media budget's line (gateway/media_budget.py)
        try:
            body = await fn(await read_body(request, self.gw.loader.limits.max_request_bytes))
        except PipelineError as e:
            self.gw._finish(endpoint, e.http_status, started)
            return error_json(e)
        except Exception as e:  # a bug: say so, keep serving
            log.exception("%s failed", endpoint)
            self.gw._finish(endpoint, 500, started)
            return error_json(internal_error(e))
        self.gw._finish(endpoint, 200, started)
        return JSONResponse(body)

    async def _tokenize(self, raw: bytes) -> dict[str, Any]:
        req = await asyncio.to_thread(parse_tokenize, raw, self.gw.loader.limits)
        resolve_model(req.model, self.gw.served_model_names)
        if req.messages is not None:
            mm = req.mm_processor_kwargs
            messages = await self.gw.chat_messages(req.messages, mm)
            chat = ChatRequest(request_id="tokenize", model=self.gw.served_model_names[0], messages=messages,
                               processor_kwargs=tuple(sorted(mm.settings().items())) if mm is not None else (),
                               tools=tuple(t.model_dump(exclude_none=True) for t in req.tools or ()),
                               template=req.template(req.messages, audio_out=False))
            async with self.gw.pipeline.building(chat):  # the media budget (gateway/media_budget.py)
                ids = (await asyncio.to_thread(self.builder.encode, chat)).tolist()
        else:
            ids = await asyncio.to_thread(tokenize_prompt, self.builder, req.prompt or "",
                                          req.add_special_tokens is not False)
        strs = token_strs(self.builder, ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.builder.max_model_len, "tokens": ids, "token_strs": strs}

    async def _detokenize(self, raw: bytes) -> dict[str, Any]:
        req = parse_detokenize(raw)
        resolve_model(req.model, self.gw.served_model_names)
        return {"prompt": await asyncio.to_thread(detokenize, self.builder, req.tokens)}
