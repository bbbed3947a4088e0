"""VocoderTask: one request in the vocoder stage — codec code groups in, 24 kHz audio chunks out.

Data flow: `codes` (Q, n) chunks are queued by `feed`; the request is ready when a whole window waits
(its window schedule, code_windows: 5 codes for the first, 25 after it by default, or any list such as
5, 10, 20, 25; the first audio comes out after a few codes), or the input ended. An engine step takes
exactly one window off the queue (`take_window`),
decodes it through the request's `Code2WavStreamer` (left context + look-ahead handled there, so the
concatenated stream equals one-piece decoding) and emits `pcm` (samples,) float32 (`emit`). Windows always
start at the schedule's offsets (0, 5, 30, 55, ... for 5, 25) whatever the timing of the input, so a
request's chunks are the same run to run. The stage steps all its ready requests together (`VocoderBatcher`, one model call per step); `step`
is that same code for this request alone. Alone, a request's audio is bit-identical run to run; in a batch
it equals that to float rounding (~1e-7: batched conv kernels round differently).

Priority on shared cores (steps at the stage's own priority, the rest at its `bulk_nice`): a request is
urgent until its first window is decoded, and `behind` whenever a client that started playing at its first
audio has less than `PLAYBACK_MARGIN_S` of audio left: its playback deadline is near, so its window must not
wait behind other requests' windows that are seconds ahead of real time.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

from omnimesh.engine.task import StageTask
from omnimesh.models.qwen3_omni.code_windows import window_size
from omnimesh.models.qwen3_omni.code2wav import Code2WavStreamer
from omnimesh.models.qwen3_omni.edges import require_ids
from omnimesh.transport.frames import StageChunk
from services.vocoder.vocoder_batcher import step_windows

EDGE = "talker -> vocoder"
SAMPLE_RATE = 24000  # Hz of Qwen3-Omni's code2wav output (not in its config)
PLAYBACK_MARGIN_S = 0.3  # `behind` when a client playing since the first audio has less than this left


class VocoderTask(StageTask):
    def __init__(self, request_id: str, code2wav: Qwen3OmniMoeCode2Wav, windows: tuple[int, ...],
                 transformer: Any = None, sample_rate: int = SAMPLE_RATE):
        """`windows`: the decode-window schedule (code_windows), e.g. (5, 25): a short first window, the
        first audio sooner. `sample_rate`: of the audio out (the playback clock of `audio_left`)."""
        super().__init__(request_id)
        self.sample_rate = sample_rate
        self.first_audio_at: float | None = None  # monotonic time the first samples were emitted
        self.samples_out = 0
        # windowing is done here, per engine step; the pre-transformer runs on the stage's ranks
        self.streamer = Code2WavStreamer(code2wav, window=1, transformer=transformer)
        self.windows = windows
        self.taken = 0  # windows taken so far
        self.codebook = int(code2wav.config.codebook_size)  # type: ignore[union-attr]
        self.pending: list[torch.Tensor] = []
        self.n_pending = 0
        self.ended = False

    def close(self) -> None:
        self.streamer.close()
        self.pending = []  # codes may be slots of the talker's shm arena: free them now

    def feed(self, chunk: StageChunk) -> None:
        if "codes" in chunk.tensors:
            codes = require_ids(chunk.tensors, "codes", EDGE)
            if codes.dim() != 2 or codes.shape[0] != self.streamer.num_quantizers:
                raise ValueError(f"{EDGE}: codes must be ({self.streamer.num_quantizers}, n), got {tuple(codes.shape)}")
            if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.codebook):
                raise ValueError(f"{EDGE}: codes must be in [0, {self.codebook}), got [{int(codes.min())}, {int(codes.max())}]")
            self.pending.append(codes)
            self.n_pending += codes.shape[1]
        self.ended = chunk.final

    @property
    def current_window(self) -> int:
        """Codes in the next full window: the schedule's entry for it."""
        return window_size(self.taken, self.windows)

    @property
    def first_window_waits(self) -> bool:
        """Its first window has codes to decode: the request still waits for its first audio."""
        return self.completion_tokens == 0 and self.next_window_size() > 0

    def urgent(self) -> bool:
        """Until its first window is decoded."""
        return self.completion_tokens == 0

    def behind(self) -> bool:
        """Its playback deadline is near: less than `PLAYBACK_MARGIN_S` of audio left (`audio_left`)."""
        return self.audio_left() < PLAYBACK_MARGIN_S

    def audio_left(self) -> float:
        """Seconds of audio a client that started playing at the first output still has buffered (inf before
        any audio); below 0 it has run dry."""
        if self.first_audio_at is None:
            return float("inf")
        return self.samples_out / self.sample_rate - (time.monotonic() - self.first_audio_at)

    def ready(self) -> bool:
        return self.n_pending >= self.current_window or self.ended

    def next_window_size(self) -> int:
        """Codes the next step takes (0: only the end of the stream is left)."""
        return min(self.current_window, self.n_pending)

    def take_window(self) -> torch.Tensor:
        """Take the next window off the queue -> codes (Q, take), take = min(current window, pending) (may be 0)."""
        codes = torch.cat(self.pending, dim=1) if self.pending else torch.zeros(self.streamer.num_quantizers, 0, dtype=torch.long)
        take = min(self.current_window, codes.shape[1])
        rest = codes[:, take:]
        self.pending = [rest] if rest.shape[1] else []
        self.n_pending = rest.shape[1]
        self.completion_tokens += take
        self.taken += take > 0
        return codes[:, :take]

    def emit(self, pcm: torch.Tensor) -> list[StageChunk]:
        """The step's output for its decoded samples (k,); the step that empties an ended queue finishes."""
        if self.ended and not self.pending:
            self.finished = True
        if pcm.numel():
            if self.first_audio_at is None:
                self.first_audio_at = time.monotonic()
            self.samples_out += pcm.numel()
        # samples leave on the host (a CUDA stage decodes on its GPU; the gateway encodes them on the CPU)
        return [StageChunk(tensors={"pcm": pcm.to("cpu", torch.float32)})] if pcm.numel() or self.finished else []

    def step(self) -> list[StageChunk]:
        result = step_windows([self])[self.request_id]
        if isinstance(result, BaseException):
            raise result
        return result
