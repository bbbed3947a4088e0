"""merge_ready: deltas of one kind that queued up behind the one in hand leave joined; the queue's next
other item (a relay's end marker too) is handed back, never lost.

Run: python -m pytest tests/gateway/test_merge_ready.py -q
"""

from __future__ import annotations

import asyncio

import numpy as np

from gateway.events import AudioDelta, Finished, TextDelta
from gateway.pipeline import merge_ready


def queue_of(*items: object) -> asyncio.Queue:
    q: asyncio.Queue = asyncio.Queue()
    for item in items:
        q.put_nowait(item)
    return q


def test_texts_join_up_to_the_next_other_item() -> None:
    q = queue_of(TextDelta("b"), TextDelta("c"), None, TextDelta("d"))
    item, held = merge_ready(TextDelta("a"), q)
    assert item == TextDelta("abc") and held == [None]  # the relay's end marker comes back
    assert q.qsize() == 1


def test_audio_joins_at_one_rate_only() -> None:
    a, b, c = (AudioDelta(np.full(3, float(i), np.float32), 24000) for i in range(3))
    other = AudioDelta(np.ones(2, np.float32), 16000)
    item, held = merge_ready(a, queue_of(b, c, other))
    assert isinstance(item, AudioDelta) and item.sample_rate == 24000
    assert item.pcm.tolist() == [0.0] * 3 + [1.0] * 3 + [2.0] * 3
    assert held == [other]


def test_nothing_queued_or_not_a_delta_passes_as_is() -> None:
    only = TextDelta("x")
    assert merge_ready(only, queue_of()) == (only, [])
    done = Finished(finish_reason="stop", prompt_tokens=1, completion_tokens=2)
    q = queue_of(TextDelta("y"))
    assert merge_ready(done, q) == (done, []) and q.qsize() == 1
    text_then_audio = queue_of(AudioDelta(np.zeros(1, np.float32), 24000))
    item, held = merge_ready(only, text_then_audio)
    assert item is only and len(held) == 1 and isinstance(held[0], AudioDelta)
