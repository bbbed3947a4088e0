"""Stage name -> the service module that builds its handler (imported lazily, so a stage process
imports only its own service and model code).

Each service module exposes `build_handler(model_dir: Path, args: ServeArgs) -> StageHandler`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omnimesh.config.serve_args import ServeArgs
from omnimesh.models.model_config import resolve_dtype
from omnimesh.models.qwen3_omni.stage_loading import LMLayout, rank_factory
from omnimesh.parallel.mp_executor import ProgramFactory
from omnimesh.parallel.node_rendezvous import NodeSpec, model_fingerprint
from omnimesh.server.stage_failure import StageFailure
from omnimesh.server.stage_servicer import StageHandler

if TYPE_CHECKING:
    from omnimesh.models.qwen3_omni.lm_engine import LMEngine

SERVICES: dict[str, str] = {
    "encoder": "services.encoder.handler",
    "thinker": "services.llm.thinker_handler",
    "talker": "services.llm.talker_handler",
    "vocoder": "services.vocoder.handler",
}


def node_spec(args: ServeArgs, stage: str, model_dir: Path) -> NodeSpec | None:
    """This host's part in the stage when its ranks span several hosts (--num-nodes), else None."""
    cfg = args.stage_configs()[stage]
    if cfg.num_nodes == 1:
        return None
    return NodeSpec(stage=stage, num_nodes=cfg.num_nodes, node_rank=args.node_rank, model=model_fingerprint(model_dir),
                    dtype=str(resolve_dtype(args)).removeprefix("torch."), partition=cfg.pp_layer_partition,
                    timeout_s=args.rendezvous_timeout, model_dir=str(model_dir), load_format=args.load_format)


def lm_layout(args: ServeArgs, stage: str, failure: StageFailure, model_dir: Path) -> LMLayout:
    """The stage's pp x tp ranks from the flags (-tp/-pp, --stage-overrides, --num-nodes, --master-*). On CUDA a
    host's ranks take the stage's `devices` in order, else that host's devices 0, 1, ..."""
    cfg = args.stage_configs()[stage]
    cuda = args.device == "cuda"
    nodes = node_spec(args, stage, model_dir)
    devices = cfg.device_list() or ([str(i) for i in range(cfg.ranks_per_node)] if nodes is not None else [])
    return LMLayout(pp=cfg.pp, tp=cfg.tp, partition=cfg.pp_layer_partition,
                    backend="nccl" if cuda else "gloo", master_addr=args.master_addr,
                    master_port=args.master_port, on_failure=failure.report,
                    devices=tuple(f"cuda:{d}" for d in devices) if cuda else (), nodes=nodes,
                    executor=args.distributed_executor_backend, ray_address=args.ray_address,
                    load_format=args.load_format)


def rank_program(args: ServeArgs, stage: str, model_dir: Path) -> ProgramFactory:
    """What each of the stage's ranks runs (the same factory the stage's own load hands its executor)."""
    from omnimesh.models.loader import with_load_format

    factory = rank_factory(stage, model_dir, resolve_dtype(args), args.stage_configs()[stage].pp_layer_partition)
    return with_load_format(factory, args.load_format)


def lm_engine(backend: Any, stage: str, args: ServeArgs, max_model_len: int,
              capture_layer: int | None = None) -> LMEngine:
    """The stage's continuous-batching engine over its ranks: KV pool sized from --kv-cache-memory (CPU
    default 4 GiB per rank) or, on CUDA, from --gpu-memory-utilization; scheduling and admission limits
    (--max-num-seqs, --max-num-batched-tokens, --max-waiting-requests) from the flags."""
    from omnimesh.models.qwen3_omni.lm_engine import LMEngine
    from omnimesh.models.qwen3_omni.paged_kv import CPU_KV_CACHE_BYTES

    cfg = args.stage_configs()[stage]
    kv_bytes = cfg.kv_cache_memory
    if kv_bytes is None and args.device != "cuda":
        kv_bytes = CPU_KV_CACHE_BYTES
    return LMEngine(backend, role=stage, block_size=args.block_size, kv_bytes=kv_bytes,
                    gpu_memory_utilization=cfg.gpu_memory_utilization, max_num_seqs=cfg.max_num_seqs,
                    max_num_batched_tokens=cfg.max_num_batched_tokens, max_model_len=max_model_len,
                    capture_layer=capture_layer, max_waiting_requests=cfg.max_waiting_requests,
                    scheduling_policy=cfg.scheduling_policy,
                    # only the thinker's rows have token ids to key a cache by (the talker's are the thinker's hidden)
                    enable_prefix_caching=cfg.enable_prefix_caching and stage == "thinker",
                    kv_cache_dtype=cfg.kv_cache_dtype, enable_chunked_prefill=cfg.enable_chunked_prefill)


def handler_factory(stage: str, model_dir: Path, args: ServeArgs) -> Callable[[], StageHandler]:
    module = importlib.import_module(SERVICES[stage])
    return partial(module.build_handler, model_dir, args)
