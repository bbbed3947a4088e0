"""OpenAI's Realtime API on a WebSocket (`/v1/realtime`): a spoken conversation with the omni model, turn by turn.

Data flow: the client's JSON events on one WebSocket -> `RealtimeSession` keeps the session settings and the
conversation (items: user audio / text, system text, assistant transcripts) -> `response.create` turns the
conversation into a `ChatRequest` (the session's `instructions` as the system turn, each audio item an
`AudioPart` at its input format's rate) and runs it through the pipeline -> the answer streams back as Realtime
events: `response.created`, `response.output_item.added`, `conversation.item.created`,
`response.content_part.added`, `response.audio_transcript.delta` / `response.audio.delta` (base64, in the
session's output format: pcm16 at the pipeline's 24 kHz, or G.711 at 8 kHz, gateway/realtime_audio.py) — or
`response.text.delta` for a text-only response — their `.done` events and `response.done` with the usage.
The assistant's transcript joins the conversation for the next turn. A reasoning model's thought
(--reasoning-parser, gateway/reasoning.py) is not said: only its answer is sent and remembered, and its responses
are text only.

Supported client events (the settings they may change: gateway/realtime_settings.py): `session.update`, `input_audio_buffer.append` / `.commit` / `.clear`,
`conversation.item.create` (message items: `input_text`, `input_audio` (base64, the input format),
`input_image` (user items: a data URI, decoded off the event loop, counted against the input limits) and an
assistant's `text`; placed after `previous_item_id`), `conversation.item.delete`, `conversation.item.truncate`
(the transcript cut in proportion to the audio played), `response.create` (its `response` may set modalities,
instructions, voice, temperature, max_output_tokens; `conversation: "none"` keeps it out of the conversation and
`input` gives it its own context), `response.cancel`. Events are JSON in text frames (a binary frame is an
error event). `?intent=transcription` (OpenAI's live-caption URL) opens a GA transcription session. A client
whose first session.update names the model at the top level speaks vLLM's own dialect (streaming speech to
text: gateway/realtime_vllm.py). Turns are the client's by default (`turn_detection` null:
commit, then response.create); with `turn_detection: {"type": "server_vad", ...}` Silero VAD
(gateway/realtime_vad.py, run off the event loop) cuts the appended audio into turns: `input_audio_buffer.speech_started` (a response
in progress is cancelled, with `interrupt_response`), `.speech_stopped`, the turn committed and, with
`create_response`, answered. `input_audio_transcription` transcribes each committed clip beside the
response (`conversation.item.input_audio_transcription.delta` as it is written, then `.completed`). Function calling (gateway/realtime_tools.py):
`tools` / `tool_choice`, `function_call` items out, `function_call_output` items in. Audio formats, each way:
`pcm16` (24 kHz), `g711_ulaw` and `g711_alaw` (8 kHz, as telephone lines carry them).
Every problem is an `error` event (invalid_request_error, with the client's
`event_id`); the socket stays open. A conversation holds at most what one REST request may carry (the input
limits' max_audio_seconds, max_messages items, max_request_bytes characters of text; past them
`conversation_too_large`), --max-realtime-sessions bounds the sessions open at once (429 on the
handshake) and --max-realtime-session-duration how long each stays open (the session's `expires_at`; then a
response in progress is cancelled, an error event with code `session_expired`, and the WebSocket closed); at a
shutdown the response in progress finishes first (`shut`; the handshake and the drain: gateway/realtime_routes.py).
One response at a time (another `response.create` meanwhile is an error).
With `--api-key`, the handshake needs `Authorization: Bearer <key>` (gateway/auth.py).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from fastapi import WebSocket, WebSocketDisconnect

from gateway import realtime_ga as ga
from gateway.audio_tempo import Tempo
from gateway.realtime_audio import RATES, AudioFormatError, OutputEncoder, decode
from gateway.events import (AudioDelta, AudioPart, ChatMessage, ChatRequest, Finished, ImagePart, PipelineError,
                            SamplingOverrides, TextDelta, TextPart)
from gateway.media import MIN_AUDIO_SAMPLES, TARGET_SAMPLE_RATE
from gateway.media_budget import mark_arrival
from gateway.structured_request import require_llguidance
from gateway.openai_schema import check_sampling, resolve_voice
from gateway.reasoning import END, AnswerSplit, thinks
from gateway.realtime_settings import (RealtimeError, RealtimeSettings, check_max_tokens, check_modalities,
                                       check_temperature, truncation_json, updated)
from gateway.realtime_tasks import spawn
from gateway.prompt import ImageTokens
from gateway.realtime_tools import CallItem, OutputItem, chat_messages, new_call_item, parse_call_item
from gateway.realtime_truncation import fitted_run
from gateway.realtime_vllm import VllmTranscriber, speaks_vllm
from gateway.realtime_vad import ServerVAD, Started, Stopped
from gateway.responses_tools import responses_tool_plan
from gateway.tool_calls import ToolAnswer, ToolPlan
from gateway.transcription_api import collect_text, token_usage, transcription_request
from services.llm.structured_output import grammar_for
from omnimesh import json_text

if TYPE_CHECKING:
    from gateway.rest import RestGateway

log = logging.getLogger(__name__)
MAX_EVENT_BYTES = 16 * 2**20  # one client event (an audio chunk is far smaller)
MAX_ITEM_ID = 32  # a client's own conversation item id, as OpenAI bounds it


@dataclass
class _Item:
    id: str
    role: str  # user | system | assistant
    parts: list[TextPart | AudioPart | ImagePart]
    transcript: str | None = None  # its audio's, once input_audio_transcription made it
    audio_samples: int = 0  # an assistant item: the samples of speech it sent (conversation.item.truncate)
    audio_rate: int = 24_000

    def to_json(self) -> dict[str, Any]:
        content = [{"type": "input_audio", "transcript": self.transcript} if isinstance(p, AudioPart)
                   else {"type": "input_image"} if isinstance(p, ImagePart)  # its pixels are not sent back
                   else {"type": "input_text" if self.role != "assistant" else "text", "text": p.text}
                   for p in self.parts]
        return {"id": self.id, "object": "realtime.item", "type": "message", "status": "completed", "role": self.role,
                "content": content}


def item_chars(item: _Item | CallItem | OutputItem) -> int:
    """The text one conversation item holds, in characters."""
    if isinstance(item, CallItem):
        return len(item.call.name) + len(item.call.arguments)
    if isinstance(item, OutputItem):
        return len(item.output)
    return sum(len(p.text) for p in item.parts if isinstance(p, TextPart)) + len(item.transcript or "")


# a failed response's error code by its HTTP status (REST's 429 / 503 / 504): whether a retry may help
FAILURE_CODES = {429: "rate_limit_exceeded", 503: "service_unavailable", 504: "response_timeout"}
CANCEL_WAIT_S = 10.0  # the longest a response.cancel holds the next event back for the response's response.done


class _Ended(Exception):
    """The session ends: it reached --max-realtime-session-duration, or the server is shutting down."""


@dataclass
class RealtimeSession:
    gw: RestGateway
    ws: WebSocket
    model: str
    id: str = field(default_factory=lambda: f"sess_{uuid.uuid4().hex}")
    settings: RealtimeSettings = field(default_factory=RealtimeSettings)
    items: list[_Item | CallItem | OutputItem] = field(default_factory=list)  # the conversation, in order
    buffer: list[np.ndarray] = field(default_factory=list)  # appended input audio not committed yet
    response: asyncio.Task | None = None
    send_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    vad: ServerVAD | None = None  # with turn_detection server_vad: it cuts the appended audio into turns
    turn_id: str = ""  # the item the turn in progress will become (server_vad)
    side_tasks: set[asyncio.Task] = field(default_factory=set)  # input transcriptions in flight
    ga: bool = False  # the GA interface (a session.update said "type": "realtime"): gateway/realtime_ga.py
    transcription: bool = False  # a GA transcription session ("type": "transcription"): no responses
    vllm: VllmTranscriber | None = None  # a client speaking vLLM's realtime dialect (gateway/realtime_vllm.py)
    max_duration: float | None = None  # seconds the session may stay open (--max-realtime-session-duration)
    opened: float = field(default_factory=time.time)  # when it was accepted (epoch seconds)
    shutdown_by: float | None = None  # the server is shutting down: what runs finishes by then (loop clock)
    _waiting: asyncio.Timeout | None = None  # the wait for the client's next message, while it waits
    cancel_reason: str = "client_cancelled"  # why the response in progress is cancelled (its status_details)

    # ------------------------------------------------------------------------------------ plumbing
    async def send(self, kind: str, **fields: Any) -> None:
        """One event to the client (in a GA session: its GA names and shapes, gateway/realtime_ga.py)."""
        in_conversation = not fields.pop("_out_of_band", False)  # an out-of-band item: not the conversation's
        out = ga.events(kind, fields, in_conversation) if self.ga else [(kind, fields)]
        async with self.send_lock:
            for name, body in out:
                await self.ws.send_text(json.dumps({"type": name, "event_id": f"event_{uuid.uuid4().hex}", **body}))

    async def send_raw(self, event: dict[str, Any]) -> None:
        """One event exactly as given (vLLM's dialect: gateway/realtime_vllm.py)."""
        async with self.send_lock:
            await self.ws.send_text(json.dumps(event))

    async def error(self, message: str, param: str | None, code: str, event_id: str | None,
                    kind: str = "invalid_request_error") -> None:
        if self.vllm is not None:  # vLLM's error event
            await self.send_raw({"type": "error", "error": message, "code": code})
            return
        await self.send("error", error={"type": kind, "code": code, "message": message, "param": param,
                                        "event_id": event_id})

    @property
    def input_rate(self) -> int:
        """The sample rate of the session's input audio (its input_audio_format's)."""
        return RATES[self.settings.input_audio_format]

    def _audio(self, data: Any, where: str) -> np.ndarray:
        """Base64 audio in the session's input format -> float32 samples at `input_rate`."""
        try:
            return decode(data, self.settings.input_audio_format, where)
        except AudioFormatError as e:
            raise RealtimeError(str(e), where) from None

    def _clip(self, wave: np.ndarray, where: str, param: str | None, code: str = "invalid_value") -> np.ndarray:
        """A clip the conversation keeps (a commit, an item's input_audio): long enough for one feature window,
        as REST's and gRPC's audio (shorter, it failed each response and transcription that read it)."""
        if wave.size * TARGET_SAMPLE_RATE < MIN_AUDIO_SAMPLES * self.input_rate:
            raise RealtimeError(f"{where} holds {1000 * wave.size / self.input_rate:.1f} ms of audio; at least "
                                f"{1000 * MIN_AUDIO_SAMPLES / TARGET_SAMPLE_RATE:g} ms is needed (one feature window)",
                                param, code)
        return wave

    def session_json(self) -> dict[str, Any]:
        s = self.settings
        beta = {"id": self.id, "object": "realtime.session", "model": self.model, "modalities": list(s.modalities),
                "instructions": s.instructions, "voice": s.voice or self.gw.pipeline.default_voice,
                "input_audio_format": s.input_audio_format, "output_audio_format": s.output_audio_format,
                "input_audio_transcription": s.input_audio_transcription,
                "turn_detection": s.turn_detection, "tools": list(s.tools), "tool_choice": s.tool_choice,
                "temperature": s.temperature if s.temperature is not None else 0.8, "speed": s.speed,
                "max_response_output_tokens": s.max_response_output_tokens or "inf",
                "truncation": truncation_json(s.truncation),
                "expires_at": None if self.max_duration is None else int(self.opened + self.max_duration)}
        return ga.session_object(beta, self.transcription) if self.ga else beta

    async def _receive(self, deadline: float | None) -> Any:
        """The client's next message; `_Ended` at the session's end (`deadline`, on the loop's clock) or when the
        server shuts down (`shut`)."""
        if self.shutdown_by is not None:
            raise _Ended
        try:
            async with asyncio.timeout_at(deadline) as self._waiting:  # a queue read: nothing is half-received
                return await self.ws.receive()
        except TimeoutError:
            raise _Ended from None
        finally:
            self._waiting = None

    def shut(self, by: float) -> None:
        """The server is shutting down: the session ends after the event in hand, letting the response and
        transcriptions in progress finish by `by` (the loop's clock)."""
        self.shutdown_by = by
        if self._waiting is not None:
            self._waiting.reschedule(asyncio.get_running_loop().time())  # wake the wait for the next event

    def _runs(self) -> list[asyncio.Task]:
        """The response and the input transcriptions still running."""
        return [t for t in [self.response, *self.side_tasks] if t is not None and not t.done()]

    async def _cancel_runs(self) -> None:
        for task in self._runs():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

    async def _end(self) -> None:
        """The session's end. At its maximum duration its runs are cancelled (a response's events end with
        response.done, cancelled); at a shutdown they may finish first, within the grace. Then the client is told
        why and the socket closed: 1000 when expired, 1012 (service restart: connect again) at a shutdown."""
        runs = self._runs()
        loop = asyncio.get_running_loop()
        if runs and self.shutdown_by is not None and self.shutdown_by > loop.time():
            await asyncio.wait(runs, timeout=self.shutdown_by - loop.time())
        self.cancel_reason = "server_shutting_down" if self.shutdown_by is not None else "session_expired"
        await self._cancel_runs()
        if self.shutdown_by is not None:
            log.info("realtime session %s: closed, the server is shutting down", self.id)
            message, code, kind = ("the server is shutting down: open a new session to go on (another replica, or "
                                   "this server once it is back)", "server_shutting_down", "server_error")
            close, reason = 1012, "server shutting down"
        else:
            assert self.max_duration is not None
            log.info("realtime session %s: closed at its maximum duration (%gs)", self.id, self.max_duration)
            minutes = self.max_duration / 60
            span = f"{minutes:g} minutes" if minutes == int(minutes) else f"{self.max_duration:g} seconds"
            message, code, kind = (f"this session hit its maximum duration of {span} "
                                   "(--max-realtime-session-duration); open a new session to go on",
                                   "session_expired", "invalid_request_error")
            close, reason = 1000, "session expired"
        with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):  # the client left meanwhile
            await self.error(message, None, code, None, kind=kind)
            await self.ws.close(code=close, reason=reason)

    async def run(self) -> None:
        await self.send("session.created", session=self.session_json())
        deadline = None
        if self.max_duration is not None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.max_duration - (time.time() - self.opened)
        try:
            while True:
                message = await self._receive(deadline)  # between events: an event in hand is handled whole
                if message["type"] == "websocket.disconnect":
                    raise WebSocketDisconnect(message.get("code", 1000), message.get("reason"))
                raw = message.get("text")
                event_id = None
                try:
                    if raw is None:  # a binary frame: receive_text would die on it and drop the connection
                        raise RealtimeError("events are JSON in text frames; a binary frame is not read (send audio "
                                            "base64 in input_audio_buffer.append)", None, "invalid_event")
                    if len(raw) > MAX_EVENT_BYTES:
                        raise RealtimeError(f"an event is at most {MAX_EVENT_BYTES} bytes; send audio in smaller "
                                            "chunks", None, "event_too_large")
                    event = json_text.loads(raw)  # nesting too deep, a lone surrogate: JSONDecodeErrors too
                    if not isinstance(event, dict) or not isinstance(event.get("type"), str):
                        raise RealtimeError("an event is a JSON object with a string 'type'", "type")
                    event_id = event.get("event_id")
                    if self.vllm is None and speaks_vllm(event) and not self.items and not self.buffer:
                        self.vllm = VllmTranscriber(self.gw, self.send_raw, self.side_tasks)  # vLLM's own dialect
                    await (self.vllm.handle(event) if self.vllm is not None else self.handle(event))
                except json.JSONDecodeError as e:
                    await self.error(f"not JSON: {e}", None, "invalid_json", None)
                except RealtimeError as e:
                    await self.error(e.message, e.param, e.code, event_id)
                except PipelineError as e:
                    await self.error(e.message, e.param, "invalid_value", event_id)
                except WebSocketDisconnect:
                    raise
                except Exception as e:  # a bug: an error event (as REST's 500) and the session stays open
                    log.exception("realtime session %s: the event %s failed", self.id, event_id)
                    await self.error(f"internal error: {type(e).__name__}: {e}", None, "internal_error", event_id,
                                     kind="server_error")
        except WebSocketDisconnect:
            pass
        except _Ended:
            await self._end()
        finally:
            await self._cancel_runs()  # the client went away: its runs stop in the stages

    # ---------------------------------------------------------------------------------- client events
    async def handle(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind == "session.update":
            session = event.get("session")
            session = {} if session is None else session
            if not isinstance(session, dict):
                raise RealtimeError("session must be an object", "session")
            transcription = ga.is_transcription(session) if "type" in session else self.transcription
            if transcription != self.transcription and (self.items or self.buffer):
                raise RealtimeError("a session becomes a transcription session (or stops being one) only before "
                                    "any audio or item", "session.type")
            self.ga = self.ga or ga.is_ga(session)  # the SDK's client.realtime (GA) from here on, refused or not
            fields = ga.session_fields(session) if self.ga else dict(session)
            if transcription and fields.get("input_audio_transcription",
                                            self.settings.input_audio_transcription) is None:
                fields["input_audio_transcription"] = {}  # a transcription session always transcribes
            heard = await self.update(fields)
            self.transcription = transcription  # a refused update changes no setting, the session's type included
            await self.send("session.updated", session=self.session_json())
            await self._turns(heard)
        elif kind == "input_audio_buffer.append":
            samples = self._audio(event.get("audio"), "audio")
            if self.vad is None:
                self.buffer.append(samples)
            else:
                await self._turns(await asyncio.to_thread(self.vad.push, samples))  # the model: ~2 ms a frame
            self._check_audio()
        elif kind == "input_audio_buffer.commit":
            turn = self.vad.flush() if self.vad is not None else None
            if turn is not None:
                self.buffer.append(turn)
            if not self.buffer:
                why = ("" if self.vad is None else ": server VAD heard no speech in the audio appended since the "
                       "last turn (it keeps only speech, and a commit ends the turn in progress)")
                raise RealtimeError(f"the input audio buffer is empty{why or ': append audio before committing'}",
                                    None, "input_audio_buffer_commit_empty")
            self._check_size(adding=1)  # refused: the buffer keeps its audio for a commit after a delete
            wave = np.concatenate(self.buffer)
            if turn is None:  # too short: the buffer keeps it for more audio (a VAD turn is longer than this)
                self._clip(wave, "the input audio buffer", None, "input_audio_buffer_commit_empty")
            self.buffer = []
            await self._commit(wave, f"item_{uuid.uuid4().hex}")
        elif kind == "input_audio_buffer.clear":
            self.buffer = []
            if self.vad is not None:
                self.vad.clear()
            await self.send("input_audio_buffer.cleared")
        elif kind == "conversation.item.create":
            raw = event.get("item")
            at = self._insert_at(event.get("previous_item_id"), raw.get("id") if isinstance(raw, dict) else None)
            item = await self._item(raw)  # checked where it goes first: a refused item decodes no picture
            self.items.insert(at, item)
            try:
                self._check_audio()
                self._check_images(self.items)
                self._check_size()
            except (RealtimeError, PipelineError):
                self.items.remove(item)  # refused: the conversation stays as it was
                raise
            previous = self.items[at - 1].id if at else None
            await self.send("conversation.item.created", previous_item_id=previous, item=item.to_json())
        elif kind == "conversation.item.truncate":
            await self._truncate(event)
        elif kind == "conversation.item.retrieve":
            await self.send("conversation.item.retrieved", item=self._find(event.get("item_id"), "item_id").to_json())
        elif kind == "conversation.item.delete":
            item_id = event.get("item_id")
            self.items.remove(self._find(item_id, "item_id"))
            await self.send("conversation.item.deleted", item_id=item_id)
        elif kind == "response.create":
            if self.transcription:
                raise RealtimeError("a transcription session only transcribes: it gives no responses", "type")
            if self.response is not None and not self.response.done():
                raise RealtimeError("a response is already in progress; cancel it or wait for response.done",
                                    None, "conversation_already_has_active_response")
            await self._start(ga.response_fields(event.get("response") or {}) if self.ga
                              else event.get("response") or {})
        elif kind == "response.cancel":
            if self.response is None or self.response.done():
                raise RealtimeError("no response is in progress", None, "response_cancel_not_active")
            self.cancel_reason = "client_cancelled"
            self.response.cancel()
            # its response.done goes out before the next event is read, as for a turn that cuts a response short:
            # a response.create right after the cancel then starts (it was refused as "already has an active one")
            await asyncio.wait({self.response}, timeout=CANCEL_WAIT_S)  # bounded: a stage slow to close
        else:
            raise RealtimeError(f"unknown event type {kind!r}", "type", "unknown_event")

    async def _truncate(self, event: dict[str, Any]) -> None:
        """`conversation.item.truncate`: the client played only `audio_end_ms` of an assistant item's speech (the
        user cut in). The conversation keeps the text it had heard: the transcript cut in proportion to the
        audio played (the talker gives no word timings, so this is an estimate to the character)."""
        item = next((i for i in self.items if i.id == event.get("item_id") and isinstance(i, _Item)), None)
        if item is None or item.role != "assistant":
            raise RealtimeError(f"no assistant item {event.get('item_id')!r}", "item_id", "item_not_found")
        index = event.get("content_index", 0)
        if index != 0 or isinstance(index, bool):  # an assistant item holds one part: its audio and transcript
            raise RealtimeError(f"content_index must be 0 (the item's audio part), got {index!r}", "content_index")
        end = event.get("audio_end_ms")
        total_ms = item.audio_samples * 1000 // item.audio_rate
        if not isinstance(end, int) or isinstance(end, bool) or not 0 <= end <= total_ms:
            raise RealtimeError(f"audio_end_ms must be a whole number in [0, {total_ms}] (the item's audio), got "
                                f"{end!r}", "audio_end_ms")
        if item.parts and total_ms:
            text = item.parts[0].text if isinstance(item.parts[0], TextPart) else ""
            kept = text[:round(len(text) * end / total_ms)]
            item.parts = [TextPart(kept)] if kept else []
        item.audio_samples = end * item.audio_rate // 1000
        await self.send("conversation.item.truncated", item_id=item.id, content_index=0, audio_end_ms=end)

    async def _start(self, overrides: dict[str, Any]) -> None:
        chat, modalities, tools = await self._chat(overrides)
        in_conversation = overrides.get("conversation", "auto") == "auto"  # "none": out of band
        metadata = overrides.get("metadata")
        self.response = asyncio.create_task(self._respond(chat, modalities, tools, in_conversation, metadata))

    async def _commit(self, wave: np.ndarray, item_id: str) -> None:
        """A user turn of audio joins the conversation."""
        previous = self.items[-1].id if self.items else None
        item = _Item(item_id, "user", [AudioPart(wave, self.input_rate)])
        self.items.append(item)
        await self.send("input_audio_buffer.committed", previous_item_id=previous, item_id=item.id)
        await self.send("conversation.item.created", previous_item_id=previous, item=item.to_json())
        if self.settings.input_audio_transcription is not None:
            spawn(self._transcribe(item, wave, self.settings.input_audio_transcription), self.side_tasks,
                  "input transcription")

    async def _transcribe(self, item: _Item, wave: np.ndarray, how: dict[str, Any]) -> None:
        """`input_audio_transcription`: the thinker transcribes the clip (as /v1/audio/transcriptions does, greedy)
        beside the response; the text comes as it is written (`.delta` events), then whole (`.completed`) and in
        the item."""
        chat = transcription_request(self.gw.pipeline.served_models[0], AudioPart(wave, self.input_rate),
                                     self.gw.reasoning, language=how.get("language"), prompt=how.get("prompt"))
        where = {"item_id": item.id, "content_index": 0}

        async def delta(piece: str) -> None:
            await self.send("conversation.item.input_audio_transcription.delta", **where, delta=piece)

        try:
            text, done = await collect_text(self.gw.pipeline, chat, self.gw.reasoning, delta)
        except WebSocketDisconnect:  # the client left: nobody to tell (`spawn` drops it quietly)
            raise
        except Exception as e:  # noqa: BLE001  # said to the client whatever it was, never only logged
            if not isinstance(e, PipelineError):
                log.exception("realtime session %s: transcribing %s failed", self.id, item.id)
            message = e.message if isinstance(e, PipelineError) else f"internal error: {type(e).__name__}: {e}"
            await self.send("conversation.item.input_audio_transcription.failed", **where,
                            error={"type": "transcription_error", "code": "transcription_failed",
                                   "message": message, "param": None})
            return
        item.transcript = text
        await self.send("conversation.item.input_audio_transcription.completed", **where, transcript=text,
                        usage=token_usage(done))

    async def _turns(self, events: list[Started | Stopped]) -> None:
        """server_vad: speech started (a response in progress is cut short, with interrupt_response) / stopped
        (the turn is committed and, with create_response, answered)."""
        td = self.settings.turn_detection or {}
        for ev in events:
            if isinstance(ev, Started):
                self.turn_id = f"item_{uuid.uuid4().hex}"
                await self.send("input_audio_buffer.speech_started", audio_start_ms=ev.ms, item_id=self.turn_id)
                if td.get("interrupt_response", True) and self.response is not None and not self.response.done():
                    self.cancel_reason = "turn_detected"  # OpenAI's reason for a response cut by speech
                    self.response.cancel()
                    with contextlib.suppress(BaseException):
                        await self.response
            else:
                await self.send("input_audio_buffer.speech_stopped", audio_end_ms=ev.ms, item_id=self.turn_id)
                try:
                    self._check_size(adding=1, dropped="this turn's audio was not kept")
                except RealtimeError as e:  # the error alone: the detector goes on with the turns after it
                    await self.error(e.message, e.param, e.code, None)
                    continue
                await self._commit(ev.audio, self.turn_id)
                if (td.get("create_response", True) and not self.transcription
                        and (self.response is None or self.response.done())):
                    await self._start({})

    async def update(self, s: dict[str, Any]) -> list[Started | Stopped]:
        """`session.update`: what omnimesh can do is taken, the rest is an error naming it. Turning server_vad
        on runs the detector over the audio appended before: what it heard comes back."""
        new = updated(self.settings, s, self.gw.pipeline)
        if new.input_audio_format != self.settings.input_audio_format and (
                self.buffer or (self.vad is not None and self.vad.buffered_seconds)):
            raise RealtimeError("input_audio_format cannot change while the input audio buffer holds audio; commit or "
                                "clear it first", "session.input_audio_format")
        if "audio" in new.modalities:  # the output format must fit the model's rate (decimation by a whole factor)
            try:
                OutputEncoder(new.output_audio_format, self.gw.pipeline.sample_rate)
            except AudioFormatError as e:
                raise RealtimeError(str(e), "session.output_audio_format") from None
        # the tools and the tool choice must make a plan (the flags, a forced call with speech, ...)
        responses_tool_plan(list(new.tools), new.tool_choice, None, self.gw.auto_tool_choice, new.modalities, "session.")
        heard: list[Started | Stopped] = []
        rate = RATES[new.input_audio_format]
        if new.turn_detection != self.settings.turn_detection or (self.vad is not None and self.vad.rate != rate):
            td = new.turn_detection
            self.vad = None if td is None else await asyncio.to_thread(
                ServerVAD, td["threshold"], td["prefix_padding_ms"], td["silence_duration_ms"], rate)
            if self.vad is not None and self.buffer:  # audio appended before: the detector hears it first
                pending, self.buffer = self.buffer, []
                heard = await asyncio.to_thread(self.vad.push, np.concatenate(pending))
        self.settings = new
        return heard

    async def _item(self, raw: Any) -> _Item | CallItem | OutputItem:
        if isinstance(raw, dict) and raw.get("type") in ("function_call", "function_call_output"):
            return parse_call_item(raw, self.items)  # a call's result (gateway/realtime_tools.py)
        if not isinstance(raw, dict) or raw.get("type", "message") != "message":
            raise RealtimeError("item must be a message ({\"type\": \"message\", \"role\", \"content\"}), a "
                                "function_call or a function_call_output", "item")
        role = raw.get("role")
        if role not in ("user", "system", "assistant"):
            raise RealtimeError(f"item.role must be user, system or assistant, got {role!r}", "item.role")
        content = raw.get("content")
        if not isinstance(content, list) or not content:
            raise RealtimeError("item.content must be a non-empty list of parts", "item.content")
        parts: list[TextPart | AudioPart | ImagePart] = []
        tokens = self._image_tokens() if role == "user" else None  # the conversation's pictures' tokens so far
        for j, p in enumerate(content):
            where = f"item.content[{j}]"
            kind = p.get("type") if isinstance(p, dict) else None
            if kind in ("input_text", "text", "output_text") and isinstance(p.get("text"), str):
                parts.append(TextPart(p["text"]))
            elif kind == "input_audio" and role == "user":
                wave = self._audio(p.get("audio"), f"{where}.audio")
                parts.append(AudioPart(self._clip(wave, f"{where}.audio", f"{where}.audio"), self.input_rate))
            elif kind == "input_image" and role == "user":  # GA's: a data URI (or an allowed URL), decoded off the loop
                url = p.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url  # the chat's {"url": ...} shape too
                if not isinstance(url, str):
                    raise RealtimeError(f"{where}.image_url: an input_image part needs its image as a data URI "
                                        "string", f"{where}.image_url")
                admit = functools.partial(tokens.add, param=f"{where}.image_url") if tokens is not None else None
                parts.append(await self.gw.loader.image_from_url(url, f"{where}.image_url", admit))
            else:
                raise RealtimeError(f"{where}: a part is input_text / text with its text, or input_audio (user "
                                    "items) with base64 audio in the session's input_audio_format, or input_image "
                                    "(user items) with a data URI", where)
        return _Item(raw.get("id") or f"item_{uuid.uuid4().hex}", role, parts)

    def _find(self, item_id: Any, param: str) -> _Item | CallItem | OutputItem:
        """The conversation's item of that id, or the `item_not_found` error naming `param`."""
        found = next((i for i in self.items if i.id == item_id), None)
        if found is None:
            raise RealtimeError(f"no conversation item {item_id!r}", param, "item_not_found")
        return found

    def _insert_at(self, after: Any, given_id: Any) -> int:
        """Where conversation.item.create puts its item: after `previous_item_id` ("root": first; none: last),
        as OpenAI's; a client's own item id is at most 32 characters and not already in the conversation (one
        the server makes is new)."""
        if given_id is not None and (not isinstance(given_id, str) or not 0 < len(given_id) <= MAX_ITEM_ID):
            raise RealtimeError(f"item.id: a string of 1 to {MAX_ITEM_ID} characters (or leave it out)", "item.id")
        if given_id and any(i.id == given_id for i in self.items):
            raise RealtimeError(f"item.id: the conversation already has an item {given_id!r}", "item.id",
                                "item_id_exists")
        if after is None:
            return len(self.items)
        return 0 if after == "root" else self.items.index(self._find(after, "previous_item_id")) + 1

    def _image_tokens(self) -> ImageTokens | None:
        """The tokens of the conversation's pictures (each counted as the prompt builder would), to which a new
        picture's are added from its header before its pixels are decoded: the one that brings them to
        max_model_len is refused (a session keeps its pictures decoded for its life). None without a builder."""
        if self.gw.prompts is None or (tokens := self.gw.prompts.image_tokens()) is None:
            return None
        for item in self.items:
            for p in item.parts if isinstance(item, _Item) else ():
                if isinstance(p, ImagePart):
                    tokens.include(*p.image.size)  # type: ignore[attr-defined]
        return tokens

    def _check_images(self, items: list[Any]) -> None:
        """The images a response would read, against --limit-mm-per-prompt and max_media_items (a 400 as an error
        event). Audio turns are bounded by their seconds instead (`_check_audio`): a long call has many."""
        n = sum(isinstance(p, ImagePart) for i in items if isinstance(i, _Item) for p in i.parts)
        try:
            self.gw.loader.check_counts(["image"] * n)
        except PipelineError as e:
            raise RealtimeError(e.message.replace("request has", "the conversation has"), "item.content") from None

    def _check_audio(self) -> None:
        seconds = sum(p.waveform.size / p.sample_rate for i in self.items if isinstance(i, _Item) for p in i.parts
                      if isinstance(p, AudioPart))
        seconds += sum(b.size for b in self.buffer) / self.input_rate
        seconds += self.vad.buffered_seconds if self.vad is not None else 0.0
        limit = self.gw.loader.limits.max_audio_seconds
        if seconds > limit:
            self.buffer = []
            raise RealtimeError(f"the conversation's audio would be {seconds:.1f} s, over this server's "
                                f"max_audio_seconds of {limit:g} s; the buffer was cleared (delete older items)",
                                None, "audio_too_long")

    def _check_size(self, adding: int = 0, dropped: str = "") -> None:
        """The conversation against what one REST request may carry: at most `max_messages` items and
        `max_request_bytes` characters of text (messages, transcripts, calls and their outputs), so a long
        session cannot grow the gateway's memory without end. `adding`: items about to join. A response's own
        items may take it past the bounds by one answer; whatever is added next is refused until the client
        deletes older items (the refused item is not kept; `dropped` says what else was not)."""
        limits = self.gw.loader.limits
        count = len(self.items) + adding
        then = f"; {dropped}" if dropped else ""
        if count > limits.max_messages:
            raise RealtimeError(f"the conversation would hold {count} items, over this server's max_messages of "
                                f"{limits.max_messages}: delete older items (conversation.item.delete){then}",
                                None, "conversation_too_large")
        chars = sum(item_chars(i) for i in self.items)
        if chars > limits.max_request_bytes:
            raise RealtimeError(f"the conversation holds {chars} characters of text, over this server's "
                                f"max_request_bytes of {limits.max_request_bytes}: delete older items "
                                f"(conversation.item.delete){then}", None, "conversation_too_large")

    async def _chat(self, r: dict[str, Any]) -> tuple[ChatRequest, tuple[str, ...], ToolPlan]:
        """`response.create` -> the pipeline's request (the response's own settings over the session's)."""
        if not isinstance(r, dict):
            raise RealtimeError("response must be an object", "response")
        s = self.settings
        modalities = check_modalities(r["modalities"], "response.modalities") if "modalities" in r else s.modalities
        instructions = r.get("instructions", s.instructions)
        voice = resolve_voice(r["voice"], self.gw.pipeline, "response.voice") if "voice" in r else s.voice
        temperature = check_temperature(r["temperature"], "response.temperature") if "temperature" in r else s.temperature
        max_tokens = (check_max_tokens(r["max_output_tokens"], "response.max_output_tokens") if "max_output_tokens" in r
                      else s.max_response_output_tokens)
        if r.get("conversation", "auto") not in ("auto", "none"):
            raise RealtimeError("conversation must be \"auto\" (the answer joins the conversation) or \"none\" (out of "
                                "band)", "response.conversation")
        metadata = r.get("metadata")
        if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
                isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                for k, v in metadata.items())):
            raise RealtimeError("metadata must be an object of at most 16 string pairs", "response.metadata")
        if r.get("conversation", "auto") == "auto":
            self._check_size(adding=1)  # its answer joins the conversation
        items = await self._input(r["input"]) if "input" in r else self.items  # the response's own context, else ours
        if not any(i.role == "user" for i in items):
            raise RealtimeError("the conversation has no user item yet: commit audio or create a user item first",
                                None, "conversation_empty")
        messages = [ChatMessage("system", (TextPart(instructions),))] if instructions else []
        self._check_images(items)
        messages += chat_messages(items)
        sampling = SamplingOverrides(temperature=temperature, max_tokens=max_tokens)
        check_sampling(sampling, "response")
        own = "tools" in r or "tool_choice" in r  # the response's own tools, else the session's
        where = "response." if own else "session."
        tools = responses_tool_plan(r.get("tools", list(s.tools)), r.get("tool_choice", s.tool_choice), None,
                                    self.gw.auto_tool_choice, modalities, where)
        if tools.structured is not None:  # a forced call's schema, checked before response.created (as REST's 400)
            require_llguidance(f"{where}tool_choice")
            try:
                await asyncio.to_thread(grammar_for, *tools.structured)  # off the loop: a big schema takes a while
            except ValueError as e:
                raise RealtimeError(f"{where}tools: a parameters schema does not compile ({e})",
                                    f"{where}tools") from None
        want_audio = "audio" in modalities
        if want_audio:
            voice = voice or resolve_voice(None, self.gw.pipeline, "voice")
        thinking = thinks(self.gw.reasoning, {}, audio_out=want_audio)  # --reasoning-parser: the answer alone
        chat = ChatRequest(request_id=f"resp_{uuid.uuid4().hex}", model=self.gw.pipeline.served_models[0],
                           messages=tuple(messages), modalities=("text", "audio") if want_audio else ("text",),
                           voice=voice if want_audio else None, sampling=sampling, tools=tools.tools,
                           structured=tools.structured, reasoning_end=END if thinking else None,
                           spoken_calls=tools.parse and want_audio)
        return chat, modalities, tools

    async def _input(self, raw: Any) -> list[Any]:
        """A response's own `input`: items as conversation.item.create takes them, or `item_reference`s to the
        conversation's items by id."""
        if not isinstance(raw, list):
            raise RealtimeError("input must be a list of items", "response.input")
        out = []
        for j, entry in enumerate(raw):
            if isinstance(entry, dict) and entry.get("type") == "item_reference":
                out.append(self._find(entry.get("id"), f"response.input[{j}].id"))
            else:
                out.append(await self._item(entry))
        return out

    # ------------------------------------------------------------------------------------ responses
    async def _respond(self, chat: ChatRequest, modalities: tuple[str, ...], tools: ToolPlan,
                       in_conversation: bool = True, metadata: dict[str, str] | None = None) -> None:
        """One response's events; `in_conversation` False (conversation "none"): out of band, its items stay out of
        the conversation."""
        mark_arrival()  # this response's place in the media budget's line (its own task: not the session's)
        rid, item_id = chat.request_id, f"item_{uuid.uuid4().hex}"
        audio = "audio" in modalities
        where = {"response_id": rid, "item_id": item_id, "output_index": 0, "content_index": 0}
        base = {"id": rid, "object": "realtime.response", "modalities": list(modalities),
                "conversation_id": "auto" if in_conversation else None, "metadata": metadata}
        item = {"id": item_id, "object": "realtime.item", "type": "message", "role": "assistant", "content": []}
        text: list[str] = []
        said = AnswerSplit(self.gw.reasoning, chat.reasoning_end is not None, include=False)  # a thought stays unsaid
        shaped = ToolAnswer(tools)  # the calls out of the text (gateway/tool_calls.py), each its own item
        calls: list[CallItem] = []
        status, usage, reason, gone = "in_progress", None, None, False
        failure: dict[str, Any] | None = None  # a failed response's error: its status_details, its HTTP status
        http = 500
        started = time.perf_counter()
        encoder = OutputEncoder(self.settings.output_audio_format, self.gw.pipeline.sample_rate)  # this answer's
        tempo = Tempo(self.settings.speed if audio else 1.0, self.gw.pipeline.sample_rate)  # gateway/audio_tempo.py
        answer = _Item(item_id, "assistant", [])  # in the conversation from its created event on; its text
        # its text comes at the end (later items created meanwhile follow it); a prompt over the context is run again
        # without the conversation's oldest messages (the session's truncation: gateway/realtime_truncation.py)
        events = aiter(fitted_run(self.gw.pipeline, chat, self.settings.truncation))
        self.gw.metrics.running.inc()
        try:  # (a cancel may come at any await, these first sends included: the `finally` settles it all)
            await self.send("response.created", response={**base, "status": "in_progress", "output": []})
            await self.send("response.output_item.added", response_id=rid, output_index=0,
                            item={**item, "status": "in_progress"})
            if in_conversation:
                await self.send("conversation.item.created", previous_item_id=self.items[-1].id if self.items else None,
                                item={**item, "status": "in_progress"})
                self.items.append(answer)
            part = {"type": "audio", "transcript": ""} if audio else {"type": "text", "text": ""}
            await self.send("response.content_part.added", **where, part=part)
            async for ev in events:
                if isinstance(ev, TextDelta) and ev.text:
                    await self._answer_text(where, audio, chat.spoken_calls, shaped, calls, said.push(ev.text)[1],
                                            ev.spoken, text, in_conversation=in_conversation)
                elif isinstance(ev, AudioDelta) and audio and np.size(ev.pcm):
                    await self._answer_audio(where, answer, encoder, tempo.push(ev.pcm), ev.sample_rate)
                elif isinstance(ev, Finished):  # what was held back (a marker or a tag that might start)
                    if audio:  # atempo's and (G.711) the decimating filter's last samples
                        await self._answer_audio(where, answer, encoder, tempo.finish(), self.gw.pipeline.sample_rate)
                        if tail := encoder.flush():
                            await self.send("response.audio.delta", **where, delta=base64.b64encode(tail).decode())
                    await self._answer_text(where, audio, chat.spoken_calls, shaped, calls, said.finish()[1],
                                            False, text, end=True, in_conversation=in_conversation)
                    status = "incomplete" if ev.finish_reason == "length" else "completed"
                    reason = "max_output_tokens" if status == "incomplete" else None
                    usage = {"total_tokens": ev.prompt_tokens + ev.completion_tokens, "input_tokens": ev.prompt_tokens,
                             "output_tokens": ev.completion_tokens,
                             "input_token_details": {"cached_tokens": ev.cached_tokens}}
                    break
        except asyncio.CancelledError:
            status, reason = "cancelled", self.cancel_reason
        except WebSocketDisconnect:  # the client hung up mid-answer: a cancel, with no one left to tell
            status, gone = "cancelled", True
        except PipelineError as e:  # the client's, a full stage's, a deadline's: said as REST says them
            status, http = "failed", e.http_status
            code = FAILURE_CODES.get(e.http_status, "response_failed")
            failure = {"type": e.kind, "code": code, "message": e.message}
            await self.error(e.message, e.param, code, None, kind=e.kind)
        except Exception as e:  # a bug: say so, keep the session
            log.exception("realtime response %s failed", rid)
            status, message = "failed", f"internal error: {type(e).__name__}: {e}"
            failure = {"type": "server_error", "code": "server_error", "message": message}
            await self.error(message, None, "server_error", None, kind="server_error")
        finally:
            with contextlib.suppress(Exception):
                await events.aclose()  # type: ignore[attr-defined]  # the stages stop at once
            self.gw.metrics.running.dec()
            self.gw._finish("realtime", 200 if status in ("completed", "incomplete") else 499 if status == "cancelled"
                            else http, started)
        transcript = "".join(text)
        if transcript and status != "failed":  # the next turn hears what was said
            answer.parts = [TextPart(transcript)]
        else:
            self.items = [i for i in self.items if i is not answer]
        if not gone:
            with contextlib.suppress(WebSocketDisconnect):  # the client may hang up while its response closes
                await self._response_done(base, item, where, status, reason, usage, transcript, audio, calls,
                                          in_conversation, failure)

    async def _response_done(self, base: dict[str, Any], item: dict[str, Any], where: dict[str, Any], status: str,
                             reason: str | None, usage: dict[str, Any] | None, transcript: str, audio: bool,
                             calls: list[CallItem], in_conversation: bool, failure: dict[str, Any] | None = None
                             ) -> None:
        """A response's closing events: its content and item done (unless it failed), then `response.done` (a
        failed one's `status_details.error` says why, as OpenAI's: a client tells a full server from a bad
        request there)."""
        rid = base["id"]
        output = []
        if status in ("completed", "incomplete", "cancelled"):
            done_part = {"type": "audio", "transcript": transcript} if audio else {"type": "text", "text": transcript}
            if audio:
                await self.send("response.audio.done", **where)
                await self.send("response.audio_transcript.done", **where, transcript=transcript)
            else:
                await self.send("response.text.done", **where, text=transcript)
            await self.send("response.content_part.done", **where, part=done_part)
            final = {**item, "status": "completed" if status == "completed" else "incomplete", "content": [done_part]}
            await self.send("response.output_item.done", response_id=rid, output_index=0, item=final,
                            _out_of_band=not in_conversation)
            output.append(final)
        output += [c.to_json() for c in calls]
        details = ({"type": status, "reason": reason} if reason else
                   {"type": "failed", "error": failure} if failure is not None else None)
        await self.send("response.done", response={**base, "status": status, "status_details": details,
                                                   "output": output, "usage": usage})

    async def _answer_audio(self, where: dict[str, Any], answer: _Item, encoder: OutputEncoder, pcm: np.ndarray,
                            rate: int) -> None:
        """Samples of the answer at the session's speed, as one audio delta (none while atempo holds them all)."""
        if pcm.size:
            answer.audio_samples += int(pcm.size)  # what the client plays: truncate's audio_end_ms counts in it
            answer.audio_rate = rate
            await self.send("response.audio.delta", **where, delta=base64.b64encode(encoder(pcm)).decode())

    async def _answer_text(self, where: dict[str, Any], audio: bool, spoken_calls: bool, shaped: ToolAnswer,
                           calls: list[CallItem], piece: str, spoken: bool, text: list[str], end: bool = False,
                           in_conversation: bool = True) -> None:
        """A piece of the answer (its thought taken out): what is shown or said goes out as a text / transcript
        delta, and each call it closes becomes a function_call item. A spoken answer's transcript is what the
        talker said (gateway/spoken_calls.py); a text answer shows its text outside the calls."""
        content, made = shaped.push(piece) if piece else ("", [])
        if end:
            tail, more = shaped.finish()
            content, made = content + tail, made + more
        shown = (piece if spoken else "") if spoken_calls else content
        if shown:
            text.append(shown)
            await self.send("response.audio_transcript.delta" if audio else "response.text.delta", **where, delta=shown)
        for call in made:
            await self._call(where["response_id"], new_call_item(call), calls, in_conversation)

    async def _call(self, rid: str, item: CallItem, calls: list[CallItem], in_conversation: bool = True) -> None:
        """A function call the answer made: its item after the message (output 1, 2, ...), in the conversation
        (unless the response is out of band)."""
        index = 1 + len(calls)
        calls.append(item)
        previous = self.items[-1].id if self.items else None
        if in_conversation:
            self.items.append(item)
        at = {"response_id": rid, "item_id": item.id, "output_index": index, "call_id": item.call.id}
        await self.send("response.output_item.added", response_id=rid, output_index=index,
                        item=item.to_json("in_progress"))
        if in_conversation:
            await self.send("conversation.item.created", previous_item_id=previous, item=item.to_json("in_progress"))
        await self.send("response.function_call_arguments.delta", **at, delta=item.call.arguments)
        await self.send("response.function_call_arguments.done", **at, arguments=item.call.arguments)
        await self.send("response.output_item.done", response_id=rid, output_index=index, item=item.to_json(),
                        _out_of_band=not in_conversation)
