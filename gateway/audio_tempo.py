"""Speech played faster or slower at the same pitch: OpenAI's `speed` on `/v1/audio/speech`.

The model speaks at its own pace; `speed` rescales the time of its audio afterwards with FFmpeg's `atempo`
filter (WSOLA: pitch kept), through PyAV's filter graph, which the gateway already has for video and
compressed audio. One `Tempo` per answer keeps the filter's state across the answer's audio deltas, so a
streamed answer is the same audio as the whole one pushed at once (the filter buffers its own windows: the
boundaries of the pushes do not change its output). `atempo` takes factors in [0.5, 2] on every FFmpeg
version: a speed outside that range runs as a chain of factors whose product is the speed.

Data flow: the vocoder's float32 mono deltas -> `Tempo.push` -> the rescaled samples ready so far (maybe
none yet) -> ... -> `Tempo.finish` -> the rest. Speed 1 passes the samples through untouched.
"""

from __future__ import annotations

from typing import Any

import numpy as np

MIN_SPEED, MAX_SPEED = 0.25, 4.0  # OpenAI's range for /v1/audio/speech


def atempo_factors(speed: float) -> list[float]:
    """`speed` as atempo factors, each in [0.5, 2], whose product is `speed` (e.g. 4 -> [2, 2], 0.3 -> [0.5, 0.6])."""
    if not MIN_SPEED <= speed <= MAX_SPEED:
        raise ValueError(f"speed must be in [{MIN_SPEED}, {MAX_SPEED}], got {speed}")
    factors = []
    while speed > 2.0:
        factors.append(2.0)
        speed /= 2.0
    while speed < 0.5:
        factors.append(0.5)
        speed /= 0.5
    return [*factors, speed]


class Tempo:
    """One answer's audio at `speed` (1: untouched). `push` / `finish` return float32 mono samples."""

    def __init__(self, speed: float, sample_rate: int) -> None:
        self.speed, self.sample_rate = speed, sample_rate
        self._graph: Any = None
        self._pts = 0
        if speed != 1.0:
            import av
            import av.filter

            graph = av.filter.Graph()
            node = graph.add_abuffer(format="flt", sample_rate=sample_rate, layout="mono")
            for factor in atempo_factors(speed):
                nxt = graph.add("atempo", f"{factor:.6f}")
                node.link_to(nxt)
                node = nxt
            node.link_to(graph.add("abuffersink"))
            graph.configure()
            self._graph = graph

    def push(self, pcm: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(np.asarray(pcm, dtype=np.float32).reshape(-1))
        if self._graph is None or x.size == 0:
            return x
        import av

        frame = av.AudioFrame.from_ndarray(x.reshape(1, -1), format="flt", layout="mono")
        frame.sample_rate, frame.pts = self.sample_rate, self._pts
        self._pts += x.size
        self._graph.push(frame)
        return self._pull()

    def finish(self) -> np.ndarray:
        """The samples the filter still holds (call once, after the last push)."""
        if self._graph is None:
            return np.zeros(0, np.float32)
        self._graph.push(None)
        return self._pull()

    def whole(self, pcm: np.ndarray) -> np.ndarray:
        """A whole answer at once: `push` then `finish`."""
        head = self.push(pcm)
        return np.concatenate([head, self.finish()]) if self._graph is not None else head

    def _pull(self) -> np.ndarray:
        import av

        out = []
        while True:
            try:
                out.append(self._graph.pull().to_ndarray().reshape(-1))
            except (av.BlockingIOError, av.EOFError):
                break
        return np.concatenate(out).astype(np.float32, copy=False) if out else np.zeros(0, np.float32)
