"""Qwen3-Omni and Qwen2.5-Omni prompt processors with a torchvision-free video processor.

Role: turn a rendered chat prompt plus raw media into the thinker's inputs, exactly as transformers' own
`Qwen3OmniMoeProcessor` / `Qwen2_5OmniProcessor` do. Neither can be built here as the library builds it:
`ProcessorMixin` type-checks the video slot against transformers' video processor classes, which all need
torchvision, and torchvision does not import beside the CPU torch (see shared/MODELS.md).
`Qwen3OmniPromptProcessor` and `Qwen2_5OmniPromptProcessor` subclass the library classes and fill the
video slot with `video_processor.VideoFrameProcessor` (the same sampling, sizes and patch layout, PIL
resizing); what the two share (skipping that check, the call's own checks) is `OmniPromptProcessorMixin`.
So the placeholder expansion and `video_second_per_grid` are the library's code, not a copy:
- Qwen3-Omni: `<|audio_pad|>` / `<|image_pad|>` / `<|video_pad|>`, audio tokens from the windowed
  encoder length (`n_window`), a video's soundtrack merged token by token with its frames
  (`position_id_per_seconds` 13);
- Qwen2.5-Omni: `<|AUDIO|>` / `<|IMAGE|>` / `<|VIDEO|>`, audio tokens (((L-1)//2+1)-2)//2+1 for L mel
  frames (audio padded to 30 s), a video's soundtrack interleaved chunk by chunk (each `seconds_per_chunk`
  2 s: that chunk's video tokens, then its audio tokens; `position_id_per_seconds` 25);
- both: images and videos grid_t*grid_h*grid_w / merge_size**2 tokens.

Data flow:
    model folder -> load_processor: config.json `model_type` picks the class (PROCESSOR_CLASSES)
    text (chat template output) + audio (16 kHz float arrays) + images (PIL) + videos (sampled uint8
    frames (T, H, W, 3), with the sampling fps in `fps`; with `load_audio_from_video` the soundtracks are in
    `audio`, `audio_from_video_indices` saying which video each belongs to, and the processor interleaves
    their audio placeholders with the video's in time, by the family's rule above)
      -> WhisperFeatureExtractor: input_features (B, 128, frames), feature_attention_mask (B, frames)
      -> Qwen2VLImageProcessor (PIL backend): pixel_values (patches, C*T*P*P), image_grid_thw (N, 3)
      -> VideoFrameProcessor: pixel_values_videos (patches, C*T*P*P), video_grid_thw (n_videos, 3),
         video_second_per_grid (n_videos,) = temporal_patch_size / fps
      -> placeholders expanded in the text -> tokenizer: input_ids, attention_mask

Usage: processor = load_processor(model_dir)
       batch = processor(text=prompt, audio=[wave], images=[img], videos=[frames], fps=2.0)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, cast

import numpy as np
from PIL import Image
from transformers import (
    AutoTokenizer,
    BatchFeature,
    PreTrainedTokenizerBase,
    Qwen2VLImageProcessorPil,
    WhisperFeatureExtractor,
)
from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import Qwen2_5OmniProcessor
from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import Qwen3OmniMoeProcessor
from transformers.processing_utils import ProcessorMixin

from omnimesh.models.qwen3_omni.video_processor import VideoFrameProcessor, video_settings

SUPPORTED_FAMILIES = "Qwen3-Omni or Qwen2.5-Omni"


class OmniPromptProcessorMixin(ProcessorMixin):
    """The part both prompt processors share; it goes first in their bases, before the library class.

    A mixin rather than a wrapped object because the library class's own methods (placeholder expansion,
    kwargs merging, soundtrack interleaving) must run on this very object, with our video slot in it.
    """

    family: ClassVar[str]  # the model family, as error messages name it

    def __init__(
        self,
        image_processor: Qwen2VLImageProcessorPil | None = None,
        feature_extractor: WhisperFeatureExtractor | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        chat_template: str | None = None,
        video_processor: VideoFrameProcessor | None = None,
    ) -> None:
        # Skip the library class's __init__: ProcessorMixin would type-check a video_processor slot against
        # transformers' torchvision-based class. The attribute list comes from `get_attributes` below, so
        # ProcessorMixin checks the three library parts; the video part is set beside them.
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
        pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw, video_second_per_grid. Audio must be
        mono float arrays at the feature extractor's rate; the library class reads its own kwargs
        (`seconds_per_chunk`, `position_id_per_seconds`, Qwen3's `n_window`) with its own defaults."""
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
            # from it, with a family default of its own otherwise); the frames are already sampled, so the
            # video processor does no sampling of its own
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


class Qwen3OmniPromptProcessor(OmniPromptProcessorMixin, Qwen3OmniMoeProcessor):
    """`Qwen3OmniMoeProcessor` for text, audio, images and (already sampled) video frames."""

    family = "Qwen3-Omni"


class Qwen2_5OmniPromptProcessor(OmniPromptProcessorMixin, Qwen2_5OmniProcessor):
    """`Qwen2_5OmniProcessor` for text, audio, images and (already sampled) video frames."""

    family = "Qwen2.5-Omni"


OmniPromptProcessor = Qwen3OmniPromptProcessor | Qwen2_5OmniPromptProcessor
# config.json `model_type` -> the prompt processor of that family
PROCESSOR_CLASSES: dict[str, type[OmniPromptProcessor]] = {
    "qwen3_omni_moe": Qwen3OmniPromptProcessor,
    "qwen2_5_omni": Qwen2_5OmniPromptProcessor,
}


def processor_class(model_dir: Path) -> type[OmniPromptProcessor]:
    """The prompt processor class for the folder's config.json `model_type`."""
    config = model_dir / "config.json"
    if not config.is_file():
        raise ValueError(f"{model_dir} has no config.json; is it a {SUPPORTED_FAMILIES} model folder?")
    model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    if model_type not in PROCESSOR_CLASSES:
        raise ValueError(f"{config} has model_type {model_type!r}; the prompt processor supports model_type "
                         f"{' or '.join(map(repr, PROCESSOR_CLASSES))} ({SUPPORTED_FAMILIES})")
    return PROCESSOR_CLASSES[model_type]


def family_video_settings(model_dir: Path, cls: type[OmniPromptProcessor]) -> dict[str, Any]:
    """`video_settings(model_dir)`, with the family's own frame-area defaults where the folder sets none.

    Without a size in video_preprocessor_config.json (or without the file: the tiny Qwen2.5-Omni folder, and
    any folder made before transformers had separate video processors), `video_settings` takes Qwen3-Omni's
    frame area (128..768 x 32*32 pixels); transformers sizes frames by the processor class's
    `videos_kwargs["size"]`, which for Qwen2.5-Omni is 128..768 x 28*28.
    """
    settings = video_settings(model_dir)
    path = model_dir / "video_preprocessor_config.json"
    cfg = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    if not cfg.get("size"):
        size = cast(dict[str, int], cls.videos_kwargs["size"])
        for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            if key not in cfg:
                settings[key] = int(size[edge])
    return settings


def load_tokenizer(folder: Path | str) -> Any:
    """The folder's tokenizer, offline; a folder without one is a ValueError that names it."""
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"no tokenizer loads from {folder} ({str(exc).splitlines()[0][:200]}); it needs "
                         f"tokenizer_config.json and the tokenizer's files") from None


def load_processor(model_dir: Path | str, overrides: Mapping[str, Any] | None = None,
                   tokenizer_dir: Path | str | None = None) -> OmniPromptProcessor:
    """Build the prompt processor of a Qwen3-Omni or Qwen2.5-Omni Hugging Face folder, offline; `overrides`
    (--mm-processor-kwargs, gateway/processor_kwargs.py) replace the folder's min_pixels / max_pixels (images
    and video frames) and video fps / min_frames / max_frames; `tokenizer_dir` (--tokenizer) holds the
    tokenizer and chat template to use instead of the model folder's."""
    model_dir = Path(model_dir)
    cls = processor_class(model_dir)
    overrides = dict(overrides or {})
    pixels = {k: overrides[k] for k in ("min_pixels", "max_pixels") if k in overrides}
    if not (model_dir / "preprocessor_config.json").is_file():
        raise ValueError(f"{model_dir} has no preprocessor_config.json; is it a {cls.family} model folder "
                         "with its processor files?")
    tokenizer = load_tokenizer(tokenizer_dir or model_dir)
    for name in ("image_token", "audio_token", "video_token", "audio_bos_token", "vision_bos_token"):
        if getattr(tokenizer, name, None) is None:
            raise ValueError(
                f"tokenizer in {tokenizer_dir or model_dir} has no {name}; tokenizer_config.json must name the "
                f"{cls.family} media tokens (image_token, audio_token, video_token, vision/audio bos/eos)"
            )
    return cls(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(model_dir, local_files_only=True, **pixels),
        feature_extractor=WhisperFeatureExtractor.from_pretrained(model_dir, local_files_only=True),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
        video_processor=VideoFrameProcessor(**{**family_video_settings(model_dir, cls), **overrides}),
    )
