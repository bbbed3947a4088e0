"""code_windows: the vocoder's decode windows (and the talker's chunks of codes) as a schedule, the last
entry repeating; `--audio-windows` parsing.

Run: python -m pytest tests/models/test_code_windows.py -q
"""

from __future__ import annotations

import pytest

from omnimesh.models.qwen3_omni.code_windows import DEFAULT_WINDOWS, parse_windows, window_size, windows_text


def test_the_last_window_repeats() -> None:
    assert [window_size(i, (5, 25)) for i in range(4)] == [5, 25, 25, 25]
    assert [window_size(i, (5, 10, 20, 25)) for i in range(6)] == [5, 10, 20, 25, 25, 25]
    assert [window_size(i, (1,)) for i in range(3)] == [1, 1, 1]
    assert window_size(10**9, DEFAULT_WINDOWS) == 25


def test_schedules_parse_and_print_back() -> None:
    assert parse_windows("5, 10,20 ,25") == (5, 10, 20, 25)
    assert parse_windows(windows_text(DEFAULT_WINDOWS)) == DEFAULT_WINDOWS == (5, 25)
    assert parse_windows("8,5") == (8, 5)  # a first window longer than the rest is allowed


@pytest.mark.parametrize("bad", ["", "5,", "0,25", "5,-1", "a", "5;25", "2.5", ",".join(["1"] * 33)])
def test_a_bad_schedule_says_what_it_must_be(bad: str) -> None:
    with pytest.raises(ValueError, match=r"--audio-windows must be 1 to 32 comma-separated whole numbers of codes"):
        parse_windows(bad)
    with pytest.raises(ValueError, match="option windows must be"):
        parse_windows(bad, "option windows")
