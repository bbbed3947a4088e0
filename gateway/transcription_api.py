"""OpenAI's `POST /v1/audio/transcriptions` and `/v1/audio/translations` on the thinker (speech in, text out).

Data flow: multipart form (size-capped as every body: `file` an audio file: WAV, MP3, FLAC, Ogg, M4A, WebM, ... `model`, optional `language`,
`prompt`, `response_format` json | text, `temperature`, vLLM's `max_completion_tokens`) -> one user message [the audio, an instruction
("Transcribe the audio into text." / "Translate the audio into English text.", with the language and the
prompt as hints)] -> the same pipeline a text-only chat runs (greedy unless `temperature` says otherwise,
the thinker's own stop) -> `{"text", "usage"}` (json) or the bare text (text); a reasoning model's thought
(--reasoning-parser) left out. A chat completion with that
message gives the same text (the e2e test checks it). Formats that need timestamps (srt, vtt,
verbose_json), `timestamp_granularities[]` and `stream` are 400s naming the field: the model gives none.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.datastructures import FormData, UploadFile

from gateway.events import (ChatMessage, ChatRequest, Finished, Pipeline, PipelineError, SamplingOverrides, TextDelta,
                            TextPart)
from gateway.http_errors import error_json, internal_error, read_body
from gateway.media import invalid_request
from gateway.openai_schema import check_sampling, resolve_model
from gateway.reasoning import END, AnswerSplit, ReasoningParser, thinks

if TYPE_CHECKING:
    from gateway.rest import RestGateway

Task = Literal["transcribe", "translate"]
NEEDS_TIMESTAMPS = ("srt", "vtt", "verbose_json")
MAX_FIELDS = 16


def instruction(task: Task, language: str | None, prompt: str | None) -> str:
    """What the thinker is asked: a plain instruction after the audio, with the client's hints."""
    text = ("Transcribe the audio into text." if task == "transcribe" else "Translate the audio into English text.")
    if language:
        text = f"The audio is in the language with ISO-639-1 code '{language}'. " + text
    if prompt:
        text += f" Context (names and spellings to follow): {prompt}"
    return text


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


class TranscriptionRoutes:
    """The two handlers on one `RestGateway` (its pipeline, media loader, model names and metrics)."""

    def __init__(self, gw: RestGateway) -> None:
        self.gw = gw

    async def transcriptions(self, request: Request) -> Response:
        return await self._handle(request, "transcribe")

    async def translations(self, request: Request) -> Response:
        return await self._handle(request, "translate")

    async def _handle(self, request: Request, task: Task) -> Response:
        endpoint = "transcriptions" if task == "transcribe" else "translations"
        started = time.perf_counter()
        try:
            response = await self._run(request, task)
        except PipelineError as e:
            self.gw._finish(endpoint, e.http_status, started)
            return error_json(e)
        except Exception as e:  # a bug: say so, keep serving
            self.gw._finish(endpoint, 500, started)
            return error_json(internal_error(e))
        self.gw._finish(endpoint, 200, started)
        return response

    async def _form(self, request: Request) -> FormData:
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise invalid_request("the body must be multipart/form-data with the audio in `file` (as OpenAI's SDK "
                                  "sends it)")
        body = await read_body(request, self.gw.loader.limits.max_request_bytes)

        async def replay() -> dict:
            return {"type": "http.request", "body": body, "more_body": False}

        try:
            return await Request(request.scope, replay).form(max_files=1, max_fields=MAX_FIELDS)
        except Exception as e:  # python-multipart / Starlette: a malformed or over-limit form
            raise invalid_request(f"the multipart form does not parse: {getattr(e, 'detail', e)}") from None

    async def _run(self, request: Request, task: Task) -> Response:
        form = await self._form(request)
        for name in ("stream", "timestamp_granularities[]", "timestamp_granularities"):
            if form.get(name) not in (None, "", "false"):
                raise invalid_request(f"{name}: not supported (the model gives no timestamps, and this endpoint "
                                      "answers in one piece; /v1/chat/completions streams)", name)
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
        sampling = SamplingOverrides(temperature=_temperature(_field(form, "temperature")),
                                     max_tokens=_max_tokens(_field(form, "max_completion_tokens")))
        check_sampling(sampling, "")
        self.gw.loader.check_counts(["audio"])  # --limit-mm-per-prompt audio=0 refuses this route too
        audio = await self.gw.loader.audio_from_bytes(await upload.read(), "file")
        self.gw.loader.check_audio_seconds(audio.waveform.size / audio.sample_rate)
        ask = instruction(task, _field(form, "language"), _field(form, "prompt"))
        pipeline_model = model if model in self.gw.pipeline.served_models else self.gw.pipeline.served_models[0]
        chat = text_request(f"trsc-{uuid.uuid4().hex}", pipeline_model, (ChatMessage("user", (audio, TextPart(ask))),),
                            sampling, self.gw.reasoning)
        text, done = await collect_text(self.gw.pipeline, chat, self.gw.reasoning)
        if fmt == "text":
            return PlainTextResponse(text)
        return JSONResponse({"text": text, "usage": {"type": "tokens", "input_tokens": done.prompt_tokens,
                                                     "output_tokens": done.completion_tokens,
                                                     "total_tokens": done.prompt_tokens + done.completion_tokens}})


def text_request(request_id: str, model: str, messages: tuple[ChatMessage, ...], sampling: SamplingOverrides,
                 reasoning: ReasoningParser | None) -> ChatRequest:
    """A text-only chat whose answer alone is wanted (a reasoning model thinks first: `collect_text` drops it)."""
    return ChatRequest(request_id=request_id, model=model, modalities=("text",), messages=messages, sampling=sampling,
                       reasoning_end=END if thinks(reasoning, {}, audio_out=False) else None)


async def collect_text(pipeline: Pipeline, chat: ChatRequest,
                       reasoning: ReasoningParser | None = None) -> tuple[str, Finished]:
    """A text-only run's whole answer and its end (the Realtime API's input transcriptions use it too); a reasoning
    model's thought (--reasoning-parser) left out."""
    parts: list[str] = []
    events = aiter(pipeline.run(chat))
    try:
        async for ev in events:
            if isinstance(ev, TextDelta):
                parts.append(ev.text)
            elif isinstance(ev, Finished):
                split = AnswerSplit(reasoning, chat.reasoning_end is not None, include=False)
                return split.whole("".join(parts))[1], ev
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()  # the pipeline cancels the request in the stages if it is still running
    raise internal_error(RuntimeError("the pipeline ended without a Finished event"))
