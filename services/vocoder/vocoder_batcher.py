"""VocoderBatcher: the vocoder stage's continuous batching — one model call per engine step for every
ready request.

Data flow (one `step_batch`, on the engine's compute thread):
    per request (errors stay with that request): take its next window of codes (Q, n_b) off its queue
        (`VocoderTask.take_window`; windows start at the schedule's offsets, as when it runs alone) and
        embed it (`Code2WavStreamer.prepare`)
    all at once: `decode_windows` -> ONE pre-transformer call over (B, T, H), right-padded (on the stage's
        pp x tp ranks, one KV cache per request) and ONE conv-stack call over each request's [kept left
        context | new frames], padded to the longest and cropped back per request
    per request: `VocoderTask.emit` -> its pcm chunk, `finished` when its ended queue is empty
A request whose stream ended with nothing left to decode just finishes (no model work). The padding is
exact (see code2wav.py), so each request's samples equal its solo decode to float rounding of the batched
kernels. `max_codes` (the stage's max_num_batched_tokens) caps the codes of one step and `max_windows` its
requests; those left out stay ready for the next step (the engine offers the longest-waiting first). On
CPU a step takes at most `CPU_CONV_ROWS` windows: wider batches decode no faster there (the conv stack
upsamples 1920x and falls out of cache), and a short step lets a new request's first window in sooner.
First windows go first: when a request waits for its first audio, a step takes only first windows (not
twice in a row); and with two compute slots (the CPU stage, in-process) a first window starts in a step of
its own beside a step in flight (`lanes`): on two cores the short first window no longer waits for a
long step of other requests' windows; when no first window waits, that lane takes the windows whose
playback deadline is near (`VocoderTask.behind`). Steps on different slots touch disjoint requests: each has its own
conv state and pre-transformer cache, and the modules are only read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from omnimesh.engine.task import StageTask
from omnimesh.models.qwen3_omni.code2wav import Window, decode_windows
from omnimesh.transport.frames import StageChunk

if TYPE_CHECKING:
    from services.vocoder.vocoder_task import VocoderTask

StepResult = dict[str, list[StageChunk] | BaseException]


def step_windows(tasks: list[VocoderTask]) -> StepResult:
    """One step of each task (its next window), decoded together; per request id its chunks or its error.
    An error of the batched model call itself is raised (it fails every task given)."""
    results: StepResult = {}
    stepped: list[tuple[VocoderTask, Window | None]] = []
    for task in tasks:
        try:
            codes = task.take_window()  # (Q, n)
            stepped.append((task, task.streamer.prepare(codes) if codes.shape[1] else None))
        except Exception as exc:
            results[task.request_id] = exc
    decoding = [(task, w) for task, w in stepped if w is not None]
    pcm = dict(zip([t.request_id for t, _ in decoding], decode_windows([w for _, w in decoding])))  # the model call
    for task, _ in stepped:
        try:
            results[task.request_id] = task.emit(pcm.get(task.request_id, torch.zeros(0)))
        except Exception as exc:
            results[task.request_id] = exc
    return results


class VocoderBatcher:
    """The vocoder handler's `batcher` (the engine loop's `BatchStepper`)."""

    def __init__(self, max_codes: int | None = None, max_windows: int | None = None, first_lane: bool = False) -> None:
        """`first_lane`: the stage has a second compute slot for first windows (see `lanes`)."""
        if max_codes is not None and max_codes < 1:
            raise ValueError(f"max_codes must be >= 1, got {max_codes}")
        if max_windows is not None and max_windows < 1:
            raise ValueError(f"max_windows must be >= 1, got {max_windows}")
        self.max_codes = max_codes
        self.max_windows = max_windows
        self.first_lane = first_lane
        self._first_only = False  # the last step took only first windows

    def lanes(self, tasks: list[StageTask], free: int, busy: int) -> list[list[StageTask]] | None:
        """The engine loop's plan (`LaneStepper`), with a first-window lane when the stage has 2 slots: no
        step in flight -> one step over everything ready (`step_batch` picks); a step in flight -> only
        first windows may start beside it, so a new request's first audio never waits for other requests'
        long windows."""
        if not self.first_lane:
            return None  # the engine's own split: a share per free slot (pp micro-batches)
        if free <= 0 or not tasks:
            return []
        if busy == 0:
            return [tasks]
        vocoder_tasks = cast("list[VocoderTask]", tasks)
        first: list[StageTask] = [t for t in vocoder_tasks if t.first_window_waits]
        lane = first or [t for t in vocoder_tasks if t.behind()]  # else those whose playback deadline is near
        return [lane] if lane else []

    def step_batch(self, tasks: list[StageTask]) -> StepResult:
        ready = cast("list[VocoderTask]", tasks)
        first = [t for t in ready if t.first_window_waits]
        if first and len(first) < len(ready):
            if not self._first_only:
                # a request's first audio goes ahead: its short first window in a step of its own (the others
                # already streamed seconds of audio ahead of real time); never twice in a row, so none starves
                ready, self._first_only = first, True
            else:
                self._first_only = False
        elif not first:
            self._first_only = False  # (a step of first windows only, e.g. the first-window lane, leaves it)
        batch: list[VocoderTask] = []
        codes = 0
        for task in ready:  # the engine's order: longest-waiting first
            if self.max_windows is not None and len(batch) >= self.max_windows:
                break
            n = task.next_window_size()
            if batch and self.max_codes is not None and codes + n > self.max_codes:
                continue  # no room this step; it stays ready
            batch.append(task)
            codes += n
        return step_windows(batch)
