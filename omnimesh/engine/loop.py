"""EngineLoop: steps every in-flight request of a stage, interleaved, on its compute thread(s).

Data flow: the servicer `submit`s a task and gets an asyncio queue of `EngineEvent`s; input chunks
arrive through `feed` and are handed to the task between steps; each pass of the loop gives every ready
task one `step` (round-robin), so a long request never blocks a short one for more than one step.
Outputs are numbered per request (seq 0, 1, ...) and put on the request's queue, followed by one
`EngineDone` or `EngineFailed`. Steps run on compute threads: one by default; a pipeline-parallel stage allows `max_inflight` = pp
requests to step at once, each on its own thread, so every pipeline rank has work.

This is where continuous batching plugs in: a pass that steps all ready tasks in one batched call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from omnimesh.engine.task import StageRequestError, StageTask
from omnimesh.parallel.mp_executor import RankFailure
from omnimesh.transport.frames import StageChunk

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineDone:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


@dataclass(slots=True)
class EngineFailed:
    code: grpc.StatusCode
    message: str


EngineEvent = StageChunk | EngineDone | EngineFailed


@dataclass(slots=True)
class _Entry:
    task: StageTask
    queue: asyncio.Queue
    deadline: float  # time.monotonic() value; inf = none
    whole_input: bool  # hold inputs until the final chunk is in (--no-async-chunk)
    inbox: list[StageChunk] = field(default_factory=list)
    out_seq: int = 0
    inflight: asyncio.Future | None = None  # the step running on a compute thread


class EngineLoop:
    def __init__(self, name: str, max_inflight: int = 1):
        """`max_inflight` > 1 lets that many requests step at once (a pipeline-parallel stage keeps each of
        its pp ranks busy with a different request); one request never has two steps in flight."""
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        self.name = name
        self._entries: dict[str, _Entry] = {}
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=max_inflight, thread_name_prefix=f"{name}-compute")
        self._runner: asyncio.Task | None = None
        self._closed = False

    @property
    def num_requests(self) -> int:
        return len(self._entries)

    def start(self) -> None:
        self._runner = asyncio.get_running_loop().create_task(self._run(), name=f"{self.name}-engine")

    async def stop(self) -> None:
        if self._runner is not None:
            self._runner.cancel()
            await asyncio.gather(self._runner, return_exceptions=True)
        for rid in list(self._entries):
            self._finish(rid, EngineFailed(grpc.StatusCode.UNAVAILABLE, f"stage {self.name} is shutting down"))
        self._executor.shutdown(wait=True, cancel_futures=False)
        self._closed = True

    def submit(self, task: StageTask, timeout_s: float | None = None, whole_input: bool = False) -> asyncio.Queue:
        if task.request_id in self._entries:
            raise StageRequestError(
                grpc.StatusCode.ALREADY_EXISTS, f"request {task.request_id} is already running in {self.name}"
            )
        deadline = time.monotonic() + timeout_s if timeout_s else float("inf")
        queue: asyncio.Queue = asyncio.Queue()
        self._entries[task.request_id] = _Entry(task=task, queue=queue, deadline=deadline, whole_input=whole_input)
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
        try:
            # close() may free model state (KV caches on every rank): it runs on the compute thread, after any
            # step in flight, so the model is never touched by two threads and the event loop never waits
            if self._closed:
                entry.task.close()
            elif entry.inflight is not None and not entry.inflight.done():
                task = entry.task  # cancelled mid-step: close once that step is over
                entry.inflight.add_done_callback(lambda _: self._executor.submit(self._close, task))
            else:
                self._executor.submit(self._close, entry.task)
        finally:
            entry.queue.put_nowait(event)

    @staticmethod
    def _close(task: StageTask) -> None:
        try:
            task.close()
        except Exception:
            log.exception("closing request %s failed", task.request_id)

    def _deliver_inputs(self, entry: _Entry) -> bool:
        """Hand buffered chunks to the task; False if the task rejected one (already finished)."""
        if entry.whole_input and not (entry.inbox and entry.inbox[-1].final):
            return True
        while entry.inbox:
            chunk = entry.inbox.pop(0)
            try:
                entry.task.feed(chunk)
            except StageRequestError as exc:
                self._finish(entry.task.request_id, EngineFailed(exc.code, exc.message))
                return False
            except ValueError as exc:
                self._finish(entry.task.request_id, EngineFailed(grpc.StatusCode.INVALID_ARGUMENT, str(exc)))
                return False
        return True

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()
            now = time.monotonic()
            ready: list[_Entry] = []
            for rid, entry in list(self._entries.items()):
                if now > entry.deadline:
                    self._finish(rid, EngineFailed(grpc.StatusCode.DEADLINE_EXCEEDED, f"request {rid} ran past its deadline in {self.name}"))
                elif self._deliver_inputs(entry) and entry.task.ready():
                    ready.append(entry)
            if not ready:
                timeout = min((e.deadline for e in self._entries.values()), default=float("inf")) - now
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=None if timeout == float("inf") else max(timeout, 0.001))
                except TimeoutError:
                    pass
                continue
            # every ready request gets one step; up to `max_inflight` of them run at once (pipeline ranks)
            await asyncio.gather(*(self._step(loop, entry) for entry in ready))

    async def _step(self, loop: asyncio.AbstractEventLoop, entry: _Entry) -> None:
        rid = entry.task.request_id
        if self._entries.get(rid) is not entry:
            return  # cancelled while an earlier task stepped
        entry.inflight = loop.run_in_executor(self._executor, entry.task.step)
        try:
            outputs = await entry.inflight
        except StageRequestError as exc:
            self._finish(rid, EngineFailed(exc.code, exc.message))
            return
        except ValueError as exc:
            self._finish(rid, EngineFailed(grpc.StatusCode.INVALID_ARGUMENT, str(exc)))
            return
        except RankFailure as exc:  # a rank of this stage died: the stage cannot serve
            self._finish(rid, EngineFailed(grpc.StatusCode.UNAVAILABLE, f"{self.name}: {exc}"))
            return
        except Exception as exc:  # a model bug must fail this request, not the stage
            log.exception("%s: request %s failed", self.name, rid)
            self._finish(rid, EngineFailed(grpc.StatusCode.INTERNAL, f"{self.name}: {type(exc).__name__}: {exc}"))
            return
        finally:
            entry.inflight = None
        if self._entries.get(rid) is not entry:
            return  # cancelled during the step: its outputs go nowhere
        if entry.task.finished:
            # the stream's last chunk carries final=True, even when the last step made no output
            if not outputs:
                outputs = [StageChunk()]
            outputs[-1].final = True
        for chunk in outputs:
            chunk.seq = entry.out_seq
            entry.out_seq += 1
            entry.queue.put_nowait(chunk)
        if entry.task.finished:
            t = entry.task
            self._finish(rid, EngineDone(t.finish_reason, t.prompt_tokens, t.completion_tokens))
