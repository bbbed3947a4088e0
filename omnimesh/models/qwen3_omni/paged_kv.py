"""Paged KV cache of one rank, and the per-step batch layout its attention reads.

Role: continuous batching keeps the keys/values of every running request of a thinker / talker stage in
one pool per layer, cut into fixed blocks of `block_size` tokens (vLLM's PagedAttention layout). The
driver's scheduler owns the block ids (`omnimesh/engine/kv_blocks.py`) and ships each step's
`BatchLayout` to every rank inside the step command, so all ranks read and write the same slots.

Data flow for one batched step on one rank (N packed tokens of B requests, see parallel_text_model.py):
    BatchLayout.build([(n_new, past, block table) per request], block_size)   on the driver, once per step
    per layer: q (1, nh, N, D), k/v (1, nkv, N, D) -> PagedBatch.attend
        -> k/v written to their slots (slot = block * block_size + offset)
        -> requests with one new token (decodes): their keys gathered into a padded (Bg, nkv, Smax, D), one
           SDPA call with a key-padding mask per group of Bg decodes, the groups as large as
           DECODE_GATHER_BYTES allows (`decode_group`), so a step's transient memory stays bounded however many
           long requests it carries; on CPU (float32) one kernel call instead writes every new key and attends
           each decode over its own slots in the pool (`cpu_kernels.paged_decode`)
        -> requests with several new tokens (prefill chunks): one SDPA each, causal over past + chunk
        -> o (1, nh, N, D) in packed order
Pool memory per rank: 2 x layers x num_blocks x block_size x (n_kv_heads / tp) x head_dim x dtype size.

The pool's dtype is the model's unless --kv-cache-dtype says otherwise (`KV_CACHE_DTYPES`): bfloat16 halves a
float32 cache, fp8 (e4m3 or e5m2) quarters it. Keys and values are cast (fp8: saturated at the format's
largest value, scale 1.0 as vLLM's without calibrated scales) when written and cast back to the compute dtype
when read, so attention itself runs in the model's dtype; fp8 pools are read and written as bytes (CPU
index_copy has no fp8 kernel).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omnimesh.kernels import cpu_kernels
from omnimesh.models.qwen3_omni.parallel_text_model import gqa_attention
from omnimesh.models.qwen3_omni.text_arch import text_arch

CPU_KV_CACHE_BYTES = 4 * 2**30  # the KV pool on CPU without --kv-cache-memory: vLLM's CPU default (VLLM_CPU_KVCACHE_SPACE=4)

# --kv-cache-dtype (vLLM's names, omnimesh.config.stage_config.KV_CACHE_DTYPE_CHOICES): auto = the model's dtype
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
PAGED_KERNEL_KEYS = 16384  # the CPU kernel's limit on a decode's keys (its softmax is not vectorised; SDPA beyond)
# what one group of gathered decodes may take at once (keys and values in the compute dtype, and their copies
# per query head where SDPA needs them): 256 decodes of 32k keys on a real Qwen3-Omni thinker would be ~70 GB
# in one call; a GPU rank keeps this much free beside its KV pool (`lm_shard`'s budget)
DECODE_GATHER_BYTES = 512 * 2**20


def gathered_bytes(keys: int, kv_heads: int, heads: int, head_dim: int, elem_bytes: int, repeat: bool) -> int:
    """What one request's `keys` gathered keys and values take in the compute dtype, plus their per-query-head
    copies when `repeat` (`gqa_attention` off CPU)."""
    return 2 * keys * head_dim * elem_bytes * (kv_heads + (heads if repeat else 0))


def decode_group(smax: int, kv_heads: int, heads: int, head_dim: int, elem_bytes: int, repeat: bool,
                 limit: int = DECODE_GATHER_BYTES) -> int:
    """How many decodes of up to `smax` keys one gathered SDPA call takes within `limit` bytes (at least 1)."""
    return max(1, limit // max(1, gathered_bytes(smax, kv_heads, heads, head_dim, elem_bytes, repeat)))


def gather_reserve(max_model_len: int, kv_heads: int, heads: int, head_dim: int, elem_bytes: int,
                   repeat: bool) -> int:
    """The most a step's attention gathers at once beside its activations: a group of decodes (bounded by
    DECODE_GATHER_BYTES, or one request past it) or one prefill chunk's whole past (chunks run one at a time),
    each up to `max_model_len` keys."""
    one = gathered_bytes(max_model_len, kv_heads, heads, head_dim, elem_bytes, repeat)
    return max(DECODE_GATHER_BYTES, one)


def block_bytes(config: Any, layers: int, tp: int, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one cache block takes on a rank holding `layers` layers and 1/tp of the KV heads."""
    kv_heads = max(1, config.num_key_value_heads // tp)
    head_dim = text_arch(config).head_dim
    return 2 * layers * block_size * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool dtype --kv-cache-dtype `name` gives a model computing in `model_dtype`."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return KV_CACHE_DTYPES[name] or model_dtype


def store(pool: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """x (N, nkv, D) into `pool`'s rows `slots`, cast to the pool's dtype (fp8: saturated, as bytes)."""
    if pool.dtype in FP8:
        top = torch.finfo(pool.dtype).max
        pool.view(torch.uint8).index_copy_(0, slots, x.clamp(-top, top).to(pool.dtype).view(torch.uint8))
    else:
        pool.index_copy_(0, slots, x.to(pool.dtype))


def load(pool: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`pool`'s rows at `slots` (any shape of slot ids) in the compute dtype."""
    if pool.dtype in FP8:
        return pool.view(torch.uint8)[slots].view(pool.dtype).to(dtype)
    return pool[slots].to(dtype)


@dataclass(frozen=True)
class PrefillSlice:
    start: int  # first packed row
    n: int  # new tokens
    slots: torch.Tensor  # (past + n,) cache slots of all its keys, in position order
    past: int  # keys already cached: 0 = plain causal from an empty cache

    def mask(self, device: torch.device | str) -> torch.Tensor | None:
        """(n, past + n) bool, made where attention runs (at 128k keys a 2048-row chunk's mask is 256 MiB: not
        something to build on the driver and send to every rank); None without a past (SDPA's causal flag)."""
        if self.past == 0:
            return None
        total = self.past + self.n  # query i sees keys 0 .. past + i
        return torch.arange(total, device=device)[None, :] <= torch.arange(self.past, total, device=device)[:, None]


@dataclass(frozen=True)
class BatchLayout:
    """Where each packed token's keys go and which keys each request attends to (built on the driver)."""

    num_tokens: int
    write_slots: torch.Tensor  # (N,) int64
    decode_rows: torch.Tensor  # (Bd,) packed rows of the one-token requests
    decode_slots: torch.Tensor  # (Bd, Smax) their keys' slots, padded with slot 0
    decode_mask: torch.Tensor | None  # (Bd, 1, 1, Smax) bool; None when no request is padded
    decode_lens: torch.Tensor  # (Bd,) int64 keys of each one-token request (the CPU kernel reads these)
    prefills: tuple[PrefillSlice, ...]

    @classmethod
    def build(cls, seqs: list[tuple[int, int, list[int]]], block_size: int) -> BatchLayout:
        """`seqs`: per request (n_new, past, block table), in packed order. Slot arithmetic in numpy (one
        call per request instead of a dozen torch ops: this runs on the driver every step)."""
        write: list[np.ndarray] = []
        dec_rows: list[int] = []
        dec_slots: list[np.ndarray] = []
        prefills: list[PrefillSlice] = []
        offsets = np.arange(block_size, dtype=np.int64)
        row = 0
        for n, past, blocks in seqs:
            total = past + n
            needed = -(-total // block_size)
            if n < 1 or needed > len(blocks):
                raise ValueError(f"a request with {past} cached + {n} new tokens needs {needed} "
                                 f"blocks, its table has {len(blocks)}")
            # slot of position p = block[p // block_size] * block_size + p % block_size
            slots = (np.asarray(blocks[:needed], dtype=np.int64)[:, None] * block_size + offsets).reshape(-1)[:total]
            write.append(slots[past:])
            if n == 1:
                dec_rows.append(row)
                dec_slots.append(slots)
            else:
                prefills.append(PrefillSlice(row, n, torch.from_numpy(slots), past))
            row += n
        lengths = np.array([s.size for s in dec_slots], dtype=np.int64)
        smax = int(lengths.max()) if len(dec_slots) else 0
        padded = np.zeros((len(dec_slots), smax), dtype=np.int64)
        for i, s in enumerate(dec_slots):
            padded[i, :s.size] = s
        ragged = bool((lengths != smax).any())
        mask = (torch.from_numpy(np.arange(smax)[None, :] < lengths[:, None]).view(len(dec_slots), 1, 1, smax)
                if ragged else None)
        return cls(num_tokens=row,
                   write_slots=torch.from_numpy(np.concatenate(write)) if write else torch.zeros(0, dtype=torch.long),
                   decode_rows=torch.tensor(dec_rows, dtype=torch.long), decode_slots=torch.from_numpy(padded),
                   decode_mask=mask, decode_lens=torch.from_numpy(lengths), prefills=tuple(prefills))


class PagedKVPool:
    """This rank's K and V pools: per owned layer (num_blocks * block_size, n_kv / tp, head_dim)."""

    def __init__(self, layer_range: tuple[int, int], num_blocks: int, block_size: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.start, self.end = layer_range
        self.num_blocks, self.block_size = num_blocks, block_size
        slots = num_blocks * block_size
        # torch.empty: pages are touched only as blocks fill, so an unused CPU pool costs no resident memory
        self.k = [torch.empty(slots, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(self.end - self.start)]
        self.v = [torch.empty(slots, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(self.end - self.start)]
        for pool in self.k + self.v:  # padded rows of a gathered step read slot 0, masked out; a NaN left in it
            pool[:block_size].view(torch.uint8).zero_()  # by earlier use of the memory would still poison 0 x NaN

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class PagedBatch:
    """The cache as one batched step sees it: implements `attend` like `KVCache` does for one request."""

    def __init__(self, pool: PagedKVPool, layout: BatchLayout) -> None:
        self.pool, self.layout = pool, layout
        device = pool.k[0].device if pool.k else "cpu"
        self.write_slots = layout.write_slots.to(device)
        self.decode_rows = layout.decode_rows.to(device)
        self.decode_slots = layout.decode_slots.to(device)
        self.decode_mask = None if layout.decode_mask is None else layout.decode_mask.to(device)
        self.decode_lens = layout.decode_lens
        self.prefills = [(p.start, p.n, p.slots.to(device), p.mask(device)) for p in layout.prefills]
        smax = layout.decode_slots.shape[1] if layout.decode_slots.dim() == 2 else 0
        # the CPU kernel writes every new key and attends each decode over its own slots (no padded gather)
        self.fused = bool(pool.k) and smax <= PAGED_KERNEL_KEYS and cpu_kernels.use(pool.k[0])

    def decode_only(self, layer_idx: int) -> tuple[torch.Tensor, ...] | None:
        """For a fused decoder layer (`ParallelDecoderLayer._fused`): the layer's pools and this step's slots, in
        `cpu_kernels.paged_decode`'s order, when every request has one new token and that kernel takes them (float32
        pools); else None (`attend` then runs)."""
        if not self.fused or self.prefills or not self.pool.start <= layer_idx < self.pool.end:
            return None
        kp, vp = self.pool.k[layer_idx - self.pool.start], self.pool.v[layer_idx - self.pool.start]
        if kp.dtype != torch.float32:
            return None
        return kp, vp, self.write_slots, self.decode_rows, self.decode_slots, self.decode_lens

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_rep: int,
               scale: float) -> torch.Tensor:
        """q (1, nh, N, D), k/v (1, nkv, N, D) of the packed tokens -> attention output (1, nh, N, D)."""
        if not self.pool.start <= layer_idx < self.pool.end:
            raise ValueError(f"layer {layer_idx} is not in this pool's range [{self.pool.start}, {self.pool.end})")
        kp, vp = self.pool.k[layer_idx - self.pool.start], self.pool.v[layer_idx - self.pool.start]
        if self.fused and q.dtype == kp.dtype:
            out = q.new_empty(q.shape)  # (1, nh, N, D) contiguous; the kernel fills the decode rows
            cpu_kernels.ops().paged_decode(q, k, v, kp, vp, self.write_slots, self.decode_rows, self.decode_slots,
                                           self.decode_lens, scale, out)
            self._prefill(q, kp, vp, n_rep, scale, out)
            return out
        store(kp, self.write_slots, k[0].transpose(0, 1))  # (N, nkv, D) into their slots
        store(vp, self.write_slots, v[0].transpose(0, 1))
        out = torch.empty_like(q)  # (1, nh, N, D)
        if self.decode_rows.numel():
            self._decodes(q, kp, vp, n_rep, scale, out)
        self._prefill(q, kp, vp, n_rep, scale, out)
        return out

    def _decodes(self, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, n_rep: int, scale: float,
                 out: torch.Tensor) -> None:
        """The decode rows of `out`: each group of decodes (`decode_group`) gathered and attended in one call."""
        Bd, smax = self.decode_slots.shape
        heads, D = q.shape[1], q.shape[3]
        group = decode_group(smax, heads // n_rep, heads, D, q.element_size(), n_rep > 1 and q.device.type != "cpu",
                             DECODE_GATHER_BYTES)
        for a in range(0, Bd, group):
            rows, slots = self.decode_rows[a:a + group], self.decode_slots[a:a + group]
            mask = None if self.decode_mask is None else self.decode_mask[a:a + group]
            qd = q[0, :, rows].transpose(0, 1).unsqueeze(2)  # (Bg, nh, 1, D)
            kd = load(kp, slots, q.dtype).permute(0, 2, 1, 3)  # (Bg, nkv, Smax, D)
            vd = load(vp, slots, q.dtype).permute(0, 2, 1, 3)
            od = gqa_attention(qd, kd, vd, n_rep, scale, mask)  # (Bg, nh, 1, D)
            out[0, :, rows] = od[:, :, 0].transpose(0, 1)

    def _prefill(self, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, n_rep: int, scale: float,
                 out: torch.Tensor) -> None:
        """The prefill chunks' rows of `out`, each over its slots (written already), one SDPA per chunk."""
        for start, n, slots, mask in self.prefills:
            qp = q[:, :, start:start + n]  # (1, nh, n, D)
            kk = load(kp, slots, q.dtype).transpose(0, 1).unsqueeze(0)  # (1, nkv, S, D)
            vv = load(vp, slots, q.dtype).transpose(0, 1).unsqueeze(0)
            out[:, :, start:start + n] = gqa_attention(qp, kk, vv, n_rep, scale, mask, is_causal=mask is None)
