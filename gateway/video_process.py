"""Video decoding in a child process of its own, so FFmpeg never runs inside the gateway.

Role: a video upload is untrusted input to FFmpeg's demuxers and decoders, the largest native attack
surface the gateway has. A crash there (a decoder bug on a crafted file) would take every request of the
gateway down; a decoder stuck inside one call cannot be interrupted by a thread's deadline; and a file's
worth of decoding buffers stays in the gateway's heap. Here each video is decoded by a fresh process, forked
from a forkserver that has PyAV, numpy and the sampling rules imported already (a few milliseconds, no
re-import; the gateway starts it at start-up):

    gateway thread: start the child -> send the file's bytes over a pipe -> wait up to
    video_decode_timeout_s + GRACE_S -> receive the pickled VideoPart (or the PipelineError's fields)
    child: decode_video(...) (gateway/media_video.py, its own deadline inside) -> send the result -> exit

A child that dies without answering (a signal, an abort) is a 400 naming the signal; one past the hard
deadline is killed and answered 400, like the soft deadline inside the decoder. Other requests never
notice either. The frames come back pickled over the pipe (bounded by `max_video_pixels`). Blocking:
call `decode_in_child` off the event loop, as `MediaLoader.video_from_bytes` does.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from gateway.events import PipelineError, VideoPart
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

Decoder = Callable[..., VideoPart]  # decode_video's signature: (data, *, sampling, limits, param, with_audio)


def _default_decoder() -> Decoder:
    from gateway.media_video import decode_video

    return decode_video


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


def decode_in_child(data: bytes, *, sampling: VideoSampling, limits: InputLimits, param: str,
                    with_audio: bool = False, decoder: Decoder | None = None) -> VideoPart:
    """`decode_video` (or `decoder`, a module-level function with its signature) in a child process; the
    same answers, plus a 400 when the child crashes or outlives its deadline. Blocks: run it in a thread."""
    _ensure_preload()
    ours, theirs = _CONTEXT.Pipe()
    child = _CONTEXT.Process(target=_child_main, name="omnimesh-video-decode", daemon=True,
                             args=(theirs, decoder or _default_decoder(), sampling, limits, param, with_audio))
    child.start()
    theirs.close()
    hard_deadline = limits.video_decode_timeout_s + GRACE_S
    started = time.monotonic()
    try:
        ours.send_bytes(data)
        if not ours.poll(max(0.0, hard_deadline - (time.monotonic() - started))):
            raise invalid_request(f"{param}: decoding the video took longer than {limits.video_decode_timeout_s:g} "
                                  "s; send a shorter or smaller video", param)
        kind, payload = ours.recv()
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the child died before (or while) answering
        child.join(5.0)
        raise invalid_request(f"{param}: the video decoder failed on this file ({_death(child.exitcode)}); "
                              "send an intact video file (MP4, WebM, MKV, MOV, AVI, ...)", param) from None
    finally:
        ours.close()
        if child.is_alive():
            child.kill()
        child.join(5.0)
    if kind == "error":
        message, fields = payload
        raise PipelineError(message, **fields)
    return payload  # type: ignore[no-any-return]


def _death(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"it was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"it was killed by signal {-exitcode}"
    return f"it exited with code {exitcode}" if exitcode is not None else "it stopped answering"


def _child_main(conn: Connection, decoder: Decoder, sampling: VideoSampling, limits: InputLimits, param: str,
                with_audio: bool) -> None:
    """In the child: one decode, one answer ('ok', VideoPart) or ('error', (message, PipelineError fields))."""
    answer: tuple[str, Any]
    try:
        data = conn.recv_bytes()
        answer = ("ok", decoder(data, sampling=sampling, limits=limits, param=param, with_audio=with_audio))
    except PipelineError as e:
        answer = ("error", (e.message, {"http_status": e.http_status, "grpc_code": e.grpc_code, "kind": e.kind,
                                        "param": e.param}))
    except Exception as e:  # noqa: BLE001  # a decoder bug: the request fails, the gateway does not
        log.exception("%s: the video decoder raised", param)
        answer = ("error", (f"{param}: the video decoder failed on this file ({type(e).__name__}); send an intact "
                            "video file", {"http_status": 400, "grpc_code": 3, "kind": "invalid_request_error",
                                           "param": param}))
    conn.send(answer)
    conn.close()
