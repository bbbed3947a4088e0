"""StageMesh: the gateway's view of the stages — each stage's replicas, what they serve, how their tensors
travel — and which replicas one request uses.

Data flow: `connect()` reads every replica's Info (bounded wait; gateway/replicas.py) -> the settings the
requests need from the stages (voices, sample rate, the vocoder's windows) -> each producer replica's
output transport to each consumer host (`choose_transports`, `mode`: shm / CUDA IPC between co-located
replicas, gRPC frames across hosts) -> an upkeep task for as long as the gateway serves (late and
DNS-discovered replicas adopted, retired ones dropped). Per request `plan()` leases one replica of each
stage it needs: the thinker's least busy one, the others preferring the host of the stage they exchange
tensors with.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine, Mapping, Sequence

import grpc

from gateway.events import PipelineError
from gateway.replicas import Lease, NoReplica, Replica, ReplicaSet
from omnimesh.models.qwen3_omni.code_windows import windows_text
from omnimesh.transport.host_id import host_id
from omnimesh.transport.stage_client import StageClient
from omnimesh.transport.transport import choose_transport

log = logging.getLogger(__name__)

REPLICA_GRACE_S = 10.0  # at start-up, how long replicas may lag once every stage has one answering
WAIT_NOTE_S = 15.0  # at start-up, how often the log names the stages the gateway still waits for
LATE_REPLICA_POLL_S = 2.0  # how often a replica that has not answered yet is asked again
# producer -> consumer of every stage edge (the vocoder's pcm is read by the gateway itself)
EDGES = (("encoder", "thinker"), ("thinker", "talker"), ("talker", "vocoder"), ("vocoder", "gateway"))


def unavailable(message: str) -> PipelineError:
    return PipelineError(message, http_status=503, grpc_code=grpc.StatusCode.UNAVAILABLE.value[0],
                         kind="service_unavailable")


class StageMesh:
    def __init__(self, stages: Mapping[str, StageClient | Sequence[StageClient]]) -> None:
        self.stages = {name: ReplicaSet(name, [c] if isinstance(c, StageClient) else list(c))
                       for name, c in stages.items()}
        self.host_id = host_id()  # where the vocoder's pcm is read: this process's host
        self.voices: tuple[str, ...] = ()
        self.default_voice = ""
        self.sample_rate = 24000
        self.talker_options: dict[str, str] = {}  # the talker's output chunks = the vocoder's decode windows
        self.eager_tokens = 1  # thinker tokens sent one by one before --stream-interval applies
        # each stage's output transport over its replica pairs ("mixed" when they differ); per request: `mode`
        self.output_transport: dict[str, str] = {name: "grpc" for name in stages}
        self._modes: dict[tuple[str, int, str], str] = {}  # (stage, replica, consumer host) -> transport
        self._edges_logged: set[tuple[str, str]] = set()
        self.background: set[asyncio.Task] = set()

    async def connect(self, timeout_s: float = 60.0, late_grace_s: float = REPLICA_GRACE_S) -> None:
        """Read every replica's Info (voices, sample rate, windows, host), waiting up to `timeout_s` for each
        stage to have one that answers; replicas still silent `late_grace_s` after that are adopted later,
        in the background, when they come up."""
        deadline = time.monotonic() + timeout_s
        all_up_by: float | None = None
        next_note = time.monotonic() + WAIT_NOTE_S
        while True:
            for rs in self.stages.values():
                await rs.refresh(timeout_s=2.0)
            waiting = [rs for rs in self.stages.values() if not rs.known()]
            for rs in waiting:  # every address answered as another stage: waiting would not change that
                if rs.active() and all(r.refused is not None for r in rs.active()):
                    raise RuntimeError(f"stage {rs.stage}: " + "; ".join(str(r.refused) for r in rs.active())
                                       + f"; check the stage addresses (--stages): none serves the {rs.stage}")
            now = time.monotonic()
            if not waiting:
                all_up_by = now + late_grace_s if all_up_by is None else all_up_by
                if all(r.info is not None for rs in self.stages.values() for r in rs.active()) or now > all_up_by:
                    break
            elif now > deadline:
                rs = waiting[0]
                raise RuntimeError(f"stage {rs.stage} did not answer within {timeout_s:.0f}s (--stage-start-timeout): "
                                   f"{rs.why_none()}")
            elif now >= next_note:  # a stage still loading its weights, or an address nobody serves: the log says
                next_note = now + WAIT_NOTE_S
                log.info("gateway: still waiting for the stages: %s; %.0f s left (--stage-start-timeout)",
                         "; ".join(rs.why_none() for rs in waiting), deadline - now)
            await asyncio.sleep(0.5)
        self._read_stage_settings()
        self.choose_transports()
        for r in (r for rs in self.stages.values() for r in rs.active() if r.info is None):
            log.warning("gateway: %s does not answer yet; it takes requests once it does", r.label)
        self.spawn(self._upkeep())

    def _read_stage_settings(self) -> None:
        talker = self.stages["talker"].reference_info() if "talker" in self.stages else None
        if talker is not None:
            self.voices = tuple(talker.speakers)
            self.default_voice = talker.speakers[0] if talker.speakers else ""
        info = self.stages["vocoder"].reference_info() if "vocoder" in self.stages else None
        if info is not None and info.sample_rate:
            self.sample_rate = info.sample_rate
        if info is not None and info.window_codes > 0:
            # the vocoder decodes nothing before a window is whole: the talker sends each window's codes as
            # one chunk instead of one message per code group, and no audio comes later for it
            windows = tuple(info.window_schedule) or (info.first_window_codes or info.window_codes, info.window_codes)
            self.talker_options = {"chunk_schedule": windows_text(windows)}
            # the talker's first window of codes reads the thinker's first `first` + 1 tokens: those leave
            # the thinker one by one whatever its --stream-interval, so the first audio never waits
            self.eager_tokens = windows[0] + 1

    async def _upkeep(self) -> None:
        """Every LATE_REPLICA_POLL_S, for as long as the gateway serves: replicas that have not answered yet
        (late starters, or new ones from DNS) are asked for their Info and adopted, unless one of their edges
        is impossible (a forced shm across hosts), which keeps them out of use; retired replicas that no
        request holds any more are dropped."""
        while True:
            await asyncio.sleep(LATE_REPLICA_POLL_S)
            try:
                await self._upkeep_once()
            except Exception:  # the upkeep must outlive any one bad round
                log.exception("gateway: replica upkeep failed; trying again in %.0f s", LATE_REPLICA_POLL_S)

    async def _upkeep_once(self) -> None:
        for rs in self.stages.values():
            await rs.prune()
            self._adopt(await rs.refresh())

    def _adopt(self, newcomers: list[Replica]) -> None:
        if not newcomers:
            return
        try:
            self.choose_transports()
        except RuntimeError as exc:
            for replica in newcomers:
                replica.refused = str(exc)
            log.error("gateway: %s; not using %s", exc, ", ".join(r.label for r in newcomers))
            return
        for replica in newcomers:
            log.info("gateway: %s answers now; it takes requests", replica.label)

    async def close(self) -> None:
        """Stop the upkeep and close every replica's channel."""
        for task in list(self.background):
            task.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)
        for rs in self.stages.values():
            await rs.close()

    def choose_transports(self) -> None:
        """Each producer replica's output transport to each consumer host, from its own setting and both ends'
        host ids (RuntimeError for an impossible pair: a forced shm across hosts)."""
        for producer, consumer in EDGES:
            if producer not in self.stages:
                continue
            if consumer == "gateway":
                hosts = [self.host_id]
            elif consumer in self.stages:
                hosts = sorted({r.host for r in self.stages[consumer].known()})
            else:
                continue  # no consumer stage: this stage's tensors go nowhere
            try:
                modes = {self.mode(r, host, consumer) for r in self.stages[producer].known() for host in hosts}
            except ValueError as exc:
                raise RuntimeError(str(exc)) from exc
            if modes:
                mode = modes.pop() if len(modes) == 1 else "mixed"
                if (producer, consumer) not in self._edges_logged or self.output_transport[producer] != mode:
                    self._edges_logged.add((producer, consumer))
                    log.info("edge %s -> %s: %s", producer, consumer, mode)
                self.output_transport[producer] = mode

    def mode(self, replica: Replica, consumer_host: str, consumer: str) -> str:
        """How `replica` sends its output to a consumer on `consumer_host` (ValueError when it cannot)."""
        key = (replica.stage, replica.index, consumer_host)
        mode = self._modes.get(key)
        if mode is None:
            info = replica.info
            assert info is not None  # only answered replicas are picked
            mode = choose_transport(replica.stage, info.transport or "grpc", info.host_id, info.device, consumer,
                                    consumer_host)
            self._modes[key] = mode
        return mode

    async def health(self) -> dict[str, bool]:
        """Per stage: True when at least one of its replicas serves."""
        return {name: any(states.values()) for name, states in (await self.health_detail()).items()}

    async def health_detail(self) -> dict[str, dict[str, bool]]:
        """Per stage, each replica's gRPC health by address."""
        names = list(self.stages)
        states = await asyncio.gather(*(self.stages[n].serving() for n in names))
        return dict(zip(names, states))

    def replicas(self, name: str) -> ReplicaSet:
        rs = self.stages.get(name)
        if rs is None:
            raise unavailable(f"this gateway has no {name} stage (start it and pass --stages {name}=HOST:PORT)")
        return rs

    def spawn(self, coro: Coroutine[object, object, None]) -> None:
        """Run `coro` in the background, kept alive until it ends (or `close`)."""
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def plan(self, encoder: bool, audio: bool, tried: Mapping[str, set[int]],
             keys: Mapping[str, bytes] | None = None) -> dict[str, Lease]:
        """The replicas one attempt at a request uses (`tried`: replicas per stage that failed it already):
        the thinker's least busy one, the others near the stage they exchange tensors with; `keys`: the
        request's content per stage, for the replicas that cache by content (gateway/replicas.py)."""
        leases: dict[str, Lease] = {}
        order: list[tuple[str, str | None]] = [("thinker", None)]
        if encoder:
            order.append(("encoder", "thinker"))
        if audio:
            order += [("talker", "thinker"), ("vocoder", "talker")]
        try:
            for name, near in order:
                host = leases[near].replica.host if near is not None else None
                leases[name] = self.replicas(name).pick(host, frozenset(tried.get(name, ())), (keys or {}).get(name))
        except (NoReplica, PipelineError) as exc:
            for lease in leases.values():
                lease.done(ok=False)
            raise exc if isinstance(exc, PipelineError) else unavailable(str(exc)) from exc
        return leases

