"""`--mm-processor-kwargs`: the operator's settings for the multimodal processor, as vLLM's flag.

Role: the few processor settings a Qwen-Omni server is tuned by, over the model folder's own
(preprocessor_config.json, video_preprocessor_config.json): `min_pixels` / `max_pixels` (the area images and
video frames are resized into: fewer pixels, fewer vision tokens and cheaper encoder steps) and the video
sampling `fps` / `min_frames` / `max_frames`. Parsed and checked here, with an error naming the flag, when
`omnimesh serve` reads its flags; `omnimesh.models.qwen3_omni.processor.load_processor` applies them, so the
prompt's placeholders, the frames the gateway decodes and the patches the encoder gets all agree. A request's
own `mm_processor_kwargs` (vLLM's per-request field) take the same keys over the server's (`check_settings`;
the prompt builder keeps a few processors built for such settings).
"""

from __future__ import annotations

from typing import Any

from omnimesh.config.stage_config import parse_json_object, typed_number

KEYS: dict[str, type] = {"min_pixels": int, "max_pixels": int, "fps": float, "min_frames": int, "max_frames": int}
MIN_FPS = 0.001
IMAGE_KEYS = ("min_pixels", "max_pixels")  # images and video frames alike, as the processor's own kwargs


def parse_mm_processor_kwargs(text: str | None) -> dict[str, Any]:
    """The flag's JSON -> {key: value} over `KEYS`; ValueError naming the flag, the key and the fix."""
    if not text:
        return {}
    return check_settings(parse_json_object(text, "--mm-processor-kwargs", "of processor settings"),
                          "--mm-processor-kwargs")


def check_settings(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """Settings over `KEYS` (the flag's, or a request's `mm_processor_kwargs`) -> typed; ValueError naming
    `where`, the key and the fix."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        kind = KEYS.get(key)
        if kind is None:
            raise ValueError(f"{where}: unknown setting {key!r}; settings: {', '.join(KEYS)} "
                             f"(and a request's use_audio_in_video)")
        out[key] = typed_number(value, kind, f"{where}[{key!r}]")
        if not out[key] > 0:
            raise ValueError(f"{where}[{key!r}] must be positive, got {value}")
        if key == "fps" and out[key] < MIN_FPS:  # the processor divides by it: 1e-300 made its tensors infinite
            raise ValueError(f"{where}['fps'] must be at least {MIN_FPS} (a frame every {1 / MIN_FPS:g} s), "
                             f"got {value}")
    for low, high in (("min_pixels", "max_pixels"), ("min_frames", "max_frames")):
        if low in out and high in out and out[low] > out[high]:
            raise ValueError(f"{where}: {low} {out[low]} is above {high} {out[high]}")
    return out
