"""The encoder stage service: loads the audio + vision towers and opens an EncoderTask per request.

Its `batcher` (EncoderBatcher) makes the engine loop step every ready request together: one audio-tower
call and one vision-tower call per engine step, whatever the number of requests.

Run: `omnimesh stage encoder --model DIR --port 50051`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import grpc

from omnimesh.config.serve_args import ServeArgs
from omnimesh.config.stage_config import parse_size
from omnimesh.engine.task import StageRequestError
from omnimesh.models.qwen3_omni.checkpoint_stages import model_family
from omnimesh.models.qwen3_omni.encoder import Qwen3OmniEncoder
from omnimesh.models.qwen3_omni.stage_loading import LMLayout, load_encoder
from omnimesh.server.stage_failure import StageFailure
from omnimesh.stage_registry import lm_layout, resolve_dtype
from omnimesh.v1 import stage_pb2
from services.encoder.encoder_batcher import EncoderBatcher
from services.encoder.encoder_cache import EncoderCache
from services.encoder.encoder_task import EncoderTask


log = logging.getLogger(__name__)


class EncoderHandler:
    name = "encoder"

    def __init__(self, encoder: Qwen3OmniEncoder, model_name: str, layout: LMLayout, failure: StageFailure,
                 family: str = "qwen3-omni", cache_bytes: int = 0):
        self.encoder = encoder
        self.family = family
        self.model_name = model_name
        self.layout = layout
        self.failure = failure
        self.max_inflight_steps = layout.pp  # one batch per pipeline rank at a time
        cache = EncoderCache(cache_bytes) if cache_bytes > 0 else None  # --encoder-cache-memory
        self.batcher = EncoderBatcher(encoder, cache)  # the engine loop steps all ready requests in one call
        if cache is not None:
            log.info("encoder: keeping the outputs of media items up to %.0f MiB (--encoder-cache-memory; 0 = off)",
                     cache_bytes / 2**20)

    def info(self) -> stage_pb2.StageInfo:
        return stage_pb2.StageInfo(stage=self.name, model=self.model_name, family=self.family,
                                   pipeline_parallel_size=self.layout.pp, tensor_parallel_size=self.layout.tp,
                                   device="cuda" if self.layout.backend == "nccl" else "cpu",
                                   prefix_caching=self.batcher.cache is not None)  # the gateway sends digests

    def open(self, msg: stage_pb2.Open) -> EncoderTask:
        if self.failure.message is not None:
            raise StageRequestError(grpc.StatusCode.UNAVAILABLE, f"encoder: {self.failure.message}")
        return EncoderTask(msg.request_id, self.encoder)


def build_handler(model_dir: Path, args: ServeArgs) -> EncoderHandler:
    failure = StageFailure()
    layout = lm_layout(args, "encoder", failure, model_dir)
    return EncoderHandler(load_encoder(model_dir, resolve_dtype(args), layout), args.model_name(model_dir), layout, failure,
                          model_family(model_dir), parse_size(args.encoder_cache_memory, "--encoder-cache-memory"))
