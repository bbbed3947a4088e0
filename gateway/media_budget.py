"""How much working memory the gateway's media processing may take at once (`InputLimits.media_build_memory`).

Role: turning a request's media into the thinker's inputs (the processor: audio features, image resizing, video
patches) takes far more memory for a moment than the media itself: ~42 bytes per 16 kHz audio sample (a
10-minute clip: ~400 MB, mostly the spectrogram's intermediates), ~10 per image pixel, measured here. Eight such
clips at once took a gateway to 3.2 GB (and its allocator kept it). A request reserves its estimate before its
prompt is built and gives it back after; one that does not fit waits, first come first served, while requests
without media never wait. One whose estimate exceeds the whole budget runs alone.

Data flow: `StagePipeline.run` / `/tokenize` -> `build_cost(request)` -> `MediaBudget.hold(cost)` around the
prompt build (a worker thread) -> released when it returns, fails or is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator

from gateway.events import AudioPart, ChatRequest, ImagePart, VideoPart

AUDIO_BYTES_PER_SAMPLE = 48  # per 16 kHz sample (measured ~42: the feature extractor's STFT and mel in float32)
IMAGE_BYTES_PER_PIXEL = 12  # measured ~10 (resizing and normalising to float32 patches)
VIDEO_BYTES_PER_PIXEL = 1  # per sampled frame pixel (measured ~0.2 beyond the frames the request already holds)
FEATURE_RATE = 16_000  # the audio the processor reads is resampled to this first


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


class MediaBudget:
    """A byte budget granted in arrival order (a large request is not overtaken for ever by small ones). Used
    on the gateway's event loop only."""

    def __init__(self, limit_bytes: int) -> None:
        if limit_bytes <= 0:
            raise ValueError(f"the media build budget must be positive, got {limit_bytes}")
        self.limit = limit_bytes
        self.used = 0
        self._waiting: deque[tuple[int, asyncio.Future[None]]] = deque()

    @contextlib.asynccontextmanager
    async def hold(self, cost: int) -> AsyncIterator[None]:
        """Reserve `cost` bytes (at most the whole budget) for the body of the `async with`."""
        cost = min(cost, self.limit)
        if cost <= 0:
            yield
            return
        await self._acquire(cost)
        try:
            yield
        finally:
            self.used -= cost
            self._grant()

    async def _acquire(self, cost: int) -> None:
        if not self._waiting and self.used + cost <= self.limit:
            self.used += cost
            return
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((cost, granted))
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():  # granted just as the caller left: give it back
                self.used -= cost
            else:
                self._waiting.remove((cost, granted))
            self._grant()
            raise

    def _grant(self) -> None:
        while self._waiting and self.used + self._waiting[0][0] <= self.limit:
            cost, granted = self._waiting.popleft()
            self.used += cost
            granted.set_result(None)
