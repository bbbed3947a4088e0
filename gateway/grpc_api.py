"""The gRPC front end: `omnimesh.v1.Omni` (Generate, ListModels, ListVoices) over the same `Pipeline` as REST.

Data flow of `Generate`: `GenerateRequest` -> `OmniServicer.build` (the REST front end's checks: model,
voice, modalities, sampling ranges incl. stop / stop_token_ids, media decoded by `MediaLoader`: WAV audio,
images, video files of which only the sampled frames are kept) ->
`ChatRequest` -> `pipeline.run` (`n` > 1: one run per choice, gateway/choices.py) -> a server stream of
`text_delta`, `audio` (mono PCM16 chunks numbered by `seq` from 0), `tool_calls` and one `done`, per choice,
each response naming its choice in `index`. `tools` / `tool_choice` work as REST's (gateway/tool_calls.py:
`ToolAnswer` shapes each choice's text into content and calls). A raw `prompt` / `prompt_token_ids` instead
of messages is REST's legacy completion: the ids (tokenized with the pipeline's PromptBuilder, checked by
`completions_api.prompt_token_ids`) go to the thinker alone, text out.
Any failure, before or during generation, is one `error` message (code = the `grpc.StatusCode` value,
INVALID_ARGUMENT for a bad request) that ends the stream; the RPC itself then ends OK, as the proto says
errors travel inside the stream.

`create_grpc_server` registers the servicer with `grpc.health.v1` and reflection on a server built with `grpc_server_options(limits)`, so requests as
large as the REST body limit are accepted (gRPC's default is 4 MiB). Inside a running event loop:

    server, health = await create_grpc_server(pipeline)
    server.add_insecure_port("0.0.0.0:8001"); await server.start(); ...; await server.stop(grace)
"""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from gateway.audio_encoding import pcm16_bytes
from gateway.auth import ApiKeyInterceptor
from gateway.chat_template_options import final_assistant_text, parse_kwargs_json, template_options
from gateway.completions_api import prompt_token_ids
from gateway.events import (
    AudioDelta,
    ChatMessage,
    ChatRequest,
    ContentPart,
    Finished,
    Pipeline,
    PipelineError,
    SamplingOverrides,
    TextDelta,
    TextPart,
    ToolCall,
    check_request_id,
)
from gateway.tool_calls import NO_TOOLS, ToolAnswer, ToolPlan, plan_tools
from gateway.choices import MAX_CHOICES, choice_requests, close_events, fan_out
from gateway.input_limits import InputLimits
from gateway.processor_kwargs import check_settings
from gateway.prompt import PromptBuilder
from gateway.reasoning import END, AnswerSplit, ReasoningParser, thinks
from gateway.media import (AudioTotal, MediaLoader, image_header_size, invalid_request, media_not_from_user,
                           video_sampling_of)
from gateway.media_budget import mark_arrival
from gateway.openai_schema import (
    MAX_LOGPROBS,
    STAGE_NAMES,
    check_sampling,
    check_thinker_min_tokens,
    check_turn_counts,
    default_modalities,
    normalize_modalities,
    resolve_model,
    resolve_voice,
    why_no_voices,
)
from omnimesh import json_text, tracing
from omnimesh.server.grpc_decode import add_service
from omnimesh.server.grpc_server import make_server
from omnimesh.v1 import omni_pb2, omni_pb2_grpc, stage_pb2
from gateway.structured_request import require_llguidance
from services.llm.structured_output import grammar_for

if TYPE_CHECKING:
    from omnimesh.models.qwen3_omni.video_sampling import VideoSampling

log = logging.getLogger(__name__)
OMNI_SERVICE = omni_pb2.DESCRIPTOR.services_by_name["Omni"]
OMNI_SERVICE_NAME = OMNI_SERVICE.full_name  # "omnimesh.v1.Omni"
_ROLES = ("system", "user", "assistant", "tool")
_MEDIA_KINDS = {"audio_wav": "audio", "audio": "audio", "image": "image", "video": "video"}  # ContentPart oneof -> modality
def grpc_server_options(limits: InputLimits) -> list[tuple[str, int]]:
    """Server options so a request may be as large as the REST body limit (gRPC's default is 4 MiB)."""
    return [("grpc.max_receive_message_length", limits.max_request_bytes),
            ("grpc.max_send_message_length", limits.max_request_bytes)]


def _overrides(p: stage_pb2.SamplingParams, param: str, max_logprobs: int) -> SamplingOverrides:
    """The proto's sampling fields (the same as REST's) -> checked `SamplingOverrides`; empty lists = unset."""

    def opt(name: str) -> float | int | None:
        return getattr(p, name) if p.HasField(name) else None

    s = SamplingOverrides(temperature=opt("temperature"), top_p=opt("top_p"), top_k=opt("top_k"),  # type: ignore[arg-type]
                          seed=opt("seed"), max_tokens=opt("max_tokens"),  # type: ignore[arg-type]
                          repetition_penalty=opt("repetition_penalty"),
                          stop_token_ids=tuple(p.stop_token_ids) or None, stop=tuple(p.stop) or None,
                          min_tokens=opt("min_tokens"),  # type: ignore[arg-type]
                          include_stop_str_in_output=opt("include_stop_str_in_output"),  # type: ignore[arg-type]
                          presence_penalty=opt("presence_penalty"), frequency_penalty=opt("frequency_penalty"),
                          logprobs=opt("logprobs"), min_p=opt("min_p"),  # type: ignore[arg-type]
                          prompt_logprobs=opt("prompt_logprobs"),  # type: ignore[arg-type]
                          skip_special_tokens=opt("skip_special_tokens"),  # type: ignore[arg-type]
                          ignore_eos=p.ignore_eos or None,
                          logit_bias=tuple(sorted(p.logit_bias.items())) or None,
                          allowed_token_ids=tuple(p.allowed_token_ids) or None, bad_words=tuple(p.bad_words) or None)
    check_sampling(s, param, max_logprobs)
    return s


def _calls(calls: list[ToolCall], index: int) -> omni_pb2.GenerateResponse:
    return omni_pb2.GenerateResponse(tool_calls=omni_pb2.ToolCalls(calls=[
        omni_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in calls]), index=index)


def _error(err: PipelineError) -> omni_pb2.GenerateResponse:
    return omni_pb2.GenerateResponse(error=stage_pb2.Error(code=err.grpc_code, message=err.message))


class OmniServicer(omni_pb2_grpc.OmniServicer):
    """Thin: validate, run the pipeline, translate events to stream messages."""

    def __init__(self, pipeline: Pipeline, *, served_model_names: Sequence[str] | None = None,
                 limits: InputLimits | None = None, video_sampling: VideoSampling | None = None,
                 max_logprobs: int = MAX_LOGPROBS, auto_tool_choice: bool = False,
                 reasoning: ReasoningParser | None = None) -> None:
        self.pipeline = pipeline
        self.reasoning = reasoning  # --reasoning-parser
        self.max_logprobs = max_logprobs  # --max-logprobs
        self.auto_tool_choice = auto_tool_choice  # --enable-auto-tool-choice (with --tool-call-parser)
        self.served_model_names = tuple(served_model_names) if served_model_names else tuple(pipeline.served_models)
        if not self.served_model_names:
            raise ValueError("no served model names: give served_model_names or a pipeline with served_models")
        # the proto carries media bytes, never URLs; video frames are sampled as the pipeline's prompt
        # builder samples them (`video_sampling` None: its processor's, else the default)
        prepare = getattr(pipeline, "prepare", None)
        sampling = video_sampling or video_sampling_of(prepare)
        self.loader = MediaLoader(limits or InputLimits(), video_sampling=sampling, budget=pipeline.media_budget)
        # its tokenizer takes raw prompts (`prompt`); a pipeline without a PromptBuilder refuses them
        self.prompts = prepare if isinstance(prepare, PromptBuilder) else None

    async def build(self, req: omni_pb2.GenerateRequest) -> tuple[ChatRequest, ToolPlan]:
        """`GenerateRequest` -> (`ChatRequest`, what its tool calls are); any problem is a `PipelineError`
        (INVALID_ARGUMENT / NOT_FOUND)."""
        model = resolve_model(req.model or None, self.served_model_names)
        rid = check_request_id(req.request_id) if req.request_id else f"omni-{uuid.uuid4().hex}"
        raw = bool(req.prompt or req.prompt_token_ids)  # a completion: text out by default, and only text
        modalities = normalize_modalities(list(req.modalities) or None,
                                          default=("text",) if raw else default_modalities(self.pipeline))
        voice = None
        if "audio" in modalities or req.voice:
            voice = resolve_voice(req.voice or None, self.pipeline, "voice", speaking="audio" in modalities)
        sampling = (_overrides(req.sampling, "sampling", self.max_logprobs) if req.HasField("sampling")
                    else SamplingOverrides())
        stages: dict[str, SamplingOverrides] = {}
        for name, p in req.stage_params.items():
            if name not in STAGE_NAMES:
                raise invalid_request(f"stage_params: unknown stage '{name}'; known: {', '.join(STAGE_NAMES)}",
                                      "stage_params")
            stages[name] = _overrides(p, f"stage_params.{name}", self.max_logprobs)
        check_thinker_min_tokens(sampling, stages.get("thinker"), "sampling")
        pipeline_model = model if model in self.pipeline.served_models else self.pipeline.served_models[0]
        if raw:
            ids = await asyncio.to_thread(self._raw_prompt, req, modalities)
            return ChatRequest(request_id=rid, model=pipeline_model, messages=(), modalities=("text",),
                               sampling=sampling, stage_params=stages, priority=req.priority,
                               structured=await self._structured(req), prompt_ids=tuple(ids)), NO_TOOLS
        if not req.messages:
            raise invalid_request("messages: at least one message is required (or a raw prompt / "
                                  "prompt_token_ids)", "messages")
        check_turn_counts(len(req.messages), sum(len(m.content) for m in req.messages), self.loader.limits,
                          "messages")  # as REST's, before any message is read
        kinds = [_MEDIA_KINDS[kind] for m in req.messages for p in m.content
                 if (kind := p.WhichOneof("part")) in _MEDIA_KINDS]
        self.loader.check_counts(kinds)  # before decoding any
        try:
            settings = check_settings(dict(req.mm_processor_kwargs), "mm_processor_kwargs")
        except ValueError as e:
            raise invalid_request(str(e), "mm_processor_kwargs") from None
        video_sampling = self.loader.sampling_with(settings)
        # the images' tokens, each counted from its header before its pixels are decoded (as REST's)
        tokens = self.prompts.image_tokens(tuple(sorted(settings.items()))) \
            if self.prompts is not None and "image" in kinds else None
        if tokens is not None:  # all of them by their headers first, before any media is decoded (off the loop)
            await asyncio.to_thread(tokens.precheck, _image_headers(req), self.loader.limits.max_image_pixels)
        messages: list[ChatMessage] = []
        heard = AudioTotal(self.loader)  # checked part by part, so nothing past the limit is decoded (as REST's)
        for i, m in enumerate(req.messages):
            if m.role not in _ROLES:
                raise invalid_request(f"messages[{i}].role: '{m.role}' is not one of {', '.join(_ROLES)}",
                                      f"messages[{i}].role")
            if m.tool_calls and m.role != "assistant":
                raise invalid_request(f"messages[{i}].tool_calls: only assistant messages make calls (this is a "
                                      f"'{m.role}' message)", f"messages[{i}].tool_calls")
            if m.role == "tool" and not m.tool_call_id:
                raise invalid_request(f"messages[{i}]: a 'tool' message needs the tool_call_id of the call it "
                                      "answers", f"messages[{i}].tool_call_id")
            parts: list[ContentPart] = []
            for j, p in enumerate(m.content):
                where = f"messages[{i}].content[{j}]"
                kind = p.WhichOneof("part")
                if kind is None:
                    raise invalid_request(f"{where}: empty content part (set text, audio_wav, audio, image or video)",
                                          where)
                if kind == "text":
                    parts.append(TextPart(text=p.text))
                    continue
                if m.role != "user":
                    raise media_not_from_user(where, m.role)
                if kind == "audio_wav":
                    parts.append(await self.loader.audio_from_wav(p.audio_wav, f"{where}.audio_wav"))
                elif kind == "audio":
                    parts.append(await self.loader.audio_from_bytes(p.audio, f"{where}.audio"))
                elif kind == "image":
                    admit = functools.partial(tokens.add, param=f"{where}.image") if tokens is not None else None
                    parts.append(await self.loader.image_from_bytes(p.image, f"{where}.image", admit))
                else:
                    parts.append(await self.loader.video_from_bytes(p.video, f"{where}.video",
                                                                    with_audio=req.use_audio_in_video,
                                                                    sampling=video_sampling))
                heard.add(parts[-1])
            calls = tuple(ToolCall(c.id, c.name, c.arguments) for c in m.tool_calls)
            messages.append(ChatMessage(role=m.role, content=tuple(parts), tool_calls=calls,  # type: ignore[arg-type]
                                        tool_call_id=m.tool_call_id or None))
        structured = await self._structured(req)
        plan = self._tools(req, modalities)
        template = template_options(req.add_generation_prompt if req.HasField("add_generation_prompt") else None,
                                    req.continue_final_message,
                                    parse_kwargs_json(req.chat_template_kwargs, "chat_template_kwargs"),
                                    [m.role for m in messages], audio_out="audio" in modalities)
        if structured is not None and (plan.parse or plan.structured is not None):
            raise invalid_request("structured_output: a structured output and tool calls cannot both shape one "
                                  "answer; send tool_choice \"none\" or leave one out", "structured_output")
        thinking = thinks(self.reasoning, template.kwargs, audio_out="audio" in modalities,
                          continued=final_assistant_text(messages) if template.continue_final_message else "")
        return ChatRequest(request_id=rid, model=pipeline_model,
                           messages=tuple(messages), modalities=modalities,
                           voice=voice if "audio" in modalities else None, sampling=sampling, stage_params=stages,
                           priority=req.priority, processor_kwargs=tuple(sorted(settings.items())),
                           structured=plan.structured or structured, tools=plan.tools, template=template,
                           reasoning_end=END if thinking else None,
                           spoken_calls=plan.parse and "audio" in modalities), plan

    async def _structured(self, req: omni_pb2.GenerateRequest) -> tuple[str, str] | None:
        """`structured_output` as (kind, spec), compiled once to check it (400 naming the field), or None."""
        if not req.HasField("structured_output"):
            return None
        so = req.structured_output
        require_llguidance("structured_output")
        try:
            await asyncio.to_thread(grammar_for, so.kind, so.spec)  # off the loop: a big schema takes a while
        except ValueError as e:
            raise invalid_request(f"structured_output: {e}", "structured_output") from None
        return so.kind, so.spec

    def _raw_prompt(self, req: omni_pb2.GenerateRequest, modalities: tuple[str, ...]) -> list[int]:
        """A completion's prompt (`prompt` or `prompt_token_ids`) -> its token ids; what a raw prompt cannot
        carry (messages, audio out, tools, template fields) is a 400 naming the field."""
        given = [name for name, on in (("messages", bool(req.messages)), ("prompt", bool(req.prompt)),
                                       ("prompt_token_ids", bool(req.prompt_token_ids))) if on]
        if len(given) > 1:
            raise invalid_request(f"{given[1]}: give one of messages, prompt and prompt_token_ids, not "
                                  f"{' and '.join(given)}", given[1])
        if "audio" in modalities:
            raise invalid_request("modalities: a raw prompt gives text only (the talker speaks an assistant turn); "
                                  "send messages for speech", "modalities")
        for name, on in (("tools", bool(req.tools)), ("tool_choice", bool(req.tool_choice)),
                         ("use_audio_in_video", req.use_audio_in_video),
                         ("mm_processor_kwargs", bool(req.mm_processor_kwargs)),
                         ("add_generation_prompt", req.HasField("add_generation_prompt")),
                         ("continue_final_message", req.continue_final_message),
                         ("chat_template_kwargs", bool(req.chat_template_kwargs))):
            if on:
                raise invalid_request(f"{name}: applies to messages only; a raw prompt runs as it is", name)
        if self.prompts is None:
            raise invalid_request("prompt: this server has no tokenizer for raw prompts", "prompt")
        tokenizer = self.prompts.processor.tokenizer
        if req.prompt:
            return prompt_token_ids(tokenizer, req.prompt, True, "prompt")
        return prompt_token_ids(tokenizer, list(req.prompt_token_ids), False, "prompt_token_ids")

    def _tools(self, req: omni_pb2.GenerateRequest, modalities: tuple[str, ...]) -> ToolPlan:
        """The request's tools as REST's (`plan_tools`): each {"type": "function", "function": {...}}."""
        tools = []
        for i, t in enumerate(req.tools):
            if not t.name:
                raise invalid_request(f"tools[{i}].name: a function needs a name", f"tools[{i}].name")
            function: dict = {"name": t.name}
            if t.description:
                function["description"] = t.description
            if t.parameters:
                try:
                    schema = json_text.loads(t.parameters)
                except ValueError as e:
                    raise invalid_request(f"tools[{i}].parameters: not JSON: {e}", f"tools[{i}].parameters") from None
                if not isinstance(schema, dict):
                    raise invalid_request(f"tools[{i}].parameters: must be a JSON schema object", f"tools[{i}].parameters")
                function["parameters"] = schema
            tools.append({"type": "function", "function": function})
        choice = req.tool_choice or None
        named = choice if choice not in (None, "none", "auto", "required") else None
        return plan_tools(tuple(tools), None if named else choice, named,
                          req.parallel_tool_calls if req.HasField("parallel_tool_calls") else None,
                          self.auto_tool_choice, modalities)

    async def Generate(self, request: omni_pb2.GenerateRequest,  # noqa: N802 (gRPC method name)
                       context: grpc.aio.ServicerContext) -> AsyncIterator[omni_pb2.GenerateResponse]:
        n = request.n or 1
        mark_arrival()  # this RPC's place in the media budget's line (gateway/media_budget.py)
        # the caller's traceparent metadata, when tracing: this RPC's task only, so it is never reset
        tracing.set_request_parent((m[0], m[1]) for m in context.invocation_metadata() or () if isinstance(m[1], str))
        try:
            if n > MAX_CHOICES:
                raise invalid_request(f"n: must be in [1, {MAX_CHOICES}] choices, got {n}", "n")
            chat, plan = await self.build(request)
        except PipelineError as e:
            yield _error(e)
            return
        events = None
        seq = [0] * n  # each choice's audio chunks are numbered from 0
        done = 0
        try:
            shaped = [ToolAnswer(plan) for _ in range(n)]  # parsed, forced or plain text (gateway/tool_calls.py)
            include = not request.HasField("include_reasoning") or request.include_reasoning
            # --reasoning-parser: the thought apart from the answer (which `shaped` reads)
            thoughts = [AnswerSplit(self.reasoning, chat.reasoning_end is not None, include) for _ in range(n)]
            events = aiter(fan_out(self.pipeline, choice_requests(chat, n)))
            async for i, ev in events:
                if isinstance(ev, TextDelta):
                    thought, answer = thoughts[i].push(ev.text)
                    if thought:
                        yield omni_pb2.GenerateResponse(reasoning_delta=thought, index=i)
                    text, calls = shaped[i].push(answer)
                    if text or ev.logprobs or ev.prompt_logprobs:  # those only when asked (sampling)
                        yield omni_pb2.GenerateResponse(text_delta=text, logprobs=ev.logprobs, index=i,
                                                        prompt_logprobs=ev.prompt_logprobs)
                    if calls:
                        yield _calls(calls, i)
                elif isinstance(ev, AudioDelta):
                    if "audio" in chat.modalities and ev.pcm.size:
                        chunk = omni_pb2.AudioChunk(pcm16=pcm16_bytes(ev.pcm), sample_rate=ev.sample_rate, seq=seq[i])
                        seq[i] += 1
                        yield omni_pb2.GenerateResponse(audio=chunk, index=i)
                elif isinstance(ev, Finished):
                    thought, answer = thoughts[i].finish()  # held back in case a marker was starting
                    if thought:
                        yield omni_pb2.GenerateResponse(reasoning_delta=thought, index=i)
                    text, calls = shaped[i].push(answer)
                    if text:
                        yield omni_pb2.GenerateResponse(text_delta=text, index=i)
                    if calls:
                        yield _calls(calls, i)
                    text, calls = shaped[i].finish()  # a forced answer not whole (max_tokens) comes as text
                    if text:
                        yield omni_pb2.GenerateResponse(text_delta=text, index=i)
                    if calls:
                        yield _calls(calls, i)
                    usage = stage_pb2.Usage(prompt_tokens=ev.prompt_tokens, completion_tokens=ev.completion_tokens,
                                            cached_tokens=ev.cached_tokens)
                    done_msg = stage_pb2.Done(finish_reason=shaped[i].finish_reason(ev.finish_reason), usage=usage)
                    if isinstance(ev.stop_reason, str):
                        done_msg.stop_string = ev.stop_reason
                    elif ev.stop_reason is not None:
                        done_msg.stop_token_id = ev.stop_reason
                    yield omni_pb2.GenerateResponse(done=done_msg, index=i)
                    done += 1
                    if done == n:
                        return
            yield _error(PipelineError("internal error: the pipeline ended without a Finished event",
                                       http_status=500, grpc_code=grpc.StatusCode.INTERNAL.value[0],
                                       kind="server_error"))
        except PipelineError as e:
            yield _error(e)
        except Exception as e:
            log.exception("Generate failed")
            yield _error(PipelineError(f"internal error: {type(e).__name__}: {e}", http_status=500,
                                       grpc_code=grpc.StatusCode.INTERNAL.value[0], kind="server_error"))
        finally:
            if events is not None:
                await close_events(events)  # tells the pipeline to cancel the runs in the stages

    async def ListModels(self, request: omni_pb2.ListModelsRequest,  # noqa: N802
                         context: grpc.aio.ServicerContext) -> omni_pb2.ListModelsResponse:
        return omni_pb2.ListModelsResponse(models=list(self.served_model_names))

    async def ListVoices(self, request: omni_pb2.ListVoicesRequest,  # noqa: N802
                         context: grpc.aio.ServicerContext) -> omni_pb2.ListVoicesResponse:
        voices = self.pipeline.voices
        why = "" if voices else why_no_voices(self.pipeline)
        return omni_pb2.ListVoicesResponse(voices=list(voices), default_voice=self.pipeline.default_voice, reason=why)


async def create_grpc_server(pipeline: Pipeline, *, served_model_names: Sequence[str] | None = None,
                             limits: InputLimits | None = None, max_logprobs: int = MAX_LOGPROBS,
                             api_keys: tuple[str, ...] = (), auto_tool_choice: bool = False,
                             reasoning: ReasoningParser | None = None
                             ) -> tuple[grpc.aio.Server, health_aio.HealthServicer]:
    """A `grpc.aio` server (not yet bound or started) serving Omni + health ("" and Omni SERVING) + reflection;
    with `api_keys`, Omni calls need one of them (`gateway/auth.py`)."""
    limits = limits or InputLimits()
    server, health = make_server([OMNI_SERVICE_NAME], options=grpc_server_options(limits),
                                 interceptors=[ApiKeyInterceptor(api_keys)] if api_keys else ())
    add_service(server, OmniServicer(pipeline, served_model_names=served_model_names, limits=limits,
                                     max_logprobs=max_logprobs, auto_tool_choice=auto_tool_choice, reasoning=reasoning),
                OMNI_SERVICE)  # a request protobuf cannot parse: INVALID_ARGUMENT
    for name in ("", OMNI_SERVICE_NAME):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, health


async def refresh_health(health: health_aio.HealthServicer, pipeline: Pipeline) -> bool:
    """Mirror `pipeline.health()` into gRPC health (SERVING only when every stage serves); returns it."""
    try:
        ok = all((await pipeline.health()).values())
    except Exception:
        log.warning("pipeline health check failed", exc_info=True)
        ok = False
    status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", OMNI_SERVICE_NAME):
        await health.set(name, status)
    return ok


def _image_headers(req: omni_pb2.GenerateRequest) -> Iterator[tuple[int, int, str]]:
    """(width, height, field) of each image part of a user message whose header says its size, in order
    (`ImageTokens.precheck`; REST's: gateway/rest.py `_image_headers`)."""
    for i, m in enumerate(req.messages):
        if m.role != "user":
            continue
        for j, p in enumerate(m.content):
            if p.WhichOneof("part") == "image" and (size := image_header_size(p.image)) is not None:
                yield size[0], size[1], f"messages[{i}].content[{j}].image"
