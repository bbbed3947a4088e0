"""The vocoder stage for Qwen2.5-Omni: token2wav (DiT + BigVGAN) over a request's whole code stream.

Role: `services/vocoder/handler.py` builds this handler for a Qwen2.5-Omni checkpoint. Each request's task
collects the talker's `codes` (1, n) chunks and, once the stream ends, decodes them in one call
(`omnimesh.models.qwen2_5_omni.token2wav`): the DiT's attention spans the whole utterance, so its audio comes
out at the end, as one `pcm` chunk (a streamed token2wav is not built yet). The noise the DiT starts from is
drawn from the request's `seed` option (the client's `seed`; `DEFAULT_SEED` without one): the same codes and
seed give the same samples, whatever else the stage runs. Two requests decode at once (two compute threads).

Data flow: talker -> codes (1, n) int64 (ids below the DiT's `num_embeds`) ... final -> `step` ->
token2wav(codes, speaker option, seed) -> pcm (480 n,) float32 at 24 kHz -> gateway.
Its Info advertises one window of `WINDOW_CODES` codes, so the talker sends its codes in chunks that size
rather than one message per code.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import torch

from omnimesh.config.serve_args import ServeArgs
from omnimesh.engine.task import StageRequestError, StageTask
from omnimesh.models.qwen2_5_omni.token2wav import SAMPLE_RATE, Qwen2_5OmniToken2Wav, load_token2wav
from omnimesh.models.qwen3_omni.edges import require_ids
from omnimesh.server.stage_failure import StageFailure
from omnimesh.stage_registry import lm_layout
from omnimesh.transport.frames import StageChunk
from omnimesh.v1 import stage_pb2

EDGE = "talker -> vocoder"
DEFAULT_SEED = 0
WINDOW_CODES = 50  # one second of codes per talker chunk


class Token2WavTask(StageTask):
    def __init__(self, request_id: str, token2wav: Qwen2_5OmniToken2Wav, speaker: str, seed: int, num_embeds: int):
        super().__init__(request_id)
        if speaker.lower() not in token2wav.speakers:
            raise ValueError(f"unknown speaker {speaker!r}; valid speakers: {', '.join(sorted(token2wav.speakers))}")
        self.token2wav, self.speaker, self.seed, self.num_embeds = token2wav, speaker, seed, num_embeds
        self.pending: list[torch.Tensor] = []
        self.ended = False

    def feed(self, chunk: StageChunk) -> None:
        if "codes" in chunk.tensors:
            codes = require_ids(chunk.tensors, "codes", EDGE)
            if codes.dim() != 2 or codes.shape[0] != 1:
                raise ValueError(f"{EDGE}: codes must be (1, n) (one codec stream), got {tuple(codes.shape)}")
            if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.num_embeds):
                raise ValueError(f"{EDGE}: codes must be in [0, {self.num_embeds}), got "
                                 f"[{int(codes.min())}, {int(codes.max())}]")
            self.pending.append(codes.clone())  # the talker's frames may be slots of its shm arena
        self.ended = chunk.final

    def ready(self) -> bool:
        return self.ended

    def step(self) -> list[StageChunk]:
        codes = torch.cat(self.pending, dim=1)[0] if self.pending else torch.zeros(0, dtype=torch.long)
        self.pending = []
        pcm = self.token2wav(codes, self.speaker, self.seed)
        self.completion_tokens = int(codes.numel())
        self.finished = True
        return [StageChunk(tensors={"pcm": pcm})]

    def close(self) -> None:
        self.pending = []


class Token2WavHandler:
    name = "vocoder"
    # two requests decode at once, on two compute threads: each draws its noise from a generator of its own and
    # the modules are read-only, so each gives what it gives alone (`sample_mel`)
    max_inflight_steps = 2

    def __init__(self, token2wav: Qwen2_5OmniToken2Wav, model_name: str, failure: StageFailure, num_embeds: int,
                 device: str = "cpu"):
        """`device`: "cuda" when the stage runs on a GPU (its Info says so)."""
        self.token2wav = token2wav
        self.device = device
        self.model_name = model_name
        self.failure = failure
        self.num_embeds = num_embeds
        self.default_speaker = "chelsie" if "chelsie" in token2wav.speakers else sorted(token2wav.speakers)[0]

    def info(self) -> stage_pb2.StageInfo:
        return stage_pb2.StageInfo(stage=self.name, model=self.model_name, family="qwen2.5-omni",
                                   pipeline_parallel_size=1, tensor_parallel_size=1, device=self.device,
                                   sample_rate=SAMPLE_RATE, window_codes=WINDOW_CODES, first_window_codes=WINDOW_CODES,
                                   window_schedule=(WINDOW_CODES,))

    def open(self, msg: stage_pb2.Open) -> Token2WavTask:
        if self.failure.message is not None:
            raise StageRequestError(grpc.StatusCode.UNAVAILABLE, f"vocoder: {self.failure.message}")
        seed = msg.options.get("seed", str(DEFAULT_SEED))
        try:
            value = int(seed)
        except ValueError:
            raise StageRequestError(grpc.StatusCode.INVALID_ARGUMENT, f"vocoder: option seed must be an integer, "
                                    f"got {seed!r}") from None
        try:
            return Token2WavTask(msg.request_id, self.token2wav, msg.options.get("speaker") or self.default_speaker,
                                 value, self.num_embeds)
        except ValueError as exc:
            raise StageRequestError(grpc.StatusCode.INVALID_ARGUMENT, f"vocoder: {exc}") from None


def build_token2wav_handler(model_dir: Path, args: ServeArgs) -> Token2WavHandler:
    """token2wav runs on one rank (the layout check refuses more before start-up), on the stage's device."""
    failure = StageFailure()
    layout = lm_layout(args, "vocoder", failure, model_dir)
    token2wav = load_token2wav(model_dir, layout.driver_device)
    num_embeds = int(token2wav.module.config.dit_config.num_embeds)
    return Token2WavHandler(token2wav, args.model_name(model_dir), failure, num_embeds,
                            "cuda" if layout.backend == "nccl" else "cpu")
