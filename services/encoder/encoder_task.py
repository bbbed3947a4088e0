"""EncoderTask: one request in the encoder stage — mel features / image and video patches in, embeddings out.

Data flow: one final input chunk with `input_features` (n_audio, n_mel, T) + `feature_attention_mask`
(n_audio, T) and/or `pixel_values` + `image_grid_thw` and/or `pixel_values_videos` + `video_grid_thw`; one
step runs the towers and emits one final chunk with what the thinker needs (see
omnimesh/models/qwen3_omni/edges.py). `step` is the solo path (a batch of one); the stage itself steps its requests together through `EncoderBatcher.step_batch`, which
emits per request exactly what `step` would (services/encoder/encoder_batcher.py).
"""

from __future__ import annotations

import torch

from omnimesh.engine.task import StageTask
from omnimesh.models.qwen3_omni.edges import require
from omnimesh.models.qwen3_omni.encoder import Qwen3OmniEncoder
from omnimesh.transport.frames import StageChunk
from services.encoder.encoder_batcher import check_inputs, encode_batch

EDGE = "gateway -> encoder"


class EncoderTask(StageTask):
    def __init__(self, request_id: str, encoder: Qwen3OmniEncoder):
        super().__init__(request_id)
        self.encoder = encoder
        self.inputs: dict[str, torch.Tensor] | None = None

    def feed(self, chunk: StageChunk) -> None:
        if self.inputs is not None or not chunk.final:
            raise ValueError(f"{EDGE}: send all media of a request in one final chunk")
        t = chunk.tensors
        if not {"input_features", "pixel_values", "pixel_values_videos"} & set(t):
            raise ValueError(f"{EDGE}: nothing to encode: give input_features, pixel_values and/or "
                             "pixel_values_videos")
        if "input_features" in t:
            require(t, "feature_attention_mask", EDGE)
        if "pixel_values" in t:
            require(t, "image_grid_thw", EDGE)
        if "pixel_values_videos" in t:
            require(t, "video_grid_thw", EDGE)
        self.inputs = t

    def ready(self) -> bool:
        return self.inputs is not None and not self.finished

    def step(self) -> list[StageChunk]:
        if self.inputs is None:
            raise RuntimeError("step before the media arrived")  # ready() prevents this
        (tensors,) = encode_batch(self.encoder, [check_inputs(self.encoder, self.inputs)])
        self.finished = True
        return [StageChunk(tensors=tensors)]
