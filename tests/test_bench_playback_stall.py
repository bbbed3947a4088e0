"""bench/common.playback_stall: the silences a player hears that starts at a stream's first audio delta.

Run: python -m pytest tests/test_bench_playback_stall.py -q
"""

from __future__ import annotations

import pytest

from bench.common import playback_stall

RATE = 24000


def test_audio_that_always_comes_ahead_of_playback_never_stalls() -> None:
    # 0.1 s of audio at 0.1 s, the next 0.1 s at 0.15 (the player is then at 0.05 s of 0.1 held)
    assert playback_stall([(0.1, 2400), (0.15, 2400)], RATE) == 0.0
    assert playback_stall([(0.1, 2400)], RATE) == 0.0
    assert playback_stall([], RATE) == 0.0


def test_each_dry_buffer_adds_the_wait_for_the_next_delta() -> None:
    # the first 0.1 s runs out at 0.2; the next comes at 0.35 (0.15 s silent) and plays to 0.45;
    # the third comes at 0.5 (0.05 s more)
    assert playback_stall([(0.1, 2400), (0.35, 2400)], RATE) == pytest.approx(0.15)
    assert playback_stall([(0.1, 2400), (0.35, 2400), (0.5, 24000)], RATE) == pytest.approx(0.2)


def test_audio_held_ahead_carries_over_later_deltas() -> None:
    # 1 s held at 0.1: deltas at 0.5 and 0.9 find the buffer still full; one at 1.6 comes after it ran dry
    # at 0.1 + 1 + 0.1 + 0.1 = 1.3
    assert playback_stall([(0.1, 24000), (0.5, 2400), (0.9, 2400), (1.6, 2400)], RATE) == pytest.approx(0.3)
