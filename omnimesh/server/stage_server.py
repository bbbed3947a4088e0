"""Runs one stage as a gRPC service: load the handler (the model part), then serve `Stage` until a signal.

Data flow: `run_stage(factory, host, port)` -> factory() loads weights (progress on the log) -> the
stage's Transport (its shm arena and which tensors go by reference, per --transport /
--shm-arena-size / --shm-min-tensor-size) -> EngineLoop + StageServicer (sharing one EngineMetrics,
served by the Metrics RPC) on a grpc.aio server (uvloop) with health and reflection -> prints
`omnimesh stage <name> listening on host:port` (the launcher waits for that line or for health) -> every
10 s while it has work, a load line (StatLogger, vLLM's; off with --disable-log-stats).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from grpc_health.v1 import health_pb2

from omnimesh.config.cpu_env import cpu_threads
from omnimesh.config.stage_config import SHM_MIN_TENSOR_BYTES
from omnimesh.engine.loop import EngineLoop
from omnimesh.engine.metrics import EngineMetrics
from omnimesh.engine.stat_logger import StatLogger, interval_from_env
from omnimesh.proc_utils import freeze_startup_heap, tune_malloc
from omnimesh.server.grpc_server import bind, listen_address, make_server, serve_forever
from omnimesh.server.grpc_decode import add_service
from omnimesh.server.stage_failure import StageFailure
from omnimesh.server.stage_servicer import StageHandler, StageServicer
from omnimesh.transport.shm_arena import DEFAULT_ARENA_BYTES
from omnimesh.transport.transport import Transport
from omnimesh.transport.transport_metrics import register_transport_metrics
from omnimesh.v1 import stage_pb2

log = logging.getLogger(__name__)

STAGE_DESCRIPTOR = stage_pb2.DESCRIPTOR.services_by_name["Stage"]
STAGE_SERVICE = STAGE_DESCRIPTOR.full_name


class StageStartRefused(Exception):
    """The stage's own start-up checks refused its settings or model folder (a ValueError while it loaded, e.g. a
    KV cache that cannot hold one max_model_len sequence): the message says what to change. `omnimesh stage`
    exits 2 with it, no traceback (--log-level DEBUG logs one); its ranks were stopped at exit. A ValueError
    from outside omnimesh's own code (a library's, which may be a bug rather than a setting) says where it was
    raised (`_origin`)."""


_OWN_CODE = tuple(Path(__file__).resolve().parents[2] / name for name in ("omnimesh", "services", "gateway"))


def _origin(exc: BaseException) -> str:
    """'' for an error raised in omnimesh's own code (its checks name the setting); else where it was raised,
    for a refusal that carries no traceback: ' (raised in transformers/configuration_utils.py:123 ...)'."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return ""
    path = Path(tb.tb_frame.f_code.co_filename).resolve()
    if any(path.is_relative_to(root) for root in _OWN_CODE):
        return ""
    parts = path.parts
    where = "/".join(parts[parts.index("site-packages") + 1:]) if "site-packages" in parts else path.name
    return f" (raised in {where}:{tb.tb_lineno} while the stage loaded; --log-level DEBUG shows the traceback)"


async def _serve(handler: StageHandler, host: str, port: int, transport: Transport, bulk_nice: int,
                 yield_steps: int, log_stats: bool = True) -> None:
    metrics = EngineMetrics(handler.name, model_name=handler.info().model)
    register_transport_metrics(metrics.registry, transport, metrics.labels)
    engine = EngineLoop(handler.name, max_inflight=getattr(handler, "max_inflight_steps", 1),
                        batcher=getattr(handler, "batcher", None), metrics=metrics, bulk_nice=bulk_nice,
                        yield_steps=yield_steps, preempt=getattr(handler, "preempt", False))
    engine.start()
    server, health_servicer = make_server([STAGE_SERVICE])
    add_service(server, StageServicer(handler, engine, metrics, transport), STAGE_DESCRIPTOR)
    bound = bind(server, host, port)
    loop = asyncio.get_running_loop()

    def not_serving(message: str) -> None:
        log.error("stage %s is NOT_SERVING: %s", handler.name, message)
        for name in ("", STAGE_SERVICE):
            asyncio.run_coroutine_threadsafe(
                health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING), loop)

    engine.on_crash = not_serving  # a dead engine loop: health says so, and the launcher restarts the stage
    failure: StageFailure | None = getattr(handler, "failure", None)
    if failure is not None:
        failure.listen(not_serving)  # a rank died
    print(f"omnimesh stage {handler.name} listening on {listen_address(host, bound)}", flush=True)
    stats = asyncio.get_running_loop().create_task(StatLogger(metrics, interval_from_env()).run()) if log_stats else None
    try:
        await serve_forever(server, health_servicer, [STAGE_SERVICE], on_stop=engine.stop)
    finally:
        if stats is not None:
            stats.cancel()
        transport.close()


def run_stage(factory: Callable[[], StageHandler], host: str, port: int, *, transport: str = "auto",
              shm_arena_size: int = DEFAULT_ARENA_BYTES, shm_min_tensor_size: int = SHM_MIN_TENSOR_BYTES,
              nice: int = 0, bulk_nice: int = 0, yield_steps: int = 0, log_stats: bool = True) -> None:
    """`nice`: lower this process's OS priority by that much first (its rank processes inherit it);
    `bulk_nice`: how much lower the steps with no request waiting for its first output run (EngineLoop).
    `yield_steps`: how many steps in a row a streaming request sits out for first outputs (EngineLoop).
    `log_stats`: the periodic load line (omnimesh/engine/stat_logger.py; off with --disable-log-stats)."""
    import torch
    import uvloop

    if nice:
        os.nice(nice)
        log.info("OS priority lowered by nice %d (the stage's `nice` setting; see --stage-overrides)", nice)
    torch.set_num_threads(cpu_threads())
    tune_malloc()
    t0 = time.monotonic()
    try:
        handler = factory()
        log.info("stage %s loaded in %.1fs", handler.name, time.monotonic() - t0)
        hand_off = Transport(handler.name, transport, shm_arena_size, shm_min_tensor_size)  # a bad setting stops start-up
    except ValueError as exc:
        log.debug("stage start-up refused", exc_info=True)
        raise StageStartRefused(f"{exc}{_origin(exc)}") from exc
    log.info("stage %s: %d start-up objects frozen out of the garbage collector's scans", handler.name,
             freeze_startup_heap())
    uvloop.run(_serve(handler, host, port, hand_off, bulk_nice, yield_steps, log_stats))
