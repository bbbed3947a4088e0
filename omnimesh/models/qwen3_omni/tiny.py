"""Builder of the built-in tiny Qwen3-Omni model folder (random weights, fixed seed, offline).

Role: write a complete Hugging Face folder for the tiny config in `tiny_config.py`, laid out like the
real Qwen3-Omni checkpoint, so tests and `omnimesh make-tiny` exercise the same loading path as a real
model. Two builds with the same seed are byte-identical, file by file.

Data flow:
    tiny_qwen3_omni_config() --(seeded construction, routed experts filled)--> model
      --save_pretrained--> config.json, generation_config.json, model.safetensors
    tiny_tokenizer_spec() --tokenizer_build--> tokenizer.json, tokenizer_config.json, chat_template.jinja
    Whisper feature extractor + Qwen2-VL image processor --> preprocessor_config.json (one merged file,
      with "processor_class", as the real model ships it; the real model has no processor_config.json)
    video sizes and sampling --> video_preprocessor_config.json (read by video_processor.video_settings)

`model.safetensors` holds the real checkpoint's key layout (transformers 5 converts back on save):
`thinker.audio_tower.*`, `thinker.visual.*`, `thinker.model.*` (the LM), `thinker.lm_head.*`,
`talker.*`, `code2wav.*`, with MoE experts stored per expert (`...mlp.experts.{e}.gate_proj.weight`).

Run: python -c "from pathlib import Path; from omnimesh.models.qwen3_omni.tiny import build_tiny_qwen3_omni; \
print(build_tiny_qwen3_omni(Path('/tmp/tiny-qwen3-omni')))"
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, cast

import torch
from transformers import GenerationConfig, PreTrainedConfig, Qwen2VLImageProcessorPil, WhisperFeatureExtractor
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTalkerConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeForConditionalGeneration

from omnimesh.models.qwen3_omni.tiny_config import (
    ORDINARY_VOCAB_LIMIT,
    ROLE_TOKENS,
    SPECIAL_TOKENS,
    THINK_TOKENS,
    THINKER_VOCAB,
    TOOL_TOKENS,
    tiny_qwen3_omni_config,
)
from omnimesh.models.tokenizer_build import TinyTokenizerSpec, build_tokenizer

# Qwen3-Omni's chat template, reduced to what the tiny model serves: content is a string or a list of
# {"type": "text"|"image"|"audio"|"video"} parts, placeholders render where the parts are, the first message
# may be a system message; `tools` render in the system turn and an assistant's `tool_calls` as
# <tool_call> JSON blocks (Qwen3's Hermes-style format), tool results go in user turns.
QWEN3_OMNI_CHAT_TEMPLATE = """\
{%- set image_count = namespace(value=0) -%}
{%- set video_count = namespace(value=0) -%}
{%- if tools -%}
    {%- set tool_text = namespace(value='# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
        ~ 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>') -%}
    {%- for tool in tools -%}
        {%- set tool_text.value = tool_text.value ~ '\\n' ~ (tool | tojson) -%}
    {%- endfor -%}
    {%- set tool_text.value = tool_text.value ~ '\\n</tools>\\n\\nFor each function call, return a json object with '
        ~ 'function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'
        ~ '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>' -%}
    {%- if not messages or messages[0].role != 'system' -%}
        {{- '<|im_start|>system\\n' ~ tool_text.value ~ '<|im_end|>\\n' -}}
    {%- endif -%}
{%- endif -%}
{%- for message in messages -%}
    {%- if message.role not in ['system', 'user', 'assistant', 'tool'] -%}
        {{- raise_exception("unknown role '" ~ message.role ~ "': use system, user, assistant or tool") -}}
    {%- endif -%}
    {%- if message.role == 'system' and not loop.first -%}
        {{- raise_exception('only the first message may be a system message') -}}
    {%- endif -%}
    {%- if message.content is string -%}
        {%- set content = message.content -%}
    {%- elif message.content is none -%}
        {%- set content = '' -%}
    {%- else -%}
        {%- set parts = namespace(text='') -%}
        {%- for item in message.content -%}
            {%- if item.type == 'image' or 'image' in item or 'image_url' in item -%}
                {%- set image_count.value = image_count.value + 1 -%}
                {%- if add_vision_id -%}
                    {%- set parts.text = parts.text ~ 'Picture ' ~ image_count.value ~ ': ' -%}
                {%- endif -%}
                {%- set parts.text = parts.text ~ '<|vision_start|><|image_pad|><|vision_end|>' -%}
            {%- elif item.type == 'audio' or 'audio' in item or 'audio_url' in item or 'input_audio' in item -%}
                {%- set parts.text = parts.text ~ '<|audio_start|><|audio_pad|><|audio_end|>' -%}
            {%- elif item.type == 'video' or 'video' in item or 'video_url' in item -%}
                {%- set video_count.value = video_count.value + 1 -%}
                {%- if add_vision_id -%}
                    {%- set parts.text = parts.text ~ 'Video ' ~ video_count.value ~ ': ' -%}
                {%- endif -%}
                {%- set parts.text = parts.text ~ '<|vision_start|><|video_pad|><|vision_end|>' -%}
            {%- elif item.type == 'text' or 'text' in item -%}
                {%- set parts.text = parts.text ~ item.text -%}
            {%- endif -%}
        {%- endfor -%}
        {%- set content = parts.text -%}
    {%- endif -%}
    {%- if message.role == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\\n<tool_response>\\n' ~ content ~ '\\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}
            {{- '<|im_end|>\\n' -}}
        {%- endif -%}
    {%- elif message.role == 'system' and tools -%}
        {{- '<|im_start|>system\\n' ~ content ~ '\\n\\n' ~ tool_text.value ~ '<|im_end|>\\n' -}}
    {%- elif message.role == 'assistant' and message.tool_calls -%}
        {{- '<|im_start|>assistant\\n' ~ content -}}
        {%- for call in message.tool_calls -%}
            {%- set call = call.function if call.function is defined else call -%}
            {%- if content or not loop.first -%}
                {{- '\\n' -}}
            {%- endif -%}
            {%- set arguments = call.arguments if call.arguments is string else (call.arguments | tojson) -%}
            {{- '<tool_call>\\n{"name": "' ~ call.name ~ '", "arguments": ' ~ arguments ~ '}\\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\\n' -}}
    {%- else -%}
        {{- '<|im_start|>' ~ message.role ~ '\\n' ~ content ~ '<|im_end|>\\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\\n' -}}
{%- endif -%}
"""

# Named media tokens, as in the real tokenizer_config.json; the processor reads these attributes.
MEDIA_TOKENS: dict[str, str] = {
    "image_token": "<|image_pad|>",
    "audio_token": "<|audio_pad|>",
    "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}

# Images are resized to a multiple of patch_size * merge_size = 32 with area in [MIN, MAX]:
# a 64x64 image stays 64x64 (4x4 patches -> 4 image tokens); anything larger than 256x256 shrinks.
IMAGE_MIN_PIXELS = 32 * 32
IMAGE_MAX_PIXELS = 256 * 256
# Video frames: one smart_resize size per video with area in [MIN, MAX], so a frame never exceeds 64x64
# (4x4 patches -> 4 tokens per pair of frames); 2 frames a second, at least 4, at most 16 (tiny prompts).
VIDEO_MIN_PIXELS = 32 * 32
VIDEO_MAX_PIXELS = 64 * 64
VIDEO_MAX_FRAMES = 16
FOLDER_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
)


def tiny_tokenizer_spec(thinking: bool = False) -> TinyTokenizerSpec:
    """The tiny tokenizer's layout, with every id taken from `tiny_config.py`; `thinking`: the thinker-only
    variant's, which also has the reasoning markers `<think>` / `</think>` (not special: decoded as text). Both have
    the function-call markers `<tool_call>` / `</tool_call>` (not special either)."""
    return TinyTokenizerSpec(
        vocab_size=THINKER_VOCAB,
        ordinary_limit=ORDINARY_VOCAB_LIMIT,
        special_tokens=dict(SPECIAL_TOKENS),
        word_tokens=dict(ROLE_TOKENS),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        named_tokens=dict(MEDIA_TOKENS),
        chat_template=QWEN3_OMNI_CHAT_TEMPLATE,
        text_tokens={**TOOL_TOKENS, **(THINK_TOKENS if thinking else {})},
    )


def tiny_feature_extractor() -> WhisperFeatureExtractor:
    """128-bin log-mel at 16 kHz, 10 ms hop; 300 s chunk like the real model (n_samples 4,800,000)."""
    return WhisperFeatureExtractor(
        feature_size=128, sampling_rate=16000, hop_length=160, n_fft=400, chunk_length=300,
        padding_value=0.0, return_attention_mask=True, dither=0.0,
    )


def tiny_image_processor() -> Qwen2VLImageProcessorPil:
    """PIL-backed Qwen2-VL image processor matching the tiny vision tower (patch 16, merge 2, T 2)."""
    return Qwen2VLImageProcessorPil(
        patch_size=16, merge_size=2, temporal_patch_size=2,
        min_pixels=IMAGE_MIN_PIXELS, max_pixels=IMAGE_MAX_PIXELS,
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    )


def preprocessor_config() -> dict[str, Any]:
    """The merged feature-extractor + image-processor config, as the real `preprocessor_config.json`."""
    merged = {**tiny_feature_extractor().to_dict(), **tiny_image_processor().to_dict()}
    merged.pop("mel_filters", None)  # recomputed from feature_size / n_fft on load
    # Legacy flat keys (the real file has them; older readers ignore `size`).
    merged["min_pixels"] = IMAGE_MIN_PIXELS
    merged["max_pixels"] = IMAGE_MAX_PIXELS
    merged["processor_class"] = "Qwen3OmniMoeProcessor"
    return merged


def video_preprocessor_config(processor_class: str = "Qwen3OmniMoeProcessor", patch_size: int = 16,
                              min_pixels: int = VIDEO_MIN_PIXELS, max_pixels: int = VIDEO_MAX_PIXELS) -> dict[str, Any]:
    """The video processor's settings, in the shape of a Qwen2-VL `video_preprocessor_config.json` (the
    defaults: the tiny Qwen3-Omni's)."""
    return {
        "video_processor_type": "Qwen2VLVideoProcessor", "processor_class": processor_class,
        "patch_size": patch_size, "merge_size": 2, "temporal_patch_size": 2,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "min_pixels": min_pixels, "max_pixels": max_pixels,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "do_sample_frames": True, "fps": 2.0, "min_frames": 4, "max_frames": VIDEO_MAX_FRAMES,
    }


def tiny_generation_config() -> GenerationConfig:
    """Qwen-style token ids, but greedy and short: a random model samples noise and rarely stops."""
    return GenerationConfig(
        bos_token_id=SPECIAL_TOKENS["<|endoftext|>"],
        eos_token_id=[SPECIAL_TOKENS["<|im_end|>"], SPECIAL_TOKENS["<|endoftext|>"]],
        pad_token_id=SPECIAL_TOKENS["<|endoftext|>"],
        do_sample=False,
        max_new_tokens=32,
    )


def fill_routed_experts(model: Qwen3OmniMoeForConditionalGeneration, seed: int) -> list[str]:
    """Fill the talker's 3-D routed-expert tensors (`...experts.gate_up_proj` / `...experts.down_proj`).

    transformers 5.23 leaves them as `torch.empty` (garbage, sometimes 1e30) when a model is built from a
    config; the thinker's experts are initialised normally. Draws N(0, initializer_range) from a generator
    seeded with `seed`, in `named_parameters()` order: the same rule as the parity-test fixture
    (tests/models/qwen3_omni_fixtures.py), so an in-process model and this folder hold equal weights.
    Returns the filled names.
    """
    talker_config = cast(Qwen3OmniMoeTalkerConfig, model.config.talker_config)
    std = cast(PreTrainedConfig, talker_config.text_config).initializer_range
    gen = torch.Generator().manual_seed(seed)
    filled = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith("talker.") and name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                param.normal_(0.0, std, generator=gen)
                filled.append(name)
    if not filled:
        raise ValueError("found no talker routed-expert tensors to fill; did the transformers layout change?")
    return filled


def make_code2wav_audible(model: Qwen3OmniMoeForConditionalGeneration, seed: int, gain: float = 0.6) -> None:
    """Re-draw code2wav's conv weights with std gain / sqrt(fan_in).

    The default init gives a waveform of ~1e-6 amplitude, which makes every absolute audio tolerance in the
    tests vacuous; with this the tiny vocoder's output peaks around 0.3, like speech.
    """
    c2w = model.code2wav
    redraw_convs(list(c2w.upsample.modules()) + list(c2w.decoder.modules()), seed + 1, gain)


def redraw_convs(modules: list[torch.nn.Module], seed: int, gain: float) -> None:
    """Every Conv1d / ConvTranspose1d among `modules` re-drawn with std gain / sqrt(fan_in), from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in modules:
            if isinstance(mod, torch.nn.Conv1d):
                fan_in = mod.weight.shape[1] * mod.weight.shape[2]
            elif isinstance(mod, torch.nn.ConvTranspose1d):
                fan_in = mod.weight.shape[0] * mod.weight.shape[2] // mod.stride[0]
            else:
                continue
            mod.weight.normal_(0.0, gain / math.sqrt(fan_in), generator=gen)


def build_tiny_model(seed: int = 0, audio_output: bool = True) -> Qwen3OmniMoeForConditionalGeneration:
    """The tiny model in float32, every weight a function of `seed`; the caller's RNG is left untouched.
    `audio_output=False`: the thinker-only variant (config `enable_audio_output: false`, like
    Qwen3-Omni-30B-A3B-Thinking), whose thinker equals the full model's (it is built first, from the same seed)."""
    config = tiny_qwen3_omni_config()
    config.enable_audio_output = audio_output
    previous = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        torch.set_default_dtype(torch.float32)
        try:
            model = Qwen3OmniMoeForConditionalGeneration(config)
        finally:
            torch.set_default_dtype(previous)
    if audio_output:
        fill_routed_experts(model, seed)
        make_code2wav_audible(model, seed)
    model.generation_config = tiny_generation_config()
    return model.eval()


def _check_out_dir(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{out_dir} exists and is not a directory")
    if out_dir.is_dir():
        foreign = sorted(p.name for p in out_dir.iterdir() if p.name not in FOLDER_FILES)
        if foreign:
            raise ValueError(
                f"{out_dir} holds files a tiny build does not write ({', '.join(foreign[:5])}); "
                "pass an empty or new directory so stale weights cannot be loaded by mistake"
            )


def build_tiny_qwen3_omni(out_dir: Path, seed: int = 0, audio_output: bool = True) -> Path:
    """Write the tiny Qwen3-Omni Hugging Face folder to `out_dir` and return it (`audio_output=False`: the
    thinker-only variant, weights `thinker.*` only).

    Loads offline with `Qwen3OmniMoeForConditionalGeneration.from_pretrained`, `AutoTokenizer`,
    `WhisperFeatureExtractor`, `Qwen2VLImageProcessor` and `processor.load_processor`.
    """
    out_dir = Path(out_dir)
    _check_out_dir(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    model = build_tiny_model(seed, audio_output)
    model.save_pretrained(out_dir)
    build_tokenizer(tiny_tokenizer_spec(thinking=not audio_output)).save_pretrained(out_dir)
    text = json.dumps(preprocessor_config(), indent=2, sort_keys=True) + "\n"
    (out_dir / "preprocessor_config.json").write_text(text, encoding="utf-8")
    text = json.dumps(video_preprocessor_config(), indent=2, sort_keys=True) + "\n"
    (out_dir / "video_preprocessor_config.json").write_text(text, encoding="utf-8")

    written = sorted(p.name for p in out_dir.iterdir())
    if written != sorted(FOLDER_FILES):
        raise ValueError(f"tiny build wrote {written}, expected {sorted(FOLDER_FILES)}; update FOLDER_FILES")
    return out_dir
