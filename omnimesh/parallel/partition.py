"""Split a decoder's layers into contiguous pipeline ranges, one per pipeline rank.

Role: decides which layers each PP rank builds and loads (and so its weight memory). Even split by
default; when the layers do not divide by pp, the extra layers go to the middle ranks, because the first
rank also holds the embedding and the last rank the final norm, the LM head and sampling. A custom
partition (layer counts per rank) overrides the default.

Data flow:  (num_layers, pp, custom counts | None) -> [(start, end), ...]  (pp entries, [start, end))

    >>> partition_layers(10, 4)
    [(0, 2), (2, 5), (5, 8), (8, 10)]
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

log = logging.getLogger(__name__)


def uneven_partition_note(num_layers: int, pp: int) -> str | None:
    """The advice printed when `num_layers` does not divide by `pp` (None when it does)."""
    if pp < 1 or num_layers % pp == 0:
        return None
    extra = num_layers % pp
    return (
        f"{num_layers} layers do not divide evenly over pp={pp}: {extra} rank(s) get "
        f"{num_layers // pp + 1} layers instead of {num_layers // pp} (the middle ranks first, since the first "
        f"rank also holds the embedding and the last the norm and LM head); pass a custom partition to "
        f"choose, or a pp that divides {num_layers}"
    )


def partition_layers(num_layers: int, pp: int, custom: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """Contiguous [start, end) layer ranges, one per pipeline rank, covering 0..num_layers exactly.

    Default: `num_layers // pp` each; the remainder (at most pp - 1 layers) goes one layer each to ranks
    pp-2, pp-3, ... (middle ranks first; the first rank only when the remainder is pp - 1; never the last
    rank). Logs `uneven_partition_note` then. `custom`: layer counts per rank, pp entries, each >= 1,
    summing to `num_layers`.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers={num_layers} must be >= 1")
    if pp < 1:
        raise ValueError(f"pipeline-parallel size pp={pp} must be >= 1")
    if pp > num_layers:
        raise ValueError(
            f"pipeline-parallel size pp={pp} exceeds the model's {num_layers} layers: every pipeline rank needs "
            f"at least one layer; use pp <= {num_layers}"
        )
    if custom is not None:
        counts = [int(c) for c in custom]
        if len(counts) != pp:
            raise ValueError(f"custom partition {counts} has {len(counts)} entries; pp={pp} needs exactly {pp}")
        if any(c < 1 for c in counts):
            raise ValueError(f"custom partition {counts}: every pipeline rank needs at least 1 layer")
        if sum(counts) != num_layers:
            raise ValueError(
                f"custom partition {counts} sums to {sum(counts)} layers; the model has {num_layers}"
            )
    else:
        counts = [num_layers // pp] * pp
        for i in range(num_layers % pp):
            counts[pp - 2 - i] += 1
        note = uneven_partition_note(num_layers, pp)
        if note:
            log.warning("%s -> layer counts %s", note, counts)
    ranges: list[tuple[int, int]] = []
    start = 0
    for count in counts:
        ranges.append((start, start + count))
        start += count
    return ranges
