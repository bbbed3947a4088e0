"""Turn detection for the Realtime API (`turn_detection: {"type": "server_vad"}`): an energy voice-activity
detector over the appended pcm16 audio.

Data flow: `EnergyVAD.push(samples)` (float32 at 24 kHz, as appended) -> 20 ms frames; a frame is speech
when its RMS amplitude is at least `threshold` x 0.1 of full scale (the default 0.5: -26 dBFS) -> the first
speech frame starts a turn (`Started(ms)`: where in the session's audio it began), and `silence_duration_ms`
of frames below it end the turn (`Stopped(ms, audio)`: the turn's audio from `prefix_padding_ms` before its
first speech frame to the end of its last one). Between turns only the last `prefix_padding_ms` are kept.
This is energy, not a neural VAD: steady background noise above the threshold reads as speech (raise
`threshold`), quiet speech below it as silence (lower it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FRAME_MS = 20
FULL_SCALE_RMS = 0.1  # threshold 1.0 <-> an RMS of 0.1 of full scale (-20 dBFS); 0.5 <-> -26 dBFS


@dataclass(frozen=True)
class Started:
    ms: int  # where the speech began in the session's audio


@dataclass(frozen=True)
class Stopped:
    ms: int  # where the speech ended in the session's audio
    audio: np.ndarray  # (samples,) the turn: prefix padding + the speech


class EnergyVAD:
    def __init__(self, threshold: float = 0.5, prefix_padding_ms: int = 300, silence_duration_ms: int = 500,
                 rate: int = 24_000) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        if prefix_padding_ms < 0 or silence_duration_ms < FRAME_MS:
            raise ValueError(f"prefix_padding_ms must be >= 0 and silence_duration_ms >= {FRAME_MS}, got "
                             f"{prefix_padding_ms} and {silence_duration_ms}")
        self.level = threshold * FULL_SCALE_RMS
        self.frame = rate * FRAME_MS // 1000
        self.rate = rate
        self.padding = rate * prefix_padding_ms // 1000  # samples kept before a turn's first speech frame
        self.silence_frames = -(-silence_duration_ms // FRAME_MS)
        self.pending = np.zeros(0, np.float32)  # samples not yet in a whole frame
        self.audio = np.zeros(0, np.float32)  # between turns: the last `padding` samples; in a turn: the turn
        self.consumed = 0  # samples of the session's audio framed so far
        self.in_speech = False
        self.quiet = 0  # frames below the level since the turn's last speech frame
        self.speech_end = 0  # length of `self.audio` at the end of the turn's last speech frame

    @property
    def buffered_seconds(self) -> float:
        return (self.audio.size + self.pending.size) / self.rate

    def push(self, samples: np.ndarray) -> list[Started | Stopped]:
        events: list[Started | Stopped] = []
        data = np.concatenate([self.pending, np.asarray(samples, np.float32).reshape(-1)])
        whole = data.size - data.size % self.frame
        self.pending = data[whole:]
        for at in range(0, whole, self.frame):
            frame = data[at:at + self.frame]
            speech = float(np.sqrt(np.mean(frame.astype(np.float64) ** 2))) >= self.level
            self.audio = np.concatenate([self.audio, frame])
            self.consumed += frame.size
            if not self.in_speech:
                if speech:
                    self.in_speech, self.quiet, self.speech_end = True, 0, self.audio.size
                    events.append(Started(self._ms(self.consumed - frame.size)))
                else:
                    self.audio = self.audio[-self.padding:] if self.padding else self.audio[:0]
            elif speech:
                self.quiet, self.speech_end = 0, self.audio.size
            else:
                self.quiet += 1
                if self.quiet >= self.silence_frames:
                    ended = self.consumed - (self.audio.size - self.speech_end)
                    events.append(Stopped(self._ms(ended), self.audio[:self.speech_end].copy()))
                    self._between_turns()
        return events

    def flush(self) -> np.ndarray | None:
        """A turn in progress ends now (the client committed): its audio, or None outside a turn."""
        if not self.in_speech:
            return None
        audio = np.concatenate([self.audio, self.pending])
        self.consumed += self.pending.size
        self.pending = np.zeros(0, np.float32)
        self._between_turns()
        return audio

    def clear(self) -> None:
        self.consumed += self.pending.size
        self.pending = np.zeros(0, np.float32)
        self.audio = self.audio[:0]
        self.in_speech = False

    def _between_turns(self) -> None:
        self.in_speech, self.quiet = False, 0
        self.audio = self.audio[-self.padding:] if self.padding else self.audio[:0]

    def _ms(self, samples: int) -> int:
        return samples * 1000 // self.rate
