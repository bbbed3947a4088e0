"""`gateway/realtime_tasks.spawn`: a Realtime session's background task that ends because the client hung up
(WebSocketDisconnect from a send) is settled quietly, where asyncio logged "Task exception was never retrieved"
with a traceback once it was collected; any other exception is logged once as an error; each leaves the set."""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest
from fastapi import WebSocketDisconnect

from gateway.realtime_tasks import spawn


async def _raise(exc: BaseException) -> None:
    await asyncio.sleep(0)
    raise exc


async def test_a_hang_up_is_quiet_and_a_bug_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    tasks: set[asyncio.Task] = set()
    gone = spawn(_raise(WebSocketDisconnect(1006)), tasks, "input transcription")
    bug = spawn(_raise(RuntimeError("a bug")), tasks, "input transcription")
    sleeping = spawn(asyncio.sleep(10), tasks, "input transcription")
    assert tasks == {gone, bug, sleeping}
    sleeping.cancel()
    await asyncio.wait({gone, bug, sleeping})
    await asyncio.sleep(0)  # the done callbacks run
    assert tasks == set()
    del gone, bug, sleeping
    gc.collect()
    errors = [(r.name, r.getMessage(), r.exc_info[1] if r.exc_info else None)
              for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, errors
    name, message, exc = errors[0]
    assert name == "gateway.realtime_tasks" and message == "realtime input transcription failed"
    assert isinstance(exc, RuntimeError)
