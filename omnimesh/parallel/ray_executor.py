"""RayExecutor: a stage's ranks 1..N-1 as Ray actors (`--distributed-executor-backend ray`), rank 0 in the server.

Role: the same executor as MpExecutor (commands to every rank in lock-step over torch.distributed, results from
the owner rank, pipelined submits, a lost rank fails the stage) with Ray deciding where the worker ranks run:
on the nodes of a running Ray cluster (`--ray-address HOST:PORT`, or `auto` for the cluster of this host), or
on a Ray instance this process starts for itself when no address is given. Only process placement and life
changes; what a rank runs is rank_worker.setup_rank + serve_commands, as in a spawned process.

Data flow:
    connect (ray.init, bounded by the rendezvous timeout)
    -> placement group: one bundle per worker rank ({"CPU": 1}, or {"GPU": 1, "CPU": 1} for NCCL), packed
       (bounded: a cluster that cannot place them is an error naming what it has free)
    -> actor r: prepare(rank r, the rendezvous, the factory: unpickled there, its device taken); start() =
       setup_rank; then serve() = serve_commands
    -> once every prepare returned (an error or a dead actor fails the start here, named), rank 0 joins the same
       rendezvous; the actors' start results are the "ready" signals
    -> a monitor thread waits on every actor's serve(): one that ends (its actor died, its node went away,
       an error) before shutdown fails the stage with the rank, node and pid named
    -> shutdown: STOP over the process group, wait for the serve() calls, kill the actors, free the group.

Rendezvous address: 127.0.0.1 with a Ray instance of our own (every rank is on this host); with a cluster,
this node's address as Ray sees it unless --master-addr names one. On CUDA, Ray gives each worker rank one GPU
(its CUDA_VISIBLE_DEVICES, so the rank uses cuda:0); rank 0 keeps the stage's first device (cuda:0 without
`devices`), and an instance of our own is told only about the stage's other devices (cuda:1 onwards without
them, each read through this process's CUDA_VISIBLE_DEVICES), so Ray never hands rank 0's GPU to a worker.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from omnimesh.config.serve_args import RAY_MISSING
from omnimesh.log_setup import log_config_from_env
from omnimesh.parallel.mp_executor import MpExecutor
from omnimesh.parallel.parallel_state import select_device
from omnimesh.parallel.rank_worker import ProgramFactory, RankFailure, Rendezvous, serve_commands, setup_rank
from omnimesh.proc_utils import free_port

log = logging.getLogger(__name__)

OBJECT_STORE_BYTES = 128 << 20  # an instance of our own: commands travel over torch.distributed, not Ray objects


def import_ray() -> Any:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # Ray reports usage to its makers unless told not to
    try:
        import ray
    except ImportError:
        raise RankFailure(RAY_MISSING) from None
    return ray


class _RankActor:
    """One worker rank inside a Ray actor: `prepare` takes its arguments (the factory unpickled here) and its device,
    `start` joins the process group and builds the program, `serve` takes the driver's commands until STOP (Ray
    runs one caller's calls in order). The driver joins the rendezvous only after every `prepare` returned, so an
    actor that cannot start fails the stage at once with its own error."""

    def prepare(self, rank: int, pp: int, tp: int, rdzv: Rendezvous, factory: ProgramFactory, threads: int,
                log_level: int, device: str | None, log_config: dict | None = None) -> tuple[str, int]:
        import torch

        from omnimesh.log_setup import setup_logging

        setup_logging(logging.getLevelName(log_level), config=log_config)  # the config's content: hosts differ
        torch.set_num_threads(threads)
        select_device(rank, rdzv.backend, device or rdzv.device(rank))
        self.args = (rank, pp, tp, rdzv, factory, device)
        self.rank = rank
        return import_ray().util.get_node_ip_address(), os.getpid()

    def start(self) -> None:
        if not hasattr(self, "args"):  # `prepare` failed (its error fails the stage): nothing to start, no 2nd error
            return
        self.state = setup_rank(*self.args)

    def serve(self) -> None:
        if not hasattr(self, "state"):  # `prepare` or `start` failed: the driver reports that one; nothing to serve
            return
        serve_commands(self.rank, *self.state)


def worker_gpus(devices: tuple[str, ...], world: int) -> tuple[str, ...]:
    """The devices of worker ranks 1..world-1 on CUDA: the stage's own after rank 0's first, else cuda:1 onwards
    (rank 0 takes cuda:0 by default, so a Ray instance told of every GPU would hand it to a worker too: NCCL then
    fails with "Duplicate GPU detected")."""
    return devices[1:] if devices else tuple(f"cuda:{rank}" for rank in range(1, world))


def visible_ids(devices: tuple[str, ...], visible: str | None) -> list[str]:
    """CUDA_VISIBLE_DEVICES for `devices` (cuda:N): N indexes the devices this process sees, so under a
    CUDA_VISIBLE_DEVICES of its own (`visible`, e.g. "4,5,6,7") cuda:1 is the entry at 1 ("5"), not GPU 1."""
    ids = [d.split(":", 1)[1] for d in devices if d.startswith("cuda:")]
    seen = [v.strip() for v in visible.split(",") if v.strip()] if visible else None
    if seen is None:
        return ids
    if bad := [i for i in ids if int(i) >= len(seen)]:
        raise ValueError(f"device(s) cuda:{', cuda:'.join(bad)} are not among the {len(seen)} this process sees "
                         f"(CUDA_VISIBLE_DEVICES={visible}); give the stage's devices as indices into that list")
    return [seen[int(i)] for i in ids]


@contextlib.contextmanager
def _visible_gpus(devices: tuple[str, ...]) -> Iterator[None]:
    """While a Ray instance of our own starts: it sees only `devices` (cuda:N), so it assigns only those."""
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible_ids(devices, before)
    if ids:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
    try:
        yield
    finally:
        if ids:
            if before is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = before


def connect(address: str | None, timeout_s: float, workers: int = 1, worker_devices: tuple[str, ...] = ()) -> Any:
    """This process's Ray connection (made once): the cluster at `address`, or an instance of our own that
    offers at least `workers` CPUs (as mp, it may put more ranks than cores on this host) and only the GPUs in
    `worker_devices`. Bounded: a cluster that does not answer within `timeout_s` is an error saying what to check."""
    ray = import_ray()
    if ray.is_initialized():
        return ray
    kwargs: dict[str, Any] = {"configure_logging": False, "log_to_driver": True}
    if address:
        kwargs["address"] = address
    else:
        kwargs.update(address="local", include_dashboard=False, num_cpus=max(os.cpu_count() or 1, workers),
                      object_store_memory=OBJECT_STORE_BYTES)  # "local": never an instance someone else started
    outcome: dict[str, BaseException | None] = {}
    done = threading.Event()

    def run() -> None:
        try:
            with _visible_gpus(() if address else worker_devices):
                ray.init(**kwargs)
            outcome["error"] = None
        except BaseException as exc:  # reported by the caller
            outcome["error"] = exc
        done.set()
        if outcome["error"] is None and not address:
            # Ray starts its own processes (GCS, raylet) with PR_SET_PDEATHSIG, which fires when the THREAD that
            # started them ends: this one stays, parked, for as long as the process lives.
            threading.Event().wait()

    where = f"the Ray cluster at {address}" if address else "a Ray instance of its own"
    log.info("connecting to %s (--distributed-executor-backend ray)", where)
    thread = threading.Thread(target=run, name="omnimesh-ray-connect", daemon=True)
    thread.start()
    done.wait(timeout_s)
    if "error" not in outcome:
        raise RankFailure(f"could not reach {where} within {timeout_s:.0f}s: check that `ray start --head` runs "
                          "there, that its port is open from this host, and that this host has the cluster's auth "
                          "token (RAY_AUTH_TOKEN) when the cluster uses one")
    if outcome["error"] is not None:
        exc = outcome["error"]
        if "InvalidAuthToken" in str(exc) or "Authentication token" in str(exc):
            raise RankFailure(f"{where} refused this host's Ray auth token: the cluster uses token authentication; "
                              "set RAY_AUTH_TOKEN to the cluster's token (docs.ray.io, ray-security/token-auth)") from exc
        first = (str(exc).strip().splitlines() or [""])[0]
        raise RankFailure(f"could not start or reach {where}: {type(exc).__name__}: {first}") from exc
    return ray


def _cause(exc: BaseException) -> str:
    """A Ray error -> the one line that says what went wrong on the actor."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        exc = cause
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}".rstrip(": ")


class RayExecutor(MpExecutor):
    def __init__(self, pp: int, tp: int, factory: ProgramFactory, *, ray_address: str | None = None,
                 **executor_args: Any):
        if executor_args.get("nodes") is not None:
            raise ValueError("--num-nodes places ranks with --distributed-executor-backend mp; with ray the "
                             "cluster places them: drop --num-nodes/--node-rank and start the stage on one node")
        super().__init__(pp, tp, factory, **executor_args)
        self.ray_address = ray_address
        self.ray: Any = None
        self.actors: dict[int, Any] = {}
        self.placement: Any = None
        self.where: dict[int, tuple[str, int]] = {}  # rank -> (node address, pid)
        self._serving: dict[Any, int] = {}  # serve() call -> rank

    def _spawn_ranks(self) -> Any:
        nccl = self.rdzv.backend == "nccl"
        ray = self.ray = connect(self.ray_address, self.rdzv.timeout_s, self.world - 1,
                                 worker_gpus(self.rdzv.devices, self.world) if nccl else ())
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if self.ray_address and self.rdzv.master_addr in ("127.0.0.1", "localhost"):
            host = ray.util.get_node_ip_address()  # worker ranks may run on other nodes: they dial this one
            self.rdzv = replace(self.rdzv, master_addr=host, master_port=free_port(host))
        bundle = {"GPU": 1, "CPU": 1} if nccl else {"CPU": 1}
        workers = self.world - 1
        self.placement = placement_group([dict(bundle)] * workers, strategy="PACK")
        ready, _ = ray.wait([self.placement.ready()], timeout=self.rdzv.timeout_s)
        if not ready:
            free, total = ray.available_resources(), ray.cluster_resources()
            raise RankFailure(
                f"the Ray cluster could not place this stage's {workers} worker rank(s) ({bundle} each) within "
                f"{self.rdzv.timeout_s:.0f}s: it has CPU {free.get('CPU', 0):g} / GPU {free.get('GPU', 0):g} free "
                f"of CPU {total.get('CPU', 0):g} / GPU {total.get('GPU', 0):g}; add nodes or lower pp x tp")
        actor_cls = ray.remote(_RankActor)
        prepares: dict[Any, int] = {}
        starts: dict[Any, int] = {}
        level = logging.getLogger().getEffectiveLevel()
        log_config = log_config_from_env()  # --log-config-file, read here: the actor's host may not have the file
        for rank in range(1, self.world):
            actor = actor_cls.options(
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), name=None, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement,
                                                                    placement_group_bundle_index=rank - 1),
            ).remote()
            self.actors[rank] = actor
            prepares[actor.prepare.remote(rank, self.pp, self.tp, self.rdzv, self.factory, self.threads, level,
                                          "cuda:0" if nccl else None, log_config)] = rank
            starts[actor.start.remote()] = rank
            self._serving[actor.serve.remote()] = rank  # queued behind start on the same actor
        return prepares, starts

    def _await_ranks(self, ready: Any, joining: bool) -> None:
        """As MpExecutor's, over the actors' `prepare` calls (`joining`) or their `start` calls."""
        pending: dict[Any, int] = dict(ready[0] if joining else ready[1])
        deadline = time.monotonic() + self.rdzv.timeout_s
        while pending:
            done, _ = self.ray.wait(list(pending), num_returns=len(pending), timeout=0.2)
            for ref in done:
                rank = pending.pop(ref)
                try:
                    result = self.ray.get(ref)
                except Exception as exc:
                    raise RankFailure(f"rank {rank} failed to start: {_cause(exc)}") from None
                if joining:
                    self.where[rank] = result
            if pending and time.monotonic() > deadline:
                what = "reach the rendezvous" if joining else "start"
                raise RankFailure(f"ranks {sorted(pending.values())} did not {what} within "
                                  f"{self.rdzv.timeout_s:.0f}s") from None

    def _describe(self, rank: int) -> str:
        node, pid = self.where.get(rank, ("?", 0))
        return f"rank {rank} (Ray actor on node {node}, pid {pid})"

    def _monitor(self) -> None:
        while self._serving and not self._stopping:
            try:
                done, _ = self.ray.wait(list(self._serving), num_returns=1, timeout=0.5)
            except Exception as exc:  # Ray itself went away (its instance died, the cluster is unreachable)
                if not self._stopping:
                    self._fail(f"lost Ray, which runs ranks {sorted(self._serving.values())}: {_cause(exc)}")
                return
            for ref in done:
                rank = self._serving.pop(ref)
                if self._stopping:
                    return
                try:
                    self.ray.get(ref)
                    why = "stopped taking commands"
                except Exception as exc:
                    why = f"ended: {_cause(exc)}"
                self._fail(f"{self._describe(rank)} {why}")

    def _join_ranks(self, deadline: float) -> None:
        if self.ray is None:
            return
        if self._serving:
            with contextlib.suppress(Exception):
                self.ray.wait(list(self._serving), num_returns=len(self._serving),
                              timeout=max(0.0, deadline - time.monotonic()))
        for actor in self.actors.values():
            with contextlib.suppress(Exception):
                self.ray.kill(actor, no_restart=True)
        if self.placement is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self.placement)
        self.actors, self._serving, self.placement = {}, {}, None

    @property
    def pids(self) -> dict[int, int]:
        return {0: os.getpid(), **{rank: pid for rank, (_, pid) in self.where.items()}}
