"""EncoderTask: one request in the encoder stage — mel features / image patches in, embeddings out.

Data flow: one final input chunk with `input_features` (n_audio, n_mel, T) + `feature_attention_mask`
(n_audio, T) and/or `pixel_values` + `image_grid_thw`; one step runs the towers and emits one final
chunk with what the thinker needs (see omnimesh/models/qwen3_omni/edges.py).
"""

from __future__ import annotations

import torch

from omnimesh.engine.task import StageTask
from omnimesh.models.qwen3_omni.edges import encoder_outputs_to_tensors, require
from omnimesh.models.qwen3_omni.encoder import Qwen3OmniEncoder
from omnimesh.transport.frames import StageChunk

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
        if "input_features" not in t and "pixel_values" not in t:
            raise ValueError(f"{EDGE}: nothing to encode: give input_features and/or pixel_values")
        if "input_features" in t:
            require(t, "feature_attention_mask", EDGE)
        if "pixel_values" in t:
            require(t, "image_grid_thw", EDGE)
        self.inputs = t

    def ready(self) -> bool:
        return self.inputs is not None and not self.finished

    def step(self) -> list[StageChunk]:
        t = self.inputs
        if t is None:
            raise RuntimeError("step before the media arrived")  # ready() prevents this
        audio = lengths = image = deep = None
        if "input_features" in t:
            mask = t["feature_attention_mask"]
            audio = self.encoder.encode_audio(t["input_features"], mask)
            lengths = mask.view(-1, mask.shape[-1]).sum(-1).long()  # (n_audio,)
        if "pixel_values" in t:
            image, deep = self.encoder.encode_image(t["pixel_values"], t["image_grid_thw"].long())
        self.finished = True
        return [StageChunk(tensors=encoder_outputs_to_tensors(audio, lengths, image, deep))]
