"""The vocoder stage for Qwen2.5-Omni: token2wav (DiT + BigVGAN) over a request's whole code stream.

Role: `services/vocoder/handler.py` builds this handler for a Qwen2.5-Omni checkpoint. Each request's task
collects the talker's `codes` (1, n) chunks and, once the stream ends, decodes them in one call
(`omnimesh.models.qwen2_5_omni.token2wav`): the DiT's attention spans the whole utterance, so its audio comes
out at the end, as one `pcm` chunk (a streamed token2wav is not built yet). The noise the DiT starts from is
drawn from the request's `seed` option (the client's `seed`; `DEFAULT_SEED` without one): the same codes and
seed give the same samples, whatever else the stage runs.

Continuous batching (`Token2WavBatcher`, the engine loop's batcher): each engine step decodes every request
whose stream ended, up to `max_requests` (`--max-num-seqs`, and at most `CPU_ROWS` on CPU) and
`max_codes` (`--max-num-batched-tokens`, default `DEFAULT_STEP_CODES`) codes, in ONE batched DiT loop and (on CUDA) ONE batched BigVGAN
call, each request's samples equal to its solo decode to float rounding (`token2wav.decode`). On CPU two steps
run at once (two compute threads over disjoint requests; the modules are only read).

Data flow: talker -> codes (1, n) int64 (ids below the DiT's `num_embeds`) ... final -> `step_batch` ->
token2wav.decode([(codes, speaker option, seed), ...]) -> per request pcm (480 n,) float32 at 24 kHz -> gateway.
Its Info advertises one window of `WINDOW_CODES` codes, so the talker sends its codes in chunks that size
rather than one message per code.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import grpc
import torch

from omnimesh.config.serve_args import ServeArgs
from omnimesh.engine.task import StageRequestError, StageTask
from omnimesh.models.qwen2_5_omni.token2wav import SAMPLE_RATE, Qwen2_5OmniToken2Wav, Utterance, load_token2wav
from omnimesh.models.qwen3_omni.edges import require_ids
from omnimesh.server.stage_failure import StageFailure
from omnimesh.stage_registry import lm_layout
from omnimesh.transport.frames import StageChunk
from omnimesh.v1 import stage_pb2

EDGE = "talker -> vocoder"
DEFAULT_SEED = 0
WINDOW_CODES = 50  # one second of codes per talker chunk
# most requests in one CPU step: on the tiny model, 1 thread, 12-30 codes each, a request costs 63 ms alone,
# 52 in a step of 2, 49 of 4, 47 of 8, 48 of 16 (the DiT's share falls; BigVGAN's does not): wider steps
# gain nothing and hold every request's audio until the whole step ends
CPU_ROWS = 8
# most codes in one step without --max-num-batched-tokens (164 s of audio): a step's DiT memory and time grow
# with its codes (its BigVGAN's do not: `bigvgan_windows`), so a step of many long utterances is capped; an
# utterance longer than this still decodes, alone. The tiny mesh's soak (every utterance ~4,000 codes, its
# talker never stops early): 8 to a step, the vocoder's RssAnon reached 2.6 GiB.
DEFAULT_STEP_CODES = 8192

StepResult = dict[str, list[StageChunk] | BaseException]


class Token2WavTask(StageTask):
    def __init__(self, request_id: str, token2wav: Qwen2_5OmniToken2Wav, speaker: str, seed: int, num_embeds: int,
                 max_codes: int):
        """`max_codes`: the most codes one utterance may have (the DiT's position table)."""
        super().__init__(request_id)
        if speaker.lower() not in token2wav.speakers:
            raise ValueError(f"unknown speaker {speaker!r}; valid speakers: {', '.join(sorted(token2wav.speakers))}")
        self.token2wav, self.speaker, self.seed, self.num_embeds = token2wav, speaker, seed, num_embeds
        self.max_codes = max_codes
        self.pending: list[torch.Tensor] = []
        self.n_pending = 0
        self.ended = False

    def feed(self, chunk: StageChunk) -> None:
        if "codes" in chunk.tensors:
            codes = require_ids(chunk.tensors, "codes", EDGE)
            if codes.dim() != 2 or codes.shape[0] != 1:
                raise ValueError(f"{EDGE}: codes must be (1, n) (one codec stream), got {tuple(codes.shape)}")
            if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.num_embeds):
                raise ValueError(f"{EDGE}: codes must be in [0, {self.num_embeds}), got "
                                 f"[{int(codes.min())}, {int(codes.max())}]")
            if self.n_pending + codes.shape[1] > self.max_codes:
                raise ValueError(f"{EDGE}: more than {self.max_codes} codes in one utterance (the DiT's "
                                 f"max_position_embeddings); shorten the reply (max_tokens)")
            self.pending.append(codes.clone())  # the talker's frames may be slots of its shm arena
            self.n_pending += codes.shape[1]
        self.ended = chunk.final

    def ready(self) -> bool:
        return self.ended

    def take(self) -> Utterance:
        """The whole stream, taken off the task."""
        codes = torch.cat(self.pending, dim=1)[0] if self.pending else torch.zeros(0, dtype=torch.long)
        self.pending, self.n_pending = [], 0
        return Utterance(codes, self.speaker, self.seed)

    def emit(self, utterance: Utterance, pcm: torch.Tensor) -> list[StageChunk]:
        self.completion_tokens = int(utterance.codes.numel())
        self.finished = True
        return [StageChunk(tensors={"pcm": pcm})]

    def step(self) -> list[StageChunk]:
        """This request alone (what `Token2WavBatcher` does for many)."""
        utterance = self.take()
        return self.emit(utterance, self.token2wav.decode([utterance])[0])

    def close(self) -> None:
        self.pending = []


class Token2WavBatcher:
    """The token2wav handler's `batcher` (the engine loop's `BatchStepper`): one batched decode per step."""

    def __init__(self, token2wav: Qwen2_5OmniToken2Wav, max_requests: int | None = None,
                 max_codes: int | None = None) -> None:
        for name, value in (("max_requests", max_requests), ("max_codes", max_codes)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.token2wav, self.max_requests, self.max_codes = token2wav, max_requests, max_codes

    def step_batch(self, tasks: list[StageTask]) -> StepResult:
        """The ready requests (longest-waiting first) that fit the caps, decoded together; those left out stay
        ready for the next step (the first one always fits)."""
        batch: list[tuple[Token2WavTask, Utterance]] = []
        codes = 0
        for task in cast("list[Token2WavTask]", tasks):
            if self.max_requests is not None and len(batch) >= self.max_requests:
                break
            if batch and self.max_codes is not None and codes + task.n_pending > self.max_codes:
                continue
            codes += task.n_pending
            batch.append((task, task.take()))
        pcm = self.token2wav.decode([u for _, u in batch])  # the model call (an error here fails the batch)
        results: StepResult = {}
        for (task, utterance), wave in zip(batch, pcm):
            try:
                results[task.request_id] = task.emit(utterance, wave)
            except Exception as exc:
                results[task.request_id] = exc
        return results


class Token2WavHandler:
    name = "vocoder"
    # two steps at once, on two compute threads over disjoint requests: each request draws its noise from a
    # generator of its own and the modules are read-only, so each gives what it gives alone
    max_inflight_steps = 2

    def __init__(self, token2wav: Qwen2_5OmniToken2Wav, model_name: str, failure: StageFailure, num_embeds: int,
                 device: str = "cpu", max_requests: int | None = None, max_codes: int | None = None,
                 layout: tuple[int, int] = (1, 1)):
        """`device`: "cuda" when the stage runs on a GPU (its Info says so). `max_requests` / `max_codes`: the
        caps of one step (none: all ready requests, on CPU at most CPU_ROWS; DEFAULT_STEP_CODES codes).
        `layout`: the (pp, tp) of the DiT's ranks."""
        self.token2wav = token2wav
        self.device = device
        self.layout = layout
        if device == "cpu":
            max_requests = min(max_requests or CPU_ROWS, CPU_ROWS)
        self.batcher = Token2WavBatcher(token2wav, max_requests, max_codes or DEFAULT_STEP_CODES)
        dit = token2wav.module.code2wav_dit_model
        self.max_codes = int(dit.config.max_position_embeddings) // int(dit.repeats)
        self.model_name = model_name
        self.failure = failure
        self.num_embeds = num_embeds
        self.default_speaker = "chelsie" if "chelsie" in token2wav.speakers else sorted(token2wav.speakers)[0]

    def info(self) -> stage_pb2.StageInfo:
        return stage_pb2.StageInfo(stage=self.name, model=self.model_name, family="qwen2.5-omni",
                                   pipeline_parallel_size=self.layout[0], tensor_parallel_size=self.layout[1],
                                   device=self.device,
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
                                 value, self.num_embeds, self.max_codes)
        except ValueError as exc:
            raise StageRequestError(grpc.StatusCode.INVALID_ARGUMENT, f"vocoder: {exc}") from None


def build_token2wav_handler(model_dir: Path, args: ServeArgs) -> Token2WavHandler:
    """The DiT's decoder layers over the stage's pp x tp ranks, the rest of token2wav here, on rank 0's device."""
    failure = StageFailure()
    layout = lm_layout(args, "vocoder", failure, model_dir)
    token2wav = load_token2wav(model_dir, layout.driver_device, layout.pp, layout.tp, layout.partition,
                               **layout.executor_args())
    num_embeds = int(token2wav.module.config.dit_config.num_embeds)
    config = args.stage_configs()["vocoder"]
    return Token2WavHandler(token2wav, args.model_name(model_dir), failure, num_embeds,
                            "cuda" if layout.backend == "nccl" else "cpu", config.max_num_seqs,
                            config.max_num_batched_tokens, (layout.pp, layout.tp))
