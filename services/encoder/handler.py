"""The encoder stage service: loads the audio + vision towers and opens an EncoderTask per request.

Run: `omnimesh stage encoder --model DIR --port 50051`.
"""

from __future__ import annotations

from pathlib import Path

from omnimesh.config.serve_args import ServeArgs
from omnimesh.models.qwen3_omni.encoder import Qwen3OmniEncoder
from omnimesh.models.qwen3_omni.stage_loading import load_encoder
from omnimesh.stage_registry import resolve_dtype
from omnimesh.v1 import stage_pb2
from services.encoder.encoder_task import EncoderTask


class EncoderHandler:
    name = "encoder"

    def __init__(self, encoder: Qwen3OmniEncoder, model_name: str):
        self.encoder = encoder
        self.model_name = model_name

    def info(self) -> stage_pb2.StageInfo:
        return stage_pb2.StageInfo(stage=self.name, model=self.model_name, family="qwen3-omni",
                                   pipeline_parallel_size=1, tensor_parallel_size=1, device="cpu")

    def open(self, msg: stage_pb2.Open) -> EncoderTask:
        return EncoderTask(msg.request_id, self.encoder)


def build_handler(model_dir: Path, args: ServeArgs) -> EncoderHandler:
    return EncoderHandler(load_encoder(model_dir, resolve_dtype(args)), model_dir.name)
