"""Qwen3-Omni prompt processor without a video processor (no torchvision needed).

Role: turn a rendered chat prompt plus raw media into the thinker's inputs, exactly as the real
`Qwen3OmniMoeProcessor` does. `AutoProcessor` cannot build that class here: it insists on a video
processor, and every video processor needs torchvision, which does not import beside the CPU torch
(see shared/MODELS.md). `Qwen3OmniPromptProcessor` subclasses the real processor and only drops the
video slot, so the placeholder expansion (`<|audio_pad|>` x audio-encoder output length,
`<|image_pad|>` x grid_t*grid_h*grid_w / merge_size**2) is the library's own code, not a copy.

Data flow:
    text (chat template output) + audio (16 kHz float arrays) + images (PIL)
      -> WhisperFeatureExtractor: input_features (B, 128, frames), feature_attention_mask (B, frames)
      -> Qwen2VLImageProcessor (PIL backend): pixel_values (patches, C*T*P*P), image_grid_thw (N, 3)
      -> placeholders expanded in the text -> tokenizer: input_ids, attention_mask

Usage: processor = load_processor(model_dir); batch = processor(text=prompt, audio=[wave], images=[img])
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from transformers import (
    AutoTokenizer,
    BatchFeature,
    PreTrainedTokenizerBase,
    Qwen2VLImageProcessorPil,
    WhisperFeatureExtractor,
)
from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import Qwen3OmniMoeProcessor
from transformers.processing_utils import ProcessorMixin


class Qwen3OmniPromptProcessor(Qwen3OmniMoeProcessor):
    """`Qwen3OmniMoeProcessor` for text, audio and images; video input raises a ValueError."""

    def __init__(
        self,
        image_processor: Qwen2VLImageProcessorPil | None = None,
        feature_extractor: WhisperFeatureExtractor | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        chat_template: str | None = None,
    ) -> None:
        # Skip Qwen3OmniMoeProcessor.__init__ (it passes a video_processor slot); the attribute list
        # comes from this signature, so ProcessorMixin checks only the three parts we have.
        ProcessorMixin.__init__(self, image_processor, feature_extractor, tokenizer, chat_template=chat_template)
        tok = self.tokenizer
        self.image_token = tok.image_token
        self.audio_token = tok.audio_token
        self.video_token = tok.video_token
        self.image_token_id = tok.image_token_id
        self.audio_token_id = tok.audio_token_id
        self.video_token_id = tok.video_token_id
        self.vision_bos_token = tok.vision_bos_token
        self.vision_eos_token = tok.vision_eos_token
        self.audio_bos_token = tok.audio_bos_token
        self.audio_eos_token = tok.audio_eos_token

    def __call__(
        self,
        text: str | list[str] | None = None,
        audio: list[np.ndarray] | None = None,
        images: list[Image.Image] | None = None,
        **kwargs: Any,
    ) -> BatchFeature:
        """Return input_ids, attention_mask and, when given, input_features, feature_attention_mask,
        pixel_values, image_grid_thw. Audio must be mono float arrays at the feature extractor's rate."""
        if kwargs.get("videos") is not None:
            raise ValueError(
                "Qwen3OmniPromptProcessor has no video processor (it needs torchvision); "
                "send frames as images or drop the video part"
            )
        kwargs.pop("videos", None)
        if text is None:
            raise ValueError("text is required: render the chat template first, then call the processor")
        sampling_rate = kwargs.pop("sampling_rate", self.feature_extractor.sampling_rate)
        if sampling_rate != self.feature_extractor.sampling_rate:
            raise ValueError(
                f"audio is at {sampling_rate} Hz but the feature extractor expects "
                f"{self.feature_extractor.sampling_rate} Hz; resample it first"
            )
        return super().__call__(text=text, images=images, audio=audio, **kwargs)

    @property
    def model_input_names(self) -> list[str]:
        names = (
            self.tokenizer.model_input_names
            + self.feature_extractor.model_input_names
            + self.image_processor.model_input_names
            + ["feature_attention_mask"]
        )
        return list(dict.fromkeys(names))


def load_processor(model_dir: Path | str) -> Qwen3OmniPromptProcessor:
    """Build the prompt processor from a Hugging Face model folder, offline."""
    model_dir = Path(model_dir)
    if not (model_dir / "preprocessor_config.json").is_file():
        raise ValueError(f"{model_dir} has no preprocessor_config.json; is it a Qwen3-Omni model folder?")
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    for name in ("image_token", "audio_token", "video_token", "audio_bos_token", "vision_bos_token"):
        if getattr(tokenizer, name, None) is None:
            raise ValueError(
                f"tokenizer in {model_dir} has no {name}; tokenizer_config.json must name the Qwen3-Omni "
                "media tokens (image_token, audio_token, video_token, vision/audio bos/eos)"
            )
    return Qwen3OmniPromptProcessor(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(model_dir, local_files_only=True),
        feature_extractor=WhisperFeatureExtractor.from_pretrained(model_dir, local_files_only=True),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    )
