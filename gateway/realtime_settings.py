"""The Realtime API's session settings (gateway/realtime_api.py): what `session.update` and a `response.create`
may set, each value checked, with OpenAI's defaults.

Data flow: a client's `session` object -> `updated(settings, session, pipeline)` -> new `RealtimeSettings`, or a
`RealtimeError` naming the field (`session.turn_detection.threshold`) that the session answers as an `error`
event and survives. `modalities`, `temperature` and `max_tokens` check a response's own overrides too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from gateway.events import Pipeline
from gateway.languages import language_name
from gateway.openai_schema import resolve_voice
from gateway.realtime_audio import RATES
from gateway.realtime_vad import FRAME_MS


class RealtimeError(Exception):
    """A client mistake: answered as an `error` event, the session goes on."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


@dataclass
class RealtimeSettings:
    modalities: tuple[str, ...] = ("text", "audio")
    instructions: str = ""
    voice: str | None = None
    temperature: float | None = None
    max_response_output_tokens: int | None = None  # None: "inf" (the thinker's own limit)
    turn_detection: dict[str, Any] | None = None  # server_vad's settings (gateway/realtime_vad.py), None: the client's
    input_audio_transcription: dict[str, Any] | None = None  # {"model", "language", "prompt"}: each user clip's text
    tools: tuple[dict[str, Any], ...] = ()  # function tools as the client gave them ({"type": "function", "name", ...})
    tool_choice: Any = "auto"  # "auto" / "none" / "required" / {"type": "function", "name"} (gateway/responses_tools.py)
    input_audio_format: str = "pcm16"  # pcm16 (24 kHz) | g711_ulaw | g711_alaw (8 kHz): gateway/realtime_audio.py
    output_audio_format: str = "pcm16"
    speed: float = 1.0  # OpenAI's, 0.25 to 1.5: the answers' audio faster or slower at the same pitch (from the next)
    truncation: float | None = 1.0  # a prompt over the context: its oldest messages left out (gateway/realtime_truncation.py)


def updated(settings: RealtimeSettings, s: Any, pipeline: Pipeline) -> RealtimeSettings:
    """`session.update`: what omnimesh can do is taken, the rest is an error naming it."""
    if not isinstance(s, dict):
        raise RealtimeError("session must be an object", "session")
    new = replace(settings)
    for key, value in s.items():
        where = f"session.{key}"
        if key == "modalities":
            new.modalities = check_modalities(value, where)
        elif key == "instructions":
            if not isinstance(value, str):
                raise RealtimeError("instructions must be a string", where)
            new.instructions = value
        elif key == "voice":
            new.voice = resolve_voice(value, pipeline, where)
        elif key == "temperature":
            new.temperature = check_temperature(value, where)
        elif key == "speed":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.25 <= value <= 1.5:
                raise RealtimeError(f"speed must be a number in [0.25, 1.5] (1: the model's own pace), got {value!r}",
                                    where)
            new.speed = float(value)
        elif key == "max_response_output_tokens":
            new.max_response_output_tokens = check_max_tokens(value, where)
        elif key in ("input_audio_format", "output_audio_format"):
            if not isinstance(value, str) or value not in RATES:
                raise RealtimeError(f"{key} must be one of {', '.join(RATES)} (pcm16: 24 kHz mono 16-bit; g711: "
                                    f"8 kHz), got {value!r}", where)
            setattr(new, key, value)
        elif key == "turn_detection":
            new.turn_detection = _turn_detection(value, where)
        elif key == "input_audio_transcription":
            new.input_audio_transcription = _transcription(value, where)
        elif key == "tools":  # checked with the tool choice, as the plan they make (RealtimeSession.update)
            if value is not None and not isinstance(value, list):
                raise RealtimeError("tools must be a list of function tools", where)
            new.tools = tuple(value or ())
        elif key == "tool_choice":
            new.tool_choice = "auto" if value is None else value
        elif key == "truncation":
            new.truncation = parse_truncation(value, where)
        elif key not in ("model", "type", "object", "id"):
            raise RealtimeError(f"unknown session field {key!r}", where)
    return new


def parse_truncation(value: Any, where: str) -> float | None:
    """"auto" (or null: the default) -> 1.0, {"type": "retention_ratio", "retention_ratio": r in [0, 1]} -> r,
    "disabled" -> None."""
    if value is None or value == "auto":
        return 1.0
    if value == "disabled":
        return None
    if isinstance(value, dict) and value.get("type") == "retention_ratio" and set(value) <= {"type", "retention_ratio"}:
        r = value.get("retention_ratio")
        if not isinstance(r, bool) and isinstance(r, (int, float)) and 0.0 <= r <= 1.0:
            return float(r)
    raise RealtimeError("truncation must be \"auto\", \"disabled\" or {\"type\": \"retention_ratio\", "
                        f"\"retention_ratio\": a number in [0, 1]}}, got {value!r}", where)


def truncation_json(ratio: float | None) -> Any:
    """The session's setting as `parse_truncation` took it."""
    if ratio is None:
        return "disabled"
    return "auto" if ratio == 1.0 else {"type": "retention_ratio", "retention_ratio": ratio}


def _transcription(value: Any, where: str) -> dict[str, Any] | None:
    """None, or {"model", "language", "prompt"} (any model name: the served model transcribes)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RealtimeError("input_audio_transcription must be null or an object", where)
    for key, v in value.items():
        if key not in ("model", "language", "prompt") or not (v is None or isinstance(v, str)):
            raise RealtimeError(f"input_audio_transcription.{key}: a string model, language or prompt",
                                f"{where}.{key}")
    if value.get("language"):
        try:
            language_name(value["language"])
        except ValueError as exc:
            raise RealtimeError(f"input_audio_transcription.language: {exc}", f"{where}.language") from None
    return {"model": value.get("model") or "", "language": value.get("language"), "prompt": value.get("prompt")}


# server_vad's numbers: the audio kept before a turn is bounded (it is held between turns: an unbounded padding kept
# every appended second, and each VAD step copied it), and so is the silence that ends one
VAD_RANGES: dict[str, tuple[float, float]] = {"threshold": (0, 1), "prefix_padding_ms": (0, 10_000),
                                              "silence_duration_ms": (FRAME_MS, 60_000)}


def _turn_detection(value: Any, where: str) -> dict[str, Any] | None:
    """None (the client commits turns) or server_vad's settings, checked, with OpenAI's defaults."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type", "server_vad") != "server_vad":
        raise RealtimeError("turn_detection must be null or {\"type\": \"server_vad\", ...} (Silero VAD "
                            "here; semantic_vad is not run)", where)
    out: dict[str, Any] = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300,
                           "silence_duration_ms": 500, "create_response": True, "interrupt_response": True}
    for key, v in value.items():
        if key == "type":
            continue
        if key not in out:
            raise RealtimeError(f"unknown turn_detection field {key!r}", f"{where}.{key}")
        low, high = VAD_RANGES.get(key, (0, 1))
        ok = (isinstance(v, bool) if key in ("create_response", "interrupt_response")
              else isinstance(v, (int, float)) and not isinstance(v, bool) and low <= v <= high)
        if not ok:
            must = "true or false" if key in ("create_response", "interrupt_response") else f"in [{low:g}, {high:g}]"
            raise RealtimeError(f"turn_detection.{key}: {v!r} is out of range (it must be {must})", f"{where}.{key}")
        out[key] = v if key in ("create_response", "interrupt_response", "threshold") else int(v)
    return out


def check_modalities(value: Any, where: str) -> tuple[str, ...]:
    if value in (["text"], ("text",)):
        return ("text",)
    if isinstance(value, (list, tuple)) and all(isinstance(m, str) for m in value) and set(value) == {"text", "audio"}:
        return ("text", "audio")
    raise RealtimeError(f"modalities must be [\"text\"] or [\"text\", \"audio\"], got {value!r}", where)


def check_temperature(value: Any, where: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 2:
        raise RealtimeError(f"temperature must be a number in [0, 2], got {value!r}", where)
    return float(value)


def check_max_tokens(value: Any, where: str) -> int | None:
    if value == "inf":
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise RealtimeError(f"must be a whole number >= 1 or \"inf\", got {value!r}", where)
    return value
