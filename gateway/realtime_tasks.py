"""The background tasks of a Realtime session (its input transcriptions, the vLLM dialect's transcription
worker; a response settles its own hang-up): kept in the session's set while they run, settled when they end.

A task whose send met a closed socket ends with WebSocketDisconnect: the client hung up, which is no error;
nobody awaits a task that ended on its own, so asyncio would log "Task exception was never retrieved" with a
traceback when it is collected. `spawn` retrieves that exception in the task's done callback, quietly; any
other exception is logged as the bug it is.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from fastapi import WebSocketDisconnect

log = logging.getLogger(__name__)


def spawn(coro: Coroutine[Any, Any, None], tasks: set[asyncio.Task], what: str) -> asyncio.Task:
    """`coro` as a task in `tasks` until it ends; `what` names it in the log."""
    task = asyncio.create_task(coro)
    tasks.add(task)

    def settled(done: asyncio.Task) -> None:
        tasks.discard(done)
        if done.cancelled():
            return
        exc = done.exception()  # retrieved: asyncio no longer logs it on collection
        if exc is not None and not isinstance(exc, WebSocketDisconnect):
            log.error("realtime %s failed", what, exc_info=exc)

    task.add_done_callback(settled)
    return task
