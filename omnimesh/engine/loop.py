"""EngineLoop: steps every in-flight request of a stage, interleaved, on its compute thread(s).

Data flow: the servicer `submit`s a task and gets an asyncio queue of `EngineEvent`s; input chunks
arrive through `feed` and are handed to the task between steps; each pass of the loop gives every ready
task one `step` (round-robin), so a long request never blocks a short one for more than one step.
Outputs are put on the request's queue in order (the servicer numbers them as they leave), followed by one
`EngineDone` or `EngineFailed`. Steps run on compute threads: one by default; a pipeline-parallel stage
allows `max_inflight` = pp steps at once, each on its own thread, so every pipeline rank has work.

Continuous batching: a stage with a `BatchStepper` gets every ready request (split over the free
compute slots) in one `step_batch` call per step; requests join and leave between steps, and the
stepper decides which of them run (token budget, KV-cache blocks). A slot frees -> the next step starts
with whatever is ready then, so new requests never wait for older ones to finish. A `LaneStepper` plans
the steps itself (`lanes`): the vocoder keeps a second slot for first windows only, so a new request's
first audio starts beside a long step of other requests' windows instead of after it.

First outputs first (`yield_steps` > 0, a batcher without lanes: the thinker and talker): while some ready
requests wait for their first output (`StageTask.urgent`) and others already stream, a step carries the
waiting ones alone: on a CPU (and at small batches on a GPU) a step's cost is mostly fixed per op, so such a
step takes about what one request costs, and the first audio does not wait for every stream's token. A
streaming request sits out at most `yield_steps` steps in a row, then rides along with the next one, so a
stream of new requests never stops the others.

Priorities (`bulk_nice` > 0, on Linux): a step with a request in it that still waits for its first output
(`StageTask.urgent`: a new prompt, the thinker tokens the talker's first codes need, the talker's first
codes, the vocoder's first window) runs on a compute thread at the stage's own OS priority; a step without
one runs on a "bulk" thread that lowered its own priority by `bulk_nice`. On cores shared by the stages a
new request's first audio then goes ahead of the work of requests already streaming. A request whose
playback deadline is near (`StageTask.behind`: the audio a client already has runs out soon) also keeps its
steps at the stage's priority, without stepping alone. With one step in
flight at a time (`max_inflight` 1) the two threads take turns: a lock keeps a step and a request's
`close` (which frees model state) from ever running at once.

Urgent steps overtake (`preempt`, a stage in one process with `max_inflight` 2): a step with a pressing request
in it starts at once beside a bulk step in flight, and the bulk step waits at its model's next checkpoint
(between decoder layers, code-predictor steps, conv blocks; `StepGate`) until no pressing step runs, for at
most `StepGate.max_pause_s` per step. Without a batcher that plans its own `lanes` (the thinker, the talker),
the engine keeps the second slot for such steps: a step's worth of requests when nothing is in flight, a
step of the pressing ones beside a bulk step, nothing beside a pressing one (the next joins it when it ends).

Metrics (optional `EngineMetrics`): each request's `RequestTiming` hears its submit, first readiness,
first step, every step with output and its end; each step gives its size and wall time, and whether a
request in it waited for its first output; the load gauges read `_load` (the batcher's `stats()` when it
has one) at scrape time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import grpc
import torch

from omnimesh.engine.task import StageRequestError, StageTask
from omnimesh.parallel.mp_executor import RankFailure
from omnimesh.engine.bulk_lane import BulkLane
from omnimesh.engine.step_gate import StepGate
from omnimesh.proc_utils import name_thread, thread_priority_is_own
from omnimesh.transport.frames import StageChunk

if TYPE_CHECKING:
    from omnimesh.engine.metrics import EngineMetrics, RequestTiming, Stats

log = logging.getLogger(__name__)

MAX_WAIT_S = 3600.0  # the loop wakes at least this often, whatever deadline its requests carry


@dataclass(slots=True)
class EngineDone:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens the prefix cache served
    stop_reason: str | int | None = None  # the task's (vLLM's stop_reason)


@dataclass(slots=True)
class EngineFailed:
    code: grpc.StatusCode
    message: str


EngineEvent = StageChunk | EngineDone | EngineFailed


class BatchStepper(Protocol):
    """A stage that steps many requests in one call (continuous batching); the engine loop's alternative to
    calling each task's own `step`."""

    def step_batch(self, tasks: list[StageTask]) -> dict[str, list[StageChunk] | BaseException]:
        """Called on a compute thread with ready tasks, none of them in another step in flight. Returns, per
        request id that was stepped, its output chunks (the task's `finished` and counters updated as in
        `StageTask.step`) or the exception that ends that request alone. A request left out made no
        progress this step (it stays ready: the batch was full). An exception raised by the call itself
        fails every task given to it."""
        ...


class LaneStepper(BatchStepper, Protocol):
    """A batch stepper that decides itself which ready requests start a step now (e.g. a latency lane)."""

    def lanes(self, tasks: list[StageTask], free: int, busy: int) -> list[list[StageTask]] | None:
        """On the asyncio thread, with the ready tasks (longest-waiting first), the free compute slots and the
        steps in flight: the batches to start now, at most `free` (none: wait for a step to end); None: the
        engine's own split."""
        ...


@dataclass(slots=True)
class _Entry:
    task: StageTask
    queue: asyncio.Queue
    deadline: float  # time.monotonic() value; inf = none
    whole_input: bool  # hold inputs until the final chunk is in (--no-async-chunk)
    inbox: list[StageChunk] = field(default_factory=list)
    inflight: asyncio.Future | None = None  # the step running on a compute thread
    last_step: int = 0  # number of the step that last included it (round-robin: the longest-waiting first)
    waits_seat: bool = False  # its last step left it out (the batcher had no room for it): no first-output step alone
    timing: RequestTiming | None = None  # metrics only


class EngineLoop:
    def __init__(self, name: str, max_inflight: int = 1, batcher: BatchStepper | None = None,
                 metrics: EngineMetrics | None = None, bulk_nice: int = 0, yield_steps: int = 0,
                 preempt: bool = False):
        """`max_inflight` > 1 lets that many steps run at once (a pipeline-parallel stage keeps each of its
        pp ranks busy with a different request or batch); one request never has two steps in flight.
        With a `batcher`, each step is one `step_batch` call over many ready requests. `metrics` records
        latencies, tokens and load. `bulk_nice` > 0: steps with no urgent request run that much lower (nice
        increment) than the others. `yield_steps` > 0: requests waiting for their first output step alone,
        and a streaming request sits out at most that many steps in a row (see the module doc). `preempt` (a
        stage in one process, `max_inflight` 2): urgent steps overtake bulk ones (see the module doc)."""
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        if not 0 <= bulk_nice <= 19:
            raise ValueError(f"bulk_nice must be from 0 to 19, got {bulk_nice}")
        if yield_steps < 0:
            raise ValueError(f"yield_steps must be >= 0 (0: every step carries every ready request), got {yield_steps}")
        if preempt and max_inflight != 2:
            raise ValueError("preempt needs max_inflight 2 (a slot for bulk steps, one for urgent ones)")
        self.name = name
        self._gate = StepGate() if preempt else None
        self._lane = preempt and getattr(batcher, "lanes", None) is None  # the engine plans the urgent slot
        self._pressing_inflight = 0  # steps in flight with a pressing request in them
        self._yield_steps = yield_steps
        self._max_inflight = max_inflight
        self._batcher = batcher
        self._entries: dict[str, _Entry] = {}
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=max_inflight, thread_name_prefix=f"{name}-compute",
                                            initializer=name_thread, initargs=(f"{name}-compute",))
        self._bulk: BulkLane | None = None
        if bulk_nice and not thread_priority_is_own():
            log.warning("%s: bulk_nice %d is ignored: per-thread priorities need Linux", name, bulk_nice)
        elif bulk_nice:
            self._bulk = BulkLane(name, bulk_nice, max_inflight)
            log.info("%s: steps in which no request waits for its first output run at nice +%d", name, bulk_nice)
        # one step at a time across both executors: a close (frees KV blocks) never overlaps a step
        self._serial = threading.Lock() if max_inflight == 1 and self._bulk is not None else None
        self._runner: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: str | None = None  # why the loop died (a bug): every request since is refused
        self.on_crash: Callable[[str], None] | None = None  # told once if the loop dies (the stage: NOT_SERVING)
        self._closed = False
        self._steps = 0
        self._metrics = metrics
        if metrics is not None:
            metrics.bind_stats(self._load)

    @property
    def num_requests(self) -> int:
        return len(self._entries)

    def _load(self) -> Stats:
        """The load gauges: every request here is running, unless the batcher's `stats()` says otherwise (and
        what else it counts)."""
        stats = getattr(self._batcher, "stats", None)
        return {"running": len(self._entries), "waiting": 0, **(stats() if stats is not None else {})}

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._runner = self._loop.create_task(self._run(), name=f"{self.name}-engine")
        self._runner.add_done_callback(self._runner_ended)

    def _runner_ended(self, runner: asyncio.Task) -> None:
        """The loop must not die, and never silently: a stage whose loop stopped would take requests and answer
        none while its health said SERVING. Should a bug end it, its requests fail, later ones are refused, and
        `on_crash` hears why (the stage turns NOT_SERVING, so its launcher or Kubernetes restarts it)."""
        if runner.cancelled() or runner.exception() is None:
            return
        exc = runner.exception()
        self._stopped = f"{type(exc).__name__}: {exc}"
        log.critical("%s: the engine loop stopped: %s", self.name, self._stopped, exc_info=exc)
        for rid in list(self._entries):
            self._finish(rid, EngineFailed(grpc.StatusCode.UNAVAILABLE,
                                           f"stage {self.name}'s engine stopped ({self._stopped})"))
        if self.on_crash is not None:
            self.on_crash(f"its engine loop stopped ({self._stopped})")

    async def stop(self) -> None:
        if self._runner is not None:
            self._runner.cancel()
            await asyncio.gather(self._runner, return_exceptions=True)
        for rid in list(self._entries):
            self._finish(rid, EngineFailed(grpc.StatusCode.UNAVAILABLE, f"stage {self.name} is shutting down"))
        self._executor.shutdown(wait=True, cancel_futures=False)
        if self._bulk is not None:
            self._bulk.shutdown()
        self._closed = True

    def submit(self, task: StageTask, timeout_s: float | None = None, whole_input: bool = False,
               trace: object = None) -> asyncio.Queue:
        """Queue `task`; its events come on the returned queue. `trace`: the caller's trace context, under which
        the request's span in this stage is written (omnimesh/tracing.py; nothing when tracing is off)."""
        if self._stopped is not None:
            raise StageRequestError(grpc.StatusCode.UNAVAILABLE,
                                    f"stage {self.name}'s engine stopped ({self._stopped}); it must be restarted")
        if task.request_id in self._entries:
            raise StageRequestError(
                grpc.StatusCode.ALREADY_EXISTS, f"request {task.request_id} is already running in {self.name}"
            )
        if timeout_s is not None and not math.isfinite(timeout_s):  # the loop's timer takes no NaN or infinity
            raise StageRequestError(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"the request's timeout must be finite, got {timeout_s}")
        deadline = time.monotonic() + timeout_s if timeout_s else float("inf")
        queue: asyncio.Queue = asyncio.Queue()
        timing = self._metrics.request(trace) if self._metrics is not None else None
        self._entries[task.request_id] = _Entry(task=task, queue=queue, deadline=deadline, whole_input=whole_input,
                                                timing=timing)
        self._wake.set()
        return queue

    def feed(self, request_id: str, chunk: StageChunk) -> None:
        entry = self._entries.get(request_id)
        if entry is not None:
            entry.inbox.append(chunk)
            self._wake.set()

    def cancel(self, request_id: str) -> None:
        """Drop a request (client went away or sent cancel); frees its state at once."""
        if request_id in self._entries:
            self._finish(request_id, EngineDone("cancelled", 0, 0))

    def fail(self, request_id: str, code: grpc.StatusCode, message: str) -> None:
        """End a request with an error found outside the task (a lost input chunk, a bad frame)."""
        self._finish(request_id, EngineFailed(code, message))

    def _finish(self, request_id: str, event: EngineDone | EngineFailed) -> None:
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return
        if entry.timing is not None:
            entry.timing.finished(entry.task, event)
        try:
            # close() may free model state (KV caches on every rank): it runs on the compute thread, after any
            # step in flight, so the model is never touched by two threads and the event loop never waits
            if self._closed:
                entry.task.close()
            elif entry.inflight is not None and not entry.inflight.done():
                task = entry.task  # cancelled mid-step: close once that step is over
                entry.inflight.add_done_callback(lambda _: self._submit_close(task))
            else:
                self._submit_close(entry.task)
        finally:
            entry.queue.put_nowait(event)

    def _submit_close(self, task: StageTask) -> None:
        try:
            self._executor.submit(self._close, task)
        except RuntimeError:  # the executor already shut down (the stage is stopping): close here
            self._close(task)

    def _close(self, task: StageTask) -> None:
        try:
            with self._serial or contextlib.nullcontext():
                task.close()
        except Exception:
            log.exception("closing request %s failed", task.request_id)
        # what a close frees (a seat, KV blocks) is news: a request a step beside it found no room for would
        # otherwise wait, the loop idle, until something else happened (on a quiet stage: its deadline)
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (the stage stopped)
                self._loop.call_soon_threadsafe(self._wake.set)

    def _ready(self, entry: _Entry) -> bool:
        """Hand the buffered chunks to the task (all at once under whole_input, with the final one); True if it can
        step now. A task that raises in `feed` or `ready` (the request's mistake: StageRequestError, ValueError;
        or a bug) fails alone, never the loop."""
        try:
            if not entry.whole_input or (entry.inbox and entry.inbox[-1].final):
                while entry.inbox:
                    entry.task.feed(entry.inbox.pop(0))
            return entry.task.ready()
        except Exception as exc:
            self._finish(entry.task.request_id, self._failure(entry.task.request_id, exc))
            return False

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        running: set[asyncio.Task] = set()
        idle = False  # the last batch made no progress: wait for news before trying again
        while True:
            self._wake.clear()
            now = time.monotonic()
            ready: list[_Entry] = []
            for rid, entry in list(self._entries.items()):
                if now > entry.deadline:
                    self._finish(rid, EngineFailed(grpc.StatusCode.DEADLINE_EXCEEDED, f"request {rid} ran past its deadline in {self.name}"))
                elif entry.inflight is None and self._ready(entry):
                    ready.append(entry)  # inputs wait in the inbox while a step is in flight
                    if entry.timing is not None:
                        entry.timing.ready()
            if (self._bulk is not None and self._gate is None and len(running) >= self._max_inflight
                    and any(_pressing(e.task) for e in ready)):
                self._bulk.boost()  # an urgent request waits for the steps in flight: lift the bulk ones
            if not idle:
                for group in self._plan(ready, len(running)):
                    # started here, not in the task: a cancel that lands before the task's first turn then
                    # finds the request in flight and closes it after the step, never before it
                    running.add(asyncio.create_task(self._step_group(group, *self._launch(loop, group))))
            # hold no request past its end while waiting: a cancelled one must free its tensors (and the shared
            # memory slots under them) now, not at the next wake-up
            ready = group = entry = None  # type: ignore[assignment]
            timeout = min(min((e.deadline for e in self._entries.values()), default=float("inf")) - now, MAX_WAIT_S)
            waits: list[asyncio.Future] = [asyncio.ensure_future(self._wake.wait()), *running]
            done, _ = await asyncio.wait(waits, timeout=max(timeout, 0.001),
                                         return_when=asyncio.FIRST_COMPLETED)
            waits[0].cancel()
            finished = [t for t in running if t in done]
            running.difference_update(finished)
            if finished:
                idle = not any(t.result() for t in finished)
            elif waits[0] in done:
                idle = False

    def _plan(self, ready: list[_Entry], running: int) -> list[list[_Entry]]:
        """The steps to start now, with `running` steps in flight. With the engine's urgent slot (`preempt`, a
        batcher without lanes): a step's worth as usual when none is in flight; beside a bulk step, a step of
        the pressing requests (the bulk one pauses for it); else nothing."""
        if not self._lane:
            return self._groups(ready, self._max_inflight - running)
        if not running:
            return self._groups(ready, 1)
        if running > 1 or self._pressing_inflight:
            return []
        lane = sorted((e for e in ready if _pressing(e.task) and not e.waits_seat), key=lambda e: e.last_step)
        return [lane] if lane else []

    def _groups(self, ready: list[_Entry], slots: int) -> list[list[_Entry]]:
        """Split the ready requests over the free compute slots: one request per slot without a batcher;
        with one, every ready request goes into some batch (a pipeline-parallel stage fills each of its pp
        slots with a share, so every pipeline rank has a micro-batch), unless the batcher plans its own
        `lanes`."""
        if slots <= 0 or not ready:
            return []
        ready = sorted(ready, key=lambda e: e.last_step)
        if self._batcher is None:
            return [[entry] for entry in ready[:slots]]
        lanes = getattr(self._batcher, "lanes", None)
        plan = lanes([e.task for e in ready], slots, self._max_inflight - slots) if lanes is not None else None
        if plan is not None:
            entry_of = {id(e.task): e for e in ready}
            return [[entry_of[id(t)] for t in group] for group in plan[:slots] if group]
        if self._yield_steps and lanes is None:
            first, ready = self._first_outputs(ready)
            if first:
                slots -= 1
                if slots <= 0 or not ready:
                    return [first]
                n = min(slots, len(ready))
                return [first, *(ready[i::n] for i in range(n))]
        n = min(slots, len(ready))
        return [ready[i::n] for i in range(n)]

    def _first_outputs(self, ready: list[_Entry]) -> tuple[list[_Entry], list[_Entry]]:
        """(the step for the requests waiting for their first output, with the streams that sat out
        `yield_steps` steps in a row; the other ready requests), or ([], ready) when none of them is urgent
        or all are (a plain step then). A request still waiting for a seat counts as a stream here."""
        first: list[_Entry] = []
        streams: list[_Entry] = []
        for e in ready:
            (first if e.task.urgent() and not e.waits_seat else streams).append(e)
        if not first or not streams:
            return [], ready
        rest: list[_Entry] = []
        for e in streams:  # a stream that sat out `yield_steps` steps in a row rides along
            (first if self._steps - e.last_step >= self._yield_steps else rest).append(e)
        return first, rest

    def _compute(self, tasks: list[StageTask], pressing: bool) -> dict[str, list[StageChunk] | BaseException]:
        """On a compute thread: one batched step (the stage's batcher) or one task's step (`pressing`: an urgent
        one, which gated bulk steps pause for), in
        `torch.inference_mode` (no autograd or version-counter bookkeeping: ~15% of a tiny LM step on CPU)."""
        gate = self._gate
        around = contextlib.nullcontext() if gate is None else gate.urgent() if pressing else gate.bulk()
        with self._serial or contextlib.nullcontext(), around, torch.inference_mode():
            if self._batcher is not None:
                return self._batcher.step_batch(tasks)
            task = tasks[0]
            try:
                return {task.request_id: task.step()}
            except Exception as exc:
                return {task.request_id: exc}

    def _launch(self, loop: asyncio.AbstractEventLoop,
                group: list[_Entry]) -> tuple[asyncio.Future, float, bool, bool]:
        """Start one step over `group` on a compute thread, its requests marked in flight at once -> (the
        step's future, its start, whether a request in it waits for its first output, whether it is pressing)."""
        started = time.monotonic()
        tasks = [e.task for e in group]
        first_output = any(t.urgent() for t in tasks)  # a request in it waits for its first output
        pressing = first_output or any(t.behind() for t in tasks)  # = any(_pressing(t)), urgent() asked once
        if self._bulk is not None and not pressing:
            future = loop.run_in_executor(self._bulk.executor, self._bulk.run, self._compute, tasks, False)
        else:
            future = loop.run_in_executor(self._executor, self._compute, tasks, pressing)
        self._pressing_inflight += pressing
        self._steps += 1
        for entry in group:
            entry.inflight = future
            entry.last_step = self._steps
        return future, started, first_output, pressing

    async def _step_group(self, group: list[_Entry], future: asyncio.Future, started: float, first_output: bool,
                          pressing: bool) -> bool:
        """Wait for the step `_launch` started over `group`; deliver each request's outputs or error. True if
        any request progressed or one was newly left out (the next pass plans differently, see `waits_seat`)."""
        try:
            results = await future
        except Exception as exc:  # the batch as a whole failed (a rank died, a model bug): every request in it
            results = {e.task.request_id: exc for e in group}
        finally:
            self._pressing_inflight -= pressing
            for entry in group:
                entry.inflight = None
            self._wake.set()
        if self._metrics is not None:  # the requests the step advanced (a batcher may leave some for later)
            self._metrics.step(len(results), time.monotonic() - started, first_output)
        newly_left_out = False
        for entry in group:
            rid = entry.task.request_id
            result = results.get(rid)
            # a request the batcher left out (no seat: --max-num-seqs, KV blocks) waits for the others to make
            # room, so it never steps alone for its first output until it progresses again; when one is newly
            # left out the loop tries again at once (a plain step then carries the requests holding the seats)
            newly_left_out |= result is None and not entry.waits_seat
            entry.waits_seat = result is None
            if result is None or self._entries.get(rid) is not entry:
                continue  # no progress this step, or cancelled during it (its outputs go nowhere)
            if entry.timing is not None:
                entry.timing.stepped(started)
                entry.timing.count(entry.task)
            if isinstance(result, BaseException):
                self._finish(rid, self._failure(rid, result))
                # the batcher's frame (its step's results) is in the traceback and holds this exception: let it go
                # now rather than at the next full collection
                result.__traceback__ = None
            else:
                self._emit(entry, result)
        return bool(results) or newly_left_out

    def _failure(self, rid: str, exc: BaseException) -> EngineFailed:
        if isinstance(exc, StageRequestError):
            return EngineFailed(exc.code, exc.message)
        if isinstance(exc, ValueError):
            return EngineFailed(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if isinstance(exc, RankFailure):  # a rank of this stage died: the stage cannot serve
            return EngineFailed(grpc.StatusCode.UNAVAILABLE, f"{self.name}: {exc}")
        # a model bug must fail this request, not the stage
        log.error("%s: request %s failed", self.name, rid, exc_info=exc)
        return EngineFailed(grpc.StatusCode.INTERNAL, f"{self.name}: {type(exc).__name__}: {exc}")

    def _emit(self, entry: _Entry, outputs: list[StageChunk]) -> None:
        rid = entry.task.request_id
        if entry.timing is not None and outputs:
            entry.timing.output()
        if entry.task.finished:
            # the stream's last chunk carries final=True, even when the last step made no output
            if not outputs:
                outputs = [StageChunk()]
            outputs[-1].final = True
        for chunk in outputs:
            entry.queue.put_nowait(chunk)
        if entry.task.finished:
            t = entry.task
            self._finish(rid, EngineDone(t.finish_reason, t.prompt_tokens, t.completion_tokens, t.cached_tokens,
                                         t.stop_reason))


def _pressing(task: StageTask) -> bool:
    """A step with this task runs at the stage's own priority: it waits for its first output, or its
    playback deadline is near."""
    return task.urgent() or task.behind()
