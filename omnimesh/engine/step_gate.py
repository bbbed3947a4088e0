"""StepGate: a stage's bulk steps pause at their model's checkpoints while one of its urgent steps runs.

Role: an in-process stage with two compute slots (EngineLoop `preempt`) starts a step of pressing requests
(a new request's first output, a near playback deadline) at once beside a bulk step in flight, instead of
after it. Two steps at once would share the process's GIL and its cores' time; instead the bulk step, at
its next checkpoint (between decoder layers, code-predictor steps or conv blocks: `checkpoint()`, called by
the model code), waits, GIL released, until no urgent step runs, for at most `max_pause_s` per step so
streams never starve. A thread outside a gated bulk step (an urgent step, a rank process, a test) passes
every checkpoint at the cost of one thread-local read.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

_local = threading.local()


class StepGate:
    def __init__(self, max_pause_s: float = 0.05) -> None:
        if max_pause_s < 0:
            raise ValueError(f"max_pause_s must be >= 0, got {max_pause_s}")
        self.max_pause_s = max_pause_s
        self._cond = threading.Condition()
        self._urgent = 0  # urgent steps running now
        self.pauses = 0  # checkpoints at which a bulk step waited

    @contextmanager
    def urgent(self) -> Iterator[None]:
        """Around an urgent step: bulk steps wait at their next checkpoint until it ends."""
        with self._cond:
            self._urgent += 1
        try:
            yield
        finally:
            with self._cond:
                self._urgent -= 1
                if not self._urgent:
                    self._cond.notify_all()

    @contextmanager
    def bulk(self) -> Iterator[None]:
        """Around a bulk step, on its thread: its checkpoints wait for urgent steps (up to max_pause_s in all)."""
        _local.gate, _local.budget = self, self.max_pause_s
        try:
            yield
        finally:
            _local.gate = None

    def _pause(self) -> None:
        started = time.monotonic()
        with self._cond:
            if self._urgent:
                self.pauses += 1
                self._cond.wait_for(lambda: not self._urgent, timeout=_local.budget)
        _local.budget -= time.monotonic() - started


def checkpoint() -> None:
    """Called by model code between its layers / blocks: a gated bulk step waits here while an urgent one runs."""
    gate = getattr(_local, "gate", None)
    if gate is not None and gate._urgent and _local.budget > 0:
        gate._pause()
