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
With the stage's EncoderCache (encoder_cache.py) the towers run only on the media items it does not hold
(each item once per step), and each request's outputs are put together from its items' rows.

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
from services.encoder.encoder_cache import EncoderCache, Rows, key


@dataclass(frozen=True)
class EncoderInputs:
    """One request's checked media, ready to join a batch (None: that modality is absent)."""

    frames: torch.Tensor | None = None  # (n_mel, sum T_valid) valid mel frames of its audios
    feature_lens: torch.Tensor | None = None  # (n_audio,) long
    pixel_values: torch.Tensor | None = None  # (n_patches, C*tp*p*p)
    grid_thw: torch.Tensor | None = None  # (n_images, 3) long
    video_pixels: torch.Tensor | None = None  # (n_video_patches, C*tp*p*p)
    video_grid_thw: torch.Tensor | None = None  # (n_videos, 3) long
    # the gateway's content digests per item (gateway/media_digest.py): audio / image / video -> (n_items,) int64
    digests: dict[str, torch.Tensor] | None = None


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
    digests = {}
    for kind, items in (("audio", lens), ("image", grid), ("video", video_grid)):
        d = tensors.get(f"{kind}_hashes")
        if d is not None and items is not None:
            if d.dim() != 1 or d.shape[0] != items.shape[0]:
                raise ValueError(f"{kind}_hashes must hold one digest per {kind} ({items.shape[0]}), got shape "
                                 f"{tuple(d.shape)}")
            digests[kind] = d
    return EncoderInputs(frames, lens, pixels, grid, video_pixels, video_grid, digests or None)


def encode_batch(encoder: Qwen3OmniEncoder, batch: list[EncoderInputs],
                 cache: EncoderCache | None = None) -> list[dict[str, torch.Tensor]]:
    """At most one audio-tower call and one vision-tower call (images and videos) for all of `batch`; per
    request its output tensors. With a `cache` (encoder_cache.py) only the items it lacks run, each once."""
    items = [item for i, r in enumerate(batch) for item in _items(i, r)]
    keys = [_key(item) if cache is not None else None for item in items]
    rows: list[Rows | None] = [cache.get(k) if cache is not None and k is not None else None for k in keys]
    todo: dict[object, int] = {}  # each missing item once: its key (or its place, uncached) -> an index in items
    for j, (k, r) in enumerate(zip(keys, rows)):
        if r is None:
            todo.setdefault(k if k is not None else j, j)
    audios = [j for j in todo.values() if items[j].kind == "audio"]
    if audios:
        embeds = encoder.audio_tower_call(torch.cat([items[j].inputs[0] for j in audios], dim=1),
                                          torch.cat([items[j].inputs[1] for j in audios]))
        counts = [int(encoder.audio_output_lengths(items[j].inputs[1]).sum()) for j in audios]
        for j, part in zip(audios, _split(embeds, counts, "audio")):
            rows[j] = (part,)
    # images and videos share ONE vision-tower call, in batch order (request, then its images, then its videos)
    visual = [j for j in todo.values() if items[j].kind != "audio"]
    if visual:
        embeds, deepstack = encoder.vision_tower_call(torch.cat([items[j].inputs[0] for j in visual]),
                                                      torch.cat([items[j].inputs[1] for j in visual]))
        counts = [int(encoder.image_token_counts(items[j].inputs[1]).sum()) for j in visual]
        per_layer = [_split(d, counts, "deepstack") for d in deepstack]  # [layer][item]
        for n, (j, part) in enumerate(zip(visual, _split(embeds, counts, "vision"))):
            rows[j] = (part, *(layer[n] for layer in per_layer))
    for j, k in enumerate(keys):  # a duplicate in this step takes its twin's rows
        if rows[j] is None:
            rows[j] = rows[todo[k if k is not None else j]]
    if cache is not None:
        for j in todo.values():
            cache.put(keys[j], rows[j])  # type: ignore[arg-type]
    mine: list[list[tuple[str, Rows | None]]] = [[] for _ in batch]  # each request's items' rows, in order
    for item, item_rows in zip(items, rows):
        mine[item.request].append((item.kind, item_rows))
    return [_request_outputs(r, parts) for r, parts in zip(batch, mine)]


@dataclass(frozen=True)
class _Item:
    """One audio clip (its valid frames (n_mel, T), its length (1,)), image or video (patches, grid (1, 3))."""

    request: int
    kind: str  # audio | image | video
    inputs: tuple[torch.Tensor, torch.Tensor]
    digest: int | None = None  # the gateway's, when it sent one


def _items(i: int, r: EncoderInputs) -> list[_Item]:
    """A request's media as items, audio first, then images, then videos (each in prompt order)."""
    def digests(kind: str, n: int) -> list[int | None]:
        d = (r.digests or {}).get(kind)
        return d.tolist() if d is not None else [None] * n

    out: list[_Item] = []
    if r.frames is not None and r.feature_lens is not None:
        for frames, n, d in zip(r.frames.split(r.feature_lens.tolist(), dim=1), r.feature_lens.split(1),
                                digests("audio", r.feature_lens.shape[0])):
            out.append(_Item(i, "audio", (frames, n), d))
    for kind, pixels, grid in (("image", r.pixel_values, r.grid_thw), ("video", r.video_pixels, r.video_grid_thw)):
        if pixels is not None and grid is not None:
            sizes = grid.prod(-1).tolist()
            out.extend(_Item(i, kind, (p, g), d)
                       for p, g, d in zip(pixels.split(sizes), grid.split(1), digests(kind, grid.shape[0])))
    return out


def _key(item: _Item) -> bytes:
    """The gateway's digest with the item's shapes (cheap: it hashed the decoded media once), else the
    item's own bytes."""
    if item.digest is not None:
        shapes = torch.tensor([*item.inputs[0].shape, *item.inputs[1].reshape(-1).tolist(), item.digest])
        return key(f"{item.kind}#", shapes)
    return key(item.kind, *item.inputs)


def _request_outputs(r: EncoderInputs, parts: list[tuple[str, Rows | None]]) -> dict[str, torch.Tensor]:
    """One request's output tensors from its items' rows (in order): what edges.py's encoder -> thinker takes."""
    def joined(kind: str) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        mine = [rows for k, rows in parts if k == kind and rows is not None]
        if not mine:
            return None
        return torch.cat([m[0] for m in mine]), [torch.cat([m[d] for m in mine]) for d in range(1, len(mine[0]))]

    audio, image, video = joined("audio"), joined("image"), joined("video")
    return encoder_outputs_to_tensors(audio[0] if audio else None, r.feature_lens, image[0] if image else None,
                                      image[1] if image else None, video=video)


def _split(out: torch.Tensor, counts: list[int], what: str) -> tuple[torch.Tensor, ...]:
    if out.shape[0] != sum(counts):  # the towers' own length formulas disagree: a bug, not a request's fault
        raise RuntimeError(f"the {what} tower returned {out.shape[0]} rows for {sum(counts)} tokens {counts}")
    return out.split(counts, dim=0)


class EncoderBatcher:
    """`step_batch`: every given encoder request in one step (each is done after it: one chunk per request),
    through the stage's `cache` when it has one."""

    def __init__(self, encoder: Qwen3OmniEncoder, cache: EncoderCache | None = None):
        self.encoder = encoder
        self.cache = cache

    def stats(self) -> dict[str, int]:
        """The cache's counters for the stage's metrics (none without a cache)."""
        return self.cache.stats() if self.cache is not None else {}

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
            for (task, _), tensors in zip(checked, encode_batch(self.encoder, [c for _, c in checked], self.cache)):
                task.finished = True
                results[task.request_id] = [StageChunk(tensors=tensors)]
        return results
