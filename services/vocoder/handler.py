"""The vocoder stage service: loads code2wav and opens a VocoderTask per request.

Run: `omnimesh stage vocoder --model DIR --port 50054`. Option `window` (codes per decode, default 25 =
2 s of audio on Qwen3-Omni) trades first-audio latency against per-call overhead; any window gives the
same samples (to ~1e-7; one window size always gives bit-identical audio).
"""

from __future__ import annotations

from pathlib import Path

from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

from omnimesh.config.serve_args import ServeArgs
from omnimesh.models.qwen3_omni.stage_loading import load_code2wav
from omnimesh.stage_registry import resolve_dtype
from omnimesh.v1 import stage_pb2
from services.vocoder.vocoder_task import VocoderTask

SAMPLE_RATE = 24000
DEFAULT_WINDOW = 25


class VocoderHandler:
    name = "vocoder"

    def __init__(self, code2wav: Qwen3OmniMoeCode2Wav, model_name: str):
        self.code2wav = code2wav
        self.model_name = model_name

    def info(self) -> stage_pb2.StageInfo:
        return stage_pb2.StageInfo(stage=self.name, model=self.model_name, family="qwen3-omni",
                                   pipeline_parallel_size=1, tensor_parallel_size=1, device="cpu",
                                   sample_rate=SAMPLE_RATE)

    def open(self, msg: stage_pb2.Open) -> VocoderTask:
        text = msg.options.get("window", str(DEFAULT_WINDOW))
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"option window must be a whole number of codes >= 1, got {text!r}")
        return VocoderTask(msg.request_id, self.code2wav, int(text))


def build_handler(model_dir: Path, args: ServeArgs) -> VocoderHandler:
    return VocoderHandler(load_code2wav(model_dir, resolve_dtype(args)), model_dir.name)
