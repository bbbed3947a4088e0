"""What one request may carry: `InputLimits`, and the operator's flags that set it.

Role: the gateway's media policy in numbers. `--limit-mm-per-prompt` (vLLM's flag and JSON syntax:
'{"image": 4, "video": 1}', 0 turns a modality off) caps the audio / image / video parts of one request,
checked from the request's shape before any part is decoded; `--input-limits` (JSON keyed by the field
names below) changes the sizes: body bytes, audio seconds, pixels, download size and time, video decoding.
`limits_from_flags` turns both into one frozen `InputLimits`; `gateway.media.MediaLoader` enforces it.
`parse_media_domains` reads `--allowed-media-domains` (the hosts http(s) media may come from).
Every parse error is a ValueError naming the flag and the fix, raised when `omnimesh serve` starts.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field, fields, replace
from typing import Any

from omnimesh.config.stage_config import fmt_bytes, parse_bytes, parse_json_object, typed_number

MODALITIES = ("audio", "image", "video")  # the part kinds --limit-mm-per-prompt caps
_BYTE_FIELDS = frozenset({"max_request_bytes", "max_fetch_bytes", "media_build_memory"})  # these also take '64MiB'


@dataclass(frozen=True, slots=True)
class InputLimits:
    """How much input one request may carry; breaches are answered with 413 (or 400 where noted)."""

    max_request_bytes: int = 64 * 1024 * 1024  # REST body size
    max_audio_seconds: float = 600.0  # decoded audio, all clips of one request together
    max_image_pixels: int = 4096 * 4096  # width * height of one image, and of each frame of a video
    max_video_seconds: float = 600.0  # one video: its frame count / its native frame rate
    # one video's sampled frames as decoded RGB, width * height * frames (3 bytes each: 768 MiB at the default),
    # checked before decoding; a 2-minute 1080p clip at 2 fps (240 frames, 498M pixels) is over it
    max_video_pixels: int = 256 * 1024 * 1024
    max_media_items: int = 32  # audio clips + images + videos in one request (400 beyond)
    # messages (or Responses input items) of one request, and their content parts together: counted on the
    # parsed JSON before any validation, which costs ~16 us a message on the gateway (a 50 MB body of 1.5M
    # messages held it for 24 s)
    max_messages: int = 4096
    max_content_parts: int = 16384
    max_fetch_bytes: int = 32 * 1024 * 1024  # one remote media download
    # working memory of the prompt builds with media and the video / compressed audio decodes running at once
    # (gateway/media_budget.py: a 10-minute clip takes ~400 MB while its features are computed, a video's decode
    # its sampled frames twice); a build or decode that needs more than all of it runs alone
    media_build_memory: int = 1024 * 1024 * 1024
    fetch_timeout_s: float = 10.0  # one remote media download, start to end (400 beyond)
    # decoding one video's frames (every frame up to the last sampled one is decoded): a small file can hold
    # minutes of large frames, and a gateway thread must not spend longer than this on one (400 beyond)
    video_decode_timeout_s: float = 60.0
    # parts of one modality in one request ('audio', 'image', 'video'; 400 beyond; 0 = the modality is
    # refused); a modality not named is bounded only by max_media_items
    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_image_pixels", "max_video_pixels", "max_media_items",
                     "max_fetch_bytes", "max_messages", "max_content_parts", "media_build_memory"):
            if getattr(self, name) <= 0:
                raise ValueError(f"InputLimits.{name} must be positive, got {getattr(self, name)}")
        for name in ("max_audio_seconds", "max_video_seconds", "fetch_timeout_s", "video_decode_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"InputLimits.{name} must be positive, got {getattr(self, name)}")
        for kind, n in self.limit_mm_per_prompt.items():
            if kind not in MODALITIES or isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"InputLimits.limit_mm_per_prompt: {kind!r}: {n!r}; expected a count >= 0 for "
                                 f"one of {', '.join(MODALITIES)}")


SIZE_FIELDS = tuple(f.name for f in fields(InputLimits) if f.name != "limit_mm_per_prompt")  # --input-limits keys


def parse_limit_mm_per_prompt(text: str | None) -> dict[str, int]:
    """vLLM's `--limit-mm-per-prompt` JSON: {"image": 2, "video": 0}, or vLLM's {"image": {"count": 2}}."""
    if not text:
        return {}
    out: dict[str, int] = {}
    for kind, value in parse_json_object(text, "--limit-mm-per-prompt", 'keyed by modality, e.g. \'{"image": 2}\'').items():
        if kind not in MODALITIES:
            raise ValueError(f"--limit-mm-per-prompt: unknown modality {kind!r}; this model takes "
                             f"{', '.join(MODALITIES)}")
        count = value.get("count") if isinstance(value, dict) and set(value) == {"count"} else value
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"--limit-mm-per-prompt[{kind!r}]: {value!r} is not a count; write a whole number "
                             f">= 0 (0: refuse {kind} input), or {{\"count\": N}}")
        out[kind] = count
    return out


def parse_input_limits(text: str | None) -> dict[str, Any]:
    """`--input-limits` JSON: {field: value} over `SIZE_FIELDS` (byte fields also take '64MiB')."""
    if not text:
        return {}
    out: dict[str, Any] = {}
    for name, value in parse_json_object(text, "--input-limits", "keyed by limit name").items():
        if name not in SIZE_FIELDS:
            raise ValueError(f"--input-limits: unknown limit {name!r}; limits are {', '.join(SIZE_FIELDS)}"
                             + (" (per-modality counts go in --limit-mm-per-prompt)" if name in MODALITIES else ""))
        kind = int if name in _BYTE_FIELDS or (name.startswith("max_") and not name.endswith("_seconds")) else float
        if name in _BYTE_FIELDS and isinstance(value, str):
            value = parse_bytes(value, f"--input-limits[{name!r}]")
        out[name] = typed_number(value, kind, f"--input-limits[{name!r}]", "a number of seconds")
    return out


def limits_from_flags(limit_mm_per_prompt: str | None, input_limits: str | None) -> InputLimits:
    """The `InputLimits` the two flags describe (defaults for what they leave out); ValueError names the flag."""
    sizes = parse_input_limits(input_limits)
    try:
        return replace(InputLimits(), limit_mm_per_prompt=parse_limit_mm_per_prompt(limit_mm_per_prompt), **sizes)
    except ValueError as exc:
        raise ValueError(f"--input-limits: {str(exc).removeprefix('InputLimits.')}") from None


def describe_limits(limits: InputLimits) -> str:
    """The limits that differ from the defaults, for the gateway's start-up log: 'max_audio_seconds=30
    (default 600), image parts <= 2, video refused'."""
    default = InputLimits()

    def shown(name: str, value: float) -> str:  # byte limits in binary units, as they are given
        return fmt_bytes(value) if name in _BYTE_FIELDS else f"{value:g}"

    said = [f"{name}={shown(name, getattr(limits, name))} (default {shown(name, getattr(default, name))})"
            for name in SIZE_FIELDS if getattr(limits, name) != getattr(default, name)]
    said += [f"{kind} refused" if n == 0 else f"{kind} parts <= {n}" for kind, n in limits.limit_mm_per_prompt.items()]
    return ", ".join(said) or "the defaults"


_HOST_NAME = re.compile(r"(?i)^(?!-)[a-z0-9-]{1,63}(?<!-)(\.(?!-)[a-z0-9-]{1,63}(?<!-))*\.?$")


def parse_media_domains(text: str | None) -> frozenset[str]:
    """--allowed-media-domains "a.example,10.0.0.5" -> the hosts, lower-case; each must be a host name or an IP
    address as a URL's host reads (no scheme, port, path or wildcard: the match is exact), else a ValueError
    saying what to write (a typo would only ever refuse media, silently)."""
    hosts = []
    for item in (p.strip() for p in (text or "").split(",")):
        if not item:
            continue
        host = item.removeprefix("[").removesuffix("]")
        try:
            ipaddress.ip_address(host)
        except ValueError:
            if not _HOST_NAME.match(host):
                raise ValueError(f"--allowed-media-domains: {item!r} is not a host name or IP address; give hosts "
                                 f"as a URL names them, comma-separated (e.g. media.example.com,10.0.0.5), without "
                                 f"scheme, port, path or wildcard") from None
        hosts.append(host.lower().rstrip("."))
    return frozenset(hosts)
