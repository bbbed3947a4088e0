"""Video (and compressed audio) decoding in a child process of its own, so FFmpeg never runs inside the gateway.

Role: a video upload is untrusted input to FFmpeg's demuxers and decoders, the largest native attack
surface the gateway has. A crash there (a decoder bug on a crafted file) would take every request of the
gateway down; a decoder stuck inside one call cannot be interrupted by a thread's deadline; and a file's
worth of decoding buffers stays in the gateway's heap. Here each video is decoded by a fresh process, forked
from a forkserver that has PyAV, numpy and the sampling rules imported already (a few milliseconds, no
re-import; the gateway starts it at start-up):

    gateway thread: start the child -> send the file's bytes over a pipe -> answer its ("admit", bytes)
    once the media budget grants them (gateway/media_budget.py; the wait is outside the deadline) -> wait up
    to video_decode_timeout_s + GRACE_S -> receive the frames straight into their array (or a pickled
    AudioPart, or the PipelineError's fields) -> give the bytes back
    child: decode_video(...) (gateway/media_video.py: it reads the stream's header, asks for the memory its
    frames will take, then decodes under its own deadline; an audio stream longer than its header said asks
    again for its new total, which the gateway waits for after giving back the first) -> send the result -> exit

A child that dies without answering (a signal, an abort) is a 400 naming the signal; one past the hard
deadline is killed and answered 400, like the soft deadline inside the decoder. Other requests never
notice either. Audio files that are not WAV (MP3, FLAC, Ogg, ...) go the same way (`kind="audio"`,
`media_video.decode_audio_file`), counted in their own series. The frames (bounded by `max_video_pixels`)
are never pickled: the child sends its array's bytes and the gateway reads them into one it allocated, so a
decode holds its frames twice at most (the child's and the gateway's), not five times (a 316 MB decode
peaked at 1.65 GB across both processes before). Blocking: call `decode_in_child` off the event loop, as
`MediaLoader.video_from_bytes` does.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import numpy as np
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.events import AudioPart, PipelineError, VideoPart
from gateway.input_limits import InputLimits
from gateway.media import invalid_request

if TYPE_CHECKING:
    from omnimesh.models.qwen3_omni.video_sampling import VideoSampling

GRACE_S = 5.0  # beyond video_decode_timeout_s: the soundtrack, pickling the frames, process start and exit
_CONTEXT = multiprocessing.get_context("forkserver")
_PRELOAD = ["gateway.media_video", "omnimesh.models.qwen3_omni.video_sampling"]
_preload_lock = threading.Lock()
_preloaded = False
log = logging.getLogger(__name__)

Decoder = Callable[..., VideoPart]  # decode_video's signature: (data, *, sampling, limits, param, with_audio, admit)
Admit = Callable[[int], Callable[[], None]]  # bytes -> blocks until granted -> their release


class DecodeMetrics(Collector):
    """This process's decodes of one kind of media ("video" or "audio") for the gateway's /metrics: how many
    by outcome (ok; refused: not such a file, or over a limit; timeout; crashed: the child died; cancelled:
    its request left while the decode waited for memory in the media budget; bug: the decoder raised) and how
    long they took."""

    OUTCOMES = ("ok", "refused", "timeout", "crashed", "cancelled", "bug")
    BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, float("inf"))

    def __init__(self, media: str = "video") -> None:
        self.media = media
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(self.OUTCOMES, 0)
        self.buckets = [0] * len(self.BUCKETS)
        self.seconds = 0.0

    def observe(self, outcome: str, seconds: float) -> None:
        with self._lock:
            self.counts[outcome] += 1
            self.seconds += seconds
            for i, bound in enumerate(self.BUCKETS):
                if seconds <= bound:
                    self.buckets[i] += 1

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            counts, buckets, seconds = dict(self.counts), list(self.buckets), self.seconds
        decodes = CounterMetricFamily(f"omnimesh:{self.media}_decodes",
                                      f"{self.media.capitalize()} files decoded in child processes, by outcome",
                                      labels=["outcome"])
        for outcome, n in counts.items():
            decodes.add_metric([outcome], float(n))
        latency = HistogramMetricFamily(f"omnimesh:{self.media}_decode_seconds",
                                        f"Seconds one {self.media} file took to decode, child process included")
        latency.add_metric([], [(_bound(b), float(n)) for b, n in zip(self.BUCKETS, buckets, strict=True)], seconds)
        return [decodes, latency]


def _bound(b: float) -> str:
    return "+Inf" if b == float("inf") else f"{b:g}"


METRICS = DecodeMetrics("video")  # the gateway's /metrics collects both (gateway/rest.py)
AUDIO_METRICS = DecodeMetrics("audio")
_HINTS = {"video": "an intact video file (MP4, WebM, MKV, MOV, AVI, ...)",
          "audio": "an intact audio file (WAV, MP3, FLAC, Ogg, M4A, WebM, ...)"}


def _default_decoder(kind: str) -> Decoder:
    from gateway.media_video import decode_audio_file, decode_video

    return decode_video if kind == "video" else decode_audio_file  # type: ignore[return-value]


def _ensure_preload() -> None:
    """The forkserver (started with the first child, or by `start_forkserver`) imports the decoder and the
    sampling rules once (the latter imports torch, not transformers); children inherit them."""
    global _preloaded
    with _preload_lock:
        if not _preloaded:
            _CONTEXT.set_forkserver_preload(_PRELOAD)
            _preloaded = True


def start_forkserver() -> float:
    """Start the forkserver now (the gateway calls this at start-up, so the first video does not wait for
    its imports); seconds it took."""
    started = time.monotonic()
    _ensure_preload()
    first = _CONTEXT.Process(target=_noop, name="omnimesh-video-warmup", daemon=True)
    first.start()  # the server's imports run before it forks this one
    first.join(120.0)
    return time.monotonic() - started


def _noop() -> None:
    pass


def decode_in_child(data: bytes, *, sampling: VideoSampling | None, limits: InputLimits, param: str,
                    with_audio: bool = False, decoder: Decoder | None = None, kind: str = "video",
                    admit: Admit | None = None) -> Any:
    """`decode_video` (kind "video") or `decode_audio_file` (kind "audio") -- or `decoder`, a module-level
    function with their signature -- in a child process; the same answers (a VideoPart / an AudioPart), plus a
    400 when the child crashes or outlives its deadline. `admit` (a `media_budget.ThreadAdmission`) is asked for
    the memory the child says its decode will take, before it decodes: the decode waits for it, outside its
    deadline, and gives it back once its answer is here. Blocks: run it in a thread. Every call is counted in
    `METRICS` / `AUDIO_METRICS` by its outcome, with its seconds (not counting that wait)."""
    if kind not in _HINTS:
        raise ValueError(f"kind must be video or audio, got {kind!r}")
    started = time.monotonic()
    outcome, waited = "crashed", [0.0]  # crashed: unless the child gets as far as an answer (or the deadline)
    try:
        outcome, result = _decode_in_child(data, sampling, limits, param, with_audio, decoder, kind, admit, waited)
    finally:
        (METRICS if kind == "video" else AUDIO_METRICS).observe(outcome, time.monotonic() - started - waited[0])
    if outcome == "cancelled":
        raise concurrent.futures.CancelledError
    if isinstance(result, PipelineError):
        raise result
    return result


def _decode_in_child(data: bytes, sampling: VideoSampling | None, limits: InputLimits, param: str, with_audio: bool,
                     decoder: Decoder | None, kind: str, admit: Admit | None, waited: list[float]) -> tuple[str, Any]:
    """(outcome, the decoded part or the error the caller gets); see `DecodeMetrics.OUTCOMES`. The child asks
    ("admit", bytes) before it decodes, and again with a larger total if it outgrows that, and waits for "go";
    `waited[0]` gets the seconds those waits took."""
    _ensure_preload()
    ours, theirs = _CONTEXT.Pipe()
    child = _CONTEXT.Process(target=_child_main, name=f"omnimesh-{kind}-decode", daemon=True,
                             args=(theirs, decoder or _default_decoder(kind), sampling, limits, param, with_audio,
                                   kind))
    child.start()
    theirs.close()
    hard_deadline = limits.video_decode_timeout_s + GRACE_S
    release: Callable[[], None] | None = None
    try:
        ours.send_bytes(data)
        started = time.monotonic()
        while True:
            if not ours.poll(max(0.0, hard_deadline - (time.monotonic() - started))):
                return "timeout", invalid_request(
                    f"{param}: decoding the {kind} took longer than {limits.video_decode_timeout_s:g} s; send a "
                    f"shorter or smaller {kind} file", param)
            tag, payload = ours.recv()
            if tag != "admit":
                break
            asked = time.monotonic()
            if admit is not None:
                if release is not None:  # a stream longer than it declared: its new total replaces the first
                    release()  # given back before the new wait: no decode waits while it holds a reservation
                    release = None
                try:
                    release = admit(payload)
                except concurrent.futures.CancelledError:  # its caller left (ThreadAdmission.cancel)
                    return "cancelled", None
            ours.send("go")
            wait = time.monotonic() - asked
            waited[0] += wait
            started += wait  # the deadline counts decoding, not the waits for memory
        if tag == "frames":  # a VideoPart whose frames follow as raw bytes, received in place
            tag, payload = "ok", _receive_frames(ours, started + hard_deadline, *payload)
            if payload is None:
                return "timeout", invalid_request(
                    f"{param}: sending the decoded {kind} took longer than {limits.video_decode_timeout_s:g} s; "
                    f"send a shorter or smaller {kind} file", param)
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the child died before (or while) answering
        child.join(5.0)
        return "crashed", invalid_request(
            f"{param}: the {kind} decoder failed on this file ({_death(child.exitcode)}); send {_HINTS[kind]}",
            param)
    finally:
        ours.close()
        if child.is_alive():
            child.kill()
        child.join(5.0)
        if release is not None:
            release()
    if tag == "ok":
        return "ok", payload
    message, fields = payload  # "refused" (the file or a limit), "timeout" (the decoder's own deadline), "bug"
    return tag, PipelineError(message, **fields)


def _receive_frames(conn: Connection, deadline: float, shape: tuple[int, ...], fps: float,
                    audio: AudioPart | None) -> VideoPart | None:
    """The frames the child writes to the pipe after its ("frames", ...) header, unframed, read straight into
    their array: no pickle, and no buffer in between (`Connection.recv_bytes_into` reads into a BytesIO first).
    None when they have not all come by `deadline` (time.monotonic)."""
    frames, got = np.empty(shape, np.uint8), 0
    with frames.reshape(-1).data as view:
        while got < frames.nbytes:
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                return None
            if (n := os.readv(conn.fileno(), [view[got:]])) == 0:
                raise EOFError(f"the child's frames ended after {got} of {frames.nbytes} bytes")
            got += n
    return VideoPart(frames=frames, fps=fps, audio=audio)


def _send_frames(conn: Connection, frames: np.ndarray) -> None:
    """In the child: the frames' bytes as they are in memory, unframed (`_receive_frames` knows their size)."""
    sent = 0
    with np.ascontiguousarray(frames).reshape(-1).data as view:
        while sent < len(view):
            sent += os.write(conn.fileno(), view[sent:])


def _death(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"it was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"it was killed by signal {-exitcode}"
    return f"it exited with code {exitcode}" if exitcode is not None else "it stopped answering"


def _child_main(conn: Connection, decoder: Decoder, sampling: VideoSampling | None, limits: InputLimits, param: str,
                with_audio: bool, kind: str = "video") -> None:
    """In the child: one decode, one answer: ('ok', the part), or (outcome, (message, PipelineError fields)) with
    outcome 'timeout' (the decoder's own deadline), 'refused' (any other refusal) or 'bug'."""
    answer: tuple[str, Any]
    try:
        data = conn.recv_bytes()
        part = decoder(data, sampling=sampling, limits=limits, param=param, with_audio=with_audio,
                       admit=functools.partial(_ask_to_decode, conn))
        if isinstance(part, VideoPart):  # the frames go as raw bytes after their header: no pickled copy
            conn.send(("frames", (part.frames.shape, part.fps, part.audio)))
            _send_frames(conn, part.frames)
            conn.close()
            return
        answer = ("ok", part)
    except PipelineError as e:
        from gateway.media_video import DecodeTimeout  # lazily, like every PyAV import (preloaded here)

        answer = ("timeout" if isinstance(e, DecodeTimeout) else "refused", _fields(e))
    except Exception as e:  # noqa: BLE001  # a decoder bug: the request fails, the gateway does not
        log.exception("%s: the %s decoder raised", param, kind)
        answer = ("bug", _fields(invalid_request(f"{param}: the {kind} decoder failed on this file "
                                                 f"({type(e).__name__}); send {_HINTS[kind]}", param)))
    conn.send(answer)
    conn.close()


def _ask_to_decode(conn: Connection, nbytes: int) -> None:
    """In the child, before decoding: the memory the decode will take (its own and its answer's copy in the
    gateway); returns when the gateway's media budget has it. A gateway gone is the end of this child."""
    conn.send(("admit", int(nbytes)))
    try:
        conn.recv()
    except EOFError:
        raise SystemExit(1) from None


def _fields(e: PipelineError) -> tuple[str, dict[str, Any]]:
    """A `PipelineError` as picklable parts (its constructor takes keywords, which pickling would lose)."""
    return e.message, {"http_status": e.http_status, "grpc_code": e.grpc_code, "kind": e.kind, "param": e.param}
