"""VocoderTask: one request in the vocoder stage — codec code groups in, 24 kHz audio chunks out.

Data flow: `codes` (Q, n) chunks are queued; an engine step runs when a whole window of `window` codes
waits (or the input ended), decodes exactly one window through a `Code2WavStreamer` (left context +
look-ahead handled there, so the concatenated stream equals one-piece decoding) and emits `pcm`
(samples,) float32. Windows always start at multiples of `window`, whatever the timing of the input, so
a request's audio is bit-identical run to run (decoding other cuts agrees only to ~1e-7).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

from omnimesh.engine.task import StageTask
from omnimesh.models.qwen3_omni.code2wav import Code2WavStreamer
from omnimesh.models.qwen3_omni.edges import require
from omnimesh.transport.frames import StageChunk

EDGE = "talker -> vocoder"


class VocoderTask(StageTask):
    def __init__(self, request_id: str, code2wav: Qwen3OmniMoeCode2Wav, window: int, transformer: Any = None):
        super().__init__(request_id)
        # windowing is done here, per engine step; the pre-transformer runs on the stage's ranks
        self.streamer = Code2WavStreamer(code2wav, window=1, transformer=transformer)
        self.window = window
        self.codebook = int(code2wav.config.codebook_size)  # type: ignore[union-attr]
        self.pending: list[torch.Tensor] = []
        self.n_pending = 0
        self.ended = False

    def close(self) -> None:
        self.streamer.close()

    def feed(self, chunk: StageChunk) -> None:
        if "codes" in chunk.tensors:
            codes = require(chunk.tensors, "codes", EDGE).long()
            if codes.dim() != 2 or codes.shape[0] != self.streamer.num_quantizers:
                raise ValueError(f"{EDGE}: codes must be ({self.streamer.num_quantizers}, n), got {tuple(codes.shape)}")
            if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.codebook):
                raise ValueError(f"{EDGE}: codes must be in [0, {self.codebook}), got [{int(codes.min())}, {int(codes.max())}]")
            self.pending.append(codes)
            self.n_pending += codes.shape[1]
        self.ended = chunk.final

    def ready(self) -> bool:
        return self.n_pending >= self.window or self.ended

    def step(self) -> list[StageChunk]:
        pcm = torch.zeros(0)
        if self.pending:
            codes = torch.cat(self.pending, dim=1)  # (Q, n)
            take = min(self.window, codes.shape[1])
            rest = codes[:, take:]
            self.pending = [rest] if rest.shape[1] else []
            self.n_pending = rest.shape[1]
            self.completion_tokens += take
            pcm = self.streamer.feed(codes[:, :take])
        if self.ended and not self.pending:
            pcm = torch.cat([pcm, self.streamer.flush()])
            self.finished = True
        return [StageChunk(tensors={"pcm": pcm.to(torch.float32)})] if pcm.numel() or self.finished else []
