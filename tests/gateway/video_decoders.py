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
