"""How much working memory the gateway's media processing may take at once (`InputLimits.media_build_memory`).

Role: turning a request's media into the thinker's inputs (the processor: audio features, image resizing, video
patches) takes far more memory for a moment than the media itself: ~42 bytes per 16 kHz audio sample (a
10-minute clip: ~400 MB, mostly the spectrogram's intermediates), ~10 per image pixel, measured here. Eight such
clips at once took a gateway to 3.2 GB (and its allocator kept it). Decoding a video or a compressed audio file
in its child process takes its frames or samples a few times over as well (a 316 MB video's frames: 0.67 GB
across the child and the gateway). A request reserves its estimate before its prompt is built and gives it
back after; each decode reserves what its child says it needs before it decodes and gives it back when its
answer is in the gateway. One that does not fit waits, while requests without media never wait. The line is
ordered by the requests' arrival (`mark_arrival`, then each wait's own order): a request's build, the step
that sends its decoded media on to the stages, never waits behind the decodes of requests that came after it,
and a newer request never overtakes an older one, so nothing waits for ever. (Twelve 720p videos at once with a
150 MiB budget, on 2 cores: the first answer came after 1.8-2.4 s instead of 4.8-5.0, the mean after 4.4-5.1 s
instead of 6.6, and the gateway with its decoders peaked at 0.91-1.0 GB instead of 1.07-1.13.) One whose
estimate exceeds the whole budget runs alone. A request never holds one reservation while it waits for another,
and a decode waits on threads of its own (`in_admission_thread`), never on one a granted build needs, so waits
cannot deadlock.

Data flow: a request's front (REST `answer`, gRPC `Generate`, `/tokenize`, a Realtime response) ->
`mark_arrival()` in its task's context ... `StagePipeline.run` / `/tokenize` -> `build_cost(request)` ->
`MediaBudget.hold(cost)` around the prompt build (a worker thread) -> released when it returns, fails or is
cancelled. A decode's thread (gateway/video_process.py, on `in_admission_thread`) waits through
`ThreadAdmission`, which its caller cancels if it leaves while the decode is in line. When the budget falls idle
after a build of at least RELEASE_AFTER_BYTES, the allocator's free pages go back to the OS RELEASE_DELAY_S
later (`omnimesh.allocator.release_free_memory`, on a worker thread): by then the build's intermediates and
most of its request (body, decoded media) are freed, and tcmalloc would otherwise keep the burst's peak for
the life of the process.
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import contextlib
import contextvars
import functools
import itertools
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, TypeVar

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from gateway.events import AudioPart, ChatRequest, ImagePart, VideoPart

AUDIO_BYTES_PER_SAMPLE = 48  # per 16 kHz sample (measured ~42: the feature extractor's STFT and mel in float32)
IMAGE_BYTES_PER_PIXEL = 12  # measured ~10 (resizing and normalising to float32 patches)
VIDEO_BYTES_PER_PIXEL = 1  # per sampled frame pixel (measured ~0.2 beyond the frames the request already holds)
log = logging.getLogger(__name__)
T = TypeVar("T")

FEATURE_RATE = 16_000  # the audio the processor reads is resampled to this first
RELEASE_AFTER_BYTES = 64 * 2**20  # a build this large leaves enough freed memory to hand back
RELEASE_DELAY_S = 1.0  # after the budget falls idle: its requests have mostly ended by then
LOOP_CHECK_S = 1.0  # how often a thread waiting for its admission checks that the loop still runs

_ARRIVAL: contextvars.ContextVar[float] = contextvars.ContextVar("omnimesh_media_arrival")


def mark_arrival() -> None:
    """Called where a request arrives, in its own task: its decodes and builds (in this task and those it starts)
    wait in the media budget's line by this moment."""
    _ARRIVAL.set(time.monotonic())


def arrival() -> float:
    """The current request's arrival (`mark_arrival`); now, for work no front marked."""
    return _ARRIVAL.get(time.monotonic())


def build_cost(request: ChatRequest) -> int:
    """The estimated peak working memory (bytes) of building this request's prompt; 0 without media."""
    cost = 0
    for message in request.messages:
        for part in message.content:
            audio = part if isinstance(part, AudioPart) else part.audio if isinstance(part, VideoPart) else None
            if isinstance(part, VideoPart):  # and its soundtrack, if the request reads it
                cost += int(part.frames[..., 0].size) * VIDEO_BYTES_PER_PIXEL
            if isinstance(part, ImagePart):
                width, height = part.image.size  # type: ignore[attr-defined]
                cost += width * height * IMAGE_BYTES_PER_PIXEL
            if audio is not None and audio.sample_rate > 0:
                cost += len(audio.waveform) * FEATURE_RATE // audio.sample_rate * AUDIO_BYTES_PER_SAMPLE
    return cost


def _release() -> str | None:
    from omnimesh.allocator import release_free_memory

    try:
        return release_free_memory()
    except Exception:  # never a failure of anyone's request: the pages stay with the process
        log.warning("handing the allocator's free pages back failed", exc_info=True)
        return None


class MediaBudget(Collector):
    """A byte budget granted in the order its requests arrived (a large request is not overtaken for ever by
    small ones, nor a request's build by a newer request's decode). Used on the gateway's event loop only; its
    state is on the gateway's /metrics (`collect`)."""

    WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, float("inf"))

    def __init__(self, limit_bytes: int) -> None:
        if limit_bytes <= 0:
            raise ValueError(f"the media build budget must be positive, got {limit_bytes}")
        self.limit = limit_bytes
        self.used = 0
        self.waits = [0] * len(self.WAIT_BUCKETS)  # grants by how long they waited (cumulative buckets)
        self.waited_s = 0.0
        # (its request's arrival, the wait's own number, cost, grant), in the order they will be granted
        self._waiting: list[tuple[float, int, int, asyncio.Future[None]]] = []
        self._numbers = itertools.count()
        self._large_ended = False  # a large build ended since the pages were last handed back
        self.releasing: asyncio.Future[str | None] | None = None  # the hand-back due or running now

    @contextlib.asynccontextmanager
    async def hold(self, cost: int) -> AsyncIterator[None]:
        """Reserve `cost` bytes (at most the whole budget) for the body of the `async with`, in the current
        request's place in line (`arrival`)."""
        granted = await self.acquire(cost)
        try:
            yield
        finally:
            self.release(granted)

    async def acquire(self, cost: int, arrived: float | None = None) -> int:
        """Wait in line, at the place of a request that arrived at `arrived` (monotonic; by default the current
        request's `arrival()`), for `cost` bytes (at most the whole budget); what was granted, for `release`."""
        cost = min(cost, self.limit)
        if cost > 0:
            await self._acquire(cost, arrival() if arrived is None else arrived)
        return max(cost, 0)

    def release(self, granted: int) -> None:
        if granted <= 0:
            return
        self.used -= granted
        self._large_ended |= granted >= RELEASE_AFTER_BYTES
        self._grant()
        self._release_when_idle()

    def _release_when_idle(self) -> None:
        if self.used or not self._large_ended or (self.releasing is not None and not self.releasing.done()):
            return
        self._large_ended = False
        self.releasing = asyncio.ensure_future(self._release_later())

    @staticmethod
    async def _release_later() -> str | None:
        await asyncio.sleep(RELEASE_DELAY_S)
        return await asyncio.to_thread(_release)

    async def _acquire(self, cost: int, arrived: float) -> None:
        # first when every wait in line is a newer request's: then it is granted now if it fits
        if (not self._waiting or self._waiting[0][0] > arrived) and self.used + cost <= self.limit:
            self.used += cost
            self._waited(0.0)
            return
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (arrived, next(self._numbers), cost, granted)
        bisect.insort(self._waiting, entry)  # the numbers are unique: the grant is never compared
        started = time.monotonic()
        try:
            await granted
            self._waited(time.monotonic() - started)
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():  # granted just as the caller left: give it back
                self.used -= cost
            else:
                self._waiting.remove(entry)
            self._grant()
            raise

    def _waited(self, seconds: float) -> None:
        self.waited_s += seconds
        for i, bound in enumerate(self.WAIT_BUCKETS):
            if seconds <= bound:
                self.waits[i] += 1

    def collect(self) -> Iterable[Metric]:
        """omnimesh:media_budget_{limit,used}_bytes, _waiting (decodes and builds in line) and _wait_seconds
        (how long each grant waited)."""
        limit = GaugeMetricFamily("omnimesh:media_budget_limit_bytes", "The media decodes' and prompt builds' "
                                  "working memory the gateway allows at once (media_build_memory)")
        limit.add_metric([], float(self.limit))
        used = GaugeMetricFamily("omnimesh:media_budget_used_bytes", "Of that, what the decodes and builds running "
                                 "now hold (their estimates)")
        used.add_metric([], float(self.used))
        waiting = GaugeMetricFamily("omnimesh:media_budget_waiting", "Decodes and prompt builds waiting for their "
                                    "share of the media budget")
        waiting.add_metric([], float(len(self._waiting)))
        wait = HistogramMetricFamily("omnimesh:media_budget_wait_seconds", "Seconds each decode or prompt build "
                                     "with media waited for its share of the media budget")
        buckets = [(floatToGoString(b), float(n)) for b, n in zip(self.WAIT_BUCKETS, self.waits, strict=True)]
        wait.add_metric([], buckets, self.waited_s)
        return [limit, used, waiting, wait]

    def _grant(self) -> None:
        while self._waiting and self.used + self._waiting[0][2] <= self.limit:
            _, _, cost, granted = self._waiting.pop(0)
            self.used += cost
            granted.set_result(None)


class ThreadAdmission:
    """A `MediaBudget` for one blocking call in a worker thread of `loop` (a media decode in a child process,
    gateway/video_process.py): calling it with a cost blocks the thread until the loop grants the bytes and
    returns their release (callable from the thread). It waits at its request's place in line: made on the loop
    in the request's task, it keeps that task's `arrival()`. `cancel()`, on the loop, withdraws a wait still in
    line (its caller left): the thread then gets `concurrent.futures.CancelledError`."""

    def __init__(self, budget: MediaBudget, loop: asyncio.AbstractEventLoop) -> None:
        self.budget, self.loop = budget, loop
        self.arrived = arrival()
        self._task: asyncio.Task | None = None  # the wait, on the loop
        self._cancelled = False

    def __call__(self, cost: int) -> Callable[[], None]:
        waiting = asyncio.run_coroutine_threadsafe(self._acquire(cost), self.loop)
        while True:
            try:
                granted = waiting.result(timeout=LOOP_CHECK_S)
                break
            except concurrent.futures.TimeoutError:
                if self.loop.is_closed() or not self.loop.is_running():  # the gateway stopped: nothing will grant
                    if not self.loop.is_closed():
                        waiting.cancel()
                    raise concurrent.futures.CancelledError from None

        def release() -> None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nothing is left to grant
                self.loop.call_soon_threadsafe(self.budget.release, granted)

        return release

    async def _acquire(self, cost: int) -> int:
        if self._cancelled:  # cancel() ran before there was a wait to withdraw
            raise asyncio.CancelledError
        self._task = asyncio.current_task()
        return await self.budget.acquire(cost, self.arrived)

    def cancel(self) -> None:
        """On the loop. A wait cancelled in line leaves it; one granted as it is cancelled gives the bytes back
        (`MediaBudget._acquire`); one already granted is not affected: the thread releases it."""
        self._cancelled = True
        if self._task is not None:
            self._task.cancel()


_admission_threads: concurrent.futures.ThreadPoolExecutor | None = None
_admission_threads_lock = threading.Lock()


async def in_admission_thread(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """`asyncio.to_thread` for a call that waits for its memory in a `ThreadAdmission` (a media decode): on
    threads of its own, never the loop's default pool. A build holds its share of the budget while it waits for
    a default-pool thread to run in; decodes waiting for memory there could take every one of those threads, and
    the build that would give the memory back never ran (12 videos at once with a 150 MiB budget hung a gateway
    that ordered its line by arrival; first come first served allowed it too, when builds came between decodes).
    As many threads as that pool has; the context goes with the call, as to_thread's does."""
    global _admission_threads
    with _admission_threads_lock:
        if _admission_threads is None:
            _admission_threads = concurrent.futures.ThreadPoolExecutor(
                max_workers=min(32, (os.cpu_count() or 1) + 4), thread_name_prefix="media-decode")
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(_admission_threads, call)
