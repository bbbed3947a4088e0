"""The OpenAI `POST /v1/chat/completions` wire format: request validation and response shapes.

Data flow: raw JSON -> `parse_chat_request` (strict pydantic: wrong types are errors, never coerced; every
failure a 400 `PipelineError` whose `param` is the dotted path, e.g. `messages[0].content[1].input_audio`)
-> `ChatCompletionRequest` -> the REST front end turns it into a `ChatRequest`. Responses are built from
the pydantic models below and serialised with `dump`.

Defaults chosen to match OpenAI: `modalities` defaults to ["text"] (no audio unless asked for); when
"audio" is asked for without an `audio` object the pipeline's default voice and "wav" are used. Unknown
top-level fields are accepted and ignored (clients send many; each is named once in the log), except ones
whose silent omission would change the answer (`refuse_unsupported`):
`functions`, and vLLM's beam search and the like, at any value but their neutral one.
OpenAI's `logit_bias` and vLLM's `allowed_token_ids` and `bad_words` reach the stages' samplers; structured outputs:
gateway/structured_request.py. vLLM-Omni's
`mm_processor_kwargs` takes only `use_audio_in_video` (any other key is a 400: the processor's settings
come from the model folder).
`tools` / `tool_choice` and the messages' `tool_calls` / `tool_call_id` are OpenAI's function calling
(checked and parsed in gateway/tool_calls.py).
`stream_options.continuous_usage_stats` (vLLM's, with include_usage) puts the usage so far on every chunk.
vLLM's `add_generation_prompt`, `continue_final_message` and `chat_template_kwargs` (`TemplateFields`, shared
with /tokenize) shape the prompt (gateway/chat_template_options.py); `echo` puts a final assistant message
before each choice's content.
Streamed audio is always base64 mono PCM16 chunks at the pipeline's sample rate, whatever `audio.format`
says (OpenAI likewise streams pcm16 only); `format` shapes the non-streaming `message.audio.data`.
`stop` (a string or up to 64: OpenAI takes 4, vLLM any number) ends the thinker's text before the first match.
`logprobs` (with `top_logprobs` alternatives, 0-20) answer OpenAI's `choices[].logprobs.content`: each text token's
log-probability under the model's raw distribution (vLLM's default), its bytes and its alternatives.
OpenAI's `presence_penalty` / `frequency_penalty` work as in vLLM. Extensions: `top_k`, `min_p`, `ignore_eos`,
`repetition_penalty`,
`stop_token_ids`, `min_tokens`, `include_stop_str_in_output` (as in vLLM), `stage_params` (per stage
sampling, the same keys; `stop` and `include_stop_str_in_output` only for the thinker), and vLLM's `audio_url`
and `video_url` content parts (`{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,..."}}`).
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Sequence
from dataclasses import replace
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from gateway.audio_encoding import OUTPUT_AUDIO_FORMATS
from gateway.chat_template_options import template_options
from gateway.events import Pipeline, PipelineError, SamplingOverrides, TemplateOptions
from gateway.input_limits import InputLimits
from gateway.media import invalid_request, too_large
from gateway.processor_kwargs import KEYS, check_settings
from gateway.prompt_logprobs import token_text
from omnimesh import json_text
from omnimesh.v1 import stage_pb2

logger = logging.getLogger(__name__)

STAGE_NAMES: tuple[str, ...] = ("thinker", "talker")
CONTENT_PART_TYPES: tuple[str, ...] = ("text", "image_url", "input_audio", "audio_url", "video_url")
MAX_LOGPROBS = 20  # --max-logprobs' default: top_logprobs up to 20, as OpenAI and vLLM


class StrictBody(BaseModel):
    """Strict types (a "1" is not an int), unknown keys ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


# -------------------------------------------------------------------------------------------- request
class ImageURL(StrictBody):
    url: str
    detail: str | None = None  # accepted, unused


class InputAudio(StrictBody):
    data: str  # base64 file bytes
    format: str  # checked by the media loader so the error names the supported formats


class AudioURL(StrictBody):
    url: str


class VideoURL(StrictBody):
    url: str  # a data:video/...;base64, URI or an http(s) URL of a video file (MP4, WebM, ...)


_MEDIA_KINDS = {"image_url": "image", "input_audio": "audio", "audio_url": "audio", "video_url": "video"}


class ContentPart(StrictBody):
    """One part of a message; exactly the field named by `type` must be present."""

    type: str
    text: str | None = None
    image_url: ImageURL | None = None
    input_audio: InputAudio | None = None
    audio_url: AudioURL | None = None
    video_url: VideoURL | None = None

    @model_validator(mode="after")
    def _matches_type(self) -> ContentPart:
        if self.type not in CONTENT_PART_TYPES:
            raise ValueError(f"content part type '{self.type}' is not supported; supported: "
                             f"{', '.join(CONTENT_PART_TYPES)}")
        if getattr(self, self.type) is None:
            raise ValueError(f"a '{self.type}' content part needs a '{self.type}' field")
        return self

    @property
    def media_kind(self) -> str | None:
        """'audio', 'image' or 'video' for a media part (what --limit-mm-per-prompt counts); None for text."""
        return _MEDIA_KINDS.get(self.type)


class FunctionCall(StrictBody):
    name: str = Field(min_length=1)
    arguments: str  # JSON text


class MessageToolCall(StrictBody):
    """A call an earlier assistant turn made (sent back with the tool's answer)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AudioRef(StrictBody):
    id: str = Field(min_length=1)  # an earlier answer's message.audio.id (gateway/audio_memory.py)


class Message(StrictBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]  # developer = system (newer OpenAI name)
    content: list[ContentPart]
    tool_calls: list[MessageToolCall] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call this answers
    audio: AudioRef | None = None  # assistant turns: an earlier spoken answer, its transcript as the text
    # assistant turns: the reasoning before the answer (vLLM's `reasoning`, and `reasoning_content` its former name),
    # handed to the chat template as `reasoning_content`, which a thinking model's template reads
    reasoning: str | None = None
    reasoning_content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _string_is_one_text_part(cls, v: Any) -> Any:
        return [{"type": "text", "text": v}] if isinstance(v, str) else v

    @model_validator(mode="before")
    @classmethod
    def _calls_may_come_without_content(cls, v: Any) -> Any:
        if isinstance(v, dict) and v.get("role") == "assistant" and (v.get("tool_calls") or v.get("audio")) \
                and v.get("content") is None:
            return {**v, "content": []}
        return v

    @model_validator(mode="after")
    def _tool_fields_match_the_role(self) -> Message:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls: only assistant messages make calls (this is a '{self.role}' message)")
        if (self.reasoning is not None or self.reasoning_content is not None) and self.role != "assistant":
            raise ValueError(f"reasoning: only assistant messages carry reasoning (this is a '{self.role}' message)")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a 'tool' message needs the tool_call_id of the call it answers")
        if self.audio is not None and self.role != "assistant":
            raise ValueError(f"audio: only assistant messages refer to an earlier spoken answer (this is a "
                             f"'{self.role}' message)")
        return self


class FunctionDef(StrictBody):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema object
    strict: bool | None = None


class ToolDef(StrictBody):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(StrictBody):
    name: str


class NamedToolChoice(StrictBody):
    type: Literal["function"]
    function: NamedFunction


class AudioOutput(StrictBody):
    voice: str | None = None
    format: str = "wav"

    @field_validator("format")
    @classmethod
    def _supported_format(cls, v: str) -> str:
        if v not in OUTPUT_AUDIO_FORMATS:
            raise ValueError(f"output audio format '{v}' is not supported; supported: "
                             f"{', '.join(OUTPUT_AUDIO_FORMATS)}")
        return v


class StreamOptions(StrictBody):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk says the usage so far


# OpenAI's `stop`: a string or a list of strings; a lone string is a list of one
StopList = Annotated[list[str], BeforeValidator(lambda v: [v] if isinstance(v, str) else v)]


def _tuple(v: list[Any] | None) -> tuple[Any, ...] | None:
    return None if v is None else tuple(v)


class StageSampling(StrictBody):
    """Per-stage overrides; unknown keys are errors (a typo must not be silently ignored)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    max_tokens: int | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    stop: StopList | None = None
    min_tokens: int | None = None
    include_stop_str_in_output: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_p: float | None = None
    ignore_eos: bool | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None

    def overrides(self) -> SamplingOverrides:
        return _overrides(self, self.max_tokens)


def _overrides(s: StageSampling | SamplingBody, max_tokens: int | None) -> SamplingOverrides:
    return SamplingOverrides(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed,
                             max_tokens=max_tokens, repetition_penalty=s.repetition_penalty,
                             stop_token_ids=_tuple(s.stop_token_ids), stop=_tuple(s.stop),
                             min_tokens=s.min_tokens, include_stop_str_in_output=s.include_stop_str_in_output,
                             presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
                             min_p=s.min_p, ignore_eos=s.ignore_eos, logit_bias=_bias(s.logit_bias),
                             allowed_token_ids=_tuple(s.allowed_token_ids), bad_words=_tuple(s.bad_words),
                             prompt_logprobs=getattr(s, "prompt_logprobs", None),
                             skip_special_tokens=getattr(s, "skip_special_tokens", None))


def _bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...] | None:
    """OpenAI's logit_bias (token ids as JSON keys) -> (id, bias) pairs; a key that is no id is a 400."""
    if not bias:
        return None
    pairs = []
    for key, value in bias.items():
        if not key.strip().isdigit():
            raise invalid_request(f"logit_bias: keys are token ids (whole numbers as strings), got {key!r}",
                                  "logit_bias")
        pairs.append((int(key), float(value)))
    return tuple(sorted(pairs))


class StageParams(StrictBody):
    model_config = ConfigDict(strict=True, extra="forbid")
    thinker: StageSampling | None = None
    talker: StageSampling | None = None


class MMProcessorKwargs(StrictBody):
    model_config = ConfigDict(strict=True, extra="forbid")  # any other processor setting: a 400, never ignored
    use_audio_in_video: bool = False
    # this request's processor settings over the server's --mm-processor-kwargs (gateway/processor_kwargs.py)
    fps: float | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    min_frames: int | None = None
    max_frames: int | None = None

    def settings(self) -> dict[str, Any]:
        """The processor settings this request sets, checked (400 naming the field)."""
        try:
            return check_settings({k: v for k in KEYS if (v := getattr(self, k)) is not None}, "mm_processor_kwargs")
        except ValueError as e:
            raise invalid_request(str(e), "mm_processor_kwargs") from None


class JsonSchemaFormat(StrictBody):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictBody):
    """OpenAI's `response_format` (gateway/structured_request.py)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(StrictBody):
    """vLLM's `structured_outputs`: one of these constrains the thinker's text."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingBody(StrictBody):
    """The fields a chat completion and a (legacy) completion share: the thinker's sampling, streaming,
    `n`, priority and the structured outputs."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None  # None = the first served model name (as vLLM does)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    stop: StopList | None = None
    min_tokens: int | None = None  # vLLM's: no stop (EOS, stop ids, stop strings) before this many tokens
    include_stop_str_in_output: bool | None = None  # vLLM's: the matched stop string ends the text
    presence_penalty: float | None = None  # OpenAI's, [-2, 2], over the generated tokens (vLLM's arithmetic)
    frequency_penalty: float | None = None
    min_p: float | None = None  # vLLM's: drop ids below min_p x the top probability (after temperature)
    ignore_eos: bool | None = None  # vLLM's: the model's EOS does not stop (max_tokens, stop ids still do)
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # vLLM's: only these ids may be picked
    bad_words: list[str] | None = None  # vLLM's: words the thinker's text must not produce
    # vLLM's: each prompt token's log-probability (from the second) with this many alternatives (not streamed)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool | None = None  # vLLM's: false keeps special tokens in the text (default true)
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens (-1: max_model_len)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None  # OpenAI's: this many choices, each its own run (gateway/choices.py)
    priority: int = 0  # vLLM's: lower runs sooner (the stages' --scheduling-policy priority)
    # structured outputs (gateway/structured_request.py): OpenAI's response_format, vLLM's structured_outputs
    # and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def overrides(self, max_tokens: int | None) -> SamplingOverrides:
        """The thinker's sampling fields as the stages take them, with the route's `max_tokens`."""
        return _overrides(self, max_tokens)


class TemplateFields(StrictBody):
    """vLLM's fields for how the messages become the prompt (chat and /tokenize;
    gateway/chat_template_options.py): None is the default (a new assistant turn, the model's variables)."""

    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None  # the final message stays open and the model continues it
    chat_template_kwargs: dict[str, Any] | None = None  # variables the chat template reads
    chat_template: str | None = None  # the request's own Jinja template (the server must trust such templates)

    def template(self, messages: Sequence[Message], audio_out: bool) -> TemplateOptions:
        """These fields, checked against the messages and the output (400s naming the field)."""
        kwargs = with_effort(self.chat_template_kwargs, getattr(self, "reasoning_effort", None))
        return template_options(self.add_generation_prompt, self.continue_final_message, kwargs,
                                [m.role for m in messages], audio_out=audio_out, chat_template=self.chat_template)


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high"]


def with_effort(kwargs: dict[str, Any] | None, effort: str | None) -> dict[str, Any] | None:
    """The chat template's variables with OpenAI's reasoning effort among them (the client's own win)."""
    return kwargs if effort is None else {"reasoning_effort": effort, **(kwargs or {})}


class ChatCompletionRequest(SamplingBody, TemplateFields):
    model_config = SamplingBody.model_config  # unknown fields kept for `refuse_unsupported` (not TemplateFields')
    messages: list[Message] = Field(min_length=1)
    # vLLM's: each choice's content starts with the final message's text when that is the assistant's (with
    # continue_final_message: the start of the message the model continued)
    echo: bool = False
    include_reasoning: bool = True  # vLLM's: false drops the reasoning (--reasoning-parser) from the answer
    # OpenAI's: how hard a reasoning model thinks; as vLLM, the chat template reads it (`reasoning_effort`)
    reasoning_effort: ReasoningEffort | None = None
    modalities: list[Literal["text", "audio"]] | None = Field(default=None, min_length=1)
    audio: AudioOutput | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # wins over max_tokens (OpenAI deprecated the latter)
    stage_params: StageParams | None = None
    # vLLM(-Omni)'s processor kwargs: only Qwen-Omni's use_audio_in_video (a video's soundtrack interleaved
    # with its frames); any other key is a 400 (the processor's settings come from the model folder)
    mm_processor_kwargs: MMProcessorKwargs | None = None
    # OpenAI's: each generated text token's log-probability, with top_logprobs alternatives (0-20)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # OpenAI's function calling (gateway/tool_calls.py): the tools render into the prompt; with
    # --enable-auto-tool-choice the thinker's <tool_call> blocks come back as `tool_calls`
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # False: "required" makes exactly one call
    # Accepted only at the values that mean "nothing special" (`refuse_unsupported`):
    functions: list[Any] | None = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _known_tool_choice(cls, v: Any) -> Any:
        if isinstance(v, str) and v not in ("none", "auto", "required"):
            raise ValueError(f"must be 'none', 'auto', 'required' or {{\"type\": \"function\", \"function\": "
                             f"{{\"name\": ...}}}}, got {v!r}")
        return v

    def sampling(self, max_logprobs: int = MAX_LOGPROBS) -> SamplingOverrides:
        """The top-level sampling fields (the thinker's); `max_logprobs` bounds `top_logprobs` (-1: none)."""
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.max_completion_tokens is not None and self.max_completion_tokens < 1:  # named as the client sent it
            raise invalid_request(f"max_completion_tokens: must be >= 1, got {self.max_completion_tokens}",
                                  "max_completion_tokens")
        if self.top_logprobs and not self.logprobs:
            raise invalid_request("top_logprobs: needs logprobs: true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= (
                self.top_logprobs if max_logprobs < 0 else max_logprobs):
            raise invalid_request(f"top_logprobs: must be in [0, {max_logprobs}] (--max-logprobs), got "
                                  f"{self.top_logprobs}", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return replace(_overrides(self, max_tokens), logprobs=logprobs)

    def stage_overrides(self) -> dict[str, SamplingOverrides]:
        if self.stage_params is None:
            return {}
        return {name: s.overrides() for name in STAGE_NAMES
                if (s := getattr(self.stage_params, name)) is not None}


# Fields OpenAI or vLLM define that omnimesh does not implement, each with the test that its value asks for
# nothing (then it is accepted and changes nothing): anything else would silently change the answer -> 400
_NEUTRAL: dict[str, Any] = {
    "functions": lambda v: not v,
    # vLLM's extra sampling / decoding parameters
    "best_of": lambda v: v is None or v == 1,
    "use_beam_search": lambda v: not v,
}
# OpenAI fields that only label, store or route a request (nothing here to honour): never logged
_HARMLESS = frozenset({"user", "metadata", "store", "service_tier", "prediction", "prompt_cache_key",
                       "safety_identifier"})
_ignored_logged: set[str] = set()  # unknown top-level fields already named in the log (once each)


def refuse_unsupported(req: SamplingBody, unsupported: dict[str, Any] | None = None) -> None:
    """A 400 naming the first field set to a value omnimesh cannot honour (`unsupported`: name -> the test
    that its value asks for nothing; a chat's `_NEUTRAL` by default); other unknown top-level fields are
    ignored, as vLLM does, and named once in the log so a typo can be found."""
    extra = req.model_extra or {}
    unsupported = _NEUTRAL if unsupported is None else unsupported
    for name, neutral in unsupported.items():
        value = getattr(req, name, None) if name in type(req).model_fields else extra.get(name)
        if not neutral(value):
            shown = json.dumps(value)[:80]
            why = "omnimesh does not implement it; leave it out"
            raise invalid_request(f"{name}: {shown} is not supported; {why}", name)
    fresh = sorted(set(extra) - set(unsupported) - _HARMLESS - _ignored_logged)
    if fresh:
        _ignored_logged.update(fresh)
        logger.warning("request fields ignored (not part of omnimesh's API; each named once): %s", ", ".join(fresh))


def _path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _message(err: Any) -> str:  # a pydantic ErrorDetails
    msg = str(err["msg"])
    if err["type"] == "value_error":
        msg = msg.removeprefix("Value error, ")
    elif err["type"] == "extra_forbidden":
        msg = "unknown field"
    return msg


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """Raw body -> a JSON object; malformed JSON, unpaired surrogates, nesting too deep and non-objects -> 400."""
    try:
        obj = json_text.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:  # json_text's own refusals are JSONDecodeErrors
        raise invalid_request(f"request body is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise invalid_request(f"request body must be a JSON object, got {type(obj).__name__}")
    return obj


BodyT = TypeVar("BodyT", bound=BaseModel)


def validate_body(model: type[BodyT], obj: Any, where: tuple[int | str, ...] = ()) -> BodyT:
    """A JSON object -> `model`; every schema violation a 400 naming the dotted path of the first (under
    `where`, the object's own place in a body, e.g. ("input", 2))."""
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        first = _path((*where, *errors[0]["loc"])) or None
        text = "; ".join(f"{_path((*where, *x['loc'])) or 'body'}: {_message(x)}" for x in errors[:5])
        if len(errors) > 5:
            text += f"; ... ({len(errors) - 5} more)"
        raise invalid_request(text, first) from None


def parse_chat_request(raw: bytes, limits: InputLimits | None = None) -> ChatCompletionRequest:
    """Raw body -> validated request; malformed JSON and every schema violation -> 400, too many messages or
    parts for `limits` -> 413 (before validating them). CPU-bound for big bodies: call it off the event loop."""
    obj = parse_json_object(raw)
    check_turns(obj.get("messages"), limits, "messages")
    req = validate_body(ChatCompletionRequest, obj)
    refuse_unsupported(req)
    return req


def check_turns(items: Any, limits: InputLimits | None, param: str) -> None:
    """A body's messages (or Responses input items), still raw JSON, within `limits`' max_messages and
    max_content_parts (a string content is one part): 413 naming `param`. Only len() calls, so a huge list
    is refused before the per-message validation that would cost seconds."""
    if limits is None or not isinstance(items, list):
        return
    parts = sum(len(c) if isinstance(c := m.get("content"), list) else 1 for m in items if isinstance(m, dict))
    check_turn_counts(len(items), parts, limits, param)


def check_turn_counts(n_items: int, n_parts: int, limits: InputLimits, param: str) -> None:
    """`n_items` messages with `n_parts` content parts in all within --input-limits (REST's raw JSON, gRPC's
    messages alike): 413 / INVALID_ARGUMENT naming `param`."""
    if n_items > limits.max_messages:
        raise too_large(f"{param}: {n_items} of them; at most {limits.max_messages} in one request "
                        "(--input-limits max_messages)", param)
    if n_parts > limits.max_content_parts:
        raise too_large(f"{param}: {n_parts} content parts in all; at most {limits.max_content_parts} in one request "
                        "(--input-limits max_content_parts)", param)


# ------------------------------------------------------------------------- checks shared with gRPC
MAX_STOP_STRINGS = 64  # OpenAI takes 4 and vLLM any; each token is checked against all (StopStrings: ~16 us at 64)
MAX_BAD_WORDS = 1024  # tokenized on the thinker's event loop when a request opens: a bound, not a taste
INT32_MAX = 2**31 - 1  # the wire's token counts are int32


def check_priority(priority: int) -> int:
    """vLLM's request priority must fit the wire's int32 (whether the stages take it is theirs to say)."""
    if not -(2**31) <= priority < 2**31:
        raise invalid_request(f"priority: must fit in a signed 32-bit integer, got {priority}", "priority")
    return priority


FLOAT32_TINY, FLOAT32_MAX = 1.1754943508222875e-38, 3.4028234663852886e38  # float32's smallest normal and largest


def as_float32(value: float) -> float:
    """`value` as a stage's float32 field holds it (struct's rounding; the magnitudes checked beside it)."""
    return struct.unpack("<f", struct.pack("<f", value))[0] if abs(value) <= FLOAT32_MAX else value


def check_sampling(s: SamplingOverrides, param: str, max_logprobs: int = MAX_LOGPROBS) -> None:
    """Ranges for sampling values (REST and gRPC alike); None means the stage default. `max_logprobs`:
    the gateway's --max-logprobs (-1: only the thinker's vocabulary bounds them).

    `param` is "" (top level: the thinker), "sampling" (gRPC's top level) or "stage_params.<stage>".
    Stop ids are checked for sign and int64 only: the stage knows its vocab and checks the upper bound.
    """
    problems: list[tuple[str, str]] = []
    if s.temperature is not None and not 0.0 <= s.temperature <= 2.0:
        problems.append(("temperature", f"must be in [0, 2] (0 = greedy), got {s.temperature}"))
    if s.top_p is not None and not 0.0 < s.top_p <= 1.0:
        problems.append(("top_p", f"must be in (0, 1], got {s.top_p}"))
    elif s.top_p is not None and as_float32(s.top_p) < FLOAT32_TINY:  # the stages read float32: 1e-300 is 0 there
        problems.append(("top_p", f"must be in (0, 1] and at least {FLOAT32_TINY:g} (a float32), got {s.top_p}"))
    if s.min_p is not None and not 0.0 <= s.min_p <= 1.0:
        problems.append(("min_p", f"must be in [0, 1] (0 disables it), got {s.min_p}"))
    if s.top_k is not None and not -1 <= s.top_k <= INT32_MAX:  # vLLM's: -1 or 0 = every token (off)
        problems.append(("top_k", f"must be -1 or 0 (off: every token) or in [1, {INT32_MAX}], got {s.top_k}"))
    if s.max_tokens is not None and not 1 <= s.max_tokens <= INT32_MAX:
        problems.append(("max_tokens", f"must be >= 1 and at most {INT32_MAX}, got {s.max_tokens}"))
    if s.min_tokens is not None and not 0 <= s.min_tokens <= INT32_MAX:
        problems.append(("min_tokens", f"must be in [0, {INT32_MAX}], got {s.min_tokens}"))
    elif s.min_tokens is not None and s.max_tokens is not None and s.min_tokens > s.max_tokens:
        problems.append(("min_tokens", f"must be <= max_tokens ({s.max_tokens}), got {s.min_tokens}"))
    if s.repetition_penalty is not None and not FLOAT32_TINY <= s.repetition_penalty <= FLOAT32_MAX:
        problems.append(("repetition_penalty", f"must be > 0 and within float32's range (what the stages read: "
                                               f"[{FLOAT32_TINY:g}, {FLOAT32_MAX:g}]), got {s.repetition_penalty}"))
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if value is not None and not -2.0 <= value <= 2.0:
            problems.append((name, f"must be in [-2, 2] (0 disables it), got {value}"))
    if s.seed is not None and not -(2**63) <= s.seed < 2**63:
        problems.append(("seed", f"must fit in a signed 64-bit integer, got {s.seed}"))
    for i, t in enumerate(s.stop_token_ids or ()):
        if not 0 <= t < 2**63:
            problems.append((f"stop_token_ids[{i}]", f"must be a token id >= 0, got {t}"))
            break
    for t, bias in s.logit_bias or ():
        if not 0 <= t < 2**63 or not -100.0 <= bias <= 100.0:
            problems.append(("logit_bias", f"token {t}: ids must be >= 0 and biases in [-100, 100], got {bias}"))
            break
    if s.allowed_token_ids is not None and not s.allowed_token_ids:  # vLLM refuses it too
        problems.append(("allowed_token_ids", "must name at least one token id (an empty list allows none; leave "
                                              "it out to allow every token)"))
    for i, t in enumerate(s.allowed_token_ids or ()):
        if not 0 <= t < 2**63:
            problems.append((f"allowed_token_ids[{i}]", f"must be a token id >= 0, got {t}"))
            break
    if s.bad_words:
        if param.endswith("talker"):
            problems.append(("bad_words", "bad words apply to the thinker's text only; the talker emits audio codes"))
        elif any(not w.strip() for w in s.bad_words):
            problems.append(("bad_words", "bad words must not be empty or only spaces"))
        elif len(s.bad_words) > MAX_BAD_WORDS:  # each is tokenized when the thinker opens the request
            problems.append(("bad_words", f"at most {MAX_BAD_WORDS} bad words, got {len(s.bad_words)}"))
    if s.stop:
        if param.endswith("talker"):
            why = "stop strings apply to the thinker's text only; the talker emits audio codes (use stop_token_ids)"
            problems.append(("stop", why))
        elif len(s.stop) > MAX_STOP_STRINGS:
            problems.append(("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(s.stop)}"))
        elif "" in s.stop:
            problems.append(("stop", "stop strings must not be empty"))
    if s.logprobs is not None and param.endswith("talker"):
        problems.append(("logprobs", "applies to the thinker's text tokens only; the talker emits audio codes"))
    elif s.logprobs is not None and not 0 <= s.logprobs <= (s.logprobs if max_logprobs < 0 else max_logprobs):
        problems.append(("logprobs", f"must be in [0, {max_logprobs}] alternatives per token (--max-logprobs), "
                                     f"got {s.logprobs}"))
    if s.prompt_logprobs is not None and param.endswith("talker"):
        problems.append(("prompt_logprobs", "applies to the thinker's prompt tokens only"))
    elif s.prompt_logprobs is not None and not 0 <= s.prompt_logprobs <= (
            s.prompt_logprobs if max_logprobs < 0 else max_logprobs):
        problems.append(("prompt_logprobs", f"must be in [0, {max_logprobs}] alternatives per token (--max-logprobs), "
                                            f"got {s.prompt_logprobs}"))
    if s.skip_special_tokens is not None and param.endswith("talker"):
        problems.append(("skip_special_tokens", "applies to the thinker's text only; the talker emits audio codes"))
    if s.include_stop_str_in_output and param.endswith("talker"):
        problems.append(("include_stop_str_in_output", "applies to the thinker's text only; the talker emits audio "
                                                       "codes"))
    if problems:
        name, why = problems[0]
        full = f"{param}.{name}" if param else name
        raise invalid_request(f"{full}: {why}", full)


def check_thinker_min_tokens(top: SamplingOverrides, thinker: SamplingOverrides | None, top_param: str) -> None:
    """min_tokens <= max_tokens for the thinker once `stage_params.thinker` is laid over the top level (each
    level alone is checked by `check_sampling`). `top_param` is "" (REST) or "sampling" (gRPC). A max_tokens
    left to the stage's default is checked by the stage (400 / INVALID_ARGUMENT naming min_tokens)."""
    own = thinker or SamplingOverrides()
    low = own.min_tokens if own.min_tokens is not None else top.min_tokens
    high = own.max_tokens if own.max_tokens is not None else top.max_tokens
    if low is not None and high is not None and low > high:
        where = "stage_params.thinker.min_tokens" if own.min_tokens is not None else (
            f"{top_param}.min_tokens" if top_param else "min_tokens")
        raise invalid_request(f"{where}: must be <= the thinker's max_tokens ({high}), got {low}", where)


def resolve_model(requested: str | None, served_names: tuple[str, ...]) -> str:
    """The served name the client asked for (None = the first); an unknown name is a 404."""
    if requested is None or requested == "":
        return served_names[0]
    if requested not in served_names:
        raise unknown_model(requested, served_names)
    return requested


def unknown_model(requested: str, served_names: tuple[str, ...]) -> PipelineError:
    """OpenAI's 404 for a model name this server does not serve."""
    return PipelineError(f"The model '{requested}' does not exist; served models: {', '.join(served_names)}",
                         http_status=404, grpc_code=5, kind="not_found_error", param="model")


def audio_unavailable(why: str, param: str = "modalities") -> PipelineError:
    """The 400 for speech asked of a server that speaks none, saying why."""
    return invalid_request(f"audio output is not available on this server: {why}; ask for modalities [\"text\"]", param)


def resolve_voice(requested: str | None, pipeline: Pipeline, param: str, speaking: bool = True) -> str:
    """The pipeline's spelling of the voice (matched case-insensitively); unknown -> 400, and so is any voice
    on a server that speaks no audio (saying why; naming `modalities` when the request asks for speech)."""
    voices = pipeline.voices
    if not voices:
        raise audio_unavailable(why_no_voices(pipeline), "modalities" if speaking else param)
    if requested is None or requested == "":
        return pipeline.default_voice
    if not isinstance(requested, str):  # (a Realtime event's raw JSON; the REST models check their own)
        raise invalid_request(f"{param}: a voice is named by a string, got {requested!r}; available: "
                              f"{', '.join(voices)}", param)
    for v in voices:
        if v.lower() == requested.lower():
            return v
    raise invalid_request(f"{param}: unknown voice '{requested}'; available: {', '.join(voices)}", param)


def why_no_voices(pipeline: Pipeline) -> str:
    """Why a server lists no voices (its reason for refusing speech)."""
    return pipeline.no_audio or "it has no voices: no talker / vocoder stage"


def default_modalities(pipeline: Pipeline) -> tuple[Literal["text", "audio"], ...]:
    """Where a protocol's default is speech (gRPC, Realtime): text and audio, or text alone on a server that
    speaks no audio (a thinker-only model)."""
    return ("text", "audio") if pipeline.voices else ("text",)


def normalize_modalities(requested: Sequence[str] | None, default: tuple[str, ...]) -> tuple[Literal["text", "audio"], ...]:
    """Text is always produced (it is the audio's transcript), so any list with "audio" means both."""
    wanted = default if requested is None else tuple(requested)
    for m in wanted:
        if m not in ("text", "audio"):
            raise invalid_request(f"modalities: '{m}' is not supported; use [\"text\"] or [\"text\", \"audio\"]",
                                  "modalities")
    return ("text", "audio") if "audio" in wanted else ("text",)


# ------------------------------------------------------------------------------------------ responses
class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Out):
    cached_tokens: int  # prompt tokens whose KV came from the thinker's prefix cache


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # with --enable-prompt-tokens-details, as vLLM's


class MessageAudio(_Out):
    id: str
    data: str  # base64 of the whole file in the requested format
    expires_at: int  # until when a later turn may send {"role": "assistant", "audio": {"id": ...}} (audio_memory.py)
    transcript: str


class FunctionCallOut(_Out):
    name: str
    arguments: str  # JSON text


class ToolCallOut(_Out):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ResponseMessage(_Out):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None when the answer is only tool calls
    refusal: None = None
    reasoning: str | None = None  # --reasoning-parser: the thought before the answer (vLLM's name)
    reasoning_content: str | None = None  # the same, under vLLM's former name (DeepSeek-style clients read it)
    audio: MessageAudio | None = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)  # as vLLM: [] when none


class DeltaFunctionCall(_Out):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Out):
    index: int  # the call's place among the choice's calls
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class TopLogprob(_Out):
    token: str  # the token's bytes as text (U+FFFD where it holds part of a character)
    logprob: float
    bytes: list[int] | None  # the exact bytes


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(_Out):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


def choice_logprobs(entries: Sequence[stage_pb2.TokenLogprob], as_ids: bool = False) -> ChoiceLogprobs:
    """The thinker's entries (services/llm/token_logprobs.py) in OpenAI's `choices[].logprobs` shape;
    `as_ids` (--return-tokens-as-token-ids): each `token` is 'token_id:<id>', as vLLM writes it."""
    def top(e: stage_pb2.TopLogprob | stage_pb2.TokenLogprob) -> dict[str, Any]:
        return {"token": token_text(e, as_ids), "logprob": e.logprob, "bytes": list(e.token)}

    return ChoiceLogprobs(content=[TokenLogprob(**top(e), top_logprobs=[TopLogprob(**top(t)) for t in e.top])
                                   for e in entries])


class Choice(_Out):
    index: int = 0
    message: ResponseMessage
    finish_reason: str
    logprobs: ChoiceLogprobs | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it


class ChatCompletion(_Out):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    # vLLM's, when asked (gateway/prompt_logprobs.py); left out of the JSON otherwise
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class DeltaAudio(_Out):
    id: str
    data: str | None = None  # base64 mono little-endian int16 at the pipeline's sample rate
    expires_at: int | None = None  # on a choice's first audio delta, as OpenAI's (gateway/audio_memory.py)
    transcript: str | None = None


class Delta(_Out):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None  # as ResponseMessage's
    reasoning_content: str | None = None
    audio: DeltaAudio | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChunkChoice(_Out):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None
    stop_reason: int | str | None = None  # on the finish chunk, when a stop string or stop id ended the choice


class ChatCompletionChunk(_Out):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "omnimesh"
    max_model_len: int | None = None  # vLLM's card carries it (clients read the context length from it)


class ModelList(_Out):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(_Out):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Out):
    error: ErrorInfo


_STATUS_CODES: dict[int, str] = {400: "invalid_request", 404: "model_not_found", 405: "method_not_allowed",
                                 413: "payload_too_large", 429: "rate_limit_exceeded", 500: "internal_error",
                                 503: "service_unavailable", 504: "timeout"}


def error_response(err: PipelineError) -> ErrorResponse:
    code = "not_found" if err.http_status == 404 and err.param != "model" else _STATUS_CODES.get(err.http_status)
    return ErrorResponse(error=ErrorInfo(message=err.message, type=err.kind, param=err.param, code=code))


def dump(obj: BaseModel, *, drop_none: bool = False) -> dict[str, Any]:
    """The JSON-ready dict; `drop_none` leaves unset fields out (stream deltas carry only what changed)."""
    data = obj.model_dump(mode="json", exclude_none=drop_none)
    if drop_none and isinstance(obj, ChatCompletionChunk):
        for c in data["choices"]:
            c.setdefault("finish_reason", None)  # OpenAI always sends it, null until the end
    return data
