"""`omnimesh gateway`: the REST (FastAPI/uvicorn) and gRPC (omnimesh.v1.Omni) fronts on one event loop.

Data flow: load the tokenizer + processor from the model folder -> StageClients for the given stage
addresses (several for a stage with replicas: gateway/replicas.py) -> StagePipeline.connect() (reads voices /
sample rate from the stages, bounded wait) ->
serve REST on --host:--port or --uds (its socket bound first: gateway/rest_socket.py) and gRPC on
--host:--grpc-port (TLS, CORS, access log, --root-path: gateway/http_front.py)
until SIGTERM / SIGINT (then, at once on both fronts: no new connection or call; the gRPC calls in flight finish,
the Realtime sessions end after their responses in progress (`stop_rest`), then uvicorn finishes the HTTP
requests in flight); meanwhile the video decoders' process server starts (gateway/video_process.py).
REST /metrics also scrapes every stage's Metrics RPC through the same clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
from pathlib import Path

import uvicorn

from gateway.auth import parse_api_keys
from gateway.grpc_api import create_grpc_server
from gateway.http_front import HttpFront
from gateway.input_limits import InputLimits, describe_limits, limits_from_flags, parse_media_domains
from gateway.media_budget import MediaBudget
from gateway.pipeline import StagePipeline
from gateway.processor_kwargs import parse_mm_processor_kwargs
from gateway.chat_template_options import parse_default_kwargs
from gateway.prompt import PromptBuilder, load_chat_template
from gateway.realtime_routes import RealtimeRoutes
from gateway.reasoning import ReasoningParser
from gateway.response_store import responses_store
from gateway.request_log import RequestLog
from gateway.stage_discovery import StageDiscovery, parse_dns_target
from gateway.rest import create_app
from gateway.rest_socket import rest_socket
from omnimesh import tracing
from omnimesh.config.serve_args import ServeArgs
from omnimesh.models.qwen3_omni.checkpoint_stages import text_only_reason
from omnimesh.proc_utils import freeze_startup_heap, tune_malloc
from omnimesh.server.grpc_server import BindError, bind, listen_address
from omnimesh.transport.stage_client import StageClient
from omnimesh.transport.transport import Transport

log = logging.getLogger(__name__)
# a shutdown's wait for the Realtime responses and gRPC calls in progress, all at once: within `omnimesh serve`'s
# 10 s for the gateway to stop (omnimesh/launcher.py STOP_GRACE_S), the HTTP requests in flight served beside them
STOP_GRACE_S = 8.0


def model_max_len(model_dir: Path) -> int:
    """The model's own context limit (its text config's max_position_embeddings)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    return int(config.get_text_config().max_position_embeddings)


def build_pipeline(args: ServeArgs, model_dir: Path,
                   stage_addrs: dict[str, list[str]]) -> tuple[StagePipeline, StageDiscovery | None]:
    """The stage chain over the given addresses, and the DNS lookups of the stages named dns:///HOST:PORT
    (None when every stage has fixed addresses; such a stage starts with no replica)."""
    template = load_chat_template(args.chat_template) if args.chat_template is not None else None
    processor_kwargs = parse_mm_processor_kwargs(args.mm_processor_kwargs)
    builder = PromptBuilder(model_dir, max_model_len=args.max_model_len or model_max_len(model_dir), chat_template=template,
                            processor_kwargs=processor_kwargs, content_format=args.chat_template_content_format,
                            default_kwargs=parse_default_kwargs(args.default_chat_template_kwargs),
                            trust_request_template=args.trust_request_chat_template, tokenizer=args.tokenizer)
    if args.tokenizer is not None:
        log.info("gateway: tokenizer and chat template from %s (--tokenizer)", args.tokenizer)
    if args.trust_request_chat_template:
        log.warning("gateway: requests may bring their own chat_template (--trust-request-chat-template): each is "
                    "rendered in jinja's sandbox, but it is the client's code")
    log.info("gateway: the chat template takes message contents as %s (%s)",
             "strings, media as placeholders in the text" if builder.content_format == "string" else "part lists",
             "detected from the template; --chat-template-content-format overrides"
             if args.chat_template_content_format == "auto" else "--chat-template-content-format")
    if processor_kwargs:
        log.info("gateway: processor settings %s (--mm-processor-kwargs, over the model folder's)",
                 ", ".join(f"{k}={v:g}" for k, v in processor_kwargs.items()))
    if builder.default_kwargs:
        log.info("gateway: chat template variables %s by default (--default-chat-template-kwargs; a request's "
                 "chat_template_kwargs win)", json.dumps(builder.default_kwargs))
    if template is not None:
        log.info("gateway: chat template from --chat-template (%d characters) instead of the model's", len(template))
    transport = Transport("gateway", "grpc")  # the gateway reads shm frames (the vocoder's pcm), never writes any

    def client(stage: str, address: str) -> StageClient:
        return StageClient(stage, address, transport)

    targets = {stage: t for stage, addrs in stage_addrs.items() for a in addrs if (t := parse_dns_target(a)) is not None}
    clients = {stage: [client(stage, a) for a in addrs if stage not in targets] for stage, addrs in stage_addrs.items()}
    request_log = RequestLog(args.max_log_len, args.enable_log_outputs) if args.enable_log_requests else None
    no_audio = text_only_reason(model_dir)
    pipeline = StagePipeline(clients, builder, served_models=args.model_names(model_dir), async_chunk=args.async_chunk,
                             request_log=request_log, request_timeout_s=args.request_timeout, no_audio=no_audio)
    discovery = StageDiscovery(targets, pipeline.stages, client, args.stage_dns_refresh) if targets else None
    return pipeline, discovery


async def serve_gateway(args: ServeArgs, model_dir: Path, stage_addrs: dict[str, list[str]]) -> None:
    keys = parse_api_keys(args.api_key)  # first: a bad $OMNIMESH_API_KEY stops us before any stage is dialled
    tracing.init("omnimesh-gateway", args.otlp_traces_endpoint)  # RuntimeError naming the packages when missing
    front = HttpFront.from_args(args)  # and an unreadable --ssl-keyfile
    pipeline, discovery = build_pipeline(args, model_dir, stage_addrs)
    if discovery is not None:
        discovery.start()  # before connect(): it waits for each stage's first replica
    await pipeline.connect(args.stage_start_timeout)  # under `omnimesh serve`: while the stages load
    if pipeline.no_audio is not None:
        log.info("gateway: text out only: %s", pipeline.no_audio)
    domains = parse_media_domains(args.allowed_media_domains)
    limits = limits_from_flags(args.limit_mm_per_prompt, args.input_limits)
    pipeline.media_budget = MediaBudget(limits.media_build_memory)  # REST, gRPC and /tokenize share it
    if limits != InputLimits():
        log.info("gateway: input limits %s", describe_limits(limits))
    if keys:
        log.info("gateway: an API key is required on /v1 and the gRPC Omni service (%d key%s accepted)",
                 len(keys), "" if len(keys) == 1 else "s")
    prompts = pipeline.prepare if isinstance(pipeline.prepare, PromptBuilder) else None  # /tokenize
    defaults = parse_default_kwargs(args.default_chat_template_kwargs)  # as the prompt builder has them
    reasoning = ReasoningParser(args.reasoning_parser, defaults) if args.reasoning_parser else None
    app = create_app(pipeline, served_model_names=pipeline.served_models, allowed_media_domains=domains, limits=limits,
                     max_logprobs=args.max_logprobs, return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                     prompt_tokens_details=args.enable_prompt_tokens_details,
                     force_include_usage=args.enable_force_include_usage,
                     auto_tool_choice=args.enable_auto_tool_choice,
                     stage_metrics=pipeline.stages, api_keys=keys, front=front, prompts=prompts,
                     reasoning=reasoning, responses_store=responses_store(args.responses_store_memory),
                     max_realtime_sessions=args.max_realtime_sessions,
                     max_realtime_session_s=args.max_realtime_session_duration or None)
    video_warmup = asyncio.create_task(_start_video_decoding())  # in the background: serving starts meanwhile
    if (described := front.describe()) is not None:
        log.info("%s", described)
    sock = rest_socket(args.host, args.port, front.uds)  # BindError naming --port / --uds, before anything serves
    config = uvicorn.Config(app, host=args.host, port=args.port, loop="none", lifespan="off", **front.uvicorn_kwargs())
    rest = uvicorn.Server(config)
    rest.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]  # we own the signals
    grpc_server, _health = await create_grpc_server(pipeline, served_model_names=pipeline.served_models, limits=limits,
                                                    max_logprobs=args.max_logprobs, api_keys=keys,
                                                    auto_tool_choice=args.enable_auto_tool_choice,
                                                    reasoning=reasoning)
    try:
        bind(grpc_server, args.host, args.grpc_port, front.grpc_credentials(), flag="--grpc-port")
    except BindError:
        sock.close()
        raise
    await grpc_server.start()
    log.info("gateway: %d start-up objects frozen out of the garbage collector's scans", freeze_startup_heap())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    rest_task = asyncio.create_task(rest.serve(sockets=[sock]))
    print(f"omnimesh gateway listening: REST {front.rest_url(args.host, args.port)} , gRPC {listen_address(args.host, args.grpc_port)}",
          flush=True)
    done, _ = await asyncio.wait([rest_task, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    if rest_task in done and (failure := rest_task.exception()) is not None:
        raise failure
    # gRPC takes no new call from now on and its calls in flight finish (STOP_GRACE_S), while REST stops
    grpc_stopped = asyncio.create_task(grpc_server.stop(STOP_GRACE_S))
    await stop_rest(rest, app.state.realtime)
    await asyncio.gather(rest_task, return_exceptions=True)
    if front.uds is not None:  # a closed Unix socket leaves its file behind
        with contextlib.suppress(OSError):
            os.unlink(front.uds)
    await app.state.responses.close()  # background responses still running end "cancelled"
    await grpc_stopped
    if discovery is not None:
        await discovery.stop()
    video_warmup.cancel()
    await pipeline.close()
    tracing.shutdown()  # the spans still batched leave now


async def stop_rest(rest: uvicorn.Server, realtime: RealtimeRoutes, grace_s: float = STOP_GRACE_S) -> None:
    """The REST front's shutdown: no new connection; the Realtime sessions open finish their responses (at most
    `grace_s`) and are closed with the reason (uvicorn would close them at once, mid-answer); then uvicorn's own
    shutdown, which finishes the HTTP requests in flight."""
    for server in getattr(rest, "servers", ()):  # set once it listens
        server.close()  # the listening socket only: the connections open go on
    await realtime.drain(grace_s)
    rest.should_exit = True


async def _start_video_decoding() -> None:
    """Start the process server that forks one child per video (gateway/video_process.py), so the first
    video does not wait for its imports; without PyAV say once that video parts will be refused."""
    try:
        import gateway.media_video  # noqa: F401  # PyAV
    except ImportError as e:
        log.warning("gateway: video input is off (%s); install PyAV (pip install av) to accept video parts", e)
        return
    from gateway.video_process import start_forkserver

    seconds = await asyncio.to_thread(start_forkserver)
    log.info("gateway: video decoding ready in %.1f s (each video decodes in a process of its own)", seconds)


def run_gateway(args: ServeArgs, model_dir: Path, stage_addrs: dict[str, list[str]]) -> int:
    import uvloop

    tune_malloc()
    try:
        uvloop.run(serve_gateway(args, model_dir, stage_addrs))
    except (RuntimeError, ValueError) as exc:  # ValueError: a bad $OMNIMESH_API_KEY or TLS file
        print(f"omnimesh gateway: error: {exc}", flush=True)
        return 1
    return 0
