"""EncoderCache: the encoder stage's outputs per media item, kept by content so the same audio, image or
video is encoded once (--encoder-cache-memory; 0 turns it off).

A chat's history carries its media again on every turn, and many clients send the same picture or clip with
different questions: without this, each turn runs the towers on all of it again. With it:

    encode_batch (encoder_batcher.py): each request's media split into items (one audio clip's valid mel
      frames, one image's or video's patches and grid) -> a content key: the gateway's digest of the
      decoded media and its processor settings (`audio_hashes` / `image_hashes` / `video_hashes`, as the
      thinker's prefix cache gets them; gateway/media_digest.py) with the item's shapes, or without one
      `key(kind, inputs)` = BLAKE2b of the item's kind, shapes, dtypes and bytes -> `get` (a hit: the item's output rows, no tower call) -> the misses
      of the whole step (an item twice in a step computed once) in one call per tower -> `put` (the rows
      copied out of the batch's output, so an entry holds only its own memory) -> each request's outputs
      put together from its items in order

An item's output does not depend on the rest of its batch (the towers keep items apart), so a hit gives the
rows a fresh run would, to the batch-to-batch rounding the batched encoder already has. Least recently used
entries go first once the bytes pass the capacity; an item larger than the whole capacity is not kept.
`stats()` feeds the stage's metrics: omnimesh:encoder_cache_queries / _hits (items) and
omnimesh:encoder_cache_usage_bytes.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

import torch

Rows = tuple[torch.Tensor, ...]  # an item's output: audio (embeds,); image / video (embeds, *deepstack)


def key(kind: str, *inputs: torch.Tensor) -> bytes:
    """An item's content key: what the towers would read of it, byte for byte."""
    h = hashlib.blake2b(kind.encode(), digest_size=16)
    for t in inputs:
        t = t.detach().contiguous().cpu()
        h.update(f"{tuple(t.shape)}{t.dtype};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else b"")
    return h.digest()


def _nbytes(rows: Rows) -> int:
    return sum(t.numel() * t.element_size() for t in rows)


class EncoderCache:
    """Item outputs by content key, least recently used first out past `capacity` bytes; thread-safe."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"an encoder cache needs a positive capacity in bytes, got {capacity}")
        self.capacity = capacity
        self.bytes = 0
        self.queries = self.hits = 0
        self._entries: OrderedDict[bytes, Rows] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, k: bytes) -> Rows | None:
        with self._lock:
            self.queries += 1
            rows = self._entries.get(k)
            if rows is not None:
                self.hits += 1
                self._entries.move_to_end(k)
            return rows

    def put(self, k: bytes, rows: Rows) -> None:
        """Keep a copy of `rows` (views into a batch's output would hold all of it)."""
        size = _nbytes(rows)
        if size > self.capacity:
            return
        owned = tuple(t.clone() for t in rows)
        with self._lock:
            if k in self._entries:
                return
            self._entries[k] = owned
            self.bytes += size
            while self.bytes > self.capacity:
                _, old = self._entries.popitem(last=False)
                self.bytes -= _nbytes(old)

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"encoder_cache_queries": self.queries, "encoder_cache_hits": self.hits,
                    "encoder_cache_usage_bytes": self.bytes}
