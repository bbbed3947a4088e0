"""Prompt preparation for the Qwen3-Omni family: a `ChatRequest`'s messages -> the thinker's inputs.

Data flow:
    ChatRequest.messages --render_conversation--> HF-style conversation (text / {"type": "audio"} /
      {"type": "image"} parts) + the audio arrays (16 kHz) and PIL images in order of appearance
    --tokenizer.apply_chat_template (add_generation_prompt)--> prompt text with one <|audio_pad|> /
      <|image_pad|> per item
    --processor (Qwen3OmniMoeProcessor API: Whisper features, Qwen2-VL patches, placeholder expansion)-->
    PromptInputs (torch, CPU): input_ids (L,), input_features (n_audio, n_mel, T), feature_attention_mask
      (n_audio, T), pixel_values (n_patches, C*tps*ps*ps), image_grid_thw (n_images, 3), prompt_tokens.

The audio fields keep the processor's leading clip axis (one row per clip, zero-padded to the longest,
the mask marks real frames): each clip's audio-token count depends on its own length, so several clips
cannot share one (n_mel, T) row; this is exactly what the thinker's `get_audio_features` takes. Problems
with the request (no user message, prompt too long, a template the messages break) are 400
`PipelineError`s. CPU-bound: call it off the event loop (`await asyncio.to_thread(builder, request)`).

    builder = PromptBuilder(model_dir, max_model_len=4096)   # or PromptBuilder(processor, ...)
    inputs = builder(chat_request)                            # = builder.build(chat_request)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gateway.events import AudioPart, ChatMessage, ChatRequest, ImagePart, TextPart
from gateway.media import TARGET_SAMPLE_RATE, invalid_request, resample


@dataclass(frozen=True, slots=True)
class PromptInputs:
    """The thinker's inputs for one request (CPU tensors; the batch axis dropped from input_ids)."""

    input_ids: torch.Tensor  # (L,) int64
    input_features: torch.Tensor | None  # (n_audio, n_mel, T) float32, None without audio
    feature_attention_mask: torch.Tensor | None  # (n_audio, T) int64, 1 = real frame
    pixel_values: torch.Tensor | None  # (n_patches, C * temporal_patch * patch * patch) float32
    image_grid_thw: torch.Tensor | None  # (n_images, 3) int64
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class Conversation:
    """Messages in the chat template's format, plus the media they point at, in order of appearance."""

    messages: list[dict[str, Any]]
    audio: list[np.ndarray]  # each (samples,) float32 at 16 kHz
    images: list[Any]  # PIL.Image.Image, RGB


def render_conversation(messages: tuple[ChatMessage, ...]) -> Conversation:
    """ChatMessages -> template messages; media parts become `{"type": "audio"}` / `{"type": "image"}`."""
    out: list[dict[str, Any]] = []
    audio: list[np.ndarray] = []
    images: list[Any] = []
    for m in messages:
        parts: list[dict[str, Any]] = []
        for p in m.content:
            if isinstance(p, TextPart):
                parts.append({"type": "text", "text": p.text})
            elif isinstance(p, AudioPart):
                wave = np.asarray(p.waveform, dtype=np.float32).reshape(-1)  # (samples,)
                if p.sample_rate != TARGET_SAMPLE_RATE:
                    wave = resample(wave, p.sample_rate, TARGET_SAMPLE_RATE)
                audio.append(wave)
                parts.append({"type": "audio"})
            elif isinstance(p, ImagePart):
                images.append(p.image)
                parts.append({"type": "image"})
            else:
                raise TypeError(f"unknown content part {type(p).__name__}")
        out.append({"role": m.role, "content": parts})
    return Conversation(messages=out, audio=audio, images=images)


def _tensor(x: Any, dtype: torch.dtype) -> torch.Tensor | None:
    if x is None:
        return None
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
    return t.to(dtype).contiguous()


class PromptBuilder:
    """Applies one model's chat template and processor; checks the result against `max_model_len`.

    `source` is a Hugging Face Qwen3-Omni folder (tiny or real; its processor is loaded offline with
    `omnimesh.models.qwen3_omni.processor.load_processor`) or an already built processor.
    """

    def __init__(self, source: str | Path | Any, *, max_model_len: int) -> None:
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {max_model_len}")
        if isinstance(source, (str, Path)):
            from omnimesh.models.qwen3_omni.processor import load_processor

            source = load_processor(source)
        self.processor = source
        self.max_model_len = max_model_len

    def __call__(self, request: ChatRequest) -> PromptInputs:
        return self.build(request)

    def render(self, request: ChatRequest) -> tuple[str, Conversation]:
        """The prompt text (one placeholder per media item) and the media, in prompt order."""
        if not any(m.role == "user" for m in request.messages):
            raise invalid_request("messages: at least one user message is required", "messages")
        conv = render_conversation(request.messages)
        try:
            text = self.processor.tokenizer.apply_chat_template(conv.messages, tokenize=False,
                                                                add_generation_prompt=True)
        except Exception as e:  # jinja's raise_exception / TemplateError: the messages break the template
            raise invalid_request(f"messages: the model's chat template rejected them: {e}", "messages") from None
        return str(text), conv

    def build(self, request: ChatRequest) -> PromptInputs:
        text, conv = self.render(request)
        try:
            batch = self.processor(text=[text], audio=conv.audio or None, images=conv.images or None,
                                   return_tensors="pt")
        except ValueError as e:
            raise invalid_request(f"messages: could not prepare the prompt: {e}", "messages") from None
        ids = _tensor(batch["input_ids"], torch.int64)
        if ids is None or ids.ndim != 2 or ids.shape[0] != 1:
            raise RuntimeError(f"the processor returned input_ids of shape {getattr(ids, 'shape', None)}, "
                               "expected (1, L) for one prompt")
        input_ids = ids[0]  # (L,)
        n = int(input_ids.shape[0])
        if n >= self.max_model_len:
            raise invalid_request(
                f"the prompt is {n} tokens, but this model's maximum context length (max_model_len) is "
                f"{self.max_model_len} tokens; shorten the messages or send less audio / smaller images",
                "messages")
        want = request.sampling.max_tokens
        if want is not None and n + want > self.max_model_len:
            raise invalid_request(
                f"the prompt is {n} tokens and max_tokens asks for {want} more, {n + want} in all, but "
                f"this model's maximum context length (max_model_len) is {self.max_model_len} tokens; "
                f"lower max_tokens to at most {self.max_model_len - n}", "max_tokens")
        has_audio = bool(conv.audio)
        has_images = bool(conv.images)
        return PromptInputs(
            input_ids=input_ids,
            input_features=_tensor(batch.get("input_features"), torch.float32) if has_audio else None,
            feature_attention_mask=_tensor(batch.get("feature_attention_mask"), torch.int64) if has_audio else None,
            pixel_values=_tensor(batch.get("pixel_values"), torch.float32) if has_images else None,
            image_grid_thw=_tensor(batch.get("image_grid_thw"), torch.int64) if has_images else None,
            prompt_tokens=n,
        )
