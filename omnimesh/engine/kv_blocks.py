"""BlockAllocator: the free list of a stage's paged KV cache (driver side; ranks only see block ids), and its
prefix cache.

Role: the LM scheduler takes blocks from here as a request's tokens grow and gives them all back the
moment the request finishes, is cancelled, or is preempted. The pool itself lives on every rank
(`models/qwen3_omni/paged_kv.py`); block ids name the same block on all of them.

Prefix caching (vLLM's automatic prefix caching, `--enable-prefix-caching`): a full block whose keys and
values are known to depend only on a known token prefix is registered under that prefix's hash (`register`,
`prefix_hashes`). A later request whose prompt starts with the same blocks takes them (`match`) instead of
computing them again: blocks are reference-counted, so several running requests read one block. A block
no request holds stays in the free list with its contents (it counts as free); taking it for new tokens
evicts it from the cache, least recently freed first, and a request's later blocks are freed ahead of its
first ones (`free`), so the shared heads of prompts are evicted last.

Which free block new tokens take: one that holds no cached prefix (all of them without prefix caching)
before any cached one, and of those the most recently freed (a stack). The blocks in use then stay as few
as the load needs, instead of cycling through the whole pool: on CPU the pool's pages are touched (and
count in the stage's resident memory) only as blocks are first used, and a block freed a moment ago may
still be in the CPU's caches. (Taking the least recently freed, as the cache's eviction order does, walked
every request onto blocks never touched before: a thinker's resident memory grew by its new blocks' bytes,
about 40 KB a short request on the tiny model, until the whole 4 GiB pool was resident.)
A block may carry a payload beside its keys and values (`attach` / `payload`: the thinker keeps there the
hidden states of media rows the talker reads); it lives exactly as long as the block's contents, until the
block is handed out for new tokens.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from math import ceil
from typing import Any

import numpy as np

ROOT_HASH = b"omnimesh-prefix-v1"


def prefix_hashes(keys: np.ndarray, block_size: int, limit: int | None = None) -> list[bytes]:
    """The chained hashes of the whole blocks of `keys` ((n, k) int64: one row of integers per token that
    fixes its keys and values, e.g. token id and M-RoPE positions): block i's hash covers blocks 0..i
    (sha256, vLLM's --prefix-caching-hash-algo sha256). At most `limit` blocks."""
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    whole = keys.shape[0] // block_size if limit is None else min(limit, keys.shape[0] // block_size)
    out: list[bytes] = []
    parent = ROOT_HASH
    for i in range(whole):
        parent = hashlib.sha256(parent + keys[i * block_size:(i + 1) * block_size].tobytes()).digest()
        out.append(parent)
    return out


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_caching = prefix_caching
        self._free: OrderedDict[int, None] = OrderedDict()  # free blocks with a cached prefix: LRU, first out first
        self._spare = list(range(num_blocks - 1, -1, -1))  # the other free blocks: a stack, block 0 on top
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}  # cached block -> its prefix hash
        self._block_of: dict[bytes, int] = {}  # prefix hash -> cached block
        self._payload: dict[int, dict[int, Any]] = {}  # block -> {offset in block: what the engine attached}
        self.queried_tokens = 0  # prompt tokens looked up in the prefix cache (vLLM's prefix_cache_queries)
        self.hit_tokens = 0  # of those, tokens found (prefix_cache_hits)
        self.payload_bytes = 0  # of what is attached (tensors' nbytes): at most one row per cached token

    @property
    def num_free(self) -> int:
        """Blocks no request holds (cached ones included: new tokens may evict them)."""
        return len(self._free) + len(self._spare)

    @property
    def num_cached(self) -> int:
        """Blocks that hold a registered prefix (held or free)."""
        return len(self._block_of)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def usage(self) -> float:
        """Fraction of blocks in use (0..1)."""
        return 1.0 - self.num_free / self.num_blocks

    def blocks_for(self, tokens: int) -> int:
        return ceil(tokens / self.block_size)

    def grow(self, table: list[int], tokens: int) -> bool:
        """Extend `table` to hold `tokens`; False (table unchanged) if too few blocks are free."""
        need = self.blocks_for(tokens) - len(table)
        if need <= 0:
            return True
        if need > self.num_free:
            return False
        for _ in range(need):
            block = self._spare.pop() if self._spare else self._free.popitem(last=False)[0]
            self._evict(block)
            self._refs[block] = 1
            table.append(block)
        return True

    def free(self, table: list[int]) -> None:
        """Release every block of `table` (which is emptied); a block no one else holds becomes free, the
        table's last blocks first in line to be reused (cached ones: evicted)."""
        spare = []
        for block in reversed(table):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._free[block] = None
                else:
                    spare.append(block)
        self._spare.extend(reversed(spare))
        table.clear()

    def match(self, hashes: Sequence[bytes], tokens: int) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` (a prompt's `prefix_hashes`), each now also held
        by the caller (release them with `free`); counts `tokens` prompt tokens queried and the hits."""
        blocks: list[int] = []
        if not self.prefix_caching:
            return blocks
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
            blocks.append(block)
        self.queried_tokens += tokens
        self.hit_tokens += len(blocks) * self.block_size
        return blocks

    def unmatch(self, table: list[int], tokens: int) -> None:
        """Undo a `match` whose request could not start after all: its blocks released (still cached), the
        query uncounted (the next attempt counts it)."""
        self.queried_tokens -= tokens
        self.hit_tokens -= len(table) * self.block_size
        self.free(table)

    def register(self, pairs: Iterable[tuple[int, bytes]]) -> None:
        """(held block, prefix hash) of full blocks whose contents are now computed: later prompts may take them.
        A hash already cached (two requests computed the same prefix at once) keeps its first block."""
        if not self.prefix_caching:
            return
        for block, h in pairs:
            if h not in self._block_of and block not in self._hash_of and self._refs[block] > 0:
                self._block_of[h] = block
                self._hash_of[block] = h

    def attach(self, block: int, offset: int, value: Any) -> None:
        """Keep `value` with the row at `offset` of `block` while the block keeps its contents."""
        rows = self._payload.setdefault(block, {})
        self.payload_bytes += int(getattr(value, "nbytes", 0)) - int(getattr(rows.get(offset), "nbytes", 0))
        rows[offset] = value

    def payload(self, block: int) -> dict[int, Any]:
        """What was attached to the block's rows since it was last handed out (offset -> value)."""
        return self._payload.get(block, {})

    def _evict(self, block: int) -> None:
        rows = self._payload.pop(block, None)
        if rows:
            self.payload_bytes -= sum(int(getattr(v, "nbytes", 0)) for v in rows.values())
        h = self._hash_of.pop(block, None)
        if h is not None:
            del self._block_of[h]
