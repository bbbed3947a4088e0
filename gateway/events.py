"""In-process structs between the gateway's front ends (REST, gRPC) and its pipeline.

Data flow: a front end validates the client's request into a `ChatRequest`; `Pipeline.run(request)`
chains the stages and yields `TextDelta`, `AudioDelta` and finally one `Finished`; a failure is raised
as `PipelineError`, which carries both the HTTP status and the gRPC code the front ends answer with.
Only IPC-free, typed dataclasses here.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

if TYPE_CHECKING:
    from gateway.media_budget import MediaBudget
    from gateway.media_release import RunMedia
    from gateway.shared_build import SharedBuild
    from omnimesh.v1 import stage_pb2

Modality = Literal["text", "audio"]


@dataclass(frozen=True, slots=True)
class TextPart:
    text: str


# The media parts change only to be let go (gateway/media_release.py): once no run of their request will build a
# prompt from them again, their data is dropped and `released` is set; a build that meets one raises.
_NO_SAMPLES = np.zeros(0, np.float32)
_NO_FRAMES = np.zeros((0, 0, 0, 3), np.uint8)


@dataclass(slots=True, eq=False)
class AudioPart:
    waveform: np.ndarray  # (samples,) float32 mono at `sample_rate`
    sample_rate: int
    released: bool = False

    def let_go(self) -> None:
        self.waveform, self.released = _NO_SAMPLES, True


@dataclass(slots=True, eq=False)
class ImagePart:
    image: object  # PIL.Image.Image, RGB; None once let go
    released: bool = False

    def let_go(self) -> None:
        self.image, self.released = None, True


@dataclass(slots=True, eq=False)
class VideoPart:
    frames: np.ndarray  # (T, H, W, 3) uint8 RGB: the frames the model sees (already sampled)
    fps: float  # the sampling rate they were taken at (video_second_per_grid = temporal_patch_size / fps)
    audio: AudioPart | None = None  # its soundtrack, when the request asked for it (use_audio_in_video)
    released: bool = False

    def let_go(self) -> None:
        self.frames, self.released = _NO_FRAMES, True
        if self.audio is not None:
            self.audio.let_go()


ContentPart = TextPart | AudioPart | ImagePart | VideoPart


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call the model made (an assistant message's, or parsed from the thinker's text)."""

    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: Literal["system", "user", "assistant", "tool"]
    content: tuple[ContentPart, ...]
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers
    reasoning: str | None = None  # an assistant turn's reasoning (the template's `reasoning_content`)


@dataclass(frozen=True, slots=True)
class SamplingOverrides:
    """What the client set; None = the stage's model default (what `transformers` generate uses).

    `stop_token_ids` add to the stage's own EOS (the stage checks them against its vocab); `stop` holds
    stop strings for the thinker's text (the talker has no text and refuses them), and
    `include_stop_str_in_output` keeps the matched one in it. `min_tokens`: no stop before that many tokens.
    `presence_penalty` / `frequency_penalty`: OpenAI's, over the stage's generated tokens.
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    max_tokens: int | None = None
    repetition_penalty: float | None = None
    stop_token_ids: tuple[int, ...] | None = None
    stop: tuple[str, ...] | None = None
    min_tokens: int | None = None
    include_stop_str_in_output: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: int | None = None  # thinker: each token's log-probability and this many alternatives (0-20)
    prompt_logprobs: int | None = None  # vLLM's, thinker: each prompt token's (from the second), this many alternatives
    skip_special_tokens: bool | None = None  # vLLM's, thinker: False keeps special tokens in the text
    min_p: float | None = None  # vLLM's: drop ids below min_p x the top probability
    ignore_eos: bool | None = None  # vLLM's: the model's own stop ids do not stop the stage
    logit_bias: tuple[tuple[int, float], ...] | None = None  # OpenAI's: (token id, added to its logit)
    allowed_token_ids: tuple[int, ...] | None = None  # vLLM's: only these ids may be picked
    bad_words: tuple[str, ...] | None = None  # vLLM's, thinker only: words the text must not produce


@dataclass(frozen=True, slots=True)
class TemplateOptions:
    """How the messages become the prompt besides the template itself (defaults: a chat's prompt, ending with
    the assistant's turn start); checked in gateway/chat_template_options.py."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the final message stays open and the model continues it
    kwargs: dict[str, Any] = field(default_factory=dict)  # vLLM's chat_template_kwargs: variables the template reads
    chat_template: str | None = None  # vLLM's: the request's own template (needs --trust-request-chat-template)


@dataclass(frozen=True, slots=True)
class ChatRequest:
    request_id: str
    model: str
    messages: tuple[ChatMessage, ...]
    modalities: tuple[Modality, ...] = ("text", "audio")
    voice: str | None = None
    sampling: SamplingOverrides = field(default_factory=SamplingOverrides)
    stage_params: dict[str, SamplingOverrides] = field(default_factory=dict)  # "thinker" | "talker"
    priority: int = 0  # vLLM's: lower runs sooner in the thinker and talker (--scheduling-policy priority)
    # the request's mm_processor_kwargs over the server's: (name, value) pairs, sorted (gateway/processor_kwargs.py)
    processor_kwargs: tuple[tuple[str, float], ...] = ()
    # OpenAI's `tools` as the chat template reads them ({"type": "function", "function": {...}} each)
    tools: tuple[dict[str, Any], ...] = ()
    # the thinker's text must follow this: (json | regex | choice | grammar, spec) (gateway/structured_request.py)
    structured: tuple[str, str] | None = None
    # a (legacy) completion's prompt: these token ids exactly, no chat template (`messages` is empty then)
    prompt_ids: tuple[int, ...] | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens (-1: max_model_len)
    template: TemplateOptions = field(default_factory=TemplateOptions)
    # the thinker's text reasons until this marker (--reasoning-parser): a structured output shapes what follows
    reasoning_end: str | None = None
    # tools with tool_choice "auto" and audio out: the talker stops where a call starts (gateway/spoken_calls.py)
    spoken_calls: bool = False
    # the client's field that carried the media, for errors about them (a transcription's upload is `file`)
    media_param: str = "messages"
    # the client's field that carried the conversation, for errors about it (Responses: `input`)
    conversation_param: str = "messages"
    # this run's share of its media, let go once every run that builds from them has (gateway/media_release.py)
    media: RunMedia | None = field(default=None, compare=False, repr=False)
    # the one prompt build of the request's n choices (gateway/shared_build.py)
    shared_build: SharedBuild | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str
    # the thinker's entries for the tokens of `text` (when the request asked for logprobs), in order
    logprobs: tuple[stage_pb2.TokenLogprob, ...] = ()
    # (prompt tokens, tokens the thinker generated up to this delta): vLLM's continuous_usage_stats
    usage: tuple[int, int] | None = None
    # on a run's first delta, when the request asked for prompt_logprobs: each prompt token's entry from the second
    prompt_logprobs: tuple[stage_pb2.TokenLogprob, ...] = ()
    spoken: bool = True  # False: text the talker did not say (a spoken answer's function calls: gateway/spoken_calls.py)


@dataclass(frozen=True, slots=True)
class AudioDelta:
    pcm: np.ndarray  # (samples,) float32 in [-1, 1]
    sample_rate: int


@dataclass(frozen=True, slots=True)
class Finished:
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of the prompt tokens, those the thinker's prefix cache served
    stop_reason: str | int | None = None  # vLLM's: the stop string or request stop id that ended it (None: EOS etc.)


Event = TextDelta | AudioDelta | Finished

MAX_REQUEST_ID_CHARS = 256
# a client's request id names the request in every stage, log line and metric exemplar: printable ASCII, no spaces
_REQUEST_ID = re.compile(r"[!-~]+")


class PipelineError(Exception):
    """A request failed. `http_status` / `grpc_code` say how the front ends answer; `kind` is the
    OpenAI error `type` (invalid_request_error, not_found_error, service_unavailable, ...)."""

    def __init__(self, message: str, *, http_status: int, grpc_code: int, kind: str, param: str | None = None,
                 stage: str | None = None):
        super().__init__(message)
        self.message = message
        self.http_status = http_status
        self.grpc_code = grpc_code
        self.kind = kind
        self.param = param
        self.stage = stage  # the stage whose answer this is (None: the gateway's own)


class Pipeline(Protocol):
    """What the front ends need from the stage chain."""

    served_models: tuple[str, ...]
    no_audio: str | None  # why this server speaks no audio (None: it does)
    media_budget: MediaBudget | None  # the media decodes' and prompt builds' working memory (None: unbounded)

    @property
    def voices(self) -> tuple[str, ...]: ...

    @property
    def default_voice(self) -> str: ...

    @property
    def sample_rate(self) -> int: ...

    def run(self, request: ChatRequest) -> AsyncIterator[Event]:
        """Yield the request's events in order; raise PipelineError on failure."""
        ...

    async def health(self) -> dict[str, bool]:
        """Stage name -> serving."""
        ...

    def building(self, request: ChatRequest) -> contextlib.AbstractAsyncContextManager[None]:
        """Around a build of the request's prompt outside `run` (/tokenize): its share of the media budget."""
        ...


def check_request_id(rid: str, param: str = "request_id") -> str:
    """A client-given request id (gRPC `request_id`, REST `X-Request-Id`), checked: a 400 / INVALID_ARGUMENT
    naming the rule it breaks."""
    why = None
    if len(rid) > MAX_REQUEST_ID_CHARS:
        why = f"at most {MAX_REQUEST_ID_CHARS} characters, got {len(rid)}"
    elif not _REQUEST_ID.fullmatch(rid):
        why = "only printable ASCII without spaces or control characters is allowed"
    if why is not None:
        raise PipelineError(f"{param}: {why}", http_status=400, grpc_code=3, kind="invalid_request_error", param=param)
    return rid
