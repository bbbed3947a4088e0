"""BlockAllocator: the free list of a stage's paged KV cache (driver side; ranks only see block ids).

Role: the LM scheduler takes blocks from here as a request's tokens grow and gives them all back the
moment the request finishes, is cancelled, or is preempted. The pool itself lives on every rank
(`models/qwen3_omni/paged_kv.py`); block ids name the same block on all of them.
"""

from __future__ import annotations

from collections import deque
from math import ceil


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def usage(self) -> float:
        """Fraction of blocks in use (0..1)."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for(self, tokens: int) -> int:
        return ceil(tokens / self.block_size)

    def grow(self, table: list[int], tokens: int) -> bool:
        """Extend `table` to hold `tokens`; False (table unchanged) if too few blocks are free."""
        need = self.blocks_for(tokens) - len(table)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        table.extend(self._free.popleft() for _ in range(need))
        return True

    def free(self, table: list[int]) -> None:
        """Return every block of `table` (which is emptied)."""
        self._free.extend(table)
        table.clear()
