"""OpenAI's `POST /v1/audio/speech` (text to speech) on an omni model: the thinker says the input, the talker
and vocoder speak it.

Data flow: JSON body (`model`, `input` up to 4096 characters, `voice`, `response_format`, `instructions`,
`speed`, `stream_format`) -> one chat: a system turn asking to say the user's text word for word (the
`instructions` added to it) and the text as the user turn, audio out in `voice` -> the thinker held to
exactly that text by a structured output (choice of one string: services/llm/structured_output.py), so
what the talker reads is the input whatever the weights would rather say -> the pipeline's audio ->
the file in `response_format` (mp3 by default, as OpenAI's; wav, flac, opus, aac, or OpenAI's `pcm`:
raw 24 kHz mono 16-bit little-endian). pcm, mp3, aac and opus stream as they are made (chunked; the
compressed ones encoded delta by delta, gateway/audio_file_stream.py); wav and flac, whose headers name their
length, come whole at the end. `stream_format` "sse" sends `speech.audio.delta` events (base64 of the
format's bytes, as the raw body would carry them) and a `speech.audio.done` event with the usage
(input_tokens: the prompt's; output_tokens: the text tokens spoken). `speed` (OpenAI's, 0.25 to 4) plays the
model's audio faster or slower at the same pitch (gateway/audio_tempo.py), streamed or whole. The thinker's max_tokens leave room for the whole input (`_sized`: its bytes + the
stop, within max_model_len; the stage default would cut a long one). The response's `X-Request-Id` names the request (`speech-<id>`) in every stage.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from gateway.audio_encoding import OutputAudioFormat, encode_audio, pcm16_bytes
from gateway.audio_file_stream import STREAMED_FORMATS, AudioFileStream
from gateway.audio_tempo import MAX_SPEED, MIN_SPEED, Tempo
from gateway.choices import Indexed
from gateway.events import (AudioDelta, ChatMessage, ChatRequest, Finished, PipelineError, SamplingOverrides, TextPart,
                            check_request_id)
from gateway.http_errors import internal_error
from gateway.media import invalid_request
from gateway.openai_schema import (StrictBody, error_response, parse_json_object, resolve_model, resolve_voice,
                                   validate_body, why_no_voices)
from gateway.sse import DONE, StreamState, chain, run_to_end, sse
from gateway.structured_request import require_llguidance

if TYPE_CHECKING:
    from gateway.prompt import PromptBuilder
    from gateway.rest import Answer, RestGateway

log = logging.getLogger(__name__)
MAX_INPUT_CHARS = 4096  # OpenAI's limit
SYSTEM = "You are a text-to-speech voice. Say the user's text exactly as written, word for word, and nothing else."
SpeechFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]
_ENCODING: dict[str, OutputAudioFormat] = {"mp3": "mp3", "opus": "opus", "aac": "aac", "flac": "flac", "wav": "wav",
                                           "pcm": "pcm16"}
WHOLE_FORMATS = ("wav", "flac")  # their headers name their length: encoded whole at the end
MEDIA_TYPES = {"mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac", "flac": "audio/flac", "wav": "audio/wav",
               "pcm": "audio/pcm"}


class SpeechRequest(StrictBody):
    model: str | None = None
    input: str
    voice: str | None = None  # None: the pipeline's default voice
    response_format: SpeechFormat = "mp3"
    instructions: str | None = Field(default=None, max_length=MAX_INPUT_CHARS)
    speed: float = 1.0
    stream_format: Literal["audio", "sse"] = "audio"


@dataclass(slots=True)
class _Speech:
    request: ChatRequest
    text: str  # the input to say
    fmt: SpeechFormat
    sse: bool
    started: float
    sample_rate: int
    speed: float = 1.0
    first_text: bool = False
    first_audio: bool = False
    pcm: list[np.ndarray] = field(default_factory=list)  # wav / flac: the answer's audio so far, at `speed`
    tempo: Tempo | None = None  # made with the first audio (its sample rate)
    file: AudioFileStream | None = None  # mp3, aac, opus: the file as it is encoded (`_stream`)


class SpeechRoutes:
    """`POST /v1/audio/speech` on one `RestGateway` (its pipeline, model names, metrics, error shape)."""

    def __init__(self, gw: RestGateway, builder: PromptBuilder | None = None) -> None:
        self.gw, self.builder = gw, builder  # the prompt builder sizes max_tokens (without one: the input's bytes)

    async def voices(self, request: Request) -> Response:
        """`GET /v1/audio/voices` (as Kokoro-FastAPI and other OpenAI-style speech servers answer it): the voices
        `voice` may name and the default one; none, with the reason, on a server that speaks no audio."""
        pipeline = self.gw.pipeline
        body: dict[str, object] = {"voices": list(pipeline.voices), "default": pipeline.default_voice or None}
        if not pipeline.voices:
            body["reason"] = why_no_voices(pipeline)
        self.gw._finish("voices", 200, time.perf_counter())
        return JSONResponse(body)

    async def speech(self, request: Request) -> Response:
        from gateway.rest import Answer  # rest imports this module to route it

        async def prepare(raw: bytes, client_id: str | None, started: float) -> Answer:
            body = await asyncio.to_thread(lambda: validate_body(SpeechRequest, parse_json_object(raw)))  # off the loop
            call = self.build(body, client_id, started)
            call.request = await asyncio.to_thread(self._sized, call.request, call.text)
            streamed = call.sse or call.fmt not in WHOLE_FORMATS
            return Answer(call.request.request_id, (call.request,), streamed,
                          lambda first, events: self._complete(call, first, events),
                          lambda first, state: self._stream(call, first, state),
                          "text/event-stream" if call.sse else MEDIA_TYPES[call.fmt])

        return await self.gw.answer("speech", request, prepare)

    def build(self, body: SpeechRequest, client_id: str | None, started: float) -> _Speech:
        gw = self.gw
        model = resolve_model(body.model, gw.served_model_names)
        if not body.input.strip():
            raise invalid_request("input: there is no text to speak", "input")
        if len(body.input) > MAX_INPUT_CHARS:
            raise invalid_request(f"input: at most {MAX_INPUT_CHARS} characters, got {len(body.input)}", "input")
        if not MIN_SPEED <= body.speed <= MAX_SPEED:
            raise invalid_request(f"speed: must be in [{MIN_SPEED}, {MAX_SPEED}] (1: the model's own pace), got "
                                  f"{body.speed}", "speed")
        voice = resolve_voice(body.voice, gw.pipeline, "voice")
        require_llguidance("input")  # the thinker is held to the input by a structured output
        suffix = check_request_id(client_id, "X-Request-Id") if client_id else uuid.uuid4().hex
        system = SYSTEM if not body.instructions else f"{SYSTEM} How to speak: {body.instructions}"
        pipeline_model = model if model in gw.pipeline.served_models else gw.pipeline.served_models[0]
        chat = ChatRequest(request_id=f"speech-{suffix}", model=pipeline_model, modalities=("text", "audio"),
                           messages=(ChatMessage("system", (TextPart(system),)),
                                     ChatMessage("user", (TextPart(body.input),))),
                           voice=voice, sampling=SamplingOverrides(temperature=0.0),
                           structured=("choice", json.dumps([body.input])))
        return _Speech(chat, body.input, body.response_format, body.stream_format == "sse", started,
                       gw.pipeline.sample_rate, body.speed)

    def _sized(self, chat: ChatRequest, text: str) -> ChatRequest:
        """The thinker's max_tokens: room for the input however the grammar lets it be tokenized (a token is at
        least one byte) and the stop, within max_model_len (the stage default, 1024, would cut a long input);
        an input whose own tokens do not fit is a 400."""
        want = len(text.encode("utf-8")) + 1
        if self.builder is not None:
            room = self.builder.max_model_len - int(self.builder.encode(chat).numel())
            tokenizer = self.builder.processor.tokenizer
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            added = tokenizer.added_tokens_decoder
            if marks := sorted({tokenizer.convert_ids_to_tokens(i) for i in ids if i in added}):
                raise invalid_request(f"input: {', '.join(marks)} is the model's own control token, which it cannot "
                                      "say as text (the thinker is held to the input); remove or spell it "
                                      "differently", "input")
            own = len(ids) + 1
            if own > room:
                raise invalid_request(f"input: its {own - 1} tokens do not fit this model's maximum context length "
                                      f"(max_model_len {self.builder.max_model_len}) after the prompt; send a shorter "
                                      "text", "input")
            want = min(want, room)
        return replace(chat, sampling=replace(chat.sampling, max_tokens=want))

    async def _complete(self, call: _Speech, first: Indexed, events: AsyncIterator[Indexed]) -> Response:
        await run_to_end(first, events, lambda ev: self._take(call, ev))
        data = await asyncio.to_thread(encode_audio, self._wave(call), call.sample_rate, _ENCODING[call.fmt])
        self.gw._finish("speech", 200, call.started)
        return Response(data, media_type=MEDIA_TYPES[call.fmt], headers={"X-Request-Id": call.request.request_id})

    async def _stream(self, call: _Speech, first: Indexed, state: StreamState) -> AsyncIterator[bytes]:
        status = 499  # client closed, unless the stream gets to its end
        try:
            finished = None
            async for _, ev in chain(first, state.events):
                new = self._take(call, ev)
                if new is not None and new.size and (data := await self._encoded(call, new)):
                    yield sse(_delta(data)) if call.sse else data
                if isinstance(ev, Finished):
                    finished = ev
                    break
            if finished is None:
                raise internal_error(RuntimeError("the pipeline ended without a Finished event"))
            if call.fmt in STREAMED_FORMATS:  # the encoder's and muxer's last bytes
                if data := await asyncio.to_thread(self._file(call).finish):
                    yield sse(_delta(data)) if call.sse else data
            elif call.sse and call.fmt in WHOLE_FORMATS:  # their length comes first: whole at the end
                data = await asyncio.to_thread(encode_audio, self._wave(call), call.sample_rate, _ENCODING[call.fmt])
                yield sse(_delta(data))
            if call.sse:
                usage = {"input_tokens": finished.prompt_tokens, "output_tokens": finished.completion_tokens,
                         "total_tokens": finished.prompt_tokens + finished.completion_tokens}
                yield sse({"type": "speech.audio.done", "usage": usage})
                yield DONE
            status = 200
        except PipelineError as e:
            status = e.http_status
            if call.sse:  # a raw audio stream has no room for an error: it just ends short
                yield sse(error_response(e).model_dump(mode="json"))
                yield DONE
        except Exception as e:
            log.exception("speech stream failed")
            status = 500
            if call.sse:
                yield sse(error_response(internal_error(e)).model_dump(mode="json"))
                yield DONE
        finally:
            if call.file is not None:
                call.file.close()  # a stream cut short: the muxer let go (a finished one: nothing left to do)
            state.settle(status)
            await state.close_events()

    async def _encoded(self, call: _Speech, new: np.ndarray) -> bytes:
        """New samples of a streamed answer -> its next bytes: raw pcm, or the file's (mp3, aac, opus) as the
        encoder makes them (off the event loop); b"" for formats sent whole at the end."""
        if call.fmt == "pcm":
            return pcm16_bytes(new)
        if call.fmt in STREAMED_FORMATS:
            return await asyncio.to_thread(self._file(call).push, new)
        return b""

    @staticmethod
    def _file(call: _Speech) -> AudioFileStream:
        if call.file is None:
            call.file = AudioFileStream(call.fmt, call.sample_rate)
        return call.file

    def _take(self, call: _Speech, ev: object) -> np.ndarray | None:
        """An event of the answer; its audio at `speed` (the filter's tail with the Finished event), returned
        (None: no audio in this event) and kept in `call.pcm` for the formats sent whole at the end."""
        self.gw._observe(call, ev)  # type: ignore[arg-type]
        if isinstance(ev, AudioDelta):
            if call.tempo is None:
                call.sample_rate, call.tempo = ev.sample_rate, Tempo(call.speed, ev.sample_rate)
            new = call.tempo.push(ev.pcm)
        elif isinstance(ev, Finished) and call.tempo is not None:
            new = call.tempo.finish()
        else:
            return None
        if call.fmt in WHOLE_FORMATS:  # the streamed ones are sent as they come: nothing to keep
            call.pcm.append(new)
        return new

    @staticmethod
    def _wave(call: _Speech) -> np.ndarray:
        return np.concatenate(call.pcm) if call.pcm else np.zeros(0, np.float32)


def _delta(data: bytes) -> dict[str, str]:
    return {"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}

