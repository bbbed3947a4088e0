"""The per-request unit of work inside a stage, and the errors a request can end with.

Role: the contract between a stage's model code and the family-agnostic `EngineLoop`. A stage turns an
`Open` message into a `StageTask`; the loop feeds it the request's input chunks in order and steps it
whenever it is ready. All model compute happens in `step`, on the loop's compute thread; `feed`,
`ready` and `close` run on the asyncio thread between steps, so a task never sees two calls at once.
"""

from __future__ import annotations

import itertools

from abc import ABC, abstractmethod
from collections.abc import Callable

import grpc

from omnimesh.transport.frames import StageChunk


class StageRequestError(Exception):
    """A request-level failure with the gRPC status it should travel with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class StageTask(ABC):
    """One request inside one stage."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.finished = False
        self.finish_reason = "stop"
        self.stop_reason: str | int | None = None  # vLLM's: the stop string or request stop id that ended it
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0  # prompt tokens whose KV came from the prefix cache (usage.prompt_tokens_details)

    @abstractmethod
    def feed(self, chunk: StageChunk) -> None:
        """Called with each input chunk, in sequence order, between steps. Cheap: store, don't compute.
        Raise ValueError for input this stage cannot use (travels as INVALID_ARGUMENT)."""

    @abstractmethod
    def ready(self) -> bool:
        """Called before each engine pass: can `step` make progress now?"""

    @abstractmethod
    def step(self) -> list[StageChunk]:
        """Called on the compute thread: do one unit of work (a prefill, a decode step, a window) and
        return the output chunks it produced (the engine numbers them). Set `finished` when done."""

    def urgent(self) -> bool:
        """Called on the asyncio thread before a step: does the request still wait for its first output (what
        the client is waiting to see or hear first)? Its steps then run at the stage's own priority, the
        others lower (the stage's bulk_nice). A stage with no such notion is urgent throughout."""
        return True

    def behind(self) -> bool:
        """Called on the asyncio thread before a step: is the request's output due soon (the audio a client
        already has runs out within a margin)? Its steps then run at the stage's own priority like an urgent
        request's, but it does not step alone. False for a stage with no such notion."""
        return False

    def close(self) -> None:
        """Called once when the request ends for any reason (done, error, cancel), on the compute thread
        after any step in flight: free what it holds (e.g. its KV cache on every rank)."""


_TASK_SERIAL = itertools.count()


class BatchedTask(StageTask):
    """A task its stage steps through a `BatchStepper` (continuous batching): `step` is a batch of one
    through that batcher, and `close` runs the callbacks the batcher registered (freeing KV blocks).

    `key` names this task's state in the batcher's engine: unique per task, not per request id. A request
    cancelled and sent again under the same id is a new task while the old one's close (which frees its
    KV blocks, on the compute thread after any step in flight) may still be queued: keyed by the id, that
    close would free the new task's state, or the new task would run on the old one's."""

    def __init__(self, request_id: str, batcher: object = None):
        super().__init__(request_id)
        self.batcher = batcher
        self.key = f"{request_id}~{next(_TASK_SERIAL)}"
        self.on_close: list[Callable[[str], None]] = []
        self.priority = 0  # vLLM's request priority (lower = sooner), read by a "priority" scheduler

    def step(self) -> list[StageChunk]:
        if self.batcher is None:
            raise RuntimeError(f"{type(self).__name__} is stepped by its stage's batcher")
        out = self.batcher.step_batch([self]).get(self.request_id, [])  # type: ignore[attr-defined]
        if isinstance(out, BaseException):
            raise out
        return out

    def close(self) -> None:
        for callback in self.on_close:
            callback(self.key)
        self.on_close.clear()
