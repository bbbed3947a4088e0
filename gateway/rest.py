"""The OpenAI-compatible REST front end: `create_app(pipeline, ...)` -> a FastAPI app.

Data flow of `POST /v1/chat/completions`: body bytes (size-capped) -> `parse_chat_request` -> media
decoded by `MediaLoader` -> `ChatRequest` -> `pipeline.run` -> events -> one `chat.completion` JSON, or an
SSE stream of `chat.completion.chunk`s ending in `data: [DONE]`. The first event is awaited before the
response starts, so errors the pipeline finds up front (prompt too long, stage down) keep their HTTP
status even for `stream: true`; an error after that is sent as `data: {"error": {...}}` then
`data: [DONE]`, never as a silently truncated stream. Every error body is OpenAI's
`{"error": {"message", "type", "param", "code"}}`; schema violations (malformed JSON, missing or wrongly
typed fields) are 400, as OpenAI answers, not FastAPI's 422. A 429 (a stage refused the request because
`--max-waiting-requests` requests already wait there) carries `Retry-After: 1`. A client's `X-Request-Id`
header names the request (`chatcmpl-<id>`, the id every stage logs); chat responses carry that id back in
`X-Request-Id`.

Also: OpenAI's legacy `POST /v1/completions` (`gateway/completions_api.py`, with a prompt builder), OpenAI's
`POST /v1/audio/transcriptions` / `translations` (`gateway/transcription_api.py`),
`GET /v1/models` (and `/v1/models/{model}`, 404 for a name not served), vLLM's `POST /tokenize` and
`/detokenize` (`gateway/tokenize_api.py`), `GET /version`, vLLM's `GET /load` (`{"server_load"}`: generating
requests in flight) and `GET|POST /ping` (/health by SageMaker's name), `GET /health` (200 / 503
naming the stages down), `GET /metrics` (Prometheus
text, `omnimesh:` prefix): the gateway's own series (a per-app registry; no `stage` label) followed by
every stage replica's, scraped over the Stage `Metrics` RPC at each request and merged into one family per
name (stage series carry `stage="thinker"` and `replica="0"` etc.; a replica that does not answer is left
out and `omnimesh:stage_scrape_up{stage,replica}` says 0: gateway/stage_scrape.py). Run: `uvicorn.Server(uvicorn.Config(create_app(p), ...))`.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import importlib.metadata
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.audio_encoding import OutputAudioFormat, encode_audio, pcm16_bytes
from gateway.audio_memory import AudioMemory
from gateway.auth import ApiKeyMiddleware
from gateway.events import (
    AudioDelta,
    ChatMessage,
    ChatRequest,
    ContentPart,
    Event,
    Finished,
    Pipeline,
    PipelineError,
    TextDelta,
    TextPart,
    ToolCall,
    check_request_id,
)
from gateway.completions_api import CompletionRoutes
from gateway.invocations_api import InvocationRoutes
from gateway.choices import MAX_CHOICES, Indexed, choice_requests, close_events, fan_out, total_usage
from gateway.chat_template_options import final_assistant_text
from gateway.client_gone import CLIENT_GONE, until_client_leaves
from gateway.http_errors import error_json, internal_error, read_body
from gateway import video_process
from gateway.http_front import HttpFront
from gateway.input_limits import InputLimits
from gateway.media import (AudioTotal, MediaLoader, image_header_size, invalid_request, media_not_from_user,
                           video_sampling_of)
from gateway.media_budget import mark_arrival
from gateway.openai_schema import (
    ChatCompletion,
    ChatCompletionChunk,
    MAX_LOGPROBS,
    ChatCompletionRequest,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    Delta,
    DeltaAudio,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCallOut,
    Message,
    MessageAudio,
    MMProcessorKwargs,
    ModelCard,
    ModelList,
    ResponseMessage,
    PromptTokensDetails,
    ToolCallOut,
    Usage,
    check_priority,
    check_sampling,
    check_thinker_min_tokens,
    choice_logprobs,
    dump,
    error_response,
    normalize_modalities,
    parse_chat_request,
    resolve_model,
    unknown_model,
    resolve_voice,
)
from gateway.prompt import ImageTokens, PromptBuilder
from gateway.prompt_logprobs import prompt_logprobs_json
from gateway.tokenize_api import TokenizeRoutes
from gateway.structured_request import structured_spec
from gateway.tool_calls import NO_TOOLS, ToolAnswer, ToolPlan, forced_calls, parse_tool_calls, tool_plan
from gateway.realtime_routes import RealtimeRoutes
from gateway.reasoning import END, AnswerSplit, ReasoningParser, thinks
from gateway.response_store import ResponseStore
from gateway.responses_api import ResponsesRoutes
from gateway.speech_api import SpeechRoutes
from gateway.transcription_api import TranscriptionRoutes
from gateway.stage_scrape import StageSources, scrape_stages
from gateway.sse import DONE, SSEResponse, StreamState, chain, sse
from omnimesh import tracing
from omnimesh.engine.metrics import merge_families, parse_exposition
from omnimesh.v1 import stage_pb2

if TYPE_CHECKING:
    from omnimesh.models.qwen3_omni.video_sampling import VideoSampling

log = logging.getLogger(__name__)
VERSION = importlib.metadata.version("omnimesh")
HEALTH_TIMEOUT_S = 5.0
STAGE_SCRAPE_TIMEOUT_S = 2.0  # a stage slower than this to answer /metrics is left out of that scrape
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class RestMetrics:
    """Prometheus series of one app (own registry, so several apps can live in one process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("omnimesh:requests", "Finished requests by endpoint and HTTP status "
                                "(a stream that fails midway counts under the error's status)",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram("omnimesh:e2e_request_latency_seconds", "Request start to last byte",
                                 ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("omnimesh:time_to_first_token_seconds", "Request start to first text delta",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.ttfa = Histogram("omnimesh:time_to_first_audio_seconds", "Request start to first audio chunk",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("omnimesh:prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("omnimesh:generation_tokens", "Text tokens generated", registry=r)
        self.running = Gauge("omnimesh:requests_running", "Chat requests in flight", registry=r)
        self.realtime_sessions = Gauge("omnimesh:realtime_sessions", "Realtime API sessions open (/v1/realtime)",
                                       registry=r)
        self.scrape_up = Gauge("omnimesh:stage_scrape_up", "1 when the stage replica answered the last /metrics "
                               "scrape", ["stage", "replica"], registry=r)


class _HandOffCollector(Collector):
    """Per stage: bytes the gateway read off the wire and the tensor bytes those frames described (with
    shared-memory hand-offs the first stays at headers and text), and the stage's output transport."""

    def __init__(self, pipeline: object) -> None:
        self.pipeline = pipeline

    def collect(self) -> Iterable[Metric]:
        received = getattr(self.pipeline, "received_bytes", None)
        described = getattr(self.pipeline, "tensor_bytes", None)
        inline = getattr(self.pipeline, "inline_bytes", None)
        transports = getattr(self.pipeline, "output_transport", None)
        if received is None or described is None or inline is None or transports is None:
            return []
        wire = CounterMetricFamily("omnimesh:gateway_stage_received_bytes",
                                   "Bytes the gateway received from the stage (serialized messages)", labels=["stage"])
        frames = CounterMetricFamily("omnimesh:gateway_stage_tensor_bytes",
                                     "Bytes of the tensors the stage's frames described (inline or by reference)",
                                     labels=["stage"])
        inlined = CounterMetricFamily("omnimesh:gateway_stage_inline_tensor_bytes",
                                      "Of those tensor bytes, the ones that came inline through the gateway",
                                      labels=["stage"])
        edge = GaugeMetricFamily("omnimesh:stage_output_transport", "1 for the transport of each stage's output "
                                 "tensors", labels=["stage", "transport"])
        for stage in received:
            wire.add_metric([stage], float(received[stage]))
            frames.add_metric([stage], float(described.get(stage, 0)))
            inlined.add_metric([stage], float(inline.get(stage, 0)))
            edge.add_metric([stage, transports.get(stage, "grpc")], 1.0)
        return [wire, frames, inlined, edge]


@dataclass(frozen=True, slots=True)
class Answer:
    """What a generating route's request becomes (`RestGateway.answer`): the runs through the pipeline (one
    per choice and prompt, indexed as the response's choices) and how their events become the response."""

    request_id: str
    runs: Sequence[ChatRequest]
    stream: bool
    complete: Callable[[Indexed, AsyncIterator[Indexed]], Awaitable[Response]]  # the whole answer at the end
    streamed: Callable[[Indexed, StreamState], AsyncIterator[bytes]]  # the SSE body
    media_type: str = "text/event-stream"  # of the streamed body
    immediate: Response | None = None  # answered at once, the runs left to the route (a background response)


class Timed(Protocol):
    """A request in flight as the latency metrics see it."""

    started: float  # perf_counter at arrival
    first_text: bool
    first_audio: bool


@dataclass(slots=True)
class _Call:
    """One chat completion in flight: what the response needs besides the events."""

    request: ChatRequest
    model: str  # the name the client used, echoed back
    stream: bool
    include_usage: bool
    audio_format: OutputAudioFormat | None  # None = text only
    created: int
    started: float  # perf_counter at arrival
    first_text: bool = False
    first_audio: bool = False
    n: int = 1  # choices (OpenAI's `n`): as many runs of the request (gateway/choices.py)
    tools: ToolPlan = NO_TOOLS  # what the answer's tool calls are (gateway/tool_calls.py): parsed, forced or none
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats (with include_usage)
    echo: str = ""  # vLLM's echo: the final assistant message's text, before each choice's content
    spoken_lead: str = ""  # a continued assistant message's start: the talker speaks it before the generated text
    reasoning: ReasoningParser | None = None  # --reasoning-parser: the text's reasoning apart from its answer
    include_reasoning: bool = True  # vLLM's include_reasoning: false drops it

    def splitter(self) -> AnswerSplit:
        """A choice's text -> (reasoning to send, answer), whole or delta by delta (it reasons first when the
        request carries the reasoning's end marker: gateway/reasoning.py)."""
        return AnswerSplit(self.reasoning, self.request.reasoning_end is not None, self.include_reasoning)

    @property
    def logprobs(self) -> bool:
        """The client asked for `logprobs`: each choice carries its tokens' entries."""
        return self.request.sampling.logprobs is not None


@dataclass(frozen=True, slots=True)
class MessageNames:
    """How a request's errors name the chat messages it stands for: the chat's own fields by default; the Responses
    API names its input items instead (gateway/responses_api.py)."""

    whole: str = "messages"  # the list (the request-wide media limits)
    each: Sequence[str] = ()  # message i's own name; past its end: f"{whole}[{i}]"
    image_url: str = "image_url.url"  # an image part's URL (the Responses API's `image_url` is the URL itself)

    def of(self, i: int) -> str:
        return self.each[i] if i < len(self.each) else f"{self.whole}[{i}]"


class RestGateway:
    """The route handlers of one app; `create_app` wires them."""

    def __init__(self, pipeline: Pipeline, served_model_names: tuple[str, ...], loader: MediaLoader,
                 stage_metrics: StageSources | None = None, max_model_len: int | None = None,
                 max_logprobs: int = MAX_LOGPROBS, tokens_as_ids: bool = False,
                 prompt_tokens_details: bool = False, auto_tool_choice: bool = False,
                 reasoning: ReasoningParser | None = None) -> None:
        self.pipeline = pipeline
        self.reasoning = reasoning  # --reasoning-parser
        self.auto_tool_choice = auto_tool_choice  # --enable-auto-tool-choice (with --tool-call-parser)
        self.prompt_tokens_details = prompt_tokens_details  # --enable-prompt-tokens-details
        self.force_include_usage = False  # --enable-force-include-usage: every stream ends with its usage
        self.prompts: PromptBuilder | None = None  # counts images' tokens before their pixels are decoded
        self.max_logprobs = max_logprobs  # --max-logprobs
        self.tokens_as_ids = tokens_as_ids  # --return-tokens-as-token-ids
        self.max_model_len = max_model_len  # on the model cards, when the prompt builder is known
        self.stage_metrics = dict(stage_metrics or {})
        self.served_model_names = served_model_names
        self.loader = loader
        self.metrics = RestMetrics()
        self.audio_memory = AudioMemory()  # spoken answers' transcripts, for later turns' assistant audio ids
        self.metrics.registry.register(_HandOffCollector(pipeline))
        self.metrics.registry.register(video_process.METRICS)  # this process's video decodes
        self.metrics.registry.register(video_process.AUDIO_METRICS)  # and its compressed audio files
        if loader.budget is not None:
            self.metrics.registry.register(loader.budget)  # the media decodes' and builds' working memory
        self.created = int(time.time())

    def _usage(self, f: Finished) -> Usage:
        details = PromptTokensDetails(cached_tokens=f.cached_tokens) if self.prompt_tokens_details else None
        return Usage(prompt_tokens=f.prompt_tokens, completion_tokens=f.completion_tokens,
                     total_tokens=f.prompt_tokens + f.completion_tokens, prompt_tokens_details=details)

    # ------------------------------------------------------------------------------ request building
    async def build(self, body: ChatCompletionRequest, client_id: str | None = None) -> _Call:
        """Validated body -> `_Call` (media decoded, model / voice / sampling checked). `client_id` (the
        `X-Request-Id` header, as vLLM reads it) names the request in every stage: `chatcmpl-<id>`."""
        model = resolve_model(body.model, self.served_model_names)
        n = 1 if body.n is None else body.n
        if not 1 <= n <= MAX_CHOICES:
            raise invalid_request(f"n: must be in [1, {MAX_CHOICES}] choices, got {n}", "n")
        suffix = check_request_id(client_id, "X-Request-Id") if client_id else uuid.uuid4().hex
        sampling = body.sampling(self.max_logprobs)
        check_sampling(sampling, "", self.max_logprobs)
        stages = body.stage_overrides()
        for name, s in stages.items():
            check_sampling(s, f"stage_params.{name}")
        check_thinker_min_tokens(sampling, stages.get("thinker"), "")
        modalities = normalize_modalities(body.modalities, default=("text",))
        voice = None
        if "audio" in modalities or (body.audio is not None and body.audio.voice):
            voice = resolve_voice(body.audio.voice if body.audio else None, self.pipeline, "audio.voice",
                                  speaking="audio" in modalities)
        tools = tool_plan(body, self.auto_tool_choice, modalities)
        if body.stream and sampling.prompt_logprobs is not None:
            raise invalid_request("prompt_logprobs: not available with stream: true (as in vLLM); ask without "
                                  "streaming", "prompt_logprobs")
        structured = await asyncio.to_thread(structured_spec, body)  # compiling a big schema takes a while
        if structured is not None and (tools.parse or tools.structured is not None):
            raise invalid_request("response_format: a structured output and tool calls (tool_choice \"auto\") "
                                  "cannot both shape one answer; send tool_choice \"none\" or leave one out",
                                  "response_format")
        template = body.template(body.messages, "audio" in modalities)
        messages = await self.chat_messages(body.messages, body.mm_processor_kwargs)
        final = final_assistant_text(messages)
        thinking = thinks(self.reasoning, template.kwargs, audio_out="audio" in modalities,
                          continued=final if template.continue_final_message else "")
        # an alias from --served-model-name runs the pipeline's own model
        pipeline_model = model if model in self.pipeline.served_models else self.pipeline.served_models[0]
        request = ChatRequest(
            request_id=f"chatcmpl-{suffix}", model=pipeline_model, messages=messages,
            modalities=modalities, voice=voice if "audio" in modalities else None, sampling=sampling,
            stage_params=stages, priority=check_priority(body.priority),
            processor_kwargs=_settings(body.mm_processor_kwargs), tools=tools.tools,
            structured=tools.structured or structured, truncate_prompt_tokens=body.truncate_prompt_tokens,
            template=template, reasoning_end=END if thinking else None,
            spoken_calls=tools.parse and "audio" in modalities)
        audio_format: OutputAudioFormat | None = None
        if "audio" in modalities:  # the schema checked it is one of OUTPUT_AUDIO_FORMATS
            audio_format = cast(OutputAudioFormat, body.audio.format) if body.audio is not None else "wav"
        return _Call(request=request, model=model, stream=body.stream,
                     include_usage=self.force_include_usage or bool(body.stream_options
                                                                    and body.stream_options.include_usage),
                     continuous_usage=bool(body.stream_options and body.stream_options.include_usage
                                           and body.stream_options.continuous_usage_stats),
                     audio_format=audio_format, created=int(time.time()), started=time.perf_counter(), n=n,
                     tools=tools, echo=final if body.echo else "",
                     spoken_lead=final if template.continue_final_message else "", reasoning=self.reasoning,
                     include_reasoning=body.include_reasoning)

    async def chat_messages(self, messages: list[Message], mm: MMProcessorKwargs | None = None,
                            names: MessageNames = MessageNames()) -> tuple[ChatMessage, ...]:
        """The body's messages, media decoded (each video with its soundtrack when `mm.use_audio_in_video`,
        its frames sampled by `mm`'s fps / frame counts over the server's), the request-wide media limits
        checked (chat, /tokenize, Responses): the part counts before anything is decoded, the images' tokens
        from all their headers before any media is decoded (`ImageTokens.precheck`), and again from each one's
        header before its pixels are (images not sent inline, and headers past the first 64 KiB). Errors name
        the messages by `names`."""
        kinds = [kind for m in messages for p in m.content if (kind := p.media_kind) is not None]
        self.loader.check_counts(kinds, names.whole)
        in_video = mm is not None and mm.use_audio_in_video
        sampling = self.loader.sampling_with(mm.settings() if mm is not None else {})
        tokens = self.prompts.image_tokens(_settings(mm)) if self.prompts is not None and "image" in kinds else None
        if tokens is not None:  # off the loop: up to 64 KiB of base64 and a header parse per image
            await asyncio.to_thread(tokens.precheck, _image_headers(messages, names),
                                    self.loader.limits.max_image_pixels)
        heard = AudioTotal(self.loader, names.whole)  # checked part by part, so nothing past the limit is decoded
        return tuple([await self._message(m, names.of(i), names.image_url, in_video, sampling, tokens, heard)
                      for i, m in enumerate(messages)])

    async def _message(self, m: Message, name: str, image_url: str, use_audio_in_video: bool = False,
                       sampling: VideoSampling | None = None, tokens: ImageTokens | None = None,
                       heard: AudioTotal | None = None) -> ChatMessage:
        """Message `m` (its field: `name`, its image parts' URL field: `image_url`) with its media decoded (each
        image's tokens added to `tokens` first, each part's audio to `heard` once decoded)."""
        parts: list[ContentPart] = []
        for j, p in enumerate(m.content):
            where = f"{name}.content[{j}]"
            decoded = len(parts)
            if p.type == "text":
                parts.append(TextPart(text=p.text or ""))
                continue
            if m.role != "user":
                raise media_not_from_user(where, m.role)
            if p.image_url is not None and p.type == "image_url":
                param = f"{where}.{image_url}"
                admit = functools.partial(tokens.add, param=param) if tokens is not None else None
                parts.append(await self.loader.image_from_url(p.image_url.url, param, admit))
            elif p.input_audio is not None and p.type == "input_audio":
                parts.append(await self.loader.audio_from_base64(p.input_audio.data, p.input_audio.format,
                                                                 f"{where}.input_audio"))
            elif p.audio_url is not None and p.type == "audio_url":
                parts.append(await self.loader.audio_from_url(p.audio_url.url, f"{where}.audio_url.url"))
            elif p.video_url is not None and p.type == "video_url":
                parts.append(await self.loader.video_from_url(p.video_url.url, f"{where}.video_url.url",
                                                              with_audio=use_audio_in_video, sampling=sampling))
            if heard is not None and len(parts) > decoded:
                heard.add(parts[-1])
        if m.audio is not None and not any(isinstance(p, TextPart) and p.text for p in parts):
            parts = [TextPart(self._earlier_answer(m.audio.id, f"{name}.audio.id"))]
        role = "system" if m.role == "developer" else m.role
        calls = tuple(ToolCall(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or ())
        reasoning = m.reasoning if m.reasoning is not None else m.reasoning_content
        return ChatMessage(role=role, content=tuple(parts), tool_calls=calls, tool_call_id=m.tool_call_id,
                           reasoning=reasoning)

    def _earlier_answer(self, audio_id: str, param: str) -> str:
        """The transcript of this gateway's spoken answer `audio_id` (OpenAI's multi-turn audio), else a 400."""
        transcript = self.audio_memory.transcript(audio_id)
        if transcript is None:
            raise invalid_request(
                f"{param}: no spoken answer {audio_id!r} on this gateway (unknown, or past its expires_at; answers are "
                f"kept {self.audio_memory.ttl_s / 3600:g} h by the gateway that gave them); send its transcript as the "
                "message's content instead", param)
        return transcript

    # ---------------------------------------------------------------------------------------- routes
    async def chat_completions(self, request: Request) -> Response:
        async def prepare(raw: bytes, client_id: str | None, started: float) -> Answer:
            body = await asyncio.to_thread(parse_chat_request, raw, self.loader.limits)  # big bodies: seconds
            call = await self.build(body, client_id)
            call.started = started
            return Answer(call.request.request_id, choice_requests(call.request, call.n), call.stream,
                          functools.partial(self._complete, call), functools.partial(self._stream, call))

        return await self.answer("chat", request, prepare)

    async def answer(self, endpoint: str, request: Request,
                     prepare: Callable[[bytes, str | None, float], Awaitable[Answer]]) -> Response:
        """A generating route: the body (size-capped) -> `prepare` -> the runs fanned out -> the first event
        awaited (errors found up front keep their status, streamed or not) -> a whole answer or an SSE
        stream. Until the stream starts, a client that disconnects stops the work (gateway/client_gone.py;
        counted as status 499). Metrics under `endpoint`; a PipelineError is its status, anything else a
        logged 500."""
        started = time.perf_counter()
        mark_arrival()  # this request's place in the media budget's line (gateway/media_budget.py)
        self.metrics.running.inc()
        streaming = False
        trace = tracing.set_request_parent(request.headers.items())  # the client's traceparent, when tracing
        try:
            raw = await read_body(request, self.loader.limits.max_request_bytes)
            work = asyncio.ensure_future(self._respond(endpoint, raw, request.headers.get("x-request-id"), started,
                                                       prepare))
            done = await until_client_leaves(request, work)
            if done is None:
                log.info("%s request: the client disconnected before its answer; its work is stopped", endpoint)
                self._finish(endpoint, CLIENT_GONE, started)
                return Response(status_code=CLIENT_GONE)
            response, streaming = done
            return response
        except PipelineError as e:
            self._finish(endpoint, e.http_status, started)
            return error_json(e)
        except Exception as e:  # a bug, not the client's fault: say so, keep serving
            log.exception("%s request failed", endpoint)
            self._finish(endpoint, 500, started)
            return error_json(internal_error(e))
        finally:
            tracing.reset_request_parent(trace)  # the runs' spans have started under it by now
            if not streaming:
                self.metrics.running.dec()

    async def _respond(self, endpoint: str, raw: bytes, client_id: str | None, started: float,
                       prepare: Callable[[bytes, str | None, float], Awaitable[Answer]]) -> tuple[Response, bool]:
        """`answer`'s work once the body is read: (the response, whether it is a stream that settles its own
        metrics). A cancel (the client left) closes the runs."""
        ans = await prepare(raw, client_id, started)
        if ans.immediate is not None:
            self._finish(endpoint, ans.immediate.status_code, started)
            return ans.immediate, False
        events = aiter(fan_out(self.pipeline, ans.runs))
        try:
            first = await anext(events)
        except StopAsyncIteration:
            raise internal_error(RuntimeError("the pipeline ended without a Finished event")) from None
        except BaseException:
            await close_events(events)
            raise
        if ans.stream:
            state = StreamState(self, endpoint, ans.request_id, started, events)
            return SSEResponse(state, ans.streamed(first, state), ans.media_type), True
        try:
            return await ans.complete(first, events), False
        except BaseException:
            await close_events(events)
            raise

    def _finish(self, endpoint: str, status: int, started: float) -> None:
        self.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()
        self.metrics.latency.labels(endpoint=endpoint).observe(time.perf_counter() - started)

    def _observe(self, call: Timed, ev: Event) -> None:
        if isinstance(ev, TextDelta) and not call.first_text:
            call.first_text = True
            self.metrics.ttft.observe(time.perf_counter() - call.started)
        elif isinstance(ev, AudioDelta) and not call.first_audio:
            call.first_audio = True
            self.metrics.ttfa.observe(time.perf_counter() - call.started)
        elif isinstance(ev, Finished):
            self.metrics.prompt_tokens.inc(ev.prompt_tokens)
            self.metrics.generation_tokens.inc(ev.completion_tokens)

    async def _complete(self, call: _Call, first: Indexed, events: AsyncIterator[Indexed]) -> Response:
        text: list[list[str]] = [[] for _ in range(call.n)]
        voiced: list[list[str]] = [[] for _ in range(call.n)]  # what the talker said (a call's text is not)
        logprobs: list[list[stage_pb2.TokenLogprob]] = [[] for _ in range(call.n)]
        prompt: list[stage_pb2.TokenLogprob] = []  # prompt_logprobs: the first choice's (the prompt is theirs alike)
        audio: list[list[np.ndarray]] = [[] for _ in range(call.n)]
        rate = self.pipeline.sample_rate
        finished: dict[int, Finished] = {}
        try:
            async for i, ev in chain(first, events):
                self._observe(call, ev)
                if isinstance(ev, TextDelta):
                    text[i].append(ev.text)
                    if ev.spoken:
                        voiced[i].append(ev.text)
                    logprobs[i].extend(ev.logprobs)
                    if i == 0:
                        prompt.extend(ev.prompt_logprobs)
                elif isinstance(ev, AudioDelta):
                    audio[i].append(np.asarray(ev.pcm, dtype=np.float32).reshape(-1))
                    rate = ev.sample_rate
                elif isinstance(ev, Finished):
                    finished[i] = ev
                    if len(finished) == call.n:
                        break
        finally:
            await close_events(events)
        if len(finished) < call.n:
            raise internal_error(RuntimeError("the pipeline ended without a Finished event"))
        choices = []
        for i in range(call.n):
            thought, transcript = call.splitter().whole("".join(text[i]))
            message = ResponseMessage(content=call.echo + transcript)
            finish = finished[i].finish_reason
            if call.tools.parse:
                content, calls = parse_tool_calls(transcript)
                if calls:
                    message = ResponseMessage(content=call.echo + (content or "") if call.echo else content,
                                              tool_calls=[_tool_call(c) for c in calls])
                    finish = "tool_calls"
            elif call.tools.forced is not None and (forced := forced_calls(call.tools, transcript)):
                message = ResponseMessage(content=None, tool_calls=[_tool_call(c) for c in forced])
            if call.reasoning is not None:
                if not transcript and not message.tool_calls and not call.echo:
                    message.content = None  # all thought, no answer (vLLM's): max_tokens cut the reasoning
                message.reasoning = message.reasoning_content = thought
            if call.audio_format is not None:
                wave = np.concatenate(audio[i]) if audio[i] else np.zeros(0, np.float32)
                data = await asyncio.to_thread(encode_audio, wave, rate, call.audio_format)
                said = "".join(voiced[i]) if call.request.spoken_calls else transcript
                audio_id, spoken = f"audio_{uuid.uuid4().hex}", call.spoken_lead + said
                message.audio = MessageAudio(id=audio_id, data=base64.b64encode(data).decode(),
                                             expires_at=self.audio_memory.remember(audio_id, spoken),
                                             transcript=spoken)
            choices.append(Choice(index=i, message=message, finish_reason=finish,
                                  logprobs=self._logprobs(call, logprobs[i]), stop_reason=finished[i].stop_reason))
        k = call.request.sampling.prompt_logprobs
        body = ChatCompletion(id=call.request.request_id, created=call.created, model=call.model, choices=choices,
                              usage=self._usage(total_usage([finished[i] for i in range(call.n)])),
                              prompt_logprobs=None if k is None else prompt_logprobs_json(prompt, k, self.tokens_as_ids))
        self._finish("chat", 200, call.started)
        payload = dump(body)
        if k is None:
            del payload["prompt_logprobs"]
        if call.reasoning is None:  # a server without --reasoning-parser answers no reasoning fields
            for choice in payload["choices"]:
                del choice["message"]["reasoning"], choice["message"]["reasoning_content"]
        return JSONResponse(payload, headers={"X-Request-Id": call.request.request_id})

    def _logprobs(self, call: _Call, entries: Sequence[stage_pb2.TokenLogprob]) -> ChoiceLogprobs | None:
        """A choice's `logprobs`: its tokens' entries when the request asked for them, else None."""
        return choice_logprobs(entries, as_ids=self.tokens_as_ids) if call.logprobs else None

    async def _stream(self, call: _Call, first: Indexed, stream: StreamState) -> AsyncIterator[bytes]:
        rid = call.request.request_id
        audio_ids = [f"audio_{uuid.uuid4().hex}" for _ in range(call.n)]
        said = [[call.spoken_lead] for _ in range(call.n)]  # each spoken choice's transcript, kept at its end
        audio_sent = [False] * call.n
        status, events = 499, stream.events  # 499 (client closed) unless the stream gets to its end

        # continuous_usage_stats: each choice's (prompt, completion) tokens so far, from its text deltas
        so_far: list[tuple[int, int] | None] = [None] * call.n
        if call.continuous_usage and isinstance(first[1], TextDelta):
            so_far[first[0]] = first[1].usage

        def chunk(i: int, delta: Delta, finish: str | None = None, logprobs: ChoiceLogprobs | None = None,
                  stop_reason: str | int | None = None) -> bytes:
            usage = None
            if call.continuous_usage and (known := so_far[i]) is not None:
                usage = Usage(prompt_tokens=known[0], completion_tokens=known[1], total_tokens=sum(known))
            c = ChatCompletionChunk(id=rid, created=call.created, model=call.model,
                                    choices=[ChunkChoice(index=i, delta=delta, finish_reason=finish,
                                                         logprobs=logprobs, stop_reason=stop_reason)], usage=usage)
            return sse(dump(c, drop_none=True))

        shaped = [ToolAnswer(call.tools) for _ in range(call.n)]  # parsed, forced or plain text (tool_calls.py)
        # --reasoning-parser: each choice's text split into its reasoning and its answer (which `shaped` reads)
        thoughts = [call.splitter() for _ in range(call.n)]

        def thought_chunk(i: int, text: str, logprobs: ChoiceLogprobs | None) -> bytes:
            return chunk(i, Delta(reasoning=text, reasoning_content=text), logprobs=logprobs)

        def calls_chunk(i: int, calls: list[ToolCall]) -> bytes:
            first_index = shaped[i].calls - len(calls)
            return chunk(i, Delta(tool_calls=[
                DeltaToolCall(index=first_index + k, id=c.id, type="function",
                              function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
                for k, c in enumerate(calls)]))

        def transcript_chunk(i: int, text: str) -> bytes:
            """What is spoken, as OpenAI streams it beside the audio (`delta.audio.transcript`); the same text
            also comes as `delta.content`, as the whole answer carries both."""
            return chunk(i, Delta(audio=DeltaAudio(id=audio_ids[i], transcript=text, expires_at=first_audio(i))))

        def first_audio(i: int) -> int | None:
            """The expiry of the choice's audio id, on its first audio delta only (as OpenAI's)."""
            if audio_sent[i]:
                return None
            audio_sent[i] = True
            return self.audio_memory.expiry()

        try:
            opening: list[bytes] = []
            for i in range(call.n):
                opening.append(chunk(i, Delta(role="assistant", content="")))
                if call.echo:
                    opening.append(chunk(i, Delta(content=call.echo)))
                if call.audio_format is not None and call.spoken_lead:  # a continued message's start is spoken too
                    opening.append(transcript_chunk(i, call.spoken_lead))
            yield b"".join(opening)
            finished: dict[int, Finished] = {}
            async for i, ev in chain(first, events):
                out: list[bytes] = []  # this event's chunks, sent in one write (a spoken delta makes two or more)
                self._observe(call, ev)
                if isinstance(ev, TextDelta) and ev.usage is not None:
                    so_far[i] = ev.usage
                elif isinstance(ev, Finished):
                    so_far[i] = (ev.prompt_tokens, ev.completion_tokens)
                if isinstance(ev, TextDelta):
                    if ev.spoken:
                        said[i].append(ev.text)
                    thought, answer = thoughts[i].push(ev.text)
                    text, calls = shaped[i].push(answer)
                    entries, carried = self._logprobs(call, ev.logprobs), False
                    if thought:  # the entries go with the answer's text when it has some
                        out.append(thought_chunk(i, thought, None if text else entries))
                        carried = not text
                    # a token holding part of a character, or a forced call's held JSON: its entry, no text yet
                    if text or ev.logprobs and not carried:
                        out.append(chunk(i, Delta(content=text), logprobs=entries))
                    if call.audio_format is not None:  # with spoken calls: what the talker says, the calls aside
                        voiced = (answer if ev.spoken else "") if call.request.spoken_calls else text
                        if voiced:
                            out.append(transcript_chunk(i, voiced))
                    if calls:
                        out.append(calls_chunk(i, calls))
                elif isinstance(ev, AudioDelta):
                    if call.audio_format is not None and np.size(ev.pcm):
                        data = base64.b64encode(pcm16_bytes(ev.pcm)).decode()
                        audio = DeltaAudio(id=audio_ids[i], data=data, expires_at=first_audio(i))
                        out.append(chunk(i, Delta(audio=audio)))
                elif isinstance(ev, Finished):
                    finished[i] = ev
                    if call.audio_format is not None:  # a later turn may name this answer by its audio id
                        self.audio_memory.remember(audio_ids[i], "".join(said[i]))
                    thought, answer = thoughts[i].finish()  # held back in case a marker was starting
                    if thought:
                        out.append(thought_chunk(i, thought, None))
                    text, calls = shaped[i].push(answer)
                    if text:
                        out.append(chunk(i, Delta(content=text)))
                        if call.audio_format is not None and not call.request.spoken_calls:
                            out.append(transcript_chunk(i, text))
                    if calls:
                        out.append(calls_chunk(i, calls))
                    text, calls = shaped[i].finish()  # a forced answer not whole (max_tokens) comes as text
                    if text:
                        out.append(chunk(i, Delta(content=text)))
                        if call.audio_format is not None and not call.request.spoken_calls:
                            out.append(transcript_chunk(i, text))
                    if calls:
                        out.append(calls_chunk(i, calls))
                    out.append(chunk(i, Delta(), shaped[i].finish_reason(ev.finish_reason), stop_reason=ev.stop_reason))
                if out:
                    yield b"".join(out)
                if len(finished) == call.n:
                    break
            if len(finished) < call.n:
                raise internal_error(RuntimeError("the pipeline ended without a Finished event"))
            end = DONE
            if call.include_usage:
                usage = self._usage(total_usage([finished[i] for i in range(call.n)]))
                end = sse(dump(ChatCompletionChunk(id=rid, created=call.created, model=call.model, choices=[],
                                                   usage=usage))) + DONE
            yield end
            status = 200
        except PipelineError as e:
            status = e.http_status
            yield sse(dump(error_response(e)))
            yield DONE
        except Exception as e:
            log.exception("chat completion stream failed")
            status = 500
            yield sse(dump(error_response(internal_error(e))))
            yield DONE
        finally:
            stream.settle(status)  # bookkeeping first: the await below may be cancelled
            await stream.close_events()

    async def models(self, request: Request) -> Response:
        self._finish("models", 200, time.perf_counter())
        cards = [self._card(n) for n in self.served_model_names]
        return JSONResponse(dump(ModelList(data=cards), drop_none=True))

    async def model(self, request: Request) -> Response:
        """OpenAI's `GET /v1/models/{model}` (the SDK's `models.retrieve`); an unknown name is its 404."""
        started = time.perf_counter()
        name = request.path_params["model"]
        if name not in self.served_model_names:  # "" too: no name here is not "the first" as in a chat body
            self._finish("models", 404, started)
            return error_json(unknown_model(name, self.served_model_names))
        self._finish("models", 200, started)
        return JSONResponse(dump(self._card(name), drop_none=True))

    def _card(self, name: str) -> ModelCard:
        return ModelCard(id=name, created=self.created, max_model_len=self.max_model_len)

    async def load(self, request: Request) -> Response:
        """vLLM's `GET /load`: the generating requests in flight on this gateway (what a load balancer weighs)."""
        running = self.metrics.registry.get_sample_value("omnimesh:requests_running") or 0.0
        return JSONResponse({"server_load": int(running)})

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": VERSION})

    async def health(self, request: Request) -> Response:
        """200 while every stage has a replica serving (a replica down is named in `replicas` / `message`),
        else 503 naming the stages down."""
        detail_of = getattr(self.pipeline, "health_detail", None)  # per replica, where the pipeline has them
        try:
            if detail_of is not None:
                replicas = await asyncio.wait_for(detail_of(), HEALTH_TIMEOUT_S)
                stages = {name: any(states.values()) for name, states in replicas.items()}
            else:
                replicas, stages = None, await asyncio.wait_for(self.pipeline.health(), HEALTH_TIMEOUT_S)
        except TimeoutError:
            return JSONResponse({"status": "unavailable", "stages": {}, "down": [],
                                 "message": f"the health check took longer than {HEALTH_TIMEOUT_S:g} s"}, 503)
        except Exception as e:
            return JSONResponse({"status": "unavailable", "stages": {}, "down": [],
                                 "message": f"the health check failed: {type(e).__name__}: {e}"}, 503)
        down = [name for name, ok in stages.items() if not ok]
        body: dict[str, object] = {"status": "unavailable" if down else "ok", "stages": stages, "down": down}
        if replicas is not None:
            body["replicas"] = replicas
            lagging = [f"{name} {addr}" for name, states in replicas.items() if stages[name]
                       for addr, ok in states.items() if not ok]
            if lagging:
                body["message"] = f"replica(s) not serving (their stages still serve): {', '.join(lagging)}"
        if down:
            body["message"] = f"stage(s) not serving: {', '.join(down)}"
            return JSONResponse(body, 503)
        return JSONResponse(body)

    async def metrics_text(self, request: Request) -> Response:
        scraped = await scrape_stages(self.stage_metrics, self.metrics.scrape_up, STAGE_SCRAPE_TIMEOUT_S)
        own = parse_exposition(generate_latest(self.metrics.registry).decode())  # `_created` as in the stages'
        return Response(merge_families([own, *scraped]), media_type=CONTENT_TYPE_LATEST)


def _image_headers(messages: list[Message], names: MessageNames) -> Iterator[tuple[int, int, str]]:
    """(width, height, field) of each image a user sent inline (a data URI) whose header says its size, in
    order; nothing is decoded beyond each header (`ImageTokens.precheck`)."""
    for i, m in enumerate(messages):
        if m.role != "user":
            continue
        for j, p in enumerate(m.content):
            if p.type == "image_url" and p.image_url is not None and p.image_url.url[:5].lower() == "data:":
                size = image_header_size(p.image_url.url)
                if size is not None:
                    yield size[0], size[1], f"{names.of(i)}.content[{j}].{names.image_url}"


def _settings(mm: MMProcessorKwargs | None) -> tuple[tuple[str, float], ...]:
    """A request's processor settings as `ChatRequest.processor_kwargs`."""
    return tuple(sorted(mm.settings().items())) if mm is not None else ()


def _tool_call(c: ToolCall) -> ToolCallOut:
    return ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))


def create_app(pipeline: Pipeline, *, served_model_names: Sequence[str] | None = None,
               allowed_media_domains: frozenset[str] = frozenset(), limits: InputLimits | None = None,
               media_transport: object | None = None, max_logprobs: int = MAX_LOGPROBS,
               return_tokens_as_token_ids: bool = False, prompt_tokens_details: bool = False,
               auto_tool_choice: bool = False, stage_metrics: StageSources | None = None, api_keys: tuple[str, ...] = (),
               front: HttpFront | None = None, prompts: PromptBuilder | None = None,
               reasoning: ReasoningParser | None = None, responses_store: ResponseStore | None = None,
               force_include_usage: bool = False, max_realtime_sessions: int | None = None,
               max_realtime_session_s: float | None = None) -> FastAPI:
    """The REST app. `served_model_names` (default: `pipeline.served_models`) are the names clients may
    ask for; `allowed_media_domains` the hosts http(s) media may come from (empty = none);
    `media_transport` an `httpx.AsyncBaseTransport` for tests; `stage_metrics` the stages whose series
    /metrics adds (by stage name); `api_keys` the keys /v1 routes need (empty: none, `gateway/auth.py`);
    `front` CORS and X-Request-Id (`gateway/http_front.py`), outside the key check; `prompts` the pipeline's
    prompt builder, for /tokenize and /detokenize (`gateway/tokenize_api.py`; without it they are 404s) and
    for the video frame sampling of `video_url` parts (its processor's; else `pipeline.prepare`'s, else the
    default); `prompt_tokens_details` adds `usage.prompt_tokens_details.cached_tokens`
    (--enable-prompt-tokens-details); `auto_tool_choice` parses tool calls out of the text
    (--enable-auto-tool-choice, gateway/tool_calls.py); `reasoning` splits a thinking model's reasoning from its
    answer (--reasoning-parser, gateway/reasoning.py); `responses_store` keeps the Responses API's answers
    (--responses-store-memory, gateway/response_store.py); `force_include_usage` ends every streamed chat and
    completion with its usage chunk, asked or not (--enable-force-include-usage); `max_realtime_sessions` caps
    the Realtime sessions open at once (--max-realtime-sessions; None: no cap) and `max_realtime_session_s` how
    long each may stay open (--max-realtime-session-duration; None: no limit)."""
    names = tuple(served_model_names) if served_model_names else tuple(pipeline.served_models)
    if not names:
        raise ValueError("no served model names: give served_model_names or a pipeline with served_models")
    # video frames are sampled as the prompt builder's processor samples them (its default without one)
    sampling = video_sampling_of(prompts if prompts is not None else getattr(pipeline, "prepare", None))
    loader = MediaLoader(limits or InputLimits(), allowed_media_domains, transport=media_transport,  # type: ignore[arg-type]
                         video_sampling=sampling, budget=pipeline.media_budget)
    gw = RestGateway(pipeline, names, loader, stage_metrics, prompts.max_model_len if prompts is not None else None,
                     max_logprobs, return_tokens_as_token_ids, prompt_tokens_details, auto_tool_choice, reasoning)
    gw.force_include_usage = force_include_usage
    gw.prompts = prompts
    app = FastAPI(title="omnimesh gateway", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gw
    if api_keys:  # /v1 needs one of them; /health and /metrics stay open (gateway/auth.py)
        app.add_middleware(ApiKeyMiddleware, keys=api_keys)  # type: ignore[arg-type]
    if front is not None:
        front.install(app)
    app.add_api_route("/v1/chat/completions", gw.chat_completions, methods=["POST"])
    speech = SpeechRoutes(gw, prompts)
    app.add_api_route("/v1/audio/speech", speech.speech, methods=["POST"])
    app.add_api_route("/v1/audio/voices", speech.voices, methods=["GET"])
    responses = ResponsesRoutes(gw, responses_store)
    app.state.responses = responses  # the server closes it on shutdown (background responses end cancelled)
    if responses_store is not None:
        gw.metrics.registry.register(responses_store)  # its size on /metrics
    app.add_api_route("/v1/responses", responses.responses, methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}", responses.retrieve, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", responses.delete, methods=["DELETE"])
    app.add_api_route("/v1/responses/{response_id}/input_items", responses.input_items, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}/cancel", responses.cancel, methods=["POST"])
    app.state.realtime = RealtimeRoutes(gw, max_realtime_sessions, max_realtime_session_s)  # drained at shutdown
    app.add_api_websocket_route("/v1/realtime", app.state.realtime.realtime)
    audio = TranscriptionRoutes(gw)
    app.add_api_route("/v1/audio/transcriptions", audio.transcriptions, methods=["POST"])
    app.add_api_route("/v1/audio/translations", audio.translations, methods=["POST"])
    app.add_api_route("/v1/models", gw.models, methods=["GET"])
    app.add_api_route("/v1/models/{model:path}", gw.model, methods=["GET"])
    completions = CompletionRoutes(gw, prompts).completions if prompts is not None else None
    if completions is not None:
        app.add_api_route("/v1/completions", completions, methods=["POST"])
    invocations = InvocationRoutes(gw.chat_completions, completions, loader.limits.max_request_bytes)
    app.add_api_route("/invocations", invocations.invocations, methods=["POST"])  # vLLM's (SageMaker's), by body
    if prompts is not None:
        routes = TokenizeRoutes(gw, prompts)
        app.add_api_route("/tokenize", routes.tokenize, methods=["POST"])
        app.add_api_route("/detokenize", routes.detokenize, methods=["POST"])
    app.add_api_route("/version", gw.version, methods=["GET"])
    app.add_api_route("/health", gw.health, methods=["GET"])
    app.add_api_route("/ping", gw.health, methods=["GET", "POST"])  # vLLM's (SageMaker's): /health by another name
    app.add_api_route("/load", gw.load, methods=["GET"])
    app.add_api_route("/metrics", gw.metrics_text, methods=["GET"])

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return error_json(PipelineError(message, http_status=exc.status_code, grpc_code=12, kind=kind))

    return app
