"""Per-request log lines, as vLLM's `--enable-log-requests` (off by default: prompts are the users' data).

Data flow: `StagePipeline.run` -> `RequestLog.received(request, prompt_tokens)` once the prompt is built
(`Received request chatcmpl-..: model=.., modalities=text+audio, voice=.., prompt='..' (31 tokens, 1 audio,
0 images), sampling=temperature=0 max_tokens=8, stage_params=talker: top_k=10`) -> `finished(...)` when
the request ends, however it ends (`Finished request ..: length, 31 prompt + 8 completion tokens in
0.412 s`; `cancelled` when the client went away; `failed (503): ..` with the error). `--max-log-len N`
keeps the first N characters of the prompt text (vLLM's flag; default: all of it). With
`--enable-log-outputs` (vLLM's) a `Generated response ..: output='..', 2.48 s of audio` line comes before
the `Finished` one: the text the thinker gave (cut as the prompt) and the seconds of speech, from the
events `output.saw` is shown on their way to the client; a cancelled or failed request logs what it had. The
REST and gRPC fronts share the pipeline, so both are logged.
"""

from __future__ import annotations

import logging
from dataclasses import fields

from gateway.events import (
    AudioDelta,
    AudioPart,
    ChatRequest,
    Finished,
    ImagePart,
    PipelineError,
    SamplingOverrides,
    TextDelta,
    TextPart,
)

log = logging.getLogger(__name__)


def _sampling(s: SamplingOverrides) -> str:
    """The fields the client set, `name=value` (None = the stage's default: left out)."""
    set_ = [(f.name, getattr(s, f.name)) for f in fields(s) if getattr(s, f.name) is not None]
    return " ".join(f"{k}={list(v) if isinstance(v, tuple) else v}" for k, v in set_) or "defaults"


class Output:
    """What one request generated so far: its text deltas and seconds of audio (--enable-log-outputs)."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.audio_s = 0.0

    def saw(self, event: object) -> None:
        if isinstance(event, TextDelta):
            self.text.append(event.text)
        elif isinstance(event, AudioDelta) and event.sample_rate > 0:
            self.audio_s += len(event.pcm) / event.sample_rate


class RequestLog:
    def __init__(self, max_log_len: int | None = None, outputs: bool = False) -> None:
        self.max_log_len = max_log_len
        self.outputs = outputs  # --enable-log-outputs

    def output(self) -> Output | None:
        """An accumulator for one request's output when outputs are logged, else None."""
        return Output() if self.outputs else None

    def _cut(self, text: str) -> str:
        if self.max_log_len is not None and len(text) > self.max_log_len:
            return text[:self.max_log_len] + f"... ({len(text) - self.max_log_len} more characters)"
        return text

    def received(self, request: ChatRequest, prompt_tokens: int) -> None:
        parts = [p for m in request.messages for p in m.content]
        text = "\n".join(f"{m.role}: " + " ".join(p.text for p in m.content if isinstance(p, TextPart))
                         for m in request.messages)
        if request.prompt_ids is not None:  # a completion's prompt: its token ids, as vLLM logs them
            ids = list(request.prompt_ids)
            if self.max_log_len is not None and len(ids) > self.max_log_len:
                text = f"token ids {ids[:self.max_log_len]}... ({len(ids) - self.max_log_len} more)"
            else:
                text = f"token ids {ids}"
        else:
            text = self._cut(text)
        stages = "; ".join(f"{name}: {_sampling(s)}" for name, s in request.stage_params.items()) or "none"
        log.info("Received request %s: model=%s, modalities=%s, voice=%s, prompt=%r (%d tokens, %d audio, "
                 "%d images), sampling=%s, stage_params=%s", request.request_id, request.model,
                 "+".join(request.modalities), request.voice, text, prompt_tokens,
                 sum(isinstance(p, AudioPart) for p in parts), sum(isinstance(p, ImagePart) for p in parts),
                 _sampling(request.sampling), stages)

    def finished(self, request_id: str, seconds: float, done: Finished | None, error: BaseException | None,
                 output: Output | None = None) -> None:
        if output is not None:
            audio = f", {output.audio_s:.2f} s of audio" if output.audio_s else ""
            log.info("Generated response %s: output=%r%s", request_id, self._cut("".join(output.text)), audio)
        if done is not None:
            log.info("Finished request %s: %s, %d prompt + %d completion tokens in %.3f s", request_id,
                     done.finish_reason, done.prompt_tokens, done.completion_tokens, seconds)
        elif isinstance(error, PipelineError):
            log.info("Finished request %s: failed (%d): %s, after %.3f s", request_id, error.http_status,
                     error.message, seconds)
        elif error is not None:
            log.info("Finished request %s: failed: %s: %s, after %.3f s", request_id, type(error).__name__, error,
                     seconds)
        else:
            log.info("Finished request %s: cancelled (the client stopped reading) after %.3f s", request_id, seconds)
