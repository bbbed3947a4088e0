"""partition_layers: even split, remainder to the middle ranks (with a logged note), custom counts, errors.

Run: python -m pytest tests/parallel/test_partition.py -q
"""

from __future__ import annotations

import itertools
import logging

import pytest

from omnimesh.parallel.partition import partition_layers, uneven_partition_note


def counts(ranges: list[tuple[int, int]]) -> list[int]:
    return [end - start for start, end in ranges]


def test_even_split_is_contiguous_and_silent(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="omnimesh.parallel.partition"):
        assert partition_layers(48, 4) == [(0, 12), (12, 24), (24, 36), (36, 48)]
        assert partition_layers(4, 1) == [(0, 4)]
        assert partition_layers(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert caplog.records == []
    assert uneven_partition_note(48, 4) is None


@pytest.mark.parametrize(
    ("layers", "pp", "expected"),
    [
        (10, 4, [2, 3, 3, 2]),  # two extra layers: both middle ranks
        (9, 4, [2, 2, 3, 2]),  # one extra: the second-last rank (a middle one)
        (11, 4, [3, 3, 3, 2]),  # pp - 1 extra: the middle ranks, then the first; never the last
        (5, 2, [3, 2]),  # no middle rank: the first (the last also runs norm, head and sampling)
        (7, 3, [2, 3, 2]),
    ],
)
def test_remainder_goes_to_middle_ranks(layers: int, pp: int, expected: list[int],
                                        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="omnimesh.parallel.partition"):
        ranges = partition_layers(layers, pp)
    assert counts(ranges) == expected
    assert ranges[0][0] == 0 and ranges[-1][1] == layers
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    note = uneven_partition_note(layers, pp)
    assert note is not None and f"{layers} layers do not divide evenly over pp={pp}" in note
    assert any(note in r.getMessage() and str(expected) in r.getMessage() for r in caplog.records)


def test_custom_partition() -> None:
    assert partition_layers(4, 2, custom=[1, 3]) == [(0, 1), (1, 4)]
    assert partition_layers(48, 3, custom=(10, 20, 18)) == [(0, 10), (10, 30), (30, 48)]


@pytest.mark.parametrize(
    ("layers", "pp", "custom", "message"),
    [
        (4, 2, [1, 2, 1], r"custom partition \[1, 2, 1\] has 3 entries; pp=2 needs exactly 2"),
        (4, 2, [1, 2], r"custom partition \[1, 2\] sums to 3 layers; the model has 4"),
        (4, 2, [0, 4], r"custom partition \[0, 4\]: every pipeline rank needs at least 1 layer"),
        (4, 5, None, r"pp=5 exceeds the model's 4 layers.*use pp <= 4"),
        (4, 0, None, r"pp=0 must be >= 1"),
        (0, 1, None, r"num_layers=0 must be >= 1"),
    ],
)
def test_errors_name_the_numbers(layers: int, pp: int, custom: list[int] | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        partition_layers(layers, pp, custom)
