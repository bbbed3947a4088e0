"""Turn detection for the Realtime API (`turn_detection: {"type": "server_vad"}`): Silero VAD (a small neural
voice-activity model, MIT, shipped inside the `silero-vad` wheel) over the appended pcm16 audio.

Data flow: `ServerVAD.push(samples)` (float32 at 24 kHz, as appended) -> 32 ms frames, each resampled to
16 kHz (`gateway.media.resample`, with the previous frame's tail as its left context) and scored by the
process's one model with the session's own recurrent state (the LSTM's h and c, and the 64 samples at 16 kHz
before the frame, carried from frame to frame) -> a frame is speech
when its probability is at least `threshold` (OpenAI's meaning of it; default 0.5) -> the first speech frame
starts a turn (`Started(ms)`: where in the session's audio it began), and `silence_duration_ms` of frames
below it end the turn (`Stopped(ms, audio)`: the turn's audio from `prefix_padding_ms` before its first speech
frame to the end of its last one). Between turns only the last `prefix_padding_ms` are kept.

The model hears voices, not loudness: steady noise, hum and tones are not speech, and quiet speech is. The
weights are read once per process (`_network`) and shared by every session: the wheel's TorchScript wrapper
keeps the state inside itself, so the detector calls the stateless network inside it (`_model`: frame with
context and state in, probability and state out; the same numbers as the wrapper, bit for bit) and a session
costs ~1 KB of state instead of a 2.8 MB copy of the model. A frame scores in ~2 ms of one core: push off the
event loop (gateway/realtime_api.py does).
"""

from __future__ import annotations

import importlib.util
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gateway.media import resample

FRAME_MS = 32  # Silero scores 512 samples at 16 kHz
MODEL_RATE = 16_000
MODEL_FRAME = 512
CONTEXT = 96  # input samples of the previous frame resampled with each frame (a whole number of outputs)
MODEL_CONTEXT = 64  # samples at 16 kHz before the frame that the network hears with it (the wrapper's context)
HIDDEN = 128  # the network's LSTM width: its state is (h, c), each (1, HIDDEN)

_lock = threading.Lock()
_loaded: Any = None


def _network() -> Any:
    """The stateless 16 kHz network of the Silero VAD TorchScript model in the installed `silero-vad` wheel, loaded
    once. Found by path: importing the package would set torch's thread count for the whole gateway."""
    global _loaded
    with _lock:
        if _loaded is None:
            spec = importlib.util.find_spec("silero_vad")
            if spec is None or spec.origin is None:
                raise RuntimeError("server_vad needs the silero-vad package (pip install silero-vad; "
                                   "scripts/setup.sh installs it)")
            with warnings.catch_warnings():  # torch 2.13 deprecates TorchScript loading; the wheel ships TorchScript
                warnings.simplefilter("ignore", DeprecationWarning)
                model = torch.jit.load(str(Path(spec.origin).parent / "data" / "silero_vad.jit"), map_location="cpu")
            _loaded = model.eval()._model
        return _loaded


@dataclass(frozen=True)
class Started:
    ms: int  # where the speech began in the session's audio


@dataclass(frozen=True)
class Stopped:
    ms: int  # where the speech ended in the session's audio
    audio: np.ndarray  # (samples,) the turn: prefix padding + the speech


class SpeechProbability:
    """One audio stream's speech probability per 32 ms frame (its own recurrent state, the process's network)."""

    def __init__(self, rate: int) -> None:
        if rate * MODEL_FRAME % MODEL_RATE or rate * CONTEXT % MODEL_RATE:
            raise ValueError(f"input rate {rate} Hz does not frame into 512 samples at 16 kHz")
        self.rate = rate
        self.frame = rate * MODEL_FRAME // MODEL_RATE
        self.network = _network()
        self.state = torch.zeros(2, 1, HIDDEN)  # the LSTM's (h, c)
        self.context = torch.zeros(1, MODEL_CONTEXT)  # the 16 kHz samples before the next frame
        self.tail = np.zeros(CONTEXT, np.float32)  # the input just before the next frame

    @torch.inference_mode()
    def __call__(self, frame: np.ndarray) -> float:
        """The probability that `frame` (`self.frame` samples at the input rate) is speech."""
        x = resample(np.concatenate([self.tail, frame]), self.rate, MODEL_RATE)
        skip = CONTEXT * MODEL_RATE // self.rate
        self.tail = frame[-CONTEXT:].astype(np.float32, copy=True)
        heard = torch.cat([self.context, torch.from_numpy(np.ascontiguousarray(x[skip:skip + MODEL_FRAME]))[None]], 1)
        probability, self.state = self.network(heard, self.state)
        self.context = heard[:, -MODEL_CONTEXT:].clone()
        return float(probability)


class ServerVAD:
    def __init__(self, threshold: float = 0.5, prefix_padding_ms: int = 300, silence_duration_ms: int = 500,
                 rate: int = 24_000) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        if prefix_padding_ms < 0 or silence_duration_ms < FRAME_MS:
            raise ValueError(f"prefix_padding_ms must be >= 0 and silence_duration_ms >= {FRAME_MS}, got "
                             f"{prefix_padding_ms} and {silence_duration_ms}")
        self.threshold = threshold
        self.speech = SpeechProbability(rate)
        self.frame = self.speech.frame
        self.rate = rate
        self.padding = rate * prefix_padding_ms // 1000  # samples kept before a turn's first speech frame
        self.silence_frames = -(-silence_duration_ms // FRAME_MS)
        self.pending = np.zeros(0, np.float32)  # samples not yet in a whole frame
        self.audio = np.zeros(0, np.float32)  # between turns: the last `padding` samples; in a turn: the turn
        self.consumed = 0  # samples of the session's audio framed so far
        self.in_speech = False
        self.quiet = 0  # frames below the threshold since the turn's last speech frame
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
            speech = self.speech(frame) >= self.threshold
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
