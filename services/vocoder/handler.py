"""The vocoder stage service: loads code2wav, opens a VocoderTask per request and steps all ready
requests together through its `batcher` (a `VocoderBatcher`: one model call per engine step).

Run: `omnimesh stage vocoder --model DIR --port 50054`. `--audio-windows` (default 5,25: the first decode takes 5 codes,
so the first audio leaves early, then 25 = 2 s of audio on Qwen3-Omni at a time; see code_windows) is the stage's
schedule, advertised in Info so that the talker chunks its codes to match. Per request, option `windows` (a schedule) or
`window` / `first_window` (at most `window`) override it. Any windows, and any batch a request shares a step with, give
the same samples (to float rounding, ~1e-7). The stage's max_num_batched_tokens caps the codes decoded in one step
(default: no cap on Qwen3-Omni; Qwen2.5-Omni's token2wav: 8,192, `token2wav_handler.DEFAULT_STEP_CODES`). On CPU the
SnakeBeta activations run as one kernel (snake_kernel): omnimesh's fused CPU kernel, or, with those off
(OMNIMESH_CPU_KERNELS=0), a torch.compile'd one made at start-up (a few seconds) unless `--enforce-eager`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import grpc
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

from omnimesh.config.serve_args import ServeArgs
from omnimesh.engine.task import StageRequestError
from omnimesh.kernels import cpu_kernels
from omnimesh.models.qwen3_omni.checkpoint_stages import model_family
from omnimesh.models.qwen3_omni.code2wav import CPU_CONV_ROWS
from omnimesh.models.qwen3_omni.code2wav_shard import Code2WavTransformerBackend
from omnimesh.models.qwen3_omni.code_windows import DEFAULT_WINDOWS, parse_windows
from omnimesh.models.qwen3_omni.snake_kernel import compile_snake, use_eager
from omnimesh.models.qwen3_omni.stage_loading import LMLayout, load_code2wav
from omnimesh.server.stage_failure import StageFailure
from omnimesh.stage_registry import lm_layout, resolve_dtype
from omnimesh.v1 import stage_pb2
from services.options import count_option
from services.vocoder.token2wav_handler import Token2WavHandler, build_token2wav_handler
from services.vocoder.vocoder_batcher import VocoderBatcher
from services.vocoder.vocoder_task import SAMPLE_RATE, VocoderTask

log = logging.getLogger(__name__)


class VocoderHandler:
    name = "vocoder"

    def __init__(self, code2wav: Qwen3OmniMoeCode2Wav, transformer: Code2WavTransformerBackend, model_name: str,
                 layout: LMLayout, failure: StageFailure, max_codes_per_step: int | None = None,
                 windows: tuple[int, ...] = DEFAULT_WINDOWS):
        self.code2wav = code2wav
        self.windows = windows
        self.transformer = transformer
        self.model_name = model_name
        self.layout = layout
        self.failure = failure
        # one batch per pipeline rank at a time; in-process on CPU a second slot for first windows (see
        # VocoderBatcher.lanes: two threads, disjoint requests, read-only modules)
        in_process_cpu = layout.in_process_cpu
        self.max_inflight_steps = 2 if in_process_cpu else layout.pp
        self.preempt = in_process_cpu  # a bulk step pauses while a first-lane step runs (StepGate)
        # on CPU a step decodes at most CPU_CONV_ROWS windows (see VocoderBatcher); on CUDA all ready ones
        self.batcher = VocoderBatcher(max_codes_per_step, CPU_CONV_ROWS if layout.backend != "nccl" else None,
                                      first_lane=in_process_cpu)

    def info(self) -> stage_pb2.StageInfo:
        return stage_pb2.StageInfo(stage=self.name, model=self.model_name, family="qwen3-omni",
                                   pipeline_parallel_size=self.layout.pp, tensor_parallel_size=self.layout.tp,
                                   device="cuda" if self.layout.backend == "nccl" else "cpu", sample_rate=SAMPLE_RATE,
                                   window_codes=self.windows[-1], first_window_codes=self.windows[0],
                                   window_schedule=self.windows)

    def open(self, msg: stage_pb2.Open) -> VocoderTask:
        if self.failure.message is not None:
            raise StageRequestError(grpc.StatusCode.UNAVAILABLE, f"vocoder: {self.failure.message}")
        windows = self.windows
        if "windows" in msg.options:
            windows = parse_windows(msg.options["windows"], "option windows")
        elif "window" in msg.options or "first_window" in msg.options:
            window = count_option(msg, "window", windows[-1])
            windows = (min(count_option(msg, "first_window", windows[0]), window), window)
        return VocoderTask(msg.request_id, self.code2wav, windows, self.transformer)


def build_handler(model_dir: Path, args: ServeArgs) -> VocoderHandler | Token2WavHandler:
    """Qwen3-Omni's code2wav (this module), or Qwen2.5-Omni's token2wav (token2wav_handler.py)."""
    if model_family(model_dir) == "qwen2.5-omni":
        return build_token2wav_handler(model_dir, args)
    failure = StageFailure()
    layout = lm_layout(args, "vocoder", failure, model_dir)
    code2wav, transformer = load_code2wav(model_dir, resolve_dtype(args), layout)
    if cpu_kernels.prepare(next(code2wav.parameters()).device):
        log.info("vocoder: SnakeBeta runs as omnimesh's fused CPU kernel")
    elif args.enforce_eager:
        use_eager()
    else:  # before serving: no request waits on a compile
        started = time.perf_counter()
        if compile_snake(next(code2wav.parameters()).device):
            log.info("vocoder: SnakeBeta compiled into one kernel in %.1f s (--enforce-eager keeps eager PyTorch)",
                     time.perf_counter() - started)
    cap = args.stage_configs()["vocoder"].max_num_batched_tokens
    return VocoderHandler(code2wav, transformer, args.model_name(model_dir), layout, failure, cap,
                          parse_windows(args.audio_windows))
