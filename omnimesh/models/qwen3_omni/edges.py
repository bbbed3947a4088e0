"""What crosses each Qwen3-Omni stage edge, as named tensors (the frames of a StageChunk).

    encoder -> thinker   audio_embeds (n_a, H), audio_feature_lengths (n_audio,), image_embeds (n_i, H),
                         deepstack_embeds (k, n_i, H), video_embeds (n_v, H), video_deepstack_embeds (k, n_v, H)
    gateway -> thinker   image_grid_thw (n_images, 3), video_grid_thw (n_videos, 3), video_second_per_grid
                         (n_videos,) float32, use_audio_in_video (1,) when set (with the prompt ids)
    thinker -> talker    first chunk: the TalkerPrompt (prompt_ids, prompt_embeds, multimodal_hidden,
                         tts_embeds [, image_grid_thw, audio_feature_lengths, video_grid_thw,
                         video_second_per_grid]; Qwen2.5-Omni: first_token (1,), use_audio_in_video (1,)
                         when set, prompt_embeds = its final hidden + layer-0 embeddings, multimodal_hidden and
                         tts_embeds empty); every chunk: token_embeds (Qwen2.5-Omni: each row r_j, the final
                         hidden + embedding of the token before)
                         (n, H) of the generated tokens the talker speaks; final=True when the text ended
    talker -> vocoder    codes (num_code_groups, n) int64
    vocoder -> client    pcm (samples,) float32 at 24 kHz

A tensor missing from an edge is a ValueError naming it (travels as INVALID_ARGUMENT).
"""

from __future__ import annotations

import torch

from omnimesh.models.qwen3_omni.thinker import TalkerPrompt

PROMPT_KEYS = ("prompt_ids", "prompt_embeds", "multimodal_hidden", "tts_embeds")


def require(tensors: dict[str, torch.Tensor], name: str, edge: str) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(f"{edge}: tensor {name!r} is missing; got {sorted(tensors)}")
    return tensors[name]


def require_ids(tensors: dict[str, torch.Tensor], name: str, edge: str) -> torch.Tensor:
    """`require` for token / code ids: an integer tensor (a float or bool one is the producer's bug), as int64."""
    ids = require(tensors, name, edge)
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"{edge}: {name} must be integer ids, got {str(ids.dtype).removeprefix('torch.')}")
    return ids.long()


def talker_prompt_to_tensors(prompt: TalkerPrompt) -> dict[str, torch.Tensor]:
    out = {
        "prompt_ids": prompt.input_ids,
        "prompt_embeds": prompt.prompt_embeds,
        "multimodal_hidden": prompt.multimodal_hidden,
        "tts_embeds": prompt.tts_embeds,
    }
    if prompt.image_grid_thw is not None:
        out["image_grid_thw"] = prompt.image_grid_thw
    if prompt.audio_feature_lengths is not None:
        out["audio_feature_lengths"] = prompt.audio_feature_lengths
    if prompt.video_grid_thw is not None and prompt.video_second_per_grid is not None:
        out["video_grid_thw"] = prompt.video_grid_thw
        out["video_second_per_grid"] = prompt.video_second_per_grid
    if prompt.first_token is not None:
        out["first_token"] = prompt.first_token
    if prompt.use_audio_in_video:
        out["use_audio_in_video"] = torch.ones(1, dtype=torch.int64)
    return out


def talker_prompt_from_tensors(tensors: dict[str, torch.Tensor]) -> TalkerPrompt:
    edge = "thinker -> talker"
    return TalkerPrompt(
        input_ids=require_ids(tensors, "prompt_ids", edge),
        prompt_embeds=require(tensors, "prompt_embeds", edge),
        multimodal_hidden=require(tensors, "multimodal_hidden", edge),
        tts_embeds=require(tensors, "tts_embeds", edge),
        image_grid_thw=tensors.get("image_grid_thw"),
        audio_feature_lengths=tensors.get("audio_feature_lengths"),
        video_grid_thw=tensors.get("video_grid_thw"),
        video_second_per_grid=tensors.get("video_second_per_grid"),
        first_token=require_ids(tensors, "first_token", edge) if "first_token" in tensors else None,
        use_audio_in_video=flag(tensors, "use_audio_in_video"),
    )


def flag(tensors: dict[str, torch.Tensor], name: str) -> bool:
    """A yes/no that travels as a one-element tensor when set (absent: no)."""
    return name in tensors and bool(tensors[name].reshape(-1)[0])


def encoder_outputs_to_tensors(
    audio_embeds: torch.Tensor | None,
    audio_feature_lengths: torch.Tensor | None,
    image_embeds: torch.Tensor | None,
    deepstack: list[torch.Tensor] | None,
    video: tuple[torch.Tensor, list[torch.Tensor]] | None = None,
) -> dict[str, torch.Tensor]:
    """The encoder's answer; `video` is (video_embeds (n_v, H), its deepstack features [(n_v, H)] * k)."""
    out: dict[str, torch.Tensor] = {}
    if audio_embeds is not None:
        if audio_feature_lengths is None:
            raise ValueError("audio_embeds need audio_feature_lengths (valid mel frames per audio)")
        out["audio_embeds"] = audio_embeds
        out["audio_feature_lengths"] = audio_feature_lengths
    if image_embeds is not None:
        out["image_embeds"] = image_embeds
        out["deepstack_embeds"] = _stack(deepstack, image_embeds)
    if video is not None:
        out["video_embeds"] = video[0]
        out["video_deepstack_embeds"] = _stack(video[1], video[0])
    return out


def _stack(deepstack: list[torch.Tensor] | None, embeds: torch.Tensor) -> torch.Tensor:
    return torch.stack(deepstack) if deepstack else embeds.new_zeros(0, *embeds.shape)  # (k, n, H)
