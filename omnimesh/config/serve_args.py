"""ServeArgs: every `omnimesh serve` flag, its help text and its checks, in one frozen dataclass.

Role: the CLI help is generated from these fields' metadata (`add_arguments`), so the docs and the
parser cannot drift. `__post_init__` validates values and names the fix; `stage_configs()` resolves the
per-stage layout from the global flags plus `--stage-overrides`; `check_devices()` compares pp x tp with
the devices this host has, before anything loads; `unsupported()` lists valid settings that this
version cannot run yet, so the CLI can say so plainly instead of misbehaving.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from gateway.content_format import CONTENT_FORMATS, check_content_format
from omnimesh.allocator import check_mode
from omnimesh.config.stage_config import (KV_CACHE_DTYPE_CHOICES, LOAD_FORMATS, SPEECH_STAGES, STAGES, TRANSPORT_CHOICES, StageConfig,
                                          VLLM_ONLY_LOAD_FORMATS, parse_bytes, parse_json_object, parse_size,
                                          parse_stage_overrides, resolve_stage)
from omnimesh.models.qwen3_omni.code_windows import DEFAULT_WINDOWS, parse_windows, windows_text

TOOL_CALL_PARSERS = ("hermes",)  # vLLM's names of the tool-call formats the gateway parses (gateway/tool_calls.py)

DTYPES = ("auto", "float32", "bfloat16", "float16")
# --logprobs-mode, vLLM's: which scores `logprobs` report (services/llm/thinker_task.py). raw: the model's logits as
# they came; processed: the scores the token was sampled from; *_logprobs: their log-softmax, *_logits: the values
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
# the part of --gpu-memory-utilization a KV-cache stage takes when it shares a GPU with another stage (and has
# no fraction of its own): the thinker's cache is the one long prompts fill, the talker's holds short contexts
SHARED_GPU = {"thinker": 2 / 3, "talker": 2 / 9}


def human_readable_int(text: str) -> int:
    """A token count as vLLM's flags take it: 4096, 4k (4000), 4K (4096), 25.6k, 1m / 1M, 1g / 1G."""
    value = text.strip()
    units = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}
    scale = units.get(value[-1:], 1)
    number = value[:-1] if scale != 1 else value
    try:
        amount = float(number) * scale if scale != 1 else int(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count (e.g. 4096, 4k or 4K)") from None
    if amount != int(amount):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens")
    return int(amount)


def _f(default: Any, help: str, *flags: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, "flags": flags, **extra})


def check_generation_config_folder(source: str) -> None:
    """--generation-config FOLDER, before anything starts: it must hold a generation_config.json that is a JSON
    object (a ValueError saying what is wrong; the thinker reads its values when it loads)."""
    folder, why = Path(source), None
    if not os.path.isdir(folder):  # (os.path: False, not OSError, for a name too long)
        why = "no such folder"
    elif not os.path.isfile(folder / "generation_config.json"):
        why = "the folder holds no generation_config.json"
    else:
        try:
            if not isinstance(json.loads((folder / "generation_config.json").read_text()), dict):
                why = "its generation_config.json is not a JSON object"
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            why = f"its generation_config.json is not readable JSON ({exc})"
    if why is not None:
        raise ValueError(f"--generation-config {source!r}: {why}; give auto (the model folder's "
                         "generation_config.json), vllm, or a folder holding a generation_config.json")


@dataclass(frozen=True, slots=True)
class ServeArgs:
    model: str | None = _f(None, "model folder (Hugging Face layout); omitted = the built-in tiny Qwen3-Omni", positional=True)
    host: str = _f("0.0.0.0", "address the gateway listens on", "--host")
    port: int = _f(8000, "gateway REST port (OpenAI-compatible API, /metrics, /health)", "--port")
    grpc_port: int = _f(8001, "gateway gRPC port (omnimesh.v1.Omni)", "--grpc-port")
    stage_base_port: int = _f(50051, "first port of the stage services (encoder, thinker, talker, vocoder; a stage "
                              "with replicas takes one port per replica, in that order); 0 = any free port",
                              "--stage-base-port")
    request_timeout: float = _f(600.0, "seconds a request may take end to end at the gateway (its deadline in every "
                                "stage); past it the stages drop it and the client gets 504 / DEADLINE_EXCEEDED "
                                "naming this flag (0: no limit)", "--request-timeout")
    stage_dns_refresh: float = _f(10.0, "seconds between DNS lookups of the stages the gateway's --stages names as "
                                  "dns:///HOST:PORT (each address one replica; new ones join, gone ones retire)",
                                  "--stage-dns-refresh")
    stage_start_timeout: float = _f(600.0, "seconds a stage may take to start serving, its model load included: "
                                    "`omnimesh serve` stops with an error naming the stage past it, and a gateway "
                                    "waits that long for every stage it names to answer (it says which it waits for)",
                                    "--stage-start-timeout")
    stage_restarts: int = _f(3, "times `omnimesh serve` restarts a stage process that exits on its own, within 10 minutes "
                             "(backoff 1, 2, 4 ... 30 s); one more exit stops the whole mesh with code 1, for an outer "
                             "supervisor; 0: a dead stage stays down (requests that need it get 503)", "--stage-restarts")
    api_key: str | None = _f(None, "clients must send 'Authorization: Bearer <key>' (gRPC: authorization metadata) on "
                             "/v1 and the Omni service; several keys comma-separated; /health and /metrics stay "
                             "open; default: $OMNIMESH_API_KEY, else none (prefer the variable: a flag shows in ps)",
                             "--api-key")
    served_model_name: tuple[str, ...] | None = _f(
        None, "model name(s) clients use, as vLLM's: the server answers to each, lists each in /v1/models, and the "
        "first is the model_name label of every stage's metrics; default: the model folder's name",
        "--served-model-name", nargs="+")
    tokenizer: str | None = _f(None, "a folder (Hugging Face layout) whose tokenizer, and its chat template, the gateway "
                               "and the thinker use instead of the model folder's, as vLLM's; it must hold the "
                               "model's media tokens and no more tokens than the thinker's vocabulary (checked at "
                               "start-up); local folders only: nothing is downloaded", "--tokenizer")
    allowed_origins: str | None = _f(None, "CORS: origins web pages may call the REST API from, a JSON list as vLLM's "
                                     "('[\"https://app.example\"]') or comma-separated, * for any; default: none, no "
                                     "CORS headers (only same-origin pages; vLLM allows every origin)", "--allowed-origins")
    allowed_methods: str | None = _f(None, "CORS: methods other origins may use (with --allowed-origins; default: all)",
                                     "--allowed-methods")
    allowed_headers: str | None = _f(None, "CORS: request headers other origins may send (with --allowed-origins; "
                                     "default: all)", "--allowed-headers")
    allow_credentials: bool = _f(False, "CORS: let the listed origins send cookies and HTTP auth (not with * origins)",
                                 "--allow-credentials", action="store_true")
    ssl_keyfile: str | None = _f(None, "TLS: PEM private key; with --ssl-certfile the REST and gRPC fronts serve "
                                 "https / TLS (the stages' own ports stay plaintext: keep them on a private network)",
                                 "--ssl-keyfile")
    ssl_certfile: str | None = _f(None, "TLS: PEM certificate chain for --ssl-keyfile", "--ssl-certfile")
    ssl_ca_certs: str | None = _f(None, "TLS: PEM CA certificates that client certificates are checked against",
                                  "--ssl-ca-certs")
    ssl_cert_reqs: int = _f(0, "TLS: client certificates, as Python's ssl.CERT_*: 0 none, 1 optional (REST; gRPC does "
                            "not ask), 2 required (mutual TLS on REST and gRPC)", "--ssl-cert-reqs")
    enable_request_id_headers: bool = _f(False, "every REST response carries X-Request-Id: the request's own, else a "
                                         "fresh id", "--enable-request-id-headers", action="store_true")
    disable_uvicorn_access_log: bool = _f(False, "no access-log line per REST request (method, path, status)",
                                          "--disable-uvicorn-access-log", action="store_true")
    uvicorn_log_level: str = _f("info", "log level of the REST server (uvicorn): critical, error, warning, info "
                                "(start-up and access lines), debug, trace", "--uvicorn-log-level")
    root_path: str | None = _f(None, "the path prefix of a proxy in front of the REST API, as vLLM's (FastAPI's "
                               "root_path), e.g. /omni: /omni/v1/... and /v1/... both reach the API (a proxy may "
                               "strip the prefix or pass it on), and the paths the gateway names carry it",
                               "--root-path")
    uds: str | None = _f(None, "serve the REST API on this Unix domain socket instead of --host:--port, as vLLM's "
                         "(the gRPC API stays on --grpc-port); the socket file is made afresh at start-up",
                         "--uds")
    chat_template: str | None = _f(None, "Jinja chat template to use instead of the model's: a file path or the template "
                                   "itself (checked at start-up on a system + user message)", "--chat-template")
    chat_template_content_format: str = _f(
        "auto", "how message contents reach the chat template (vLLM's flag): openai (lists of text / audio / image / "
        "video parts, as Qwen's templates take them), string (one string each, media as the model's placeholders in "
        "the text, for text-only templates) or auto (from the template: does it loop over a message's content)",
        "--chat-template-content-format", choices=CONTENT_FORMATS)
    trust_request_chat_template: bool = _f(
        False, "render a request's own chat_template (vLLM's flag); off: such a request is a 400 (a template is code "
        "the gateway runs, in jinja's sandbox)", "--trust-request-chat-template", action="store_true")
    default_chat_template_kwargs: str | None = _f(
        None, "template variables every request's chat template gets unless its own chat_template_kwargs set them "
        "(vLLM's flag), a JSON object, e.g. '{\"enable_thinking\": false}' (a thinking model answers without its "
        "reasoning by default)", "--default-chat-template-kwargs")
    enable_log_requests: bool = _f(False, "log every request at the gateway (as vLLM's): its id, prompt text, token "
                                   "count, media and sampling when it arrives, and how it ended (finish reason, "
                                   "tokens, seconds; cancelled; the error); off by default, prompts are users' data",
                                   "--enable-log-requests", action="store_true")
    disable_log_requests: bool = _f(False, "vLLM's older flag, accepted so its command lines run: request logging is "
                                    "off unless --enable-log-requests", "--disable-log-requests", action="store_true")
    enable_log_outputs: bool = _f(False, "with --enable-log-requests: also log what each request generated (vLLM's "
                                  "flag): its text, cut to --max-log-len, and the seconds of audio, when it ends",
                                  "--enable-log-outputs", action="store_true")
    log_config_file: str | None = _f(None, "a logging.config.dictConfig JSON for every process of the mesh, omnimesh's "
                                     "and uvicorn's records alike (vLLM's flag; e.g. JSON lines to stdout); it sets "
                                     "levels and formats instead of --log-level", "--log-config-file")
    max_log_len: int | None = _f(None, "with --enable-log-requests: the most prompt (and output) characters a line "
                                 "shows (default: all)",
                                 "--max-log-len")
    otlp_traces_endpoint: str | None = _f(None, "export OpenTelemetry traces (as vLLM's flag) to this OTLP/gRPC "
                                          "receiver, e.g. http://127.0.0.1:4317: one trace per request, the "
                                          "gateway's llm_request span with each stage's span under it, continuing "
                                          "a client's W3C traceparent (needs omnimesh[otel])",
                                          "--otlp-traces-endpoint")
    disable_log_stats: bool = _f(False, "no periodic load line from the stages (as vLLM's: every 10 s while a stage has "
                                 "work, throughput, running / waiting requests, KV-cache usage; "
                                 "OMNIMESH_LOG_STATS_INTERVAL sets the seconds)", "--disable-log-stats",
                                 action="store_true")
    tensor_parallel_size: int = _f(1, "tensor-parallel ranks per model stage", "-tp", "--tensor-parallel-size")
    pipeline_parallel_size: int = _f(1, "pipeline-parallel ranks per model stage", "-pp", "--pipeline-parallel-size")
    data_parallel_size: int = _f(1, "copies of every stage, as vLLM's data parallelism: each stage's num_replicas "
                                 "unless its --stage-overrides entry gives one; the gateway sends each request to "
                                 "the least busy copy. On CUDA copy r of a stage without its own `devices` takes "
                                 "devices r x pp x tp onwards, so -dp 2 on two GPUs runs one whole pipeline on each",
                                 "-dp", "--data-parallel-size")
    pp_layer_partition: str | None = _f(None, "layers per pipeline rank, e.g. 3,5 (default: even, extra layers to the middle ranks)", "--pp-layer-partition")
    gpu_memory_utilization: float = _f(0.9, "fraction of each device a stage may take (weights + KV cache)", "--gpu-memory-utilization")
    max_model_len: int | None = _f(None, "longest prompt + output in tokens, e.g. 32768, 32k (32000) or 32K (32768) as "
                                   "vLLM's; default: the model's limit", "--max-model-len", type=human_readable_int)
    max_num_seqs: int = _f(256, "most requests a stage runs at once", "--max-num-seqs")
    max_waiting_requests: int = _f(256, "most requests the thinker (and the talker) keeps waiting beyond its free --max-num-seqs "
                                   "seats; one more is refused at once (gRPC RESOURCE_EXHAUSTED, HTTP 429 with "
                                   "Retry-After) rather than queued without bound (0: never queue)",
                                   "--max-waiting-requests")
    scheduling_policy: str = _f("fcfs", "order of the thinker's and talker's requests, as vLLM's: fcfs (arrival) or "
                                "priority (each request's `priority`, lower first, arrival among equals; a "
                                "waiting request preempts a lower-priority running one when seats or KV blocks "
                                "run short)", "--scheduling-policy")
    max_num_batched_tokens: int | None = _f(None, "most tokens in one engine step (long prompts are chunked); 8192, 8k or "
                                            "8K as --max-model-len", "--max-num-batched-tokens", type=human_readable_int)
    enable_prefix_caching: bool = _f(False, "the thinker keeps the KV-cache blocks of prompts (media parts named by "
                                     "their content) and a later prompt that starts the same way "
                                     "reuses them instead of computing them again, as vLLM's automatic prefix "
                                     "caching; cached blocks count as free and are evicted least recently used "
                                     "first (off by default: each prompt is computed exactly as alone)",
                                     "--enable-prefix-caching", action=argparse.BooleanOptionalAction)
    enable_chunked_prefill: bool = _f(True, "the thinker and talker prefill a prompt longer than a step's budget "
                                      "(--max-num-batched-tokens) over several steps beside the running decodes, as "
                                      "vLLM's (on by default); --no-enable-chunked-prefill: whole, in one step, once "
                                      "the budget holds it (a long prompt's first token sooner, a pause for the "
                                      "decodes beside it; the step budget then defaults to --max-model-len)",
                                      "--enable-chunked-prefill", action=argparse.BooleanOptionalAction)
    encoder_cache_memory: str = _f("512MiB", "the encoder stage keeps its outputs per media item (an audio clip, image or "
                                   "video) up to this size, least recently used out first, so media sent again (a "
                                   "chat's history, the same picture with another question) skip the towers; on "
                                   "the encoder's device; 0 = off", "--encoder-cache-memory")
    kv_cache_memory: str | None = _f(None, "KV-cache size per rank of the thinker / talker, e.g. 2GiB (CPU default 4GiB; on CUDA it is what --gpu-memory-utilization leaves after weights and activations)", "--kv-cache-memory")
    kv_cache_dtype: str = _f("auto", "dtype the thinker's / talker's KV cache keeps keys and values in, as vLLM's: "
                             "auto (the model's dtype), float32, bfloat16, float16, fp8 (= fp8_e4m3) or fp8_e5m2; "
                             "fp8 holds 4x the tokens of a float32 cache in the same memory (2x of bfloat16), cast "
                             "with scale 1.0 as vLLM's without calibrated scales; attention still runs in the "
                             "model's dtype", "--kv-cache-dtype")
    block_size: int = _f(16, "tokens per KV-cache block", "--block-size")
    stream_interval: int = _f(4, "thinker tokens per streamed chunk (text deltas and the talker's inputs), as vLLM's "
                              "--stream-interval (its default is 1): the first token, the tokens the first audio "
                              "needs and the last token go at once; larger = fewer messages under load, burstier "
                              "text; 1 = every token its own delta", "--stream-interval")
    audio_windows: str = _f(windows_text(DEFAULT_WINDOWS),
                            "codec codes per vocoder decode, window by window, the last entry repeating (a code is "
                            "80 ms of audio on Qwen3-Omni): the first audio leaves after the first window, and "
                            "each later window must be made while the audio before it plays. 5,25: 5 codes first, "
                            "then 2 s at a time (the next 25 must come at 5x real time or playback runs dry); "
                            "5,10,20,25: doubling, smooth playback from real time on, one more decode per request",
                            "--audio-windows")
    enforce_eager: bool = _f(False, "no CUDA graphs and no torch.compile'd kernels, as vLLM's flag (with "
                              "omnimesh's fused CPU kernels off, OMNIMESH_CPU_KERNELS=0, the vocoder compiles its "
                              "SnakeBeta activation at start-up unless this is set; the fused kernels are ops, "
                              "not compiled graphs, and run either way)", "--enforce-eager", action="store_true")
    trust_remote_code: bool = _f(False, "accepted for vLLM compatibility and has no effect: omnimesh runs its own "
                                  "model code and reads only config, weights and tokenizer files, so no code "
                                  "from the model folder runs either way", "--trust-remote-code", action="store_true")
    dtype: str = _f("auto", f"weight / activation dtype: {', '.join(DTYPES)} (auto: bfloat16 on CUDA, float32 on CPU)", "--dtype")
    load_format: str = _f("auto", "where weights come from, as vLLM's flag: auto or safetensors (the folder's "
                          "*.safetensors), or dummy (no weight file read: every parameter random in [-1e-3, 1e-3], "
                          "for benchmarks and deployment checks of a model's shape; config, tokenizer and processor "
                          "files are still needed). Headless --num-nodes hosts must be given the same",
                          "--load-format")
    async_chunk: bool = _f(True, "stream chunks to the next stage as soon as they exist", "--async-chunk", action=argparse.BooleanOptionalAction)
    distributed_executor_backend: str = _f("mp", "how a stage of more than one rank starts its ranks 1..N-1: mp (local "
                                           "processes; several hosts with --num-nodes) or ray (actors placed by Ray, "
                                           "on the cluster at --ray-address)", "--distributed-executor-backend")
    ray_address: str | None = _f(None, "the Ray cluster for --distributed-executor-backend ray (HOST:PORT of its head, "
                                 "or auto); default: each stage starts a Ray instance of its own on this host",
                                 "--ray-address")
    num_nodes: int = _f(1, "hosts a stage of more than one rank spans: pp x tp / num_nodes consecutive ranks on each "
                        "(tp best inside a host); node 0 runs the stage's server, the others only ranks (headless)",
                        "--num-nodes")
    node_rank: int = _f(0, "this host's rank among --num-nodes (0: the stages' servers and, with `serve`, the "
                        "gateway; 1..N-1: headless ranks)", "--node-rank")
    master_addr: str = _f("127.0.0.1", "rendezvous address of node 0 (every node gives the same; node 0 listens on "
                          "all its interfaces)", "--master-addr")
    master_port: int | None = _f(None, "rendezvous port on node 0 (`serve`: the encoder's; stage i uses --master-port + "
                                 "i); required with --num-nodes > 1; default: a free port per stage", "--master-port")
    rendezvous_timeout: float = _f(120.0, "seconds a multi-node stage waits at its rendezvous: node 0 for every other "
                                   "node to join and report ready, a node > 0 to reach node 0 and hear its verdict; "
                                   "past it, an error naming what was missing", "--rendezvous-timeout")
    stage_overrides: str | None = _f(None, "JSON keyed by stage name or id, e.g. '{\"thinker\": {\"tp\": 2}}'", "--stage-overrides")
    generation_config: str = _f("auto", "where the thinker's default sampling comes from, as vLLM's: auto (the "
                                "model folder's generation_config.json), vllm (none: temperature 1, top_p 1, no "
                                "top_k, as vLLM's own defaults; the end-of-turn ids still the model's), or a folder "
                                "holding a generation_config.json", "--generation-config")
    override_generation_config: str | None = _f(None, "the thinker's default sampling over the model's "
                                                "generation_config.json, as vLLM's: JSON such as '{\"temperature\": "
                                                "0.5, \"max_new_tokens\": 512}' (keys: temperature, top_p, top_k, "
                                                "min_p, max_new_tokens / max_tokens, repetition_penalty, "
                                                "presence_penalty, frequency_penalty); requests still set their own; "
                                                "the talker's: default_sampling_params in --stage-overrides",
                                                "--override-generation-config")
    seed: int | None = _f(None, "vLLM's: the thinker and talker give each request that sets no seed one drawn from "
                          "this (the stage's Nth such request always gets the same), so a server restarted with the "
                          "same --seed samples the same answers to the same requests sent in the same order; each "
                          "request keeps its own generator, so what runs beside it changes nothing; default: fresh "
                          "randomness per request", "--seed")
    allowed_media_domains: str | None = _f(None, "comma-separated domains http(s) media may be fetched from (default: none)", "--allowed-media-domains")
    max_logprobs: int = _f(20, "most alternatives per token a request may ask for (REST top_logprobs, gRPC "
                           "sampling.logprobs), as vLLM's; -1: up to the vocabulary", "--max-logprobs")
    logprobs_mode: str = _f("raw_logprobs", "which scores logprobs report, as vLLM's: raw_logprobs (the model's "
                            "distribution, before sampling settings), raw_logits, processed_logprobs (the "
                            "distribution the token was sampled from: penalties, logit_bias, allowed / bad words, a "
                            "grammar, and when sampling temperature, top-k, top-p, min-p) or processed_logits; prompt "
                            "logprobs stay raw", "--logprobs-mode", choices=LOGPROBS_MODES)
    return_tokens_as_token_ids: bool = _f(False, "logprobs name each token 'token_id:<id>' instead of its text, as "
                                          "vLLM's (for tokens that are not valid text on their own)",
                                          "--return-tokens-as-token-ids", action="store_true")
    enable_auto_tool_choice: bool = _f(False, "with tool_choice \"auto\" (the default when a request sends tools), "
                                       "the thinker's tool-call blocks come back as OpenAI tool_calls, as vLLM's; "
                                       "needs --tool-call-parser", "--enable-auto-tool-choice", action="store_true")
    tool_call_parser: str | None = _f(None, "how tool calls look in the model's text, as vLLM's: hermes (Qwen2.5 / Qwen3 "
                                      "/ Qwen3-Omni: <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>)",
                                      "--tool-call-parser")
    responses_store_memory: str | None = _f(None, "keep the Responses API's answers in the gateway's memory, up to this "
                                            "size (e.g. 512MiB; the least recently used dropped first), for "
                                            "previous_response_id and GET /v1/responses/{id}; default: keep none",
                                            "--responses-store-memory")
    max_realtime_sessions: int = _f(256, "most Realtime API sessions (/v1/realtime WebSockets) the gateway keeps "
                                    "open at once; one more handshake is refused with HTTP 429 and Retry-After. "
                                    "Each session holds its conversation while it is open, bounded by "
                                    "--input-limits (max_audio_seconds of audio, max_messages items, "
                                    "max_request_bytes of text)", "--max-realtime-sessions")
    max_realtime_session_duration: float = _f(3600.0, "seconds a Realtime API session may stay open (OpenAI's 60 "
                                              "minutes); past it a response in progress is cancelled, the client "
                                              "gets an error event (code session_expired) and the WebSocket is "
                                              "closed, freeing its --max-realtime-sessions slot (0: no limit)",
                                              "--max-realtime-session-duration")
    reasoning_parser: str | None = _f(None, "split a thinking model's reasoning from its answer, as vLLM's: qwen3 or "
                                      "deepseek_r1 (<think>...</think>; Qwen3-Omni-30B-A3B-Thinking): chat answers "
                                      "carry it in message.reasoning (and reasoning_content), streamed as "
                                      "delta.reasoning", "--reasoning-parser")
    enable_force_include_usage: bool = _f(False, "every streamed chat or completion ends with its usage chunk, whether "
                                          "its stream_options asked for it or not (vLLM's flag; for clients that "
                                          "bill by it)", "--enable-force-include-usage", action="store_true")
    enable_prompt_tokens_details: bool = _f(False, "chat completions' usage says how many prompt tokens the thinker's "
                                            "prefix cache served (prompt_tokens_details.cached_tokens; see "
                                            "--enable-prefix-caching), as vLLM's",
                                            "--enable-prompt-tokens-details", action="store_true")
    mm_processor_kwargs: str | None = _f(None, "the multimodal processor's settings over the model folder's, as vLLM's: "
                                         "JSON with min_pixels / max_pixels (the area images and video frames are "
                                         "resized into: fewer vision tokens) and the video sampling fps / "
                                         "min_frames / max_frames, e.g. '{\"max_pixels\": 802816, \"fps\": 1}'",
                                         "--mm-processor-kwargs")
    limit_mm_per_prompt: str | None = _f(None, "most audio / image / video parts one request may carry, as vLLM's: JSON "
                                         "such as '{\"image\": 4, \"video\": 1}' (0 refuses a modality: "
                                         "'{\"video\": 0}'); checked before any part is decoded (400); a modality "
                                         "not named is bounded only by max_media_items (32 parts in all)",
                                         "--limit-mm-per-prompt")
    input_limits: str | None = _f(None, "the gateway's size limits on one request, JSON keyed by name (defaults in "
                                  "brackets): max_request_bytes (64MiB, REST body), max_audio_seconds (600, all clips "
                                  "together), max_image_pixels (16777216, per image or video frame), "
                                  "max_video_seconds (600), max_video_pixels (268435456, one video's sampled frames "
                                  "together), max_media_items (32), max_fetch_bytes (32MiB, one http(s) download), "
                                  "fetch_timeout_s (10), video_decode_timeout_s (60), max_messages (4096, a chat's "
                                  "messages; a Realtime conversation's items), max_content_parts (16384); byte sizes "
                                  "also take '16MiB'; "
                                  "413 (or 400) beyond, with a message naming the limit", "--input-limits")
    device: str = _f("auto", "auto, cpu or cuda", "--device")
    transport: str = _f("auto", "where tensors between stages travel: auto (shared memory / CUDA IPC between co-located stages, gRPC frames across hosts), grpc, shm or cuda-ipc", "--transport")
    shm_arena_size: str = _f("256MiB", "shared-memory arena of each stage for co-located hand-offs (0: none)", "--shm-arena-size")
    shm_min_tensor_size: str = _f("16KiB", "smallest tensor a co-located hand-off passes by shared-memory reference; "
                                  "smaller ones go inline, where their bytes cost less than a slot's locks "
                                  "(0: every tensor by reference)", "--shm-min-tensor-size")
    malloc: str = _f("auto", "memory allocator of the stage and gateway processes: auto (tcmalloc where it is installed, "
                     "for the gateway and CPU stages), tcmalloc (required) or system (as started); see "
                     "omnimesh/allocator.py", "--malloc")

    def __post_init__(self) -> None:
        names = self.served_model_name
        if names is not None:  # one name (a str, as code gives it) or several (a list, as argparse's nargs)
            names = (names,) if isinstance(names, str) else tuple(names)
            if not names or any(not isinstance(n, str) or not n.strip() or n != n.strip() for n in names):
                raise ValueError(f"--served-model-name takes one or more non-empty names without surrounding spaces, "
                                 f"got {list(names)!r}")
            if len(set(names)) != len(names):
                raise ValueError(f"--served-model-name lists a name twice: {list(names)!r}")
            object.__setattr__(self, "served_model_name", names)
        if self.tokenizer is not None and not os.path.isdir(self.tokenizer):
            raise ValueError(f"--tokenizer {self.tokenizer!r}: not a folder; give a local folder with the tokenizer "
                             f"files (tokenizer.json / vocab + merges, tokenizer_config.json): nothing is downloaded")
        for name in ("port", "grpc_port"):
            if not 0 < getattr(self, name) < 65536:
                raise ValueError(f"--{name.replace('_', '-')} must be a port number 1-65535, got {getattr(self, name)}")
        if not self.request_timeout >= 0:
            raise ValueError(f"--request-timeout must be >= 0 seconds (0: no limit), got {self.request_timeout}")
        if not self.stage_start_timeout > 0:
            raise ValueError(f"--stage-start-timeout must be > 0 seconds, got {self.stage_start_timeout}")
        if not self.stage_dns_refresh > 0:
            raise ValueError(f"--stage-dns-refresh must be > 0 seconds, got {self.stage_dns_refresh}")
        if self.stage_restarts < 0:
            raise ValueError(f"--stage-restarts must be >= 0 (0: never restart a stage), got {self.stage_restarts}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.load_format in VLLM_ONLY_LOAD_FORMATS:
            raise ValueError(f"--load-format {self.load_format} is not supported: omnimesh reads safetensors "
                             f"checkpoints (--load-format auto or safetensors) or none (dummy); convert the "
                             f"weights to safetensors")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"--load-format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError(f"--distributed-executor-backend must be mp or ray, got {self.distributed_executor_backend!r}")
        if self.distributed_executor_backend == "ray" and self.num_nodes > 1:
            raise ValueError("--num-nodes spreads ranks with --distributed-executor-backend mp; with ray the Ray "
                             "cluster places them on its nodes: drop --num-nodes/--node-rank and give --ray-address")
        if self.ray_address is not None and self.distributed_executor_backend != "ray":
            raise ValueError("--ray-address is for --distributed-executor-backend ray; add that flag or drop "
                             "--ray-address")
        if self.num_nodes < 1 or not 0 <= self.node_rank < self.num_nodes:
            raise ValueError(f"--node-rank must be in [0, --num-nodes) = [0, {self.num_nodes}), got {self.node_rank}")
        if self.data_parallel_size < 1:
            raise ValueError(f"-dp/--data-parallel-size must be >= 1 (copies of every stage), got {self.data_parallel_size}")
        if self.data_parallel_size > 1 and self.num_nodes > 1:
            raise ValueError(f"-dp {self.data_parallel_size} with --num-nodes {self.num_nodes}: a stage is either copied "
                             f"on this host or spread over hosts; for copies on several hosts start a mesh (or stages) "
                             f"on each and name them all in the gateway's --stages")
        if self.max_waiting_requests < 0:
            raise ValueError(f"--max-waiting-requests must be >= 0 (0: never queue beyond the free seats), "
                             f"got {self.max_waiting_requests}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.stream_interval < 1:
            raise ValueError(f"--stream-interval must be >= 1 token, got {self.stream_interval}")
        parse_windows(self.audio_windows)
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"--block-size must be in 1..1024 tokens, got {self.block_size} (16 is the usual value)")
        if self.kv_cache_memory is not None:
            parse_bytes(self.kv_cache_memory, "--kv-cache-memory")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPE_CHOICES)}, "
                             f"got {self.kv_cache_dtype!r}")
        parse_size(self.encoder_cache_memory, "--encoder-cache-memory")
        if self.responses_store_memory is not None:
            parse_bytes(self.responses_store_memory, "--responses-store-memory")
        if self.max_realtime_sessions < 1:
            raise ValueError(f"--max-realtime-sessions must be >= 1, got {self.max_realtime_sessions}")
        if not self.max_realtime_session_duration >= 0:
            raise ValueError("--max-realtime-session-duration must be >= 0 seconds (0: no limit), got "
                             f"{self.max_realtime_session_duration}")
        if self.transport not in TRANSPORT_CHOICES:
            raise ValueError(f"--transport must be one of {', '.join(TRANSPORT_CHOICES)}, got {self.transport!r}")
        check_mode(self.malloc)
        if self.api_key is not None:
            from gateway.auth import parse_api_keys

            parse_api_keys(self.api_key)
        if self.otlp_traces_endpoint is not None:
            from omnimesh.tracing import check_endpoint

            check_endpoint(self.otlp_traces_endpoint)
        if self.log_config_file is not None:
            from omnimesh.log_setup import read_log_config

            read_log_config(self.log_config_file)
        if self.generation_config not in ("auto", "vllm"):  # a folder, read by the thinker once its weights load
            check_generation_config_folder(self.generation_config)
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"--logprobs-mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        if self.disable_log_requests and self.enable_log_requests:
            raise ValueError("--disable-log-requests and --enable-log-requests contradict each other; give one")
        if self.enable_log_outputs and not self.enable_log_requests:
            raise ValueError("--enable-log-outputs logs each request's output beside its request lines: add "
                             "--enable-log-requests")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"--max-log-len must be >= 0 characters, got {self.max_log_len}")
        if not self.disable_log_stats:
            from omnimesh.engine.stat_logger import interval_from_env

            interval_from_env()
        from omnimesh.config.cpu_env import cpu_threads, kernels_mode

        kernels_mode()  # OMNIMESH_CPU_KERNELS and OMNIMESH_CPU_THREADS: wrong ones stop the start here
        cpu_threads()
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser (hermes for the Qwen omni models)")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"--tool-call-parser {self.tool_call_parser!r}: omnimesh knows "
                             f"{', '.join(TOOL_CALL_PARSERS)}")
        from gateway.reasoning import check_parser

        check_parser(self.reasoning_parser)
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"--seed must be in [0, 2**63), got {self.seed}")
        if self.max_logprobs < -1:
            raise ValueError(f"--max-logprobs must be >= 0 (or -1: up to the vocabulary), got {self.max_logprobs}")
        from gateway.input_limits import limits_from_flags, parse_media_domains
        from gateway.processor_kwargs import parse_mm_processor_kwargs

        parse_mm_processor_kwargs(self.mm_processor_kwargs)

        limits_from_flags(self.limit_mm_per_prompt, self.input_limits)
        parse_media_domains(self.allowed_media_domains)
        check_content_format(self.chat_template_content_format)
        from gateway.chat_template_options import parse_default_kwargs

        parse_default_kwargs(self.default_chat_template_kwargs)
        if self.chat_template is not None:
            from gateway.prompt import load_chat_template

            load_chat_template(self.chat_template)
        from gateway.http_front import check_front_args

        check_front_args(self)
        if self.master_port is not None and not 0 < self.master_port < 65536 - len(STAGES):
            raise ValueError(f"--master-port must be a port number below {65536 - len(STAGES)} (stage i uses "
                             f"--master-port + i), got {self.master_port}")
        if self.num_nodes > 1 and self.master_port is None:
            raise ValueError(f"--num-nodes {self.num_nodes} needs --master-port: every node must name the same "
                             f"rendezvous port on node 0 (with `omnimesh serve`, stage i uses --master-port + i)")
        if not self.rendezvous_timeout > 0:
            raise ValueError(f"--rendezvous-timeout must be > 0 seconds, got {self.rendezvous_timeout}")
        self._check_global_spread()
        processes = self.stage_processes()  # validates -tp/-pp, --stage-overrides
        if not 0 <= self.stage_base_port <= 65536 - processes:
            raise ValueError(f"--stage-base-port must leave room for {processes} stage ports (one per stage replica) "
                             f"below 65536, got {self.stage_base_port}")
        if self.uds is None and self.port == self.grpc_port:
            raise ValueError(f"--port and --grpc-port are both {self.port}: the REST and gRPC APIs need a port each")

    def stage_processes(self, stages: tuple[str, ...] = STAGES) -> int:
        """How many stage processes `omnimesh serve` starts for the model's `stages` (at most, all four): one per
        replica of each."""
        return sum(cfg.num_replicas for stage, cfg in self.stage_configs().items() if stage in stages)

    def check_stage_ports(self, stages: tuple[str, ...] = STAGES) -> None:
        """`omnimesh serve`: the ports of the model's `stages` (--stage-base-port on, one per replica, as the
        launcher hands them out) miss the gateway's."""
        end = self.stage_base_port + self.stage_processes(stages) if self.stage_base_port else 0
        stage_ports = range(self.stage_base_port, end)
        for flag, port in {"--port": None if self.uds is not None else self.port, "--grpc-port": self.grpc_port}.items():
            if port in stage_ports:
                raise ValueError(f"{flag} {port} is one of the stages' ports ({stage_ports.start}-{stage_ports.stop - 1}: "
                                 f"--stage-base-port {self.stage_base_port}, one per stage replica); move one of them")

    def model_name(self, model_dir: Path) -> str:
        """The name metrics carry: the first --served-model-name, else the model folder's name."""
        return self.model_names(model_dir)[0]

    def model_names(self, model_dir: Path) -> tuple[str, ...]:
        """The names clients may use: every --served-model-name, else the model folder's name."""
        return self.served_model_name or (model_dir.name,)

    def stage_configs(self, together: bool = False) -> dict[str, StageConfig]:
        """Each stage's settings: the global flags under its --stage-overrides entry. `together`: every stage
        runs on this host (`serve`, `plan`): KV-cache stages sharing a GPU split its memory (`_share_gpus`); a
        stage started alone (`omnimesh stage`) takes its whole fraction."""
        model_stage = StageConfig(
            pp=self.pipeline_parallel_size,
            tp=self.tensor_parallel_size,
            pp_layer_partition=parse_partition(self.pp_layer_partition),
            gpu_memory_utilization=self.gpu_memory_utilization,
            num_replicas=self.data_parallel_size,
            max_num_seqs=self.max_num_seqs,
            max_waiting_requests=self.max_waiting_requests,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            scheduling_policy=self.scheduling_policy,
            enable_prefix_caching=self.enable_prefix_caching,
            enable_chunked_prefill=self.enable_chunked_prefill,
            kv_cache_memory=None if self.kv_cache_memory is None else parse_bytes(self.kv_cache_memory, "--kv-cache-memory"),
            kv_cache_dtype=self.kv_cache_dtype,
            transport=self.transport,
            shm_arena_size=parse_size(self.shm_arena_size, "--shm-arena-size"),
            shm_min_tensor_size=parse_size(self.shm_min_tensor_size, "--shm-min-tensor-size"),
        )
        overrides = parse_stage_overrides(self.stage_overrides)
        if self.override_generation_config:  # the thinker's, under its own default_sampling_params
            thinker = overrides.setdefault("thinker", {})
            own = thinker.get("default_sampling_params")
            generation = parse_json_object(self.override_generation_config, "--override-generation-config",
                                           "of sampling defaults")
            thinker["default_sampling_params"] = {**generation, **(own if isinstance(own, dict) else {})}
        for stage in ("encoder", "vocoder"):
            if overrides.get(stage, {}).get("default_sampling_params") is not None:
                raise ValueError(f"--stage-overrides[{stage!r}].default_sampling_params: the {stage} does not sample; "
                                 f"only the thinker and the talker take sampling defaults")
        configs = {stage: resolve_stage(model_stage, self._spread(model_stage, overrides.get(stage, {}), stage), stage)
                   for stage in STAGES}
        if self.data_parallel_size > 1 and self.device == "cuda":  # copy r on devices r x pp x tp onwards
            configs = {s: c if c.devices is not None or c.num_replicas < 2 else
                       replace(c, devices=",".join(str(d) for d in range(c.num_replicas * c.world_size)))
                       for s, c in configs.items()}
        if len({configs[s].num_replicas == 0 for s in SPEECH_STAGES}) > 1:
            raise ValueError("--stage-overrides: num_replicas 0 for one of the talker and vocoder needs it for the other "
                             "too (speech needs both; both 0: a text-only mesh)")
        return self._share_gpus(configs, overrides) if together else configs

    def _share_gpus(self, configs: dict[str, StageConfig], overrides: dict[str, Any]) -> dict[str, StageConfig]:
        """On CUDA, the thinker and the talker size their KV caches from their own gpu_memory_utilization (per
        instance, as vLLM's). One that shares a GPU with another stage and has no fraction of its own in
        --stage-overrides takes its SHARED_GPU share of the global one (at 0.9: thinker 0.6, talker 0.2, the
        rest left to the encoder's and the vocoder's weights and working memory), so the default mesh, every
        stage on GPU 0, fits one GPU."""
        if self.device != "cuda":
            return configs
        used = {stage: set(cfg.replica_devices(0) or [str(i) for i in range(cfg.ranks_per_node)])
                for stage, cfg in configs.items() if cfg.num_replicas > 0}
        out = dict(configs)
        for stage, share in SHARED_GPU.items():
            if stage not in used or "gpu_memory_utilization" in overrides.get(stage, {}):
                continue
            if any(used[stage] & devices for other, devices in used.items() if other != stage):
                out[stage] = replace(configs[stage], gpu_memory_utilization=configs[stage].gpu_memory_utilization * share)
        return out

    def _check_global_spread(self) -> None:
        """-pp x -tp that some stage takes as they are must divide over --num-nodes (said once, for the flags,
        rather than for the first such stage)."""
        pp, tp, n = self.pipeline_parallel_size, self.tensor_parallel_size, self.num_nodes
        if n == 1 or pp * tp == 1 or (pp * tp) % n == 0:
            return
        overrides = parse_stage_overrides(self.stage_overrides)
        if any(not {"pp", "tp", "num_nodes"} & set(overrides.get(stage, {})) for stage in STAGES):
            raise ValueError(f"-pp {pp} x -tp {tp} = {pp * tp} ranks cannot be spread evenly over --num-nodes {n} hosts "
                             f"(each host runs pp x tp / num_nodes consecutive ranks); make pp x tp a multiple of {n} "
                             f"(e.g. -pp {n} with tp inside a host), or keep a stage on node 0 with num_nodes 1 in "
                             f"--stage-overrides")

    def _spread(self, model_stage: StageConfig, own: dict[str, Any], stage: str) -> dict[str, Any]:
        """The stage's overrides with its num_nodes: --num-nodes for a stage of more than one rank, 1 (node 0) for
        a single rank; a stage's own num_nodes (--stage-overrides) may only be 1 or --num-nodes."""
        if "num_nodes" in own:
            if own["num_nodes"] not in (1, self.num_nodes):
                raise ValueError(f"stage {stage}: num_nodes {own['num_nodes']} in --stage-overrides must be 1 (node 0 "
                                 f"only) or --num-nodes ({self.num_nodes})")
            return own
        pp, tp = own.get("pp", model_stage.pp), own.get("tp", model_stage.tp)
        if self.num_nodes == 1 or not (isinstance(pp, int) and isinstance(tp, int)) or pp * tp == 1:
            return own  # (a malformed pp / tp: resolve_stage names it)
        return {**own, "num_nodes": self.num_nodes}

    def check_devices(self, available: int, kind: str, only: str | None = None) -> None:
        """pp x tp of every stage (or just `only`) must fit the devices of this host (before anything loads)."""
        on_a_cluster = self.distributed_executor_backend == "ray" and self.ray_address is not None  # Ray places them
        for stage, cfg in self.stage_configs().items():
            if only is not None and stage != only or only is None and cfg.num_replicas == 0:
                continue
            if cfg.world_size > available * cfg.num_nodes and not on_a_cluster:
                raise ValueError(
                    f"stage {stage}: pp x tp = {cfg.pp} x {cfg.tp} = {cfg.world_size} ranks, but only "
                    f"{available * cfg.num_nodes} {kind} are available ({available} per host x {cfg.num_nodes} "
                    f"host(s)); lower -tp/-pp or set the stage's pp/tp in --stage-overrides"
                )
            for d in cfg.device_list():
                if int(d) >= available:
                    dp = (f" (-dp {self.data_parallel_size} puts copy r of a stage on devices r x pp x tp onwards: "
                          f"lower -dp, or give the stage's devices in --stage-overrides)" if self.data_parallel_size > 1
                          else "")
                    raise ValueError(f"stage {stage}: device {d} does not exist; this host has {available} {kind} "
                                     f"(0-{available - 1}){dp}")

    def unsupported(self, only: str | None = None) -> list[str]:
        """Valid settings this installation cannot run (each says what would be needed)."""
        out = []
        ranks = [cfg.world_size for stage, cfg in self.stage_configs().items() if only is None or stage == only]
        if self.distributed_executor_backend == "ray" and max(ranks, default=1) > 1:
            import importlib.util

            if importlib.util.find_spec("ray") is None:
                out.append(RAY_MISSING)
        return out


RAY_MISSING = ("--distributed-executor-backend ray needs Ray in this environment: pip install 'omnimesh[ray]' "
               "(or use --distributed-executor-backend mp)")
HTTP_FRONT_FIELDS = frozenset(
    {"allowed_origins", "allowed_methods", "allowed_headers", "allow_credentials", "ssl_keyfile", "ssl_certfile",
     "ssl_ca_certs", "ssl_cert_reqs", "enable_request_id_headers", "disable_uvicorn_access_log", "uvicorn_log_level",
     "root_path", "uds"}
)  # gateway/http_front.py
GATEWAY_FIELDS = frozenset(
    {"host", "port", "grpc_port", "api_key", "served_model_name", "tokenizer", "async_chunk", "allowed_media_domains", "max_model_len",
     "stage_dns_refresh", "stage_start_timeout", "request_timeout", "limit_mm_per_prompt", "input_limits", "max_logprobs",
     "return_tokens_as_token_ids",
     "mm_processor_kwargs", "enable_prompt_tokens_details", "enable_force_include_usage", "enable_auto_tool_choice",
     "tool_call_parser",
     "reasoning_parser", "responses_store_memory", "max_realtime_sessions", "max_realtime_session_duration",
     "trust_remote_code", "malloc",
     "chat_template", "chat_template_content_format", "default_chat_template_kwargs",
     "trust_request_chat_template", "enable_log_requests", "disable_log_requests", "max_log_len",
     "enable_log_outputs", "otlp_traces_endpoint", "log_config_file"}
) | HTTP_FRONT_FIELDS
STAGE_EXCLUDED = frozenset(
    {"model", "host", "port", "grpc_port", "stage_base_port", "stage_restarts", "stage_dns_refresh", "stage_start_timeout",
     "request_timeout",
     "api_key", "async_chunk",
     "allowed_media_domains", "chat_template", "chat_template_content_format", "default_chat_template_kwargs",
     "trust_request_chat_template", "enable_log_requests", "disable_log_requests", "max_log_len", "enable_log_outputs",
     "limit_mm_per_prompt",
     "input_limits", "max_logprobs", "return_tokens_as_token_ids", "mm_processor_kwargs",
     "enable_prompt_tokens_details", "enable_force_include_usage", "enable_auto_tool_choice", "tool_call_parser",
     "reasoning_parser",
     "responses_store_memory", "max_realtime_sessions", "max_realtime_session_duration", "data_parallel_size"}
) | HTTP_FRONT_FIELDS


def parse_partition(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--pp-layer-partition must be comma-separated layer counts like 3,5, got {text!r}") from None


def add_arguments(
    parser: argparse.ArgumentParser, *, only: frozenset[str] | None = None, exclude: frozenset[str] = frozenset()
) -> None:
    """Add ServeArgs fields as flags (all, `only` some, or all but `exclude`); help comes from the fields."""
    for f in fields(ServeArgs):
        if (only is not None and f.name not in only) or f.name in exclude:
            continue
        meta = f.metadata
        default = None if f.default is MISSING else f.default
        if meta.get("positional"):
            parser.add_argument(f.name, nargs="?", default=default, help=meta["help"])
            continue
        kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": f"{meta['help']} (default: {default})"}
        if "action" in meta:
            kwargs["action"] = meta["action"]
        else:
            kwargs["type"] = meta.get("type") or _type_of(f.type)
        if "nargs" in meta:
            kwargs["nargs"] = meta["nargs"]
        if "choices" in meta:
            kwargs["choices"] = meta["choices"]
        parser.add_argument(*meta["flags"], **kwargs)


def _type_of(annotation: Any) -> Any:
    text = str(annotation)
    if text.startswith("int"):
        return int
    if text.startswith("float"):
        return float
    return str


def to_argv(args: ServeArgs, only: frozenset[str] | None = None, skip: frozenset[str] = frozenset()) -> list[str]:
    """The flags (and the model, first) that `add_arguments` parses back into `args`: every field (of `only`, less
    `skip`) that differs from its default."""
    model: list[str] = []
    out: list[str] = []
    for f in fields(ServeArgs):
        value = getattr(args, f.name)
        if (only is not None and f.name not in only) or f.name in skip or value == f.default:
            continue
        meta = f.metadata
        if meta.get("positional"):
            model = [str(value)]
            continue
        flag, action = meta["flags"][-1], meta.get("action")
        if action is argparse.BooleanOptionalAction:
            out.append(flag if value else "--no-" + flag.removeprefix("--"))
        elif action == "store_true":
            out.append(flag)
        elif isinstance(value, tuple):
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return model + out


def from_namespace(ns: argparse.Namespace) -> ServeArgs:
    """Fields a sub-command has no flag for keep their defaults."""
    return ServeArgs(**{f.name: getattr(ns, f.name) for f in fields(ServeArgs) if hasattr(ns, f.name)})
