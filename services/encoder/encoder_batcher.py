"""EncoderBatcher: the encoder stage's continuous batching — every ready request's media in one tower call
per modality, per engine step (the EngineLoop's `BatchStepper`).

Data flow, for the requests of one step:
    each request alone: `check_inputs` -> its valid mel frames (n_mel, T_r) + feature_lens (n_audio_r,)
        and / or pixel_values (P_r, C*tp*p*p) + image_grid_thw (n_images_r, 3) and / or
        pixel_values_videos + video_grid_thw (n_videos_r, 3); bad input -> ValueError for THAT request only
        (it fails alone; the rest of the batch goes on)
    `encode_batch`: frames concatenated along time (n_mel, sum T_r) + feature_lens concatenated -> ONE
        audio-tower call -> (sum tokens, H), split back by audio_output_lengths per request;
        image and video patches concatenated (sum P_r, ...) + grids concatenated -> ONE vision-tower call
        -> embeddings and each deepstack feature, split back by t*h*w / merge**2 per request and kind
    each request: one final chunk, exactly what a solo `EncoderTask.step` emits (edges.py's encoder -> thinker)

Concatenating the valid frames is what padding every audio to the longest and masking the padding would
give the tower: it only ever sees valid frames (`Qwen3OmniEncoder.audio_frames`). Both towers keep
requests apart (audio attention windows never span two clips, vision attention stays within a frame), so a
request's embeddings do not depend on the rest of its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omnimesh.engine.task import StageTask
from omnimesh.models.qwen3_omni.edges import encoder_outputs_to_tensors
from omnimesh.models.qwen3_omni.encoder import Qwen3OmniEncoder
from omnimesh.transport.frames import StageChunk


@dataclass(frozen=True)
class EncoderInputs:
    """One request's checked media, ready to join a batch (None: that modality is absent)."""

    frames: torch.Tensor | None = None  # (n_mel, sum T_valid) valid mel frames of its audios
    feature_lens: torch.Tensor | None = None  # (n_audio,) long
    pixel_values: torch.Tensor | None = None  # (n_patches, C*tp*p*p)
    grid_thw: torch.Tensor | None = None  # (n_images, 3) long
    video_pixels: torch.Tensor | None = None  # (n_video_patches, C*tp*p*p)
    video_grid_thw: torch.Tensor | None = None  # (n_videos, 3) long


def check_inputs(encoder: Qwen3OmniEncoder, tensors: dict[str, torch.Tensor]) -> EncoderInputs:
    """Everything a tower would refuse in this request's media, as a ValueError, before any batching."""
    frames = lens = pixels = grid = video_pixels = video_grid = None
    if "input_features" in tensors:
        frames, lens = encoder.audio_frames(tensors["input_features"], tensors["feature_attention_mask"])
    if "pixel_values" in tensors:
        pixels = tensors["pixel_values"]
        grid = encoder.check_image(pixels, tensors["image_grid_thw"])
    if "pixel_values_videos" in tensors:
        video_pixels = tensors["pixel_values_videos"]
        video_grid = encoder.check_image(video_pixels, tensors["video_grid_thw"], kind="video")
    return EncoderInputs(frames, lens, pixels, grid, video_pixels, video_grid)


def encode_batch(encoder: Qwen3OmniEncoder, batch: list[EncoderInputs]) -> list[dict[str, torch.Tensor]]:
    """At most one audio-tower call and one vision-tower call (images and videos) for all of `batch`; per
    request its output tensors."""
    audio: list[torch.Tensor | None] = [None] * len(batch)
    audios = [(i, r.frames, r.feature_lens) for i, r in enumerate(batch)
              if r.frames is not None and r.feature_lens is not None]
    if audios:
        embeds = encoder.audio_tower_call(torch.cat([f for _, f, _ in audios], dim=1),
                                          torch.cat([n for _, _, n in audios]))
        counts = [int(encoder.audio_output_lengths(n).sum()) for _, _, n in audios]
        for (i, _, _), part in zip(audios, _split(embeds, counts, "audio")):
            audio[i] = part
    # images and videos share ONE vision-tower call: (request, kind, patches, grid) in a fixed order
    visual = [(i, kind, p, g) for i, r in enumerate(batch)
              for kind, p, g in (("image", r.pixel_values, r.grid_thw), ("video", r.video_pixels, r.video_grid_thw))
              if p is not None and g is not None]
    parts: list[dict[str, tuple[torch.Tensor, list[torch.Tensor]]]] = [{} for _ in batch]
    if visual:
        embeds, deepstack = encoder.vision_tower_call(torch.cat([p for _, _, p, _ in visual]),
                                                      torch.cat([g for _, _, _, g in visual]))
        counts = [int(encoder.image_token_counts(g).sum()) for _, _, _, g in visual]
        per_layer = [_split(d, counts, "deepstack") for d in deepstack]  # [layer][item]
        for j, ((i, kind, _, _), part) in enumerate(zip(visual, _split(embeds, counts, "vision"))):
            parts[i][kind] = (part, [layer[j] for layer in per_layer])
    out = []
    for i, r in enumerate(batch):
        image, deep = parts[i].get("image", (None, None))
        out.append(encoder_outputs_to_tensors(audio[i], r.feature_lens, image, deep, video=parts[i].get("video")))
    return out


def _split(out: torch.Tensor, counts: list[int], what: str) -> tuple[torch.Tensor, ...]:
    if out.shape[0] != sum(counts):  # the towers' own length formulas disagree: a bug, not a request's fault
        raise RuntimeError(f"the {what} tower returned {out.shape[0]} rows for {sum(counts)} tokens {counts}")
    return out.split(counts, dim=0)


class EncoderBatcher:
    """`step_batch`: every given encoder request in one step (each is done after it: one chunk per request)."""

    def __init__(self, encoder: Qwen3OmniEncoder):
        self.encoder = encoder

    def step_batch(self, tasks: list[StageTask]) -> dict[str, list[StageChunk] | BaseException]:
        results: dict[str, list[StageChunk] | BaseException] = {}
        checked: list[tuple[StageTask, EncoderInputs]] = []
        for task in tasks:
            inputs = getattr(task, "inputs", None)
            if inputs is None:  # ready() prevents this
                results[task.request_id] = RuntimeError(f"encoder request {task.request_id} stepped before its media")
                continue
            try:
                checked.append((task, check_inputs(self.encoder, inputs)))
            except ValueError as exc:
                results[task.request_id] = exc
        if checked:
            for (task, _), tensors in zip(checked, encode_batch(self.encoder, [c for _, c in checked])):
                task.finished = True
                results[task.request_id] = [StageChunk(tensors=tensors)]
        return results
