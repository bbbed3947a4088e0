"""OpenAI's `POST /v1/audio/transcriptions` and `/v1/audio/translations` on the thinker (speech in, text out).

Data flow: multipart form (size-capped as every body: `file` an audio file: WAV, MP3, FLAC, Ogg, M4A, WebM, ... `model`, optional `language`,
`prompt`, `response_format` json | text, `temperature`, vLLM's `max_completion_tokens`) -> one user message [the audio, an instruction
("Transcribe the audio into text." / "Translate the audio into English text.", with the language and the
prompt as hints)] -> the same pipeline a text-only chat runs (greedy unless `temperature` says otherwise,
the thinker's own stop) -> `{"text", "usage"}` (json) or the bare text (text); a reasoning model's thought
(--reasoning-parser) left out. A chat completion with that
message gives the same text (the e2e test checks it). With `stream=true` the answer comes as it is
written, in OpenAI's events: `transcript.text.delta` (`delta`: the new text) per piece, then
`transcript.text.done` (the whole `text` and the `usage`), then `data: [DONE]` (vLLM streams translations
too; so does omnimesh, with the same events). `include[]=logprobs` (json only) adds each answer token's
`{token, logprob, bytes}`: `logprobs` on the answer, on each delta and on the done event. Formats that need timestamps (srt, vtt, verbose_json) and
`timestamp_granularities[]` are 400s naming the field: the model gives none. The route runs through
`RestGateway.answer`, as the chat does (the running gauge, a client's X-Request-Id, tracing).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.datastructures import FormData, UploadFile

from gateway.choices import Indexed, close_events
from gateway.events import (AudioPart, ChatMessage, ChatRequest, Finished, Pipeline, SamplingOverrides, TextDelta,
                            TextPart, check_request_id)
from gateway.http_errors import internal_error
from gateway.languages import language_name
from gateway.media import invalid_request
from gateway.openai_schema import check_sampling, choice_logprobs, resolve_model
from gateway.sse import DONE, StreamState, chain, guarded, run_to_end, sse
from gateway.reasoning import END, AnswerSplit, ReasoningParser, ThoughtTokens, thinks

if TYPE_CHECKING:
    from gateway.rest import RestGateway

Task = Literal["transcribe", "translate"]
NEEDS_TIMESTAMPS = ("srt", "vtt", "verbose_json")
MAX_FIELDS = 16


def instruction(task: Task, language: str | None, prompt: str | None) -> str:
    """What the thinker is asked: a plain instruction after the audio, with the client's hints."""
    text = ("Transcribe the audio into text." if task == "transcribe" else "Translate the audio into English text.")
    if language:  # checked by the caller (`check_language`)
        text = f"The audio is in {language_name(language)}. " + text
    if prompt:
        text += f" Context (names and spellings to follow): {prompt}"
    return text


def check_language(language: str | None) -> str | None:
    """The form's `language`, or a 400 naming what it should be."""
    if language:
        try:
            language_name(language)
        except ValueError as exc:
            raise invalid_request(f"language: {exc}", "language") from None
    return language


def _field(form: FormData, name: str) -> str | None:
    value = form.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise invalid_request(f"{name}: must be a form field, not a file", name)
    return value


def _temperature(text: str | None) -> float:
    if text is None or text == "":
        return 0.0  # OpenAI's default for transcriptions
    try:
        value = float(text)
    except ValueError:
        raise invalid_request(f"temperature: {text!r} is not a number", "temperature") from None
    if not 0.0 <= value <= 1.0:
        raise invalid_request(f"temperature: must be in [0, 1] for transcriptions, got {value:g}", "temperature")
    return value


def _max_tokens(text: str | None) -> int | None:
    """vLLM's `max_completion_tokens` form field; None: the thinker's own limit."""
    if text is None or text == "":
        return None
    if not text.isdigit() or int(text) < 1:
        raise invalid_request(f"max_completion_tokens: must be a whole number >= 1, got {text!r}", "max_completion_tokens")
    return int(text)


def _flag(text: str | None, name: str) -> bool:
    """A boolean form field as the SDKs send one (true / false; absent: false)."""
    if text is None or text.lower() in ("", "false", "0"):
        return False
    if text.lower() in ("true", "1"):
        return True
    raise invalid_request(f"{name}: must be true or false, got {text!r}", name)


@dataclass(slots=True)
class _Transcription:
    """One transcription in flight: what the response needs besides the events (`Timed` for the metrics)."""

    request: ChatRequest
    fmt: str  # json | text
    stream: bool  # server-sent events: transcript.text.delta ..., transcript.text.done
    started: float
    split: ThoughtTokens  # a reasoning model's thought left out (--reasoning-parser)
    logprobs: list[dict[str, Any]] | None  # include=logprobs: the answer's tokens' so far; None: not asked
    as_ids: bool = False  # --return-tokens-as-token-ids
    text: list[str] = field(default_factory=list)  # the answer so far
    first_text: bool = False
    first_audio: bool = False

    def take(self, ev: object) -> tuple[str, list[dict[str, Any]]]:
        """The answer's text an event adds ('' for none; a Finished flushes what the split held back) and, when
        asked, its tokens' logprobs (a thought's stay out, as the Responses API leaves them)."""
        entries: list[dict[str, Any]] = []
        if isinstance(ev, TextDelta):
            piece = self.split.push(ev.text, ev.usage)[1]
            if self.logprobs is not None and self.split.in_answer:
                content = choice_logprobs(ev.logprobs, as_ids=self.as_ids).content or []
                entries = [e.model_dump(mode="json", exclude={"top_logprobs"}) for e in content]
                self.logprobs.extend(entries)
        elif isinstance(ev, Finished):
            piece = self.split.finish()[1]
        else:
            return "", entries
        self.text.append(piece)
        return piece, entries

    def usage(self, done: Finished) -> dict[str, object]:
        return token_usage(done)


def token_usage(done: Finished) -> dict[str, object]:
    """A transcription's usage as OpenAI gives it (the endpoint's and the Realtime API's)."""
    return {"type": "tokens", "input_tokens": done.prompt_tokens, "output_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens}


class TranscriptionRoutes:
    """The two handlers on one `RestGateway` (its pipeline, media loader, model names and metrics)."""

    def __init__(self, gw: RestGateway) -> None:
        self.gw = gw

    async def transcriptions(self, request: Request) -> Response:
        return await self._handle(request, "transcribe")

    async def translations(self, request: Request) -> Response:
        return await self._handle(request, "translate")

    async def _handle(self, request: Request, task: Task) -> Response:
        from gateway.rest import Answer  # rest imports this module to route it

        endpoint = "transcriptions" if task == "transcribe" else "translations"

        async def prepare(raw: bytes, client_id: str | None, started: float) -> Answer:
            call = await self._prepare(request, raw, task, client_id, started)
            return Answer(call.request.request_id, (call.request,), call.stream,
                          lambda first, events: self._complete(call, endpoint, first, events),
                          lambda first, state: guarded(self._stream(call, first, state), state, "transcription"))

        return await self.gw.answer(endpoint, request, prepare)

    async def _form(self, request: Request, body: bytes) -> FormData:
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise invalid_request("the body must be multipart/form-data with the audio in `file` (as OpenAI's SDK "
                                  "sends it)")

        async def replay() -> dict:
            return {"type": "http.request", "body": body, "more_body": False}

        try:
            return await Request(request.scope, replay).form(max_files=1, max_fields=MAX_FIELDS)
        except Exception as e:  # python-multipart / Starlette: a malformed or over-limit form
            raise invalid_request(f"the multipart form does not parse: {getattr(e, 'detail', e)}") from None

    async def _prepare(self, request: Request, raw: bytes, task: Task, client_id: str | None,
                       started: float) -> _Transcription:
        form = await self._form(request, raw)
        for name in ("timestamp_granularities[]", "timestamp_granularities"):
            if form.get(name) not in (None, ""):
                raise invalid_request(f"{name}: not supported (the model gives no timestamps)", name)
        stream = _flag(_field(form, "stream"), "stream")
        include = [v for name in ("include[]", "include") for v in form.getlist(name)]
        for value in include:
            if value != "logprobs":
                raise invalid_request(f"include: {value!r} is not something a transcription can include "
                                      "(logprobs is)", "include")
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise invalid_request("file: the audio file (WAV, MP3, FLAC, ...) is required", "file")
        model = resolve_model(_field(form, "model"), self.gw.served_model_names)
        fmt = _field(form, "response_format") or "json"
        if fmt in NEEDS_TIMESTAMPS:
            raise invalid_request(f"response_format: {fmt} needs timestamps, which this model does not give; "
                                  "use json or text", "response_format")
        if fmt not in ("json", "text"):
            raise invalid_request(f"response_format: {fmt!r} is not one of json, text", "response_format")
        if include and fmt != "json":
            raise invalid_request(f"include: logprobs come with response_format json, not {fmt}", "include")
        sampling = SamplingOverrides(temperature=_temperature(_field(form, "temperature")),
                                     max_tokens=_max_tokens(_field(form, "max_completion_tokens")),
                                     logprobs=0 if include else None)
        check_sampling(sampling, "", self.gw.max_logprobs)
        self.gw.loader.check_counts(["audio"], "file")  # --limit-mm-per-prompt audio=0 refuses this route too
        audio = await self.gw.loader.audio_from_bytes(await upload.read(), "file")
        self.gw.loader.check_audio_seconds(audio.waveform.size / audio.sample_rate, "file")
        pipeline_model = model if model in self.gw.pipeline.served_models else self.gw.pipeline.served_models[0]
        suffix = check_request_id(client_id, "X-Request-Id") if client_id else uuid.uuid4().hex
        chat = transcription_request(pipeline_model, audio, self.gw.reasoning, task=task,
                                     language=check_language(_field(form, "language")), prompt=_field(form, "prompt"),
                                     sampling=sampling, request_id=f"trsc-{suffix}", media_param="file")
        split = ThoughtTokens(AnswerSplit(self.gw.reasoning, chat.reasoning_end is not None, include=False))
        return _Transcription(chat, fmt, stream, started, split, [] if include else None, self.gw.tokens_as_ids)

    def _take(self, call: _Transcription, ev: object) -> tuple[str, list[dict[str, Any]]]:
        self.gw._observe(call, ev)  # type: ignore[arg-type]
        return call.take(ev)

    async def _complete(self, call: _Transcription, endpoint: str, first: Indexed,
                        events: AsyncIterator[Indexed]) -> Response:
        done = await run_to_end(first, events, lambda ev: self._take(call, ev))
        self.gw._finish(endpoint, 200, call.started)
        headers = {"X-Request-Id": call.request.request_id}
        text = "".join(call.text)
        if call.fmt == "text":
            return PlainTextResponse(text, headers=headers)
        logprobs = {} if call.logprobs is None else {"logprobs": call.logprobs}
        return JSONResponse({"text": text, **logprobs, "usage": call.usage(done)}, headers=headers)

    async def _stream(self, call: _Transcription, first: Indexed, state: StreamState) -> AsyncIterator[bytes]:
        """OpenAI's transcription events: `transcript.text.delta` per piece of the answer, then
        `transcript.text.done` with the whole text and the usage (`guarded`: an error midway is an error event)."""
        async for _, ev in chain(first, state.events):
            piece, entries = self._take(call, ev)
            asked = call.logprobs is not None
            if piece or entries:
                yield sse({"type": "transcript.text.delta", "delta": piece, **({"logprobs": entries} if asked else {})})
            if isinstance(ev, Finished):
                logprobs = {"logprobs": call.logprobs} if asked else {}
                yield sse({"type": "transcript.text.done", "text": "".join(call.text), **logprobs,
                           "usage": call.usage(ev)})
                yield DONE
                return
        raise internal_error(RuntimeError("the pipeline ended without a Finished event"))


def transcription_request(model: str, audio: AudioPart, reasoning: ReasoningParser | None, *,
                          task: Task = "transcribe", language: str | None = None, prompt: str | None = None,
                          sampling: SamplingOverrides = SamplingOverrides(temperature=0.0),
                          request_id: str | None = None, media_param: str = "messages") -> ChatRequest:
    """The chat every transcription runs (this route, the Realtime API's input transcriptions, vLLM's realtime
    dialect): one user message, the clip then the instruction with the client's hints; text only, greedy unless
    `sampling` says otherwise. `media_param` names the clip's field in errors about it."""
    ask = instruction(task, language, prompt)
    chat = text_request(request_id or f"trsc-{uuid.uuid4().hex}", model,
                        (ChatMessage("user", (audio, TextPart(ask))),), sampling, reasoning)
    return replace(chat, media_param=media_param)


def text_request(request_id: str, model: str, messages: tuple[ChatMessage, ...], sampling: SamplingOverrides,
                 reasoning: ReasoningParser | None) -> ChatRequest:
    """A text-only chat whose answer alone is wanted (a reasoning model thinks first: `collect_text` drops it)."""
    return ChatRequest(request_id=request_id, model=model, modalities=("text",), messages=messages, sampling=sampling,
                       reasoning_end=END if thinks(reasoning, {}, audio_out=False) else None)


async def collect_text(pipeline: Pipeline, chat: ChatRequest, reasoning: ReasoningParser | None = None,
                       on_piece: Callable[[str], Awaitable[None]] | None = None) -> tuple[str, Finished]:
    """A text-only run's whole answer and its end (the Realtime API's input transcriptions use it too); a reasoning
    model's thought (--reasoning-parser) left out. `on_piece` gets each piece of the answer as it comes."""
    parts: list[str] = []
    split = AnswerSplit(reasoning, chat.reasoning_end is not None, include=False)
    events = aiter(pipeline.run(chat))
    try:
        async for ev in events:
            if isinstance(ev, (TextDelta, Finished)):
                piece = split.push(ev.text)[1] if isinstance(ev, TextDelta) else split.finish()[1]
                parts.append(piece)
                if piece and on_piece is not None:
                    await on_piece(piece)
            if isinstance(ev, Finished):
                return "".join(parts), ev
    finally:
        await close_events(events)  # the pipeline cancels the request in the stages if it is still running
    raise internal_error(RuntimeError("the pipeline ended without a Finished event"))
