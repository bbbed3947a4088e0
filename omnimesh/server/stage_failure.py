"""StageFailure: a stage-wide fault (a rank died) that the server must hear about.

A handler owns one; whatever detects the fault (the executor's rank monitor, on its own thread) calls
`report`; the stage server listens and turns its health to NOT_SERVING, and the handler refuses new
requests with UNAVAILABLE naming the fault.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class StageFailure:
    def __init__(self) -> None:
        self.message: str | None = None
        self._listeners: list[Callable[[str], None]] = []
        self._lock = threading.Lock()

    def listen(self, callback: Callable[[str], None]) -> None:
        """Called (from any thread) once, with the message, when the stage fails."""
        with self._lock:
            self._listeners.append(callback)
            message = self.message
        if message is not None:
            callback(message)

    def report(self, message: str) -> None:
        with self._lock:
            if self.message is not None:
                return
            self.message = message
            listeners = list(self._listeners)
        for callback in listeners:
            callback(message)
