"""Prompt preparation for the Qwen3-Omni family: a `ChatRequest`'s messages -> the thinker's inputs.

Data flow:
    ChatRequest.messages --render_conversation--> HF-style conversation (text / {"type": "audio"} /
      {"type": "image"} / {"type": "video"} parts) + the audio arrays (16 kHz), PIL images and sampled
      video frames in order of appearance
    --tokenizer.apply_chat_template (the request's TemplateOptions)--> prompt text with one <|audio_pad|> /
      <|image_pad|> / <|video_pad|> per item
    --processor (Qwen3OmniMoeProcessor API: Whisper features, Qwen2-VL patches, placeholder expansion)-->
    PromptInputs (torch, CPU): input_ids (L,), input_features (n_audio, n_mel, T), feature_attention_mask
      (n_audio, T), pixel_values (n_patches, C*tps*ps*ps), image_grid_thw (n_images, 3),
      pixel_values_videos (n_video_patches, C*tps*ps*ps), video_grid_thw (n_videos, 3),
      video_second_per_grid (n_videos,), prompt_tokens, use_audio_in_video.
With use_audio_in_video (a `VideoPart` carrying its soundtrack) the soundtrack joins the audio list at the
video's place and the processor interleaves its `<|audio_pad|>`s with the video's `<|video_pad|>`s.

The audio fields keep the processor's leading clip axis (one row per clip, zero-padded to the longest,
the mask marks real frames): each clip's audio-token count depends on its own length, so several clips
cannot share one (n_mel, T) row; this is exactly what the thinker's `get_audio_features` takes. Problems
with the request (no user message, prompt too long, a template the messages break) are 400
`PipelineError`s. `chat_template` (vLLM's --chat-template, `load_chat_template`) replaces the model's
template; it is tried on a probe conversation at start-up. `encode` gives /tokenize the same ids. A request
with `prompt_ids` (a /v1/completions prompt, tokenized by its route) skips all of this: its ids are the
prompt, checked against max_model_len like any other. CPU-bound: call it off the event loop (`await asyncio.to_thread(builder, request)`).

    builder = PromptBuilder(model_dir, max_model_len=4096)   # or PromptBuilder(processor, ...)
    inputs = builder(chat_request)                            # = builder.build(chat_request)
"""

from __future__ import annotations

import functools
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gateway.content_format import as_strings, check_content_format, detect_content_format, media_placeholders
from gateway.events import AudioPart, ChatMessage, ChatRequest, ImagePart, PipelineError, TextPart, VideoPart
from gateway.media import TARGET_SAMPLE_RATE, invalid_request, resample
from gateway.media_digest import media_digests
from omnimesh import json_text

MAX_VARIANTS = 8  # processors kept for requests with their own mm_processor_kwargs
log = logging.getLogger(__name__)


def images_too_long(tokens: int, max_model_len: int, param: str) -> PipelineError:
    return invalid_request(
        f"the images alone are {tokens} tokens at this request's processor settings, but this model's maximum "
        f"context length (max_model_len) is {max_model_len} tokens; send smaller images or a lower "
        "mm_processor_kwargs min_pixels / max_pixels", param)


def _image_token_count(processor: Any) -> Callable[[int, int], int] | None:
    """(width, height) -> the tokens an image of that size takes with this processor (its resize rule; a
    ValueError for a shape the rule refuses); None when its image processor cannot say."""
    images = getattr(processor, "image_processor", None)
    patches = getattr(images, "get_number_of_image_patches", None)
    if patches is None:
        return None
    merge = int(getattr(images, "merge_size", 1) or 1)
    return lambda width, height: int(patches(height, width, {})) // merge**2


class ImageTokens:
    """The tokens of a request's images so far, each counted from its header's size by the processor's resize
    rule (`count(width, height)`) before its pixels are decoded: images that alone reach max_model_len would be
    refused once the prompt is built, after their pixels were decoded (32 flat 4096x4096 PNGs, 2.4 MB of body,
    took a gateway to 4.2 GB and 17 s), so they are refused at the first image over it: first from every inline
    image's header before any of the request's media is decoded (`precheck`), then as each is decoded (`add`)."""

    def __init__(self, count: Callable[[int, int], int], max_model_len: int) -> None:
        self.count, self.max_model_len, self.tokens = count, max_model_len, 0

    def include(self, width: int, height: int) -> None:
        """An image already accepted (a Realtime conversation's), counted without a check."""
        self.tokens += self.count(width, height)

    def precheck(self, sizes: Iterable[tuple[int, int, str]], max_pixels: int) -> None:
        """A request's images by their headers' sizes (width, height, field; in order, those whose header was
        readable), before any of its media is decoded: the 400 that `add` would give at an image's decode, given
        now, and nothing counted (each image is counted by `add` as it is decoded). Before, the images ahead of
        the one that crossed max_model_len were decoded first, and the request's audio and videos with them.
        It stops at an image over `max_pixels`: its decode refuses it (413) before it is counted."""
        scratch = ImageTokens(self.count, self.max_model_len)
        scratch.tokens = self.tokens
        for width, height, param in sizes:
            if width * height > max_pixels:
                return
            scratch.add(width, height, param)

    def add(self, width: int, height: int, param: str) -> None:
        """One more image (its field: `param`); a 400 naming it when the images now reach max_model_len, or when
        the resize rule refuses its shape (an aspect ratio over 200)."""
        try:
            self.tokens += self.count(width, height)
        except ValueError as e:
            raise invalid_request(f"{param}: could not prepare the image for this model: {e}", param) from None
        if self.tokens >= self.max_model_len:
            raise images_too_long(self.tokens, self.max_model_len, param)


@dataclass(frozen=True, slots=True)
class PromptInputs:
    """The thinker's inputs for one request (CPU tensors; the batch axis dropped from input_ids)."""

    input_ids: torch.Tensor  # (L,) int64
    input_features: torch.Tensor | None  # (n_audio, n_mel, T) float32, None without audio
    feature_attention_mask: torch.Tensor | None  # (n_audio, T) int64, 1 = real frame
    pixel_values: torch.Tensor | None  # (n_patches, C * temporal_patch * patch * patch) float32
    image_grid_thw: torch.Tensor | None  # (n_images, 3) int64
    prompt_tokens: int
    pixel_values_videos: torch.Tensor | None = None  # (n_video_patches, C * temporal_patch * patch * patch) float32
    video_grid_thw: torch.Tensor | None = None  # (n_videos, 3) int64
    video_second_per_grid: torch.Tensor | None = None  # (n_videos,) float32
    use_audio_in_video: bool = False  # the videos' soundtracks are among the audio, interleaved with their frames
    # each media item's content digest, per modality in prompt order (gateway/media_digest.py): the thinker's
    # prefix cache keys media rows by them
    media_hashes: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Conversation:
    """Messages in the chat template's format, plus the media they point at, in order of appearance."""

    messages: list[dict[str, Any]]
    audio: list[np.ndarray]  # each (samples,) float32 at 16 kHz
    images: list[Any]  # PIL.Image.Image, RGB
    videos: list[np.ndarray] = field(default_factory=list)  # each (T, H, W, 3) uint8, sampled frames
    video_fps: float | None = None  # the rate every video's frames were sampled at
    # use_audio_in_video: for each entry of `audio`, the index of the video it is the soundtrack of (None:
    # a standalone clip); None when the videos' soundtracks are not used
    audio_from_video: list[int | None] | None = None


def render_conversation(messages: tuple[ChatMessage, ...]) -> Conversation:
    """ChatMessages -> template messages; media parts become `{"type": "audio"}` / `{"type": "image"}`."""
    out: list[dict[str, Any]] = []
    audio: list[np.ndarray] = []
    images: list[Any] = []
    videos: list[VideoPart] = []
    audio_from_video: list[int | None] = []
    for m in messages:
        parts: list[dict[str, Any]] = []
        for p in m.content:
            if not isinstance(p, TextPart) and p.released:  # a bug, never a prompt without its media
                raise RuntimeError("a media part was let go before this build (gateway/media_release.py): a run "
                                   "that builds from it again must not be handed to own_media")
            if isinstance(p, TextPart):
                parts.append({"type": "text", "text": p.text})
            elif isinstance(p, AudioPart):
                audio.append(_at_16k(p))
                audio_from_video.append(None)
                parts.append({"type": "audio"})
            elif isinstance(p, ImagePart):
                images.append(p.image)
                parts.append({"type": "image"})
            elif isinstance(p, VideoPart):
                if p.audio is not None:  # its soundtrack: an audio slot of its own, at the video's place
                    audio.append(_at_16k(p.audio))
                    audio_from_video.append(len(videos))
                videos.append(p)
                parts.append({"type": "video"})
            else:
                raise TypeError(f"unknown content part {type(p).__name__}")
        message: dict[str, Any] = {"role": m.role, "content": parts}
        if m.tool_calls:  # as the Qwen / Hermes templates read them: arguments as an object when they are JSON
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                                     for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.reasoning is not None:  # as vLLM hands it over: a thinking model's template reads it
            message["reasoning_content"] = m.reasoning
        out.append(message)
    if len({v.fps for v in videos}) > 1:  # the processor takes one fps per call; one loader samples them all alike
        raise invalid_request(f"messages: the videos were sampled at different rates {sorted({v.fps for v in videos})}",
                              "messages")
    heard = sum(v.audio is not None for v in videos)
    if heard not in (0, len(videos)):  # the model's positions assume all or none (use_audio_in_video)
        raise invalid_request(f"messages: {heard} of {len(videos)} videos carry their soundtrack; with "
                              "use_audio_in_video every video needs one", "messages")
    return Conversation(messages=out, audio=audio, images=images, videos=[v.frames for v in videos],
                        video_fps=videos[0].fps if videos else None,
                        audio_from_video=audio_from_video if heard else None)


def _arguments(text: str) -> Any:
    """A call's arguments for the template: the JSON object they hold (as vLLM passes them), else the text."""
    try:
        value = json_text.loads(text)  # nested too deeply, a lone surrogate: ValueErrors too
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _at_16k(part: AudioPart) -> np.ndarray:
    """An audio part's samples (samples,) float32 at the feature extractor's 16 kHz."""
    wave = np.asarray(part.waveform, dtype=np.float32).reshape(-1)
    return wave if part.sample_rate == TARGET_SAMPLE_RATE else resample(wave, part.sample_rate, TARGET_SAMPLE_RATE)


def _tensor(x: Any, dtype: torch.dtype) -> torch.Tensor | None:
    if x is None:
        return None
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
    return t.to(dtype).contiguous()


class PromptBuilder:
    """Applies one model's chat template and processor; checks the result against `max_model_len`.

    `source` is a Hugging Face Qwen3-Omni or Qwen2.5-Omni folder (tiny or real; its processor is loaded offline with
    `omnimesh.models.qwen3_omni.processor.load_processor`) or an already built processor.
    """

    def __init__(self, source: str | Path | Any, *, max_model_len: int, chat_template: str | None = None,
                 processor_kwargs: dict[str, Any] | None = None, content_format: str = "auto",
                 default_kwargs: dict[str, Any] | None = None, trust_request_template: bool = False,
                 tokenizer: str | Path | None = None) -> None:
        """`processor_kwargs`: --mm-processor-kwargs (gateway/processor_kwargs.py), for a folder `source`;
        `content_format`: --chat-template-content-format (gateway/content_format.py); `default_kwargs`:
        --default-chat-template-kwargs, the template variables under every request's own;
        `trust_request_template`: --trust-request-chat-template (a request's own `chat_template` is rendered)."""
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {max_model_len}")
        self._folder: Path | None = None  # where processors for a request's own settings are loaded from
        self._tokenizer = tokenizer  # --tokenizer: the folder of the tokenizer and its template (None: the model's)
        self._base_kwargs = dict(processor_kwargs or {})
        self._variants: OrderedDict[tuple[tuple[str, float], ...], Any] = OrderedDict()  # the last few, LRU
        self._variants_lock = threading.Lock()
        if isinstance(source, (str, Path)):
            from omnimesh.models.qwen3_omni.processor import load_processor

            self._folder = Path(source)
            source = load_processor(source, processor_kwargs, tokenizer)
        self.processor = source
        self.max_model_len = max_model_len
        self._longest_token: int | None = None  # characters of the vocabulary's longest token (check_chars)
        self.chat_template = chat_template  # None: the model's own (tokenizer_config / chat_template.jinja)
        self.content_format_flag = check_content_format(content_format)  # a request's own template: detected too
        if content_format == "auto":
            content_format = detect_content_format(self.template_source)
        self.content_format = content_format  # "openai": contents as part lists; "string": one string each
        self.default_kwargs = dict(default_kwargs or {})
        self.trust_request_template = trust_request_template
        if chat_template is not None or self.default_kwargs:
            check_chat_template(self)

    def __call__(self, request: ChatRequest) -> PromptInputs:
        return self.build(request)

    def render(self, request: ChatRequest) -> tuple[str, Conversation]:
        """The prompt text (one placeholder per media item) and the media, in prompt order; how it ends and the
        template's own variables are the request's `template` (gateway/chat_template_options.py)."""
        if not any(m.role == "user" for m in request.messages):
            where = request.conversation_param
            raise invalid_request(f"{where}: at least one user message is required", where)
        conv = render_conversation(request.messages)
        options = request.template
        template, fmt, whose = self.chat_template, self.content_format, (
            ("the model's" if self._tokenizer is None else "the --tokenizer folder's") if self.chat_template is None
            else "the --chat-template")
        if options.chat_template is not None:
            if not self.trust_request_template:
                raise invalid_request("chat_template: this server does not render a request's own chat template; "
                                      "start it with --trust-request-chat-template to allow it", "chat_template")
            template, whose = options.chat_template, "the request's"
            fmt = detect_content_format(template) if self.content_format_flag == "auto" else self.content_format
        reads_tools = self.renders_tools if template is self.chat_template else _reads_tools(template)
        if request.tools and not reads_tools:
            raise invalid_request(f"tools: {whose} chat template does not render tools; start the server with "
                                  "a --chat-template that does", "tools")
        try:
            text = self.processor.tokenizer.apply_chat_template(
                self.template_messages(conv, fmt), tokenize=False, add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message, chat_template=template,
                tools=list(request.tools) or None, **{**self.default_kwargs, **options.kwargs})
        except Exception as e:  # jinja's raise_exception / TemplateError: the messages break the template
            raise invalid_request(f"messages: {whose} chat template rejected them: {e}", "messages") from None
        return str(text), conv

    @property
    def template_source(self) -> str:
        """The chat template this builder renders with: --chat-template's, else the model's."""
        return str(self.chat_template or getattr(self.processor.tokenizer, "chat_template", None) or "")

    def template_messages(self, conv: Conversation, content_format: str | None = None) -> list[dict[str, Any]]:
        """The conversation's messages in the template's content format (the server's, or `content_format`)."""
        if (content_format or self.content_format) == "openai":
            return conv.messages
        return as_strings(conv.messages, media_placeholders(self.processor))

    @functools.cached_property
    def renders_tools(self) -> bool:
        """Does the chat template read `tools` at all (else they would vanish from the prompt unseen)? Read once:
        the template is the builder's for good."""
        return _reads_tools(self.template_source)

    def processor_for(self, request: ChatRequest) -> Any:
        """The processor for this request: the server's, or one built for its mm_processor_kwargs over the
        server's (the last `MAX_VARIANTS` kept: building one reads the folder's configs)."""
        return self.processor_with(request.processor_kwargs)

    def processor_with(self, processor_kwargs: tuple[tuple[str, float], ...]) -> Any:
        """`processor_for` a request whose mm_processor_kwargs are `processor_kwargs`."""
        if not processor_kwargs:
            return self.processor
        if self._folder is None:
            raise invalid_request("mm_processor_kwargs: this server's processor takes no per-request settings",
                                  "mm_processor_kwargs")
        key = tuple(sorted({**self._base_kwargs, **dict(processor_kwargs)}.items()))
        with self._variants_lock:
            if key in self._variants:
                self._variants.move_to_end(key)
                return self._variants[key]
        from omnimesh.models.qwen3_omni.processor import load_processor

        processor = load_processor(self._folder, dict(key), self._tokenizer)
        with self._variants_lock:
            self._variants[key] = processor
            while len(self._variants) > MAX_VARIANTS:
                self._variants.popitem(last=False)
        return processor

    def _process(self, text: str, conv: Conversation, processor: Any = None) -> tuple[torch.Tensor, Any]:
        """Prompt text + media -> input_ids (L,) (placeholders expanded) and the processor's batch (this
        builder's processor, or `processor`)."""
        processor = processor if processor is not None else self.processor
        try:  # the resize rule itself refuses some shapes (an aspect ratio over 200: ValueError)
            self._check_media_tokens(conv, processor)
            video: dict[str, Any] = {"videos": conv.videos, "fps": conv.video_fps} if conv.videos else {}
            if conv.audio_from_video is not None:
                video.update(load_audio_from_video=True, audio_from_video_indices=conv.audio_from_video)
            batch = processor(text=[text], audio=conv.audio or None, images=conv.images or None,
                              return_tensors="pt", **video)
        except ValueError as e:
            raise invalid_request(f"messages: could not prepare the prompt: {e}", "messages") from None
        ids = _tensor(batch["input_ids"], torch.int64)
        if ids is None or ids.ndim != 2 or ids.shape[0] != 1:
            raise RuntimeError(f"the processor returned input_ids of shape {getattr(ids, 'shape', None)}, "
                               "expected (1, L) for one prompt")
        return ids[0], batch  # (L,)

    def image_tokens(self, processor_kwargs: tuple[tuple[str, float], ...] = ()) -> ImageTokens | None:
        """A request's running count of its images' tokens, to refuse them from their headers before their pixels
        are decoded (gateway/rest.py); None when the processor cannot count them."""
        count = _image_token_count(self.processor_with(processor_kwargs))
        return ImageTokens(count, self.max_model_len) if count is not None else None

    def _check_media_tokens(self, conv: Conversation, processor: Any) -> None:
        """Images and videos that alone exceed max_model_len are refused from their shapes and the processor's
        resize rule, before the processor resizes them into float patches only for the length check to fail: a
        request's own min_pixels could otherwise blow a 32x32 image up to gigabytes of floats first."""
        n = 0
        count = _image_token_count(processor)
        if conv.images and count is not None:
            n = sum(count(*image.size) for image in conv.images)  # PIL images: size is (width, height)
            if n >= self.max_model_len:
                raise images_too_long(n, self.max_model_len, "messages")
        counter = getattr(getattr(processor, "video_processor", None), "token_count", None)
        if not conv.videos or counter is None:
            return
        videos = sum(counter(v) for v in conv.videos)
        if n + videos >= self.max_model_len:
            raise invalid_request(
                f"the videos alone are {videos} tokens (with the images {n + videos}), but this model's maximum "
                f"context length (max_model_len) is {self.max_model_len} tokens; send a shorter or smaller video",
                "messages")

    def encode(self, request: ChatRequest) -> torch.Tensor:
        """The prompt's token ids (L,) as the thinker would get them (/tokenize): no prompt-length checks, only
        the refusal of videos that alone exceed max_model_len (their preprocessing would be wasted work)."""
        return self._process(*self.render(request), self.processor_for(request))[0]

    def check_chars(self, text: str, param: str = "messages") -> None:
        """Before tokenizing (~1 s of a gateway core per MB of text): a prompt text longer than max_model_len
        tokens of this vocabulary's longest could cover is a 400 at once. The bound allows 4x for Unicode
        normalization (NFC joins characters before the tokenizer counts them), so no prompt that fits is refused.
        A request that truncates its prompt (truncate_prompt_tokens) is not checked: its text is cut after."""
        longest = self._longest_token
        if longest is None:
            vocab = self.processor.tokenizer.get_vocab()  # byte-level strings: at least as long as the text they cover
            longest = self._longest_token = max((len(t) for t in vocab), default=1)
        if len(text) > (limit := 4 * longest * self.max_model_len):
            shorten = "shorten the messages" if param == "messages" else f"shorten the {param}"
            raise invalid_request(
                f"the prompt is {len(text)} characters, more than the {self.max_model_len} tokens of this model's "
                f"maximum context length (max_model_len) can hold (no prompt over {limit} characters fits: refused "
                f"before tokenizing); {shorten}", param)

    def check_length(self, n: int, max_tokens: int | None, param: str = "messages") -> None:
        """A prompt of `n` tokens and the `max_tokens` asked for (None: up to the limit) must fit
        max_model_len with at least one generated token: else a 400 naming `param` or max_tokens."""
        if n >= self.max_model_len:
            shorten = ("shorten the messages or send less audio / smaller images / shorter videos"
                       if param == "messages" else f"shorten the {param}")
            raise invalid_request(
                f"the prompt is {n} tokens, but this model's maximum context length (max_model_len) is "
                f"{self.max_model_len} tokens; {shorten}", param)
        if max_tokens is not None and n + max_tokens > self.max_model_len:
            raise invalid_request(
                f"the prompt is {n} tokens and max_tokens asks for {max_tokens} more, {n + max_tokens} in all, but "
                f"this model's maximum context length (max_model_len) is {self.max_model_len} tokens; "
                f"lower max_tokens to at most {self.max_model_len - n}", "max_tokens")

    def truncated(self, ids: torch.Tensor, k: int | None) -> torch.Tensor:
        """vLLM's truncate_prompt_tokens: the prompt's last `k` ids (-1: max_model_len); cutting into media
        (their placeholders would no longer match the encoder's rows) is a 400."""
        if k is None:
            return ids
        if k == -1:
            k = self.max_model_len
        if not 1 <= k <= self.max_model_len:
            raise invalid_request(f"truncate_prompt_tokens: must be in [1, {self.max_model_len}] (max_model_len) or "
                                  f"-1, got {k}", "truncate_prompt_tokens")
        if ids.numel() <= k:
            return ids
        cut = ids[:ids.numel() - k]
        if bool(torch.isin(cut, self._media_ids).any()):
            raise invalid_request(f"truncate_prompt_tokens: keeping the last {k} of {ids.numel()} tokens would cut "
                                  "into the prompt's audio, images or video; keep more tokens or send less media",
                                  "truncate_prompt_tokens")
        return ids[ids.numel() - k:]

    @functools.cached_property
    def _media_ids(self) -> torch.Tensor:
        """The placeholder ids media rows take in a prompt."""
        tokenizer = self.processor.tokenizer  # the tokenizer names them (Qwen3-Omni <|audio_pad|>, Qwen2.5 <|AUDIO|>)
        names = [getattr(tokenizer, a, None) for a in ("audio_token", "image_token", "video_token")]
        ids = [tokenizer.convert_tokens_to_ids(t) for t in names if t]
        return torch.tensor([i for i in ids if isinstance(i, int) and i >= 0], dtype=torch.int64)

    def build(self, request: ChatRequest, hash_media: bool = True) -> PromptInputs:
        """The thinker's inputs; `hash_media` False skips the media items' digests (no thinker replica caches
        prefixes: nothing would read them)."""
        if request.prompt_ids is not None:  # a completion's prompt, tokenized by its route (no template, no media)
            ids = self.truncated(torch.tensor(request.prompt_ids, dtype=torch.int64), request.truncate_prompt_tokens)
            self.check_length(int(ids.numel()), request.sampling.max_tokens, "prompt")
            return PromptInputs(input_ids=ids, input_features=None, feature_attention_mask=None, pixel_values=None,
                                image_grid_thw=None, prompt_tokens=int(ids.numel()))
        text, conv = self.render(request)
        if request.truncate_prompt_tokens is None:
            self.check_chars(text, request.conversation_param)
        input_ids, batch = self._process(text, conv, self.processor_for(request))
        input_ids = self.truncated(input_ids, request.truncate_prompt_tokens)
        n = int(input_ids.shape[0])
        self.check_length(n, request.sampling.max_tokens, request.conversation_param)
        has_audio = bool(conv.audio)
        has_images = bool(conv.images)
        has_videos = bool(conv.videos)
        features, frames = _valid_frames(batch) if has_audio else (None, None)
        if features is not None and not bool(torch.isfinite(features).all()):  # float32 spectra overflow
            where = request.media_param
            raise invalid_request(f"{where}: an audio input is too loud to analyse (its spectrum overflows float32: "
                                  "its samples reach far past 1.0); float audio is expected in [-1, 1]: scale it down",
                                  where)
        return PromptInputs(
            input_ids=input_ids,
            input_features=features,
            feature_attention_mask=frames,
            pixel_values=_tensor(batch.get("pixel_values"), torch.float32) if has_images else None,
            image_grid_thw=_tensor(batch.get("image_grid_thw"), torch.int64) if has_images else None,
            prompt_tokens=n,
            pixel_values_videos=_tensor(batch.get("pixel_values_videos"), torch.float32) if has_videos else None,
            video_grid_thw=_tensor(batch.get("video_grid_thw"), torch.int64) if has_videos else None,
            video_second_per_grid=_tensor(batch.get("video_second_per_grid"), torch.float32) if has_videos else None,
            use_audio_in_video=conv.audio_from_video is not None,
            media_hashes=media_digests(conv.audio, conv.images, conv.videos,
                                       {**self._base_kwargs, **dict(request.processor_kwargs)}) if hash_media else {},
        )


def _valid_frames(batch: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """input_features (n_audio, n_mel, T) and feature_attention_mask (n_audio, T) cut to the longest audio's
    frames: Qwen2.5-Omni's processor pads every clip to the extractor's whole window (300 s: 30000 frames,
    15 MB of float32 per clip), which the towers never read (they take the masked frames only)."""
    features = _tensor(batch.get("input_features"), torch.float32)
    mask = _tensor(batch.get("feature_attention_mask"), torch.int64)
    if features is None or mask is None or mask.ndim != 2 or mask.shape[1] != features.shape[-1]:
        return features, mask
    longest = max(int(mask.sum(dim=1).max()), 1)
    return features[..., :longest].contiguous(), mask[:, :longest].contiguous()


def _reads_tools(template: str | None) -> bool:
    """Does a chat template read `tools` at all (else they would vanish from the prompt unseen)?"""
    return re.search(r"\btools\b", template or "") is not None


def load_chat_template(value: str) -> str:
    """vLLM's --chat-template: a Jinja file's path, or the template itself (anything with `{{` or `{%`)."""
    path = Path(value).expanduser()
    if os.path.isfile(path):  # (not Path.is_file: an inline template longer than a file name raises there)
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--chat-template {value}: cannot read it as UTF-8 text ({exc})") from None
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r}: no such file, and not an inline Jinja template (no '{{{{' or '{{%')")


_PROBE = (ChatMessage("system", (TextPart("s"),)),
          ChatMessage("user", (TextPart("t"), AudioPart(np.zeros(1600, np.float32), TARGET_SAMPLE_RATE))))


def check_chat_template(builder: PromptBuilder) -> None:
    """At start-up, with --chat-template or --default-chat-template-kwargs: the template renders a system +
    user message with the default variables (else ValueError naming the flags) and keeps media parts as
    placeholders (else a warning: requests with audio or images would be 400s)."""
    conv = render_conversation(_PROBE)
    flags = " with ".join(f for f, on in (("--chat-template", builder.chat_template is not None),
                                          ("--default-chat-template-kwargs", bool(builder.default_kwargs))) if on)
    try:
        text = builder.processor.tokenizer.apply_chat_template(builder.template_messages(conv), tokenize=False,
                                                               add_generation_prompt=True,
                                                               chat_template=builder.chat_template,
                                                               **builder.default_kwargs)
    except Exception as exc:  # jinja's TemplateSyntaxError / UndefinedError / raise_exception
        whose = flags if builder.chat_template is not None else f"the model's chat template with {flags}"
        raise ValueError(f"{whose} does not render a system + user message: {type(exc).__name__}: {exc}") from None
    pad = getattr(builder.processor, "audio_token", "<|audio_pad|>")
    if str(text).count(pad) != 1:
        log.warning(f"{flags}: a user message with one audio part renders %d %s placeholders, not 1; "
                    "requests with audio or images will be refused (see the model's own template; a template that "
                    "reads each content as one string needs --chat-template-content-format string)",
                    str(text).count(pad), pad)
