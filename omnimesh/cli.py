"""The `omnimesh` command.

    omnimesh serve [MODEL] [--port 8000] [-tp N] [-pp N] [--stage-overrides JSON] ...   whole mesh, one host
    omnimesh serve ... --num-nodes N --node-rank R --master-addr A --master-port P      stages over N hosts
    omnimesh stage encoder|thinker|talker|vocoder --model DIR --port P                   one stage service
    omnimesh stage NAME ... --num-nodes N --node-rank R --master-addr A --master-port P  one stage over N hosts
    omnimesh gateway --model DIR --stages thinker=HOST:PORT,...                          the front door alone
    omnimesh make-tiny [--family qwen3-omni|qwen2.5-omni] --out DIR [--thinker-only]     the built-in tiny model
    omnimesh plan [MODEL] [serve flags] [--device-memory 80GiB] [--num-devices N]       memory per stage, starts nothing

Every value is checked before anything starts; a wrong one exits with status 2 and a message that
names the fix, and a valid setting this version cannot run yet says so and exits with status 3.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

from omnimesh.config.config_file import add_config_flag, apply_config
from omnimesh.config.serve_args import (GATEWAY_FIELDS, HTTP_FRONT_FIELDS, STAGE_EXCLUDED, ServeArgs, add_arguments,
                                        from_namespace)
from omnimesh import tracing
from omnimesh.config.stage_config import STAGES
from omnimesh.log_setup import CONFIG_ENV, LEVEL_ENV, LEVELS, check_level, setup_logging

TINY_MODEL_NAME = "tiny-qwen3-omni"
EXIT_USAGE = 2
EXIT_UNSUPPORTED = 3


def _fail(msg: str, code: int = EXIT_USAGE) -> int:
    print(f"omnimesh: error: {msg}", file=sys.stderr)
    return code


CPU_RANKS_PER_CORE = 4


def _devices(device: str) -> tuple[int, str]:
    """How many devices this host gives a stage: CUDA GPUs; on CPU the devices are rank processes, and a
    core can time-share a few of them (slowly: CPU ranks are for testing layouts, not for speed)."""
    import torch

    if device != "cpu" and torch.cuda.is_available():
        return torch.cuda.device_count(), "CUDA devices"
    if device == "cuda":
        raise ValueError("--device cuda, but no CUDA device is visible (check CUDA_VISIBLE_DEVICES / drivers)")
    return CPU_RANKS_PER_CORE * (os.cpu_count() or 1), f"CPU ranks ({CPU_RANKS_PER_CORE} per core)"


# the device nodes of a GPU driver torch could use: NVIDIA's, WSL's GPU bridge, ROCm's
GPU_DRIVER_NODES = ("/dev/nvidiactl", "/dev/dxg", "/dev/kfd")


def gpu_driver_present() -> bool:
    """Whether this host exposes a GPU driver (Linux: one of GPU_DRIVER_NODES; elsewhere assumed). Without one no
    CUDA device can be visible, so `--device auto` is cpu without importing torch to ask: a standalone CPU stage
    re-executes itself on tcmalloc right after, and would otherwise have imported torch (~1.3 s of CPU) in vain."""
    return not sys.platform.startswith("linux") or any(os.path.exists(p) for p in GPU_DRIVER_NODES)


def resolve_device(args: ServeArgs) -> ServeArgs:
    """`--device auto` made concrete once, before anything reads it: cuda when a CUDA device is visible, else
    cpu (the stages, their dtype and KV-cache defaults and the launcher's stage command lines all read it)."""
    if args.device != "auto":
        return args
    if not gpu_driver_present():
        return replace(args, device="cpu")
    import torch

    return replace(args, device="cuda" if torch.cuda.is_available() else "cpu")


def _check_devices(args: ServeArgs, only: str | None = None) -> int | None:
    try:
        available, kind = _devices(args.device)
        args.check_devices(available, kind, only)
    except ValueError as exc:
        return _fail(str(exc))
    return None


def _check_supported(args: ServeArgs, only: str | None = None) -> int | None:
    unsupported = args.unsupported(only)
    if unsupported:
        return _fail("cannot run with this installation:\n  " + "\n  ".join(unsupported), EXIT_UNSUPPORTED)
    return None


def _model_dir(model: str | None, load_format: str | None = None) -> Path:
    """The model folder (the built-in tiny one when none is given). With `load_format` (a process that loads
    weights) a folder without a safetensors checkpoint is refused here, before anything starts, unless it is dummy."""
    if model is None:
        from omnimesh.tiny_cache import tiny_model_dir

        print("omnimesh: no MODEL given; using the built-in tiny Qwen3-Omni (random weights)", file=sys.stderr)
        return tiny_model_dir()
    path = Path(model)
    if not os.path.isfile(path / "config.json"):  # (os.path: False, not OSError, for a name too long)
        raise ValueError(
            f"model {model!r} is not a model folder (no config.json); give a local Hugging Face folder — "
            "this build never downloads from a hub"
        )
    try:  # every process reads it first: a file cut short or not an object is said here, not as a traceback
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (ValueError, OSError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"model {model!r}: its config.json cannot be read ({exc}); the file is truncated or "
                         "corrupt: copy the model folder again") from None
    if not isinstance(config, dict):
        raise ValueError(f"model {model!r}: its config.json holds a JSON {type(config).__name__}, not the object of "
                         "a Hugging Face config")
    if load_format not in (None, "dummy"):
        from omnimesh.models.loader import INDEX_FILE, SINGLE_FILE

        if not os.path.isfile(path / SINGLE_FILE) and not os.path.isfile(path / INDEX_FILE):
            raise ValueError(f"model {model!r} holds no weights (neither {SINGLE_FILE} nor {INDEX_FILE}); omnimesh "
                             f"reads safetensors checkpoints, or give --load-format dummy to run the model's shape "
                             f"with random weights")
        _check_checkpoint_header(path, model)
    return path


def _check_checkpoint_header(path: Path, model: str) -> None:
    """The checkpoint's header (its tensor table; no tensor is read) or, when sharded, its index: a file cut short
    or corrupt is refused before anything loads (it failed each stage after seconds of loading, with a
    traceback per stage)."""
    from omnimesh.models.loader import INDEX_FILE, SINGLE_FILE, checkpoint_files

    try:
        checkpoint_files(path)  # the loader's own read of the index or the single file's header
    except Exception as exc:  # noqa: BLE001  # safetensors' own error type, JSON's, the OS's
        name = INDEX_FILE if (path / INDEX_FILE).is_file() else SINGLE_FILE  # the one the loader reads
        raise ValueError(f"model {model!r}: its {name} cannot be read ({type(exc).__name__}: {exc}); the file is "
                         "truncated or corrupt: copy the model folder again") from None


def _check_layout(args: ServeArgs, model_dir: Path, only: str | None = None) -> int | None:
    """pp x tp against the model's heads, vocab and layers (errors exit 2; advice goes to stderr)."""
    from omnimesh.models.qwen3_omni.parallel_plan import check_layout
    from omnimesh.models.model_config import load_config

    from omnimesh.models.qwen3_omni.checkpoint_stages import model_stages

    has = model_stages(model_dir)
    layouts = {stage: cfg for stage, cfg in args.stage_configs().items()
               if stage in has and (cfg.num_replicas > 0 or stage == only)}
    if only is not None:
        layouts = {only: layouts[only]}
    try:
        advice = check_layout(load_config(model_dir), layouts)
    except ValueError as exc:
        return _fail(str(exc))
    for line in advice:
        print(f"omnimesh: advice: {line}", file=sys.stderr)
    return None


def _check_memory(args: ServeArgs, model_dir: Path, only: str | None = None) -> int | None:
    """Weights + KV cache against the devices' memory (omnimesh/memory_plan.py): on CUDA a stage that does not
    fit exits 2 saying what is missing and which pp / tp fits; on CPU a shortfall is advice only. What a stage
    would refuse after loading whatever the memory (`MemoryPlan.refusals`: a KV cache too small for one sequence,
    a --max-model-len past the model's) exits 2 on any device."""
    from omnimesh.memory_plan import plan_memory

    try:
        plan = plan_memory(model_dir, args, only=only)
    except Exception as exc:  # an estimate never stops a start that might work
        print(f"omnimesh: advice: no memory estimate ({type(exc).__name__}: {exc})", file=sys.stderr)
        return None
    if plan.refusals:  # the stage's engine would refuse them whatever the memory
        return _fail(plan.refusal_text())
    if not plan.ok and args.device == "cuda":
        return _fail(plan.error_text())
    for line in plan.errors + plan.advice:
        print(f"omnimesh: advice: {line}", file=sys.stderr)
    return None


def cmd_plan(ns: argparse.Namespace) -> int:
    """Print each stage's memory against its devices; exit 0 when everything fits, 2 when not."""
    from omnimesh.config.stage_config import parse_bytes
    from omnimesh.memory_plan import plan_memory

    try:
        args = resolve_device(from_namespace(ns))
        memory = None if ns.device_memory is None else parse_bytes(ns.device_memory, "--device-memory")
        if ns.num_devices is not None and ns.num_devices < 1:
            raise ValueError(f"--num-devices must be >= 1, got {ns.num_devices}")
        model_dir = _model_dir(args.model, args.load_format)
    except ValueError as exc:
        return _fail(str(exc))
    if args.device == "cpu" and (rc := _check_devices(args)) is not None:
        return rc
    if (rc := _check_layout(args, model_dir)) is not None:
        return rc
    try:
        plan = plan_memory(model_dir, args, device_memory=memory, num_devices=ns.num_devices)
    except ValueError as exc:
        return _fail(str(exc))
    print(plan.report())
    if plan.refusals:
        return _fail(f"the mesh would not start ({len(plan.refusals)} reason(s)): see 'cannot start' above")
    return 0 if plan.ok else _fail(f"the model does not fit its devices: {len(plan.errors)} problem(s) above")


def _check_stage_exists(model_dir: Path, stage: str) -> int | None:
    """A thinker-only checkpoint has no talker or vocoder to serve (exit 2, saying what to start instead)."""
    from omnimesh.models.qwen3_omni.checkpoint_stages import model_stages, text_only_reason

    if stage not in (stages := model_stages(model_dir)):
        return _fail(f"stage {stage}: {text_only_reason(model_dir)}; it serves text only: start the "
                     f"{' and '.join(stages)} stages and a gateway over them")
    return None


def _check_nodes(args: ServeArgs, only: str | None = None) -> int | None:
    """--num-nodes against the stages' layouts (errors exit 2; advice goes to stderr)."""
    from omnimesh.node_launcher import check_nodes

    try:
        advice = check_nodes(args, only)
    except ValueError as exc:
        return _fail(str(exc))
    for line in advice:
        print(f"omnimesh: advice: {line}", file=sys.stderr)
    return None


def cmd_serve(ns: argparse.Namespace) -> int:
    try:
        args = resolve_device(from_namespace(ns))
    except ValueError as exc:
        return _fail(str(exc))
    if (rc := _check_devices(args)) is not None or (rc := _check_nodes(args)) is not None:
        return rc
    try:
        model_dir = _model_dir(args.model, args.load_format)
    except ValueError as exc:
        return _fail(str(exc))
    if (rc := _check_layout(args, model_dir)) is not None or (rc := _check_supported(args)) is not None:
        return rc
    if (rc := _check_memory(args, model_dir)) is not None:
        return rc
    if args.model is None and args.served_model_name is None:
        args = replace(args, served_model_name=(TINY_MODEL_NAME,))
    if args.node_rank > 0:  # a headless host: only its ranks of the spread stages, no gateway
        from omnimesh.node_launcher import HeadlessNode

        return HeadlessNode(args, model_dir).run()
    from gateway.http_front import HttpFront
    from gateway.rest_socket import check_free
    from omnimesh.launcher import MeshLauncher
    from omnimesh.models.qwen3_omni.checkpoint_stages import model_stages
    from omnimesh.server.grpc_server import BindError, check_port

    try:  # the gateway's ports and TLS files, before any stage spends minutes loading
        args.check_stage_ports(model_stages(model_dir))
        check_free(args.host, args.port, args.grpc_port, args.uds)
        HttpFront.from_args(args)
        base = args.stage_base_port  # the stages' own ports too, when the flag fixes them (0: free ones)
        ports = range(base, base + args.stage_processes(model_stages(model_dir)) if base else 0)
        for port in ports:
            try:
                check_port("127.0.0.1", port, "--stage-base-port")
            except BindError as exc:
                raise BindError(f"--stage-base-port {base}: port {port} (of the stages' {ports.start}-{ports.stop - 1})"
                                f" cannot be listened on ({exc}): pick another --stage-base-port") from None
    except (BindError, ValueError) as exc:
        return _fail(str(exc))
    return MeshLauncher(args, model_dir).run()


def cmd_stage(ns: argparse.Namespace) -> int:
    try:
        args = resolve_device(from_namespace(ns))
    except ValueError as exc:
        return _fail(str(exc))
    # first: a re-executed process redoes everything before it (the tiny model's cache check included)
    if (rc := _use_allocator(ns, args.malloc, args.device, f"stage {ns.stage_name}")) is not None:
        return rc
    try:
        model_dir = _model_dir(args.model, args.load_format)
    except ValueError as exc:
        return _fail(str(exc))
    stage = ns.stage_name
    if (rc := _check_stage_exists(model_dir, stage)) is not None:
        return rc
    if args.load_format != "auto":  # this process's own loads; its ranks get it through their factory
        from omnimesh.models.loader import DUMMY_RANGE, set_load_format

        set_load_format(args.load_format)
        if args.load_format == "dummy":
            print(f"omnimesh: stage {stage}: --load-format dummy: no weight file is read; every parameter is random "
                  f"in [-{DUMMY_RANGE:g}, {DUMMY_RANGE:g}] (answers are noise)", file=sys.stderr)
    if (rc := _check_devices(args, stage)) is not None or (rc := _check_nodes(args, stage)) is not None:
        return rc
    if (rc := _check_layout(args, model_dir, only=stage)) is not None or (rc := _check_supported(args, stage)) is not None:
        return rc
    if (rc := _check_memory(args, model_dir, only=stage)) is not None:
        return rc
    if (replicas := args.stage_configs()[stage].num_replicas) > 1:
        return _fail(f"num_replicas = {replicas} for stage {stage}: one `omnimesh stage` process is one replica; start "
                     f"it {replicas} times on ports of their own and name each in the gateway's --stages "
                     f"({stage}=HOST:PORT,{stage}=HOST:PORT2,...), or let `omnimesh serve` start them")
    from omnimesh.parallel.node_rendezvous import RendezvousError

    if args.node_rank > 0:  # a headless host of a multi-node stage: its ranks only, no server
        from omnimesh.node_launcher import run_headless_stage

        return run_headless_stage(stage, model_dir, args)
    from omnimesh.server.stage_server import StageStartRefused, run_stage
    from omnimesh.stage_registry import handler_factory

    port = ns.stage_port if ns.stage_port is not None else 50051 + STAGES.index(ns.stage_name)
    from omnimesh.server.grpc_server import BindError, check_port

    try:  # before the weights load (port 0 too: the host must be one to listen on)
        check_port(ns.stage_host, port, "--port")
    except BindError as exc:
        return _fail(str(exc))
    cfg = args.stage_configs()[stage]
    try:
        tracing.init(f"omnimesh-{stage}", args.otlp_traces_endpoint)
    except RuntimeError as exc:  # the packages are missing: the message says what to install
        return _fail(str(exc))
    try:
        run_stage(handler_factory(ns.stage_name, model_dir, args), ns.stage_host, port,
                  transport=cfg.transport, shm_arena_size=cfg.shm_arena_size,
                  shm_min_tensor_size=cfg.shm_min_tensor_size, nice=cfg.nice,
                  bulk_nice=cfg.effective_bulk_nice(stage, args.device),
                  yield_steps=cfg.effective_yield_steps(stage), log_stats=not args.disable_log_stats)
    except RendezvousError as exc:  # the stage's nodes could not meet or disagree: the message says which
        return _fail(str(exc), 1)
    except StageStartRefused as exc:  # its settings or model folder: the message says what to change
        return _fail(str(exc) if str(exc).startswith(f"{stage}:") else f"stage {stage}: {exc}")
    return 0


def cmd_gateway(ns: argparse.Namespace) -> int:
    try:
        args = from_namespace(ns)
        stages = parse_stage_addresses(ns.stages)
    except ValueError as exc:
        return _fail(str(exc))
    if (rc := _use_allocator(ns, args.malloc, None, "gateway")) is not None:
        return rc
    try:
        model_dir = _model_dir(args.model)
    except ValueError as exc:
        return _fail(str(exc))
    from gateway.rest_socket import check_free
    from omnimesh.server.grpc_server import BindError

    try:  # before it waits for its stages (up to --stage-start-timeout), as `serve` and `stage` check theirs
        check_free(args.host, args.port, args.grpc_port, args.uds)
    except BindError as exc:
        return _fail(str(exc))
    from gateway.server import run_gateway

    return run_gateway(args, model_dir, stages)


def _use_allocator(ns: argparse.Namespace, mode: str, device: str | None, role: str) -> int | None:
    """Run on the allocator `--malloc` asks for (omnimesh/allocator.py): this re-executes the process when it
    must. Only when the command is this process's program, never for an in-process `main([...])` call."""
    if not getattr(ns, "own_process", False):  # set by main() for its own command line only
        return None
    from omnimesh.allocator import use_allocator

    try:
        use_allocator(mode, device, role)
    except RuntimeError as exc:
        return _fail(str(exc))
    return None


def parse_stage_addresses(text: str) -> dict[str, list[str]]:
    """`NAME=HOST:PORT,...` -> each stage's addresses; a name given again adds a replica of that stage, and
    `NAME=dns:///HOST:PORT` (alone for its stage) makes every address HOST resolves to a replica."""
    from gateway.stage_discovery import parse_dns_target

    out: dict[str, list[str]] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, sep, addr = item.partition("=")
        host, colon, port = addr.rpartition(":")
        if not sep or name not in STAGES or not colon:
            raise ValueError(f"--stages: {item!r} must look like NAME=HOST:PORT with NAME one of {', '.join(STAGES)}")
        dns = parse_dns_target(addr)
        if dns is None and (not host or not port.isdigit() or not 0 < int(port) < 65536):
            raise ValueError(f"--stages: {item!r}: the address must be HOST:PORT with a port in 1-65535 "
                             f"([v6]:PORT for an IPv6 address)")
        if addr in out.get(name, []):
            raise ValueError(f"--stages names {name}={addr} twice; each replica needs its own address")
        out.setdefault(name, []).append(addr)
        if dns is not None and len(out[name]) > 1 or any(
                parse_dns_target(a) is not None for a in out[name][:-1]):
            raise ValueError(f"--stages: stage {name} is named by DNS ({name}=dns:///HOST:PORT); give it alone, "
                             f"without other addresses")
    if "thinker" not in out:
        raise ValueError("--stages must name at least the thinker, e.g. thinker=127.0.0.1:50052")
    return out


def cmd_run_batch(ns: argparse.Namespace) -> int:
    from omnimesh.run_batch import run_batch

    try:
        args = from_namespace(ns)
        return run_batch(args, ns.input_file, ns.output_file, ns.url, ns.max_concurrency)
    except ValueError as exc:
        return _fail(str(exc))
    except RuntimeError as exc:
        print(f"omnimesh run-batch: error: {exc}", file=sys.stderr, flush=True)
        return 1


def cmd_make_tiny(ns: argparse.Namespace) -> int:
    if ns.family == "qwen2.5-omni" and ns.thinker_only:
        return _fail("--thinker-only: the tiny qwen2.5-omni model has no thinker-only variant (Qwen2.5-Omni "
                     "ships none); drop the flag")
    try:  # a path that is a file, or under one that cannot be made: said, not a traceback
        if ns.family == "qwen2.5-omni":
            from omnimesh.models.qwen2_5_omni.tiny import build_tiny_qwen2_5_omni

            out = build_tiny_qwen2_5_omni(Path(ns.out), seed=ns.seed)
        else:
            from omnimesh.models.qwen3_omni.tiny import build_tiny_qwen3_omni

            out = build_tiny_qwen3_omni(Path(ns.out), seed=ns.seed, audio_output=not ns.thinker_only)
    except (OSError, ValueError) as exc:
        return _fail(f"--out {ns.out}: cannot write the model there ({exc})")
    print(out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnimesh", description="Serve omni multimodal models as a mesh of gRPC stages.")
    parser.add_argument("--version", action="version", version=f"omnimesh {importlib.metadata.version('omnimesh')}")
    parser.add_argument("--log-level", default=os.environ.get(LEVEL_ENV, "INFO"),
                        help=f"{', '.join(LEVELS)}: every process the command starts logs at it (default: "
                             f"${LEVEL_ENV}, else INFO; a --log-config-file decides it instead)")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start every stage and the gateway on this host")
    add_arguments(serve)
    add_config_flag(serve)
    serve.set_defaults(func=cmd_serve)

    stage = sub.add_parser("stage", help="start one stage service")
    stage.add_argument("stage_name", choices=STAGES)
    add_arguments(stage, exclude=STAGE_EXCLUDED)
    add_config_flag(stage)
    stage.add_argument("--model", default=None, help="model folder (default: the built-in tiny model)")
    stage.add_argument("--host", dest="stage_host", default="127.0.0.1", help="address the stage listens on")
    stage.add_argument("--port", dest="stage_port", type=int, default=None, help="port (default: 50051 + stage index; 0 = any free port)")
    stage.set_defaults(func=cmd_stage)

    gw = sub.add_parser("gateway", help="start the gateway against running stages")
    add_arguments(gw, only=GATEWAY_FIELDS)
    add_config_flag(gw)
    gw.add_argument("--model", default=None, help="model folder: tokenizer and processor (default: the built-in tiny model)")
    gw.add_argument("--stages", required=True, help="NAME=HOST:PORT,... for encoder, thinker, talker, vocoder; "
                    "name a stage again for each of its replicas (vocoder=A:P,vocoder=B:P), or once by a DNS name "
                    "whose every address is a replica (vocoder=dns:///omnimesh-vocoder:50054, a Kubernetes headless "
                    "Service); each request goes to the least busy replica")
    gw.set_defaults(func=cmd_gateway)

    plan = sub.add_parser("plan", help="print each stage's weights and KV cache per rank against its devices' memory, "
                          "and a pp / tp that fits; starts nothing (exit 0: everything fits, 2: not)")
    add_arguments(plan)
    add_config_flag(plan)
    plan.add_argument("--device-memory", default=None, help="memory of each device, e.g. 80GiB, instead of each CUDA "
                      "device's own (with --device cpu: instead of the host's RAM); plans for another machine")
    plan.add_argument("--num-devices", type=int, default=None, help="CUDA devices per host (default: those visible; "
                      "8 when none is and --device-memory is given)")
    plan.set_defaults(func=cmd_plan)

    batch = sub.add_parser("run-batch", help="answer an OpenAI batch file (JSONL of chat / completion / responses "
                           "requests) with a mesh started for it, or the server at --url, as vLLM's run-batch")
    # the mesh it starts listens on loopback ports of its own, plain http: no front flags of a served gateway
    add_arguments(batch, exclude=HTTP_FRONT_FIELDS | {"host", "port", "grpc_port", "stage_base_port"})
    add_config_flag(batch)
    batch.add_argument("-i", "--input-file", required=True, help="the batch file, one request per line: "
                       "{\"custom_id\", \"method\": \"POST\", \"url\": \"/v1/chat/completions\", \"body\"}; - for stdin")
    batch.add_argument("-o", "--output-file", required=True, help="where the answers go, one line per request in the "
                       "input's order (OpenAI's batch output format); - for stdout")
    batch.add_argument("--url", default=None, help="send the requests to this running server (e.g. "
                       "http://127.0.0.1:8000) instead of starting a mesh")
    batch.add_argument("--max-concurrency", type=int, default=64, help="requests in flight at once (default: 64)")
    batch.set_defaults(func=cmd_run_batch)

    tiny = sub.add_parser("make-tiny", help="write the built-in tiny random-weight model folder")
    tiny.add_argument("--family", default="qwen3-omni", choices=("qwen3-omni", "qwen2.5-omni"))
    tiny.add_argument("--out", required=True)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--thinker-only", action="store_true",
                      help="the thinker-only variant (enable_audio_output false, no talker or vocoder weights), as "
                           "Qwen3-Omni-30B-A3B-Thinking is laid out: text out only")
    tiny.set_defaults(func=cmd_make_tiny)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    apply_config(parser, sys.argv[1:] if argv is None else argv)  # --config FILE: its flags as defaults
    ns = parser.parse_args(argv)
    ns.own_process = argv is None  # the command line of this process (not an in-process call)
    config = getattr(ns, "log_config_file", None)
    try:
        level = check_level(ns.log_level)
        setup_logging(level, config)
    except ValueError as exc:
        parser.error(str(exc))
    if ns.own_process:  # the processes it starts (stages, gateway, ranks) log the same way
        os.environ[LEVEL_ENV] = level
        if config:
            os.environ[CONFIG_ENV] = str(Path(config).resolve())
    try:
        return ns.func(ns)
    except KeyboardInterrupt:  # Ctrl-C reaches every process of the group: each stops quietly, no traceback
        return 130


if __name__ == "__main__":
    sys.exit(main())
