"""take_run: the items queued right behind one in hand that can join it, taken without waiting.

Role: where a writer has fallen behind, several outputs of one kind wait in its asyncio queue; taking them
as one run lets the writer send one message instead of several (the stage servicer merges a request's
output chunks, the gateway joins text / audio deltas). Nothing ever waits for a run to grow.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


def take_run(first: Any, queue: asyncio.Queue, joins: Callable[[Any, Any], bool]) -> tuple[list[Any], list[Any]]:
    """`first` and the items queued behind it while `joins(first, item)` holds -> (the run, [the item that
    ended it] or [] when the queue ran empty). The ending item is returned, never lost: the caller handles
    it next (it may be None, a relay's end marker)."""
    run = [first]
    while not queue.empty():
        item = queue.get_nowait()
        if not joins(first, item):
            return run, [item]
        run.append(item)
    return run, []
