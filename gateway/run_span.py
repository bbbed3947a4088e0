"""The gateway's span of one pipeline run (omnimesh/tracing.py): vLLM's `llm_request`, with its gen_ai.*
attributes and omnimesh's own.

Data flow: `StagePipeline.run` -> `RunSpan.start(request)` (None while tracing is off) under the client's trace
context (`tracing.request_parent`, set by the REST / gRPC front from the request's `traceparent`) ->
`headers()` travel with every stage call, so each stage's span joins this one -> `saw(event)` notes the first
text and audio and the audio's length -> `end(finished, error)` sets the usage, latencies and outcome.
"""

from __future__ import annotations

import time
from typing import Any

from gateway.events import AudioDelta, ChatRequest, Event, Finished, PipelineError, TextDelta
from omnimesh import tracing


class RunSpan:
    def __init__(self, span: Any, started: float) -> None:
        self.span = span
        self.started = started
        self.first_text = 0.0
        self.first_audio = 0.0
        self.audio_s = 0.0

    @classmethod
    def start(cls, request: ChatRequest) -> RunSpan | None:
        if not tracing.enabled():
            return None
        s = request.sampling
        span = tracing.start_span("llm_request", tracing.request_parent(), {
            "gen_ai.request.id": request.request_id, "gen_ai.response.model": request.model,
            "gen_ai.request.max_tokens": s.max_tokens, "gen_ai.request.temperature": s.temperature,
            "gen_ai.request.top_p": s.top_p, "omnimesh.modalities": ",".join(request.modalities),
            "omnimesh.voice": request.voice})
        return cls(span, time.monotonic())

    def headers(self) -> dict[str, str]:
        """The span's context as the stages' call metadata."""
        return tracing.inject(self.span)

    def saw(self, event: Event) -> None:
        now = time.monotonic()
        if isinstance(event, TextDelta) and not self.first_text:
            self.first_text = now
            self.span.add_event("first_text")
        elif isinstance(event, AudioDelta):
            if not self.first_audio:
                self.first_audio = now
                self.span.add_event("first_audio")
            self.audio_s += event.pcm.size / event.sample_rate

    def end(self, done: Finished | None, error: BaseException | None) -> None:
        attributes: dict[str, Any] = {"gen_ai.latency.e2e": time.monotonic() - self.started,
                                      "omnimesh.audio_seconds": self.audio_s or None}
        if self.first_text:
            attributes["gen_ai.latency.time_to_first_token"] = self.first_text - self.started
        if self.first_audio:
            attributes["omnimesh.latency.time_to_first_audio"] = self.first_audio - self.started
        if done is not None:
            attributes.update({"gen_ai.usage.prompt_tokens": done.prompt_tokens,
                               "gen_ai.usage.completion_tokens": done.completion_tokens,
                               "omnimesh.usage.cached_tokens": done.cached_tokens,
                               "omnimesh.finish_reason": done.finish_reason})
        why = None
        if isinstance(error, PipelineError):
            attributes["http.response.status_code"] = error.http_status
            why = error.message
        elif error is not None:
            why = f"{type(error).__name__}: {error}"
        elif done is None:
            attributes["omnimesh.finish_reason"] = "cancelled"  # the client stopped reading
        tracing.end(self.span, attributes, why)
