"""BulkLane: the compute threads that run an engine's bulk steps (no request in them waits for its first
output) at a lower OS priority than the stage's other steps.

Role: on cores shared by the stages of a mesh, a new request's first audio (its prefill, first tokens,
first codes, first window) goes ahead of the work of requests already streaming. Linux keeps a nice value
per thread, and lowering one's own needs no privilege: each bulk step starts by setting its thread to the
stage's priority + `bulk_nice`. The engine runs one step at a time (per pipeline slot), so an urgent request
that becomes ready while a bulk step runs waits for it: `boost` then lifts the threads of the bulk steps in
flight back to the stage's priority for the rest of those steps (priority inheritance). Raising a priority
needs CAP_SYS_NICE or an RLIMIT_NICE that allows it (`docker run --ulimit nice=40`, Kubernetes
`capabilities: add: [SYS_NICE]`); without it, the first refusal turns boosting off and the rest works.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from omnimesh.proc_utils import name_thread

log = logging.getLogger(__name__)
T = TypeVar("T")


class BulkLane:
    def __init__(self, name: str, bulk_nice: int, workers: int):
        """Called on the thread whose priority is the stage's (the engine's asyncio thread)."""
        self.base = os.getpriority(os.PRIO_PROCESS, 0)
        self.value = min(19, self.base + bulk_nice)
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"{name}-bulk",
                                           initializer=name_thread, initargs=(f"{name}-bulk",))
        self._running: set[int] = set()  # native ids of the threads in a bulk step now
        self._lock = threading.Lock()
        self.can_boost = True
        self.boosts = 0

    def run(self, fn: Callable[..., T], *args: object) -> T:
        """On a lane thread: `fn(*args)` at the lane's priority (a boost lasts to the end of one step)."""
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, 0, self.value)  # PRIO_PROCESS, 0: the calling thread on Linux
        with self._lock:
            self._running.add(tid)
        try:
            return fn(*args)
        finally:
            with self._lock:
                self._running.discard(tid)

    def boost(self) -> int:
        """Lift the bulk steps in flight to the stage's priority; returns how many threads it lifted."""
        if not self.can_boost:
            return 0
        with self._lock:
            tids = list(self._running)
        lifted = 0
        for tid in tids:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, self.base)
                lifted += 1
            except ProcessLookupError:  # the thread ended
                continue
            except PermissionError:
                self.can_boost = False
                log.info("bulk steps are not lifted when an urgent request waits for one: raising a thread's "
                         "priority needs CAP_SYS_NICE or RLIMIT_NICE (e.g. docker run --ulimit nice=40)")
                break
        self.boosts += lifted
        return lifted

    def shutdown(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=False)
