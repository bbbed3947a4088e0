"""Qwen3-Omni prompt processor with a torchvision-free video processor.

Role: turn a rendered chat prompt plus raw media into the thinker's inputs, exactly as the real
`Qwen3OmniMoeProcessor` does. `AutoProcessor` cannot build that class here: it insists on a video
processor, and every transformers video processor needs torchvision, which does not import beside the
CPU torch (see shared/MODELS.md). `Qwen3OmniPromptProcessor` subclasses the real processor and fills the
video slot with `video_processor.VideoFrameProcessor` (the same sampling, sizes and patch layout, PIL
resizing), so the placeholder expansion (`<|audio_pad|>` x audio-encoder output length,
`<|image_pad|>` / `<|video_pad|>` x grid_t*grid_h*grid_w / merge_size**2) and `video_second_per_grid`
are the library's own code, not a copy.

Data flow:
    text (chat template output) + audio (16 kHz float arrays) + images (PIL) + videos (sampled uint8
    frames (T, H, W, 3), with the sampling fps in `fps`; with `load_audio_from_video` the soundtracks are in
    `audio`, `audio_from_video_indices` saying which video each belongs to, and the processor interleaves
    their `<|audio_pad|>`s with the video's `<|video_pad|>`s in time)
      -> WhisperFeatureExtractor: input_features (B, 128, frames), feature_attention_mask (B, frames)
      -> Qwen2VLImageProcessor (PIL backend): pixel_values (patches, C*T*P*P), image_grid_thw (N, 3)
      -> VideoFrameProcessor: pixel_values_videos (patches, C*T*P*P), video_grid_thw (n_videos, 3),
         video_second_per_grid (n_videos,) = temporal_patch_size / fps
      -> placeholders expanded in the text -> tokenizer: input_ids, attention_mask

Usage: processor = load_processor(model_dir)
       batch = processor(text=prompt, audio=[wave], images=[img], videos=[frames], fps=2.0)
"""

from __future__ import annotations

from pathlib import Path
from collections.abc import Mapping
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

from omnimesh.models.qwen3_omni.video_processor import VideoFrameProcessor, video_settings


class Qwen3OmniPromptProcessor(Qwen3OmniMoeProcessor):
    """`Qwen3OmniMoeProcessor` for text, audio, images and (already sampled) video frames."""

    def __init__(
        self,
        image_processor: Qwen2VLImageProcessorPil | None = None,
        feature_extractor: WhisperFeatureExtractor | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        chat_template: str | None = None,
        video_processor: VideoFrameProcessor | None = None,
    ) -> None:
        # Skip Qwen3OmniMoeProcessor.__init__: ProcessorMixin would type-check a video_processor slot
        # against transformers' torchvision-based class. The attribute list comes from `get_attributes`
        # below, so ProcessorMixin checks the three library parts; the video part is set beside them.
        ProcessorMixin.__init__(self, image_processor, feature_extractor, tokenizer, chat_template=chat_template)
        if video_processor is not None:
            self.video_processor = video_processor
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

    @classmethod
    def get_attributes(cls) -> list[str]:
        """The library-typed parts (saved, type-checked); the video part is ours and is not among them."""
        return ["image_processor", "feature_extractor", "tokenizer"]

    def __call__(
        self,
        text: str | list[str] | None = None,
        audio: list[np.ndarray] | None = None,
        images: list[Image.Image] | None = None,
        **kwargs: Any,
    ) -> BatchFeature:
        """Return input_ids, attention_mask and, when given, input_features, feature_attention_mask,
        pixel_values, image_grid_thw. Audio must be mono float arrays at the feature extractor's rate."""
        videos = kwargs.pop("videos", None)
        if videos is not None and not hasattr(self, "video_processor"):
            raise ValueError("this processor was built without a video processor; drop the video part")
        if kwargs.pop("use_audio_in_video", False):  # transformers' older name for load_audio_from_video
            kwargs["load_audio_from_video"] = True
        if kwargs.get("load_audio_from_video") and kwargs.get("audio_from_video_indices") is None:
            # transformers would decode the soundtracks itself with torchcodec, which is not installed here
            raise ValueError("load_audio_from_video needs the videos' soundtracks already decoded: pass them in "
                             "`audio` with `audio_from_video_indices` (the video index of each audio, None for a "
                             "standalone clip)")
        if text is None:
            raise ValueError("text is required: render the chat template first, then call the processor")
        sampling_rate = kwargs.pop("sampling_rate", self.feature_extractor.sampling_rate)
        if sampling_rate != self.feature_extractor.sampling_rate:
            raise ValueError(
                f"audio is at {sampling_rate} Hz but the feature extractor expects "
                f"{self.feature_extractor.sampling_rate} Hz; resample it first"
            )
        if videos is not None:
            # `fps` is the rate the frames were sampled at (`_process_videos` derives video_second_per_grid
            # from it); the frames are already sampled, so the video processor does no sampling of its own
            kwargs.setdefault("fps", self.video_processor.sampling.fps)
        return super().__call__(text=text, images=images, videos=videos, audio=audio, **kwargs)

    @property
    def model_input_names(self) -> list[str]:
        names = (
            self.tokenizer.model_input_names
            + self.feature_extractor.model_input_names
            + self.image_processor.model_input_names
            + (self.video_processor.model_input_names if hasattr(self, "video_processor") else [])
            + ["feature_attention_mask", "video_second_per_grid"]
        )
        return list(dict.fromkeys(names))


def load_processor(model_dir: Path | str, overrides: Mapping[str, Any] | None = None) -> Qwen3OmniPromptProcessor:
    """Build the prompt processor from a Hugging Face model folder, offline; `overrides` (--mm-processor-kwargs,
    gateway/processor_kwargs.py) replace the folder's min_pixels / max_pixels (images and video frames) and
    video fps / min_frames / max_frames."""
    model_dir = Path(model_dir)
    overrides = dict(overrides or {})
    pixels = {k: overrides[k] for k in ("min_pixels", "max_pixels") if k in overrides}
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
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(model_dir, local_files_only=True, **pixels),
        feature_extractor=WhisperFeatureExtractor.from_pretrained(model_dir, local_files_only=True),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
        video_processor=VideoFrameProcessor(**{**video_settings(model_dir), **overrides}),
    )
