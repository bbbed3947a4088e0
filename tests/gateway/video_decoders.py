"""Stand-in video decoders for tests/gateway/test_video_process.py: module-level, so a forkserver child can
import them by name, each failing the way a broken FFmpeg could (signature of `decode_video`)."""

from __future__ import annotations

import faulthandler
import time
from typing import Any


def crash(data: bytes, **_: Any) -> None:
    """A decoder bug that kills the process: a segmentation fault."""
    faulthandler.disable()  # no traceback dump on the test's stderr
    faulthandler._sigsegv()


def hang(data: bytes, **_: Any) -> None:
    """Stuck inside one native call, where no deadline check runs."""
    time.sleep(3600)


def raise_bug(data: bytes, **_: Any) -> None:
    raise RuntimeError("a bug in the decoder")


def admitted_then_slow(data: bytes, *, admit: Any, **kw: Any) -> Any:
    """The real decoder's answer, after asking the media budget for 600 bytes and holding them 0.4 s."""
    from gateway.media_video import decode_video

    admit(600)
    time.sleep(0.4)
    return decode_video(data, **kw)


def peak_growth(conn: Any, data: bytes, warm_up: bytes) -> None:
    """In a fresh child: decode `warm_up` (the imports, the codec's first buffers), reset the peak resident size
    (/proc/self/clear_refs), decode `data` as a video and send (the frames' bytes, how far the peak rose above
    the resident size before), both in bytes."""
    from gateway.input_limits import InputLimits
    from gateway.media_video import decode_video
    from omnimesh.models.qwen3_omni.video_sampling import VideoSampling

    def status(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

    decode_video(warm_up, sampling=VideoSampling(), limits=InputLimits(), param="v")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
    except OSError:  # a kernel without it (before Linux 4.0): nothing to measure against
        conn.send((0, None))
        return
    before = status("VmRSS")
    part = decode_video(data, sampling=VideoSampling(), limits=InputLimits(), param="v")
    conn.send((part.frames.nbytes, status("VmHWM") - before))


def understated_audio(data: bytes, **kw: Any) -> Any:
    """The real audio decoder, for a file whose header says it lasts 1 s whatever it holds."""
    from gateway import media_video

    media_video._expected_seconds = lambda container, size, max_seconds: 1.0
    return media_video.decode_audio_file(data, **kw)


def understated_soundtrack(data: bytes, **kw: Any) -> Any:
    """The real video decoder with its soundtrack, for a file whose audio header says it lasts 1 s."""
    from gateway import media_video

    media_video._expected_seconds = lambda container, size, max_seconds: 1.0
    return media_video.decode_video(data, **{**kw, "with_audio": True})
