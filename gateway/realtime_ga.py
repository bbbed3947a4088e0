"""The Realtime API's GA interface (what the `openai` SDK's `client.realtime.connect()` speaks) on top of the
beta one the session runs (gateway/realtime_api.py).

A session speaks GA from `session.created` on, as OpenAI's server since the beta's end, unless the client asks
for beta (the header `OpenAI-Beta: realtime=v1`, or a browser's subprotocol "openai-beta.realtime-v1":
gateway/realtime_routes.py); a beta session's `session.update` whose session says `"type": "realtime"` switches
it to GA for good. A GA session's beta-only field is refused with its GA name and the header to send. In GA,
both ways:

    client -> session: `session_fields` turns a GA session object into the beta fields `updated` checks
      (`output_modalities` -> modalities, `audio.input.format` / `.turn_detection` / `.transcription` ->
      input_audio_format / turn_detection / input_audio_transcription, `audio.output.format` / `.voice` ->
      output_audio_format / voice, `max_output_tokens` -> max_response_output_tokens), and an error's field
      back into its GA path (`param`); `response_fields` does the same for a `response.create`'s response
    session -> client: `events` renames what the session sends (response.audio.delta ->
      response.output_audio.delta, response.audio_transcript.* -> response.output_audio_transcript.*,
      response.text.* -> response.output_text.*, conversation.item.created -> conversation.item.added, plus
      conversation.item.done once an item is complete), content parts' types (audio -> output_audio, text ->
      output_text), a response's `modalities` -> `output_modalities`, and `session_object` writes the
      session in the GA shape.

A session.update with `"type": "transcription"` makes a transcription session instead (before any audio or
item): each committed turn (server_vad's or the client's commit) is transcribed, with delta events, and
nothing answers (`response.create` is an error); its session object is GA's transcription session.

Formats are objects in GA: {"type": "audio/pcm", "rate": 24000}, {"type": "audio/pcmu"} (mu-law) and
{"type": "audio/pcma"} (A-law), the beta's pcm16, g711_ulaw and g711_alaw (gateway/realtime_audio.py).
"""

from __future__ import annotations

from typing import Any

from gateway.realtime_settings import RealtimeError

_FORMATS = {"audio/pcm": "pcm16", "audio/pcmu": "g711_ulaw", "audio/pcma": "g711_alaw"}
_GA_FORMAT = {v: k for k, v in _FORMATS.items()}
_RENAMED = {"response.audio.delta": "response.output_audio.delta", "response.audio.done": "response.output_audio.done",
            "response.audio_transcript.delta": "response.output_audio_transcript.delta",
            "response.audio_transcript.done": "response.output_audio_transcript.done",
            "response.text.delta": "response.output_text.delta", "response.text.done": "response.output_text.done",
            "conversation.item.created": "conversation.item.added"}
_PART_TYPES = {"audio": "output_audio", "text": "output_text"}
# a beta field's path in the GA session, for the errors `updated` raises
_GA_PATHS = {"session.modalities": "session.output_modalities", "session.voice": "session.audio.output.voice",
             "session.input_audio_format": "session.audio.input.format",
             "session.output_audio_format": "session.audio.output.format",
             "session.turn_detection": "session.audio.input.turn_detection",
             "session.input_audio_transcription": "session.audio.input.transcription",
             "session.max_response_output_tokens": "session.max_output_tokens",
             "session.speed": "session.audio.output.speed",
             "response.modalities": "response.output_modalities", "response.voice": "response.audio.output.voice"}
_NEUTRAL: dict[str, tuple[Any, ...]] = {"tracing": (None, "auto"), "include": (None, []), "prompt": (None,)}


def is_ga(session: Any) -> bool:
    return isinstance(session, dict) and session.get("type") in ("realtime", "transcription")


def is_transcription(session: Any) -> bool:
    """A GA transcription session: the audio appended is transcribed turn by turn, and nothing answers."""
    return isinstance(session, dict) and session.get("type") == "transcription"


def ga_param(param: str | None) -> str | None:
    """A beta field's error path as the GA session names it."""
    if param is None:
        return None
    for beta, ga in _GA_PATHS.items():
        if param == beta or param.startswith(beta + "."):
            return ga + param[len(beta):]
    return param


def _modalities(value: Any, where: str) -> list[str]:
    if value in (["audio"], ["text", "audio"], ["audio", "text"]):
        return ["text", "audio"]  # GA's audio answers carry their transcript
    if value == ["text"]:
        return ["text"]
    raise RealtimeError(f"output_modalities must be [\"audio\"] or [\"text\"], got {value!r}", where)


def _format(value: Any, where: str) -> str:
    kind = value.get("type") if isinstance(value, dict) else None
    if not isinstance(kind, str) or kind not in _FORMATS:
        raise RealtimeError("format must be {\"type\": \"audio/pcm\", \"rate\": 24000}, {\"type\": \"audio/pcmu\"} or "
                            f"{{\"type\": \"audio/pcma\"}}, got {value!r}", where)
    if kind == "audio/pcm" and value.get("rate", 24_000) != 24_000:
        raise RealtimeError(f"audio/pcm is 24000 Hz here, got rate {value.get('rate')!r}", f"{where}.rate")
    return _FORMATS[kind]


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise RealtimeError(f"{where.removeprefix('session.')} must be an object", where)
    return value


def session_fields(session: dict[str, Any]) -> dict[str, Any]:
    """A GA session object -> the beta fields `updated` takes (GA-only fields checked here)."""
    out: dict[str, Any] = {}
    for key, value in session.items():
        where = f"session.{key}"
        if key == "type" and value not in ("realtime", "transcription"):
            raise RealtimeError(f"session.type must be \"realtime\" or \"transcription\", got {value!r}", where)
        if key in ("type", "model", "id", "object", "instructions", "tools", "tool_choice", "temperature", "truncation"):
            if key not in ("type", "model", "id", "object"):
                out[key] = value
        elif key == "output_modalities":
            out["modalities"] = _modalities(value, where)
        elif key == "max_output_tokens":
            out["max_response_output_tokens"] = value
        elif key == "audio":
            for side, fields in _object(value, where).items():
                if side not in ("input", "output"):
                    raise RealtimeError(f"unknown audio field {side!r}", f"{where}.{side}")
                for name, v in _object(fields, f"{where}.{side}").items():
                    at = f"{where}.{side}.{name}"
                    if name == "format":
                        out[f"{side}_audio_format"] = _format(v, at)
                    elif (side, name) == ("input", "turn_detection"):
                        out["turn_detection"] = None if v is None else {
                            k: x for k, x in _object(v, at).items() if not (k == "idle_timeout_ms" and x is None)}
                    elif (side, name) == ("input", "transcription"):
                        out["input_audio_transcription"] = v
                    elif (side, name) == ("input", "noise_reduction") and v is None:
                        continue
                    elif (side, name) == ("output", "voice"):
                        out["voice"] = v
                    elif (side, name) == ("output", "speed"):
                        out["speed"] = v
                    else:
                        raise RealtimeError(f"{side}.{name}: {v!r} is not supported here", at)
        elif key in _NEUTRAL and value in _NEUTRAL[key]:
            continue
        elif where in _GA_PATHS:  # a beta client that did not say so
            raise RealtimeError(f"session field {key!r} is the beta interface's; this session speaks GA, where it is "
                                f"{_GA_PATHS[where]} (a beta client connects with the header "
                                "OpenAI-Beta: realtime=v1)", where, code="unknown_parameter")
        else:
            raise RealtimeError(f"session field {key!r}: {value!r} is not supported here", where)
    return out


def response_fields(response: Any) -> Any:
    """A GA `response.create`'s response -> the beta overrides `_chat` reads."""
    if not isinstance(response, dict):
        return response
    out = {k: v for k, v in response.items() if k not in ("output_modalities", "audio")}
    if "output_modalities" in response:
        out["modalities"] = _modalities(response["output_modalities"], "response.output_modalities")
    audio = response.get("audio")
    if audio is not None:
        output = _object(_object(audio, "response.audio").get("output") or {}, "response.audio.output")
        for name, v in output.items():
            if name == "voice":
                out["voice"] = v
            elif name != "format" or _format(v, "response.audio.output.format") != "pcm16":
                raise RealtimeError(f"audio.output.{name} is the session's here", f"response.audio.output.{name}")
    return out


def session_object(beta: dict[str, Any], transcription: bool = False) -> dict[str, Any]:
    """The beta session JSON -> the GA session object (a transcription session's, with `transcription`)."""
    td = beta["turn_detection"]
    audio_in = {"format": _format_object(beta["input_audio_format"]),
                "transcription": beta["input_audio_transcription"], "noise_reduction": None, "turn_detection": None if td is None else {**td, "idle_timeout_ms": None}}
    if transcription:
        return {"type": "transcription", "object": "realtime.transcription_session", "id": beta["id"],
                "expires_at": beta["expires_at"], "audio": {"input": audio_in}, "include": None}
    return {"type": "realtime", "object": "realtime.session", "id": beta["id"], "model": beta["model"],
            "expires_at": beta["expires_at"],
            "output_modalities": ["audio"] if "audio" in beta["modalities"] else ["text"],
            "instructions": beta["instructions"], "tools": beta["tools"], "tool_choice": beta["tool_choice"],
            "max_output_tokens": beta["max_response_output_tokens"], "tracing": None, "truncation": beta["truncation"],
            "prompt": None, "include": None,
            "audio": {"input": audio_in,
                      "output": {"format": _format_object(beta["output_audio_format"]), "voice": beta["voice"],
                                 "speed": beta["speed"]}}}


def _format_object(fmt: str) -> dict[str, Any]:
    kind = _GA_FORMAT[fmt]
    return {"type": kind, "rate": 24_000} if kind == "audio/pcm" else {"type": kind}


def _part(part: Any) -> Any:
    if isinstance(part, dict) and part.get("type") in _PART_TYPES:
        return {**part, "type": _PART_TYPES[part["type"]]}
    return part


def _item(item: Any) -> Any:
    if isinstance(item, dict) and item.get("role") == "assistant" and isinstance(item.get("content"), list):
        return {**item, "content": [_part(p) for p in item["content"]]}
    return item


def events(kind: str, fields: dict[str, Any], in_conversation: bool = True) -> list[tuple[str, dict[str, Any]]]:
    """One beta event -> the GA events the client gets instead (see the module docstring); `in_conversation`
    False: an out-of-band response's item, which no conversation.item.done follows."""
    fields = dict(fields)
    if "part" in fields:
        fields["part"] = _part(fields["part"])
    if "item" in fields:
        fields["item"] = _item(fields["item"])
    if isinstance(fields.get("response"), dict):
        response = dict(fields["response"])
        if "modalities" in response:
            response["output_modalities"] = ["audio"] if "audio" in response.pop("modalities") else ["text"]
        if isinstance(response.get("output"), list):
            response["output"] = [_item(i) for i in response["output"]]
        fields["response"] = response
    if isinstance(fields.get("error"), dict) and fields["error"].get("code") != "unknown_parameter":  # that one
        fields["error"] = {**fields["error"], "param": ga_param(fields["error"].get("param"))}  # names what was sent
    out = [(_RENAMED.get(kind, kind), fields)]
    item = fields.get("item")
    if kind == "conversation.item.created" and isinstance(item, dict) and item.get("status") == "completed":
        out.append(("conversation.item.done", {"item": item}))  # a user's or a client's item: whole at once
    elif kind == "response.output_item.done" and in_conversation:
        out.append(("conversation.item.done", {"item": item}))
    return out
