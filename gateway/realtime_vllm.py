"""vLLM's own `/v1/realtime` dialect: streaming speech to text as vLLM's and vLLM-Omni's realtime clients speak it.

The protocol (vLLM's `entrypoints/openai/realtime`): the server says `session.created`; the client names the
model with a top-level `{"type": "session.update", "model": ...}` (no `session` object: that is how the
dialect is told from OpenAI's, `gateway/realtime_api.py`); `input_audio_buffer.commit` opens the audio
stream, `input_audio_buffer.append` sends base64 pcm16 at 16 kHz mono, `input_audio_buffer.commit` with
`"final": true` ends it. The server answers `transcription.delta` events and, when the stream has ended,
`transcription.done` with the whole text and the usage; errors are `{"type": "error", "error", "code"}`.

The towers hear whole clips, so the stream is cut into clips where the speaker pauses (Silero VAD, as
server_vad cuts turns: `gateway/realtime_vad.py`): each pause sends the audio since the last cut to the
thinker with /v1/audio/transcriptions' instruction (greedy), and its text streams out as deltas while the
client goes on talking; the final commit transcribes what is left. The cuts partition the audio (none is
heard twice or dropped), one clip at a time, in order. A live microphone that never sends the final commit
still gets its text, pause by pause. The audio not transcribed yet (since the last pause, and clips waiting
for the thinker) is bounded by the input limits' max_audio_seconds: past it an append is refused.

Data flow: append -> samples at 16 kHz -> the utterance buffer and the VAD (off the event loop) -> at a
pause or the final commit: a clip -> `collect_text` -> `transcription.delta` ... -> `transcription.done`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from gateway.events import AudioPart, PipelineError
from gateway.media import MIN_AUDIO_SAMPLES
from gateway.realtime_settings import RealtimeError
from gateway.realtime_tasks import spawn
from gateway.realtime_vad import ServerVAD, Stopped
from gateway.transcription_api import collect_text, transcription_request

if TYPE_CHECKING:
    from gateway.rest import RestGateway

RATE = 16_000  # vLLM's realtime audio: pcm16, 16 kHz, mono


def speaks_vllm(event: dict[str, Any]) -> bool:
    """vLLM's session.update names the model at the top level and carries no `session` object."""
    return event.get("type") == "session.update" and "model" in event and "session" not in event


class VllmTranscriber:
    """One connection in vLLM's dialect. `send` writes one event (a dict) to the client; `tasks` is the
    connection's set of tasks its end cancels."""

    def __init__(self, gw: RestGateway, send: Callable[[dict[str, Any]], Awaitable[None]],
                 tasks: set[asyncio.Task]) -> None:
        self.gw, self.send, self.tasks = gw, send, tasks
        self.model_ok = False
        self.open = False  # between the opening commit and the final one
        self.audio: list[np.ndarray] = []  # the stream since the last cut
        self.held = 0  # ... its samples
        self.vad: ServerVAD | None = None
        self.clips: asyncio.Queue[np.ndarray | None] = asyncio.Queue()  # cut clips; None: the stream ended
        self.worker: asyncio.Task | None = None
        self.queued = 0  # samples cut into clips and not transcribed yet (all streams of the connection)

    async def error(self, message: str, code: str) -> None:
        await self.send({"type": "error", "error": message, "code": code})

    async def handle(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind == "session.update":
            model = event.get("model")
            if model not in self.gw.served_model_names:
                raise RealtimeError(f"The model `{model}` does not exist; served: "
                                    f"{', '.join(self.gw.served_model_names)}", "model", "model_not_found")
            self.model_ok = True
        elif kind == "input_audio_buffer.append":
            await self._append(event.get("audio"))
        elif kind == "input_audio_buffer.commit":
            if not self.model_ok:
                raise RealtimeError("Model not validated: send a session.update naming the model first", None,
                                    "model_not_validated")
            if not event.get("final"):
                self._open()
            elif not self.open:
                raise RealtimeError("no audio stream is open: commit, append audio, then commit with final true",
                                    None, "input_audio_buffer_commit_empty")
            else:
                self._cut()
                self.audio, self.held = [], 0  # under one feature window: nothing to hear
                self.clips.put_nowait(None)  # the stream's end: transcription.done after its last clip
                self.open, self.vad = False, None
        else:
            raise RealtimeError(f"Unknown event type: {kind} (vLLM's realtime dialect: session.update, "
                                "input_audio_buffer.append, input_audio_buffer.commit)", "type", "unknown_event")

    def _open(self) -> None:
        if self.open:
            return  # vLLM ignores a commit while its stream runs
        self.open, self.vad, self.clips = True, ServerVAD(rate=RATE), asyncio.Queue()
        self.worker = spawn(self._transcribe(self.clips, self.worker), self.tasks,  # after the last stream's
                            "transcription (vLLM's dialect)")

    async def _append(self, data: Any) -> None:
        try:
            raw = base64.b64decode(data, validate=True) if isinstance(data, str) else b""
        except (binascii.Error, ValueError):
            raw = b""
        if not raw or len(raw) % 2:
            raise RealtimeError("Invalid audio data: base64 pcm16 (16 kHz mono) with a whole number of samples",
                                "audio", "invalid_audio")
        if not self.open:
            self._open()  # audio before the opening commit belongs to the stream it opens
        samples = np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0
        held = self.held + samples.size + self.queued
        limit = self.gw.loader.limits.max_audio_seconds
        if held / RATE > limit:  # a pause-less talker, or a client faster than the transcription: bounded memory
            raise RealtimeError(f"the audio not transcribed yet would be {held / RATE:.1f} s, over this server's "
                                f"max_audio_seconds of {limit:g} s: pause, or wait for the text", "audio",
                                "audio_too_long")
        self.audio.append(samples)
        self.held += samples.size
        vad = self.vad
        if vad is not None and any(isinstance(e, Stopped) for e in await asyncio.to_thread(vad.push, samples)):
            self._cut()

    def _cut(self) -> None:
        """The audio since the last cut becomes a clip (too short for a feature window: kept for the next)."""
        if self.held >= MIN_AUDIO_SAMPLES:
            self.clips.put_nowait(np.concatenate(self.audio))
            self.queued += self.held
            self.audio, self.held = [], 0

    async def _transcribe(self, clips: asyncio.Queue[np.ndarray | None], before: asyncio.Task | None) -> None:
        """The stream's clips in order (after the previous stream's are done): each one's text as deltas, a
        space between clips; at the stream's end, transcription.done with the whole text and the usage."""
        if before is not None:
            with contextlib.suppress(BaseException):
                await before
        said = ""
        prompt = completion = 0
        while (clip := await clips.get()) is not None:
            chat = transcription_request(self.gw.pipeline.served_models[0], AudioPart(clip, RATE), self.gw.reasoning)
            sep = lead = " " if said and not said.endswith(" ") else ""  # between clips' texts, with the first delta

            async def delta(piece: str) -> None:
                nonlocal lead
                out, lead = lead + piece, ""
                await self.send({"type": "transcription.delta", "delta": out})

            try:
                text, done = await collect_text(self.gw.pipeline, chat, self.gw.reasoning, delta)
            except PipelineError as e:
                await self.error(e.message, "processing_error")
                continue
            finally:
                self.queued -= clip.size
            said += sep + text if text else ""
            prompt, completion = prompt + done.prompt_tokens, completion + done.completion_tokens
        await self.send({"type": "transcription.done", "text": said,
                         "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                   "total_tokens": prompt + completion}})

