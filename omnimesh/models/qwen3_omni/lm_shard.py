"""LMShard: what one rank of a thinker or talker stage runs — its layers of the LM, its KV caches.

Role: the `RankProgram` the stage's executor runs on every rank of a pp x tp grid (and, with
`ParallelState.single()`, in-process for pp = tp = 1). Each rank builds a `ParallelTextModel` over its own
contiguous layer range (`partition_layers`), loads only those tensors, sharded for its TP rank, and keeps
one KV cache per open request for exactly those layers and heads.

Commands (sent by the driver to every rank, executed in lock-step):
    LMInitCache(block_size, kv_bytes | None, ..., kv_cache_dtype)   size the paged KV pool (min over ranks)
        -> num_blocks; the pool holds keys and values in `kv_cache_dtype` (auto: the model's dtype)
    LMBatch(x (1, N, H), position_ids, layout, logit_rows, ...)   one continuous-batching step over the pool:
        the new tokens of many requests packed; -> LMBatchResult(logits (M, V), last hidden (M, H), captured,
        scores): `score_rows` (S,) with their `score_targets` (S,) come back scored on the last pp rank (vLLM's
        prompt_logprobs): the target's log-probability and rank and the `score_k` likeliest ids, computed
        SCORE_CHUNK rows at a time so a long prompt never holds (S, V) logits at once
    LMStep(handle, x (1, T, H), position_ids, visual_pos_mask, deepstack, capture_layer)
        every rank: pipeline_step over its layers (hidden crosses pp boundaries, see parallel_text_model)
        last pp rank: logits of the last position (all-gathered over TP) -> LMStepResult
    LMFree(handle)    every rank drops the request's KV cache
    LMPredict(key, prefix (B, 2, H), params per request)   talker only: the code predictor for B requests,
        split over the same ranks -> LMPredictResult(residual codes per request, codec sums (B, 1, H)); the
        codec sums are made on the first pp rank
        (rank 0, the driver), which keeps it by `key` when it is not the owner
Inputs arrive as embeddings (the driver embeds and merges media), so no rank needs the embedding table.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from omnimesh.models.qwen3_omni.paged_kv import (BatchLayout, PagedBatch, PagedKVPool, block_bytes, gather_reserve,
                                               kv_cache_dtype)
from omnimesh.models.qwen3_omni.parallel_code_predictor import ParallelCodePredictor, predict_residuals
from omnimesh.models.qwen3_omni.parallel_text_model import KVCache, ParallelTextModel, pipeline_step
from omnimesh.models.qwen3_omni.sampling import Sampler, SamplingParams
from omnimesh.models.qwen3_omni.text_arch import text_arch
from omnimesh.parallel.parallel_state import ParallelState
from omnimesh.parallel.partition import partition_layers

log = logging.getLogger(__name__)

TRACE_ENV = "OMNIMESH_TRACE_DIR"  # a folder: each rank appends its busy intervals there (tests, debugging)


@dataclass(frozen=True)
class LMStep:
    handle: int
    x: torch.Tensor  # (1, T, H) inputs_embeds of the first layer
    position_ids: torch.Tensor  # (4 | 3, 1, T)
    visual_pos_mask: torch.Tensor | None = None  # (1, T) bool
    deepstack: list[torch.Tensor] | None = None  # [(n_visual, H)] added after the first layers
    capture_layer: int | None = None


@dataclass(frozen=True)
class LMFree:
    handle: int


@dataclass(frozen=True)
class LMPredict:
    """The talker's code predictor for one talker step of B requests (talker stages only): residual codes."""

    key: int  # names this command's codec sums, kept on the first pipeline rank until the driver takes them
    prefix: torch.Tensor  # (B, 2, H) per request [talker last hidden, talker codec embedding of c0]
    params: tuple[SamplingParams, ...]  # per request: the code predictor's sampling (greedy, or seeded)


@dataclass(frozen=True)
class LMPredictResult:
    codes: tuple[tuple[int, ...], ...]  # per request r1 .. r_{G-1}
    codec_sum: torch.Tensor | None  # (B, 1, H) on the first pipeline rank; None when that is not the owner


@dataclass(frozen=True)
class LMInitCache:
    """Size and allocate every rank's paged KV pool; all ranks take the smallest block count any can hold."""

    block_size: int
    kv_bytes: int | None  # per-rank budget; None on CUDA: measured from `gpu_memory_utilization`
    gpu_memory_utilization: float = 0.9
    profile_tokens: int = 2048  # CUDA: activations of a step this large are kept free
    logit_rows: int = 256  # CUDA: ... and of the head over this many rows (--max-num-seqs; at least a score chunk)
    kv_cache_dtype: str = "auto"  # the pool's dtype (--kv-cache-dtype, paged_kv.KV_CACHE_DTYPES)
    max_model_len: int = 0  # CUDA: a prefill chunk's gathered past of this many keys is kept free too


@dataclass(frozen=True)
class LMBatch:
    """One continuous-batching step: the new tokens of many requests, packed (see paged_kv.py)."""

    x: torch.Tensor  # (1, N, H) packed input embeddings (used on the first pp rank)
    position_ids: torch.Tensor  # (4 | 3, 1, N) packed
    layout: BatchLayout
    logit_rows: torch.Tensor  # (M,) packed rows whose logits and final hidden come back
    visual_pos_mask: torch.Tensor | None = None  # (1, N) bool
    deepstack: list[torch.Tensor] | None = None  # [(n_visual rows of this step, H)] per deepstack layer
    capture_layer: int | None = None
    capture_rows: torch.Tensor | None = None  # (C,) packed rows whose hidden at capture_layer comes back
    score_rows: torch.Tensor | None = None  # (S,) packed rows scored against `score_targets` (prompt logprobs)
    score_targets: torch.Tensor | None = None  # (S,) the token that follows each of those rows
    score_k: int = 0  # alternatives per scored row


@dataclass(frozen=True)
class PromptScores:
    """Scored rows (vLLM's prompt_logprobs), from the raw logits' log_softmax."""

    targets: torch.Tensor  # (S,) int64: the scored tokens
    logprobs: torch.Tensor  # (S,) float32: each target's log-probability
    ranks: torch.Tensor  # (S,) int64: 1 + the ids strictly likelier than the target
    top_logprobs: torch.Tensor  # (S, k) float32, best first
    top_ids: torch.Tensor  # (S, k) int64

    def rows(self, start: int, stop: int) -> PromptScores:
        return PromptScores(self.targets[start:stop], self.logprobs[start:stop], self.ranks[start:stop],
                            self.top_logprobs[start:stop], self.top_ids[start:stop])


SCORE_CHUNK = 128  # scored rows per head call: (128, V) float32 logits at a time


def score_rows(logits_of: Any, hidden: torch.Tensor, targets: torch.Tensor, k: int) -> PromptScores:
    """`hidden` (S, H) final-norm rows -> their targets' scores; `logits_of` is the head (all TP ranks call it
    the same number of times: its all-gather needs them all)."""
    parts = []
    for at in range(0, hidden.shape[0], SCORE_CHUNK):
        logprobs = torch.log_softmax(logits_of(hidden[at:at + SCORE_CHUNK]).float(), dim=-1)  # (s, V)
        target = targets[at:at + SCORE_CHUNK].to(logprobs.device).view(-1, 1)
        value = logprobs.gather(1, target)  # (s, 1)
        top = torch.topk(logprobs, k, dim=-1) if k else None
        parts.append((target.view(-1).cpu(), value.view(-1).cpu(), ((logprobs > value).sum(-1) + 1).cpu(),
                      top.values.cpu() if top is not None else logprobs.new_zeros(len(target), 0).cpu(),
                      top.indices.cpu() if top is not None else torch.zeros(len(target), 0, dtype=torch.long)))
    return PromptScores(*(torch.cat(p) for p in zip(*parts, strict=True)))


@dataclass(frozen=True)
class LMBatchResult:
    logits: torch.Tensor  # (M, V)
    last_hidden: torch.Tensor  # (M, H) final-norm hidden of those rows
    captured: torch.Tensor | None  # (C, H)
    scores: PromptScores | None = None  # of the batch's score_rows, in order


@dataclass(frozen=True)
class LMStepResult:
    logits: torch.Tensor  # (V,) of the last position
    last_hidden: torch.Tensor  # (1, 1, H) final-norm hidden of the last position
    captured: torch.Tensor | None  # (1, T, H) at capture_layer, when asked for


@dataclass(frozen=True)
class LMShardSpec:
    """Everything a rank needs to build its shard (picklable: it crosses into spawned processes)."""

    model_dir: Path
    role: str  # "thinker" | "talker"
    partition: tuple[int, ...] | None = None  # layers per pp rank; None = even split
    dtype: torch.dtype = torch.float32

    def text_config(self):  # noqa: ANN201 - a transformers text config
        from omnimesh.models.model_config import load_config

        config = load_config(self.model_dir)
        sub = config.thinker_config if self.role == "thinker" else config.talker_config
        return getattr(sub, "text_config", None) or sub  # Qwen2.5-Omni's talker config is its LM's config


class LMShard:
    def __init__(self, spec: LMShardSpec, ps: ParallelState):
        if spec.role not in ("thinker", "talker"):
            raise ValueError(f"role must be thinker or talker, got {spec.role!r}")
        config = spec.text_config()
        ranges = partition_layers(config.num_hidden_layers, ps.pp_size, list(spec.partition) if spec.partition else None)
        self.layer_range = ranges[ps.pp_rank]
        self.ps = ps
        # inputs arrive as embeddings (the driver holds the table), so no rank builds one
        self.model = ParallelTextModel(config, ps, self.layer_range, is_talker=spec.role == "talker",
                                       with_embed=False, dtype=spec.dtype)
        self.model.load_weights(spec.model_dir)
        self.caches: dict[int, KVCache] = {}  # LMStep: one contiguous cache per handle
        self.pool: PagedKVPool | None = None  # LMBatch: the paged pool (LMInitCache sizes it)
        self.dtype = spec.dtype
        self.predictor: ParallelCodePredictor | None = None
        self.codec_sums: dict[int, torch.Tensor] = {}  # LMPredict.key -> codec sum (first pp rank only)
        cp: Any = None
        if spec.role == "talker":  # Qwen3-Omni's talker has a code predictor; Qwen2.5-Omni's one codec stream none
            from omnimesh.models.model_config import load_config

            cp = getattr(load_config(spec.model_dir).talker_config, "code_predictor_config", None)
        if cp is not None:
            cp_range = partition_layers(cp.num_hidden_layers, ps.pp_size)[ps.pp_rank]
            self.predictor = ParallelCodePredictor(cp, ps, cp_range, spec.dtype)
            self.predictor.load_weights(spec.model_dir)
        self.role = spec.role
        trace_dir = os.environ.get(TRACE_ENV)
        self.trace = Path(trace_dir) / f"{spec.role}-rank{ps.rank}.jsonl" if trace_dir else None
        log.info("%s rank %d (pp %d, tp %d): layers [%d, %d), %.2f MB of parameters", spec.role, ps.rank,
                 ps.pp_rank, ps.tp_rank, *self.layer_range, self.model.param_bytes() / 1e6)

    def execute(self, command: Any) -> Any:
        if isinstance(command, LMBatch):
            return self._batch(command)
        if isinstance(command, LMInitCache):
            return self._init_cache(command)
        if isinstance(command, LMFree):
            self.caches.pop(command.handle, None)
            return None
        if isinstance(command, LMPredict):
            return self._predict(command)
        cache = self.caches.get(command.handle)
        if cache is None:
            cache = self.caches[command.handle] = self.model.new_cache()
        x = command.x.to(self.ps.device) if self.ps.is_first_pp_rank else None
        started = time.time()
        out = pipeline_step(self.model, x, command.position_ids, cache, visual_pos_mask=command.visual_pos_mask,
                            deepstack=command.deepstack, capture_layer=command.capture_layer)
        if not (self.ps.is_last_pp_rank and self.ps.tp_rank == 0):
            if self.ps.is_last_pp_rank:
                self.model.compute_logits(out.hidden[:, -1])  # the all-gather needs every TP rank
            self._record(int(command.position_ids.shape[-1]), command.handle, started)
            return None
        last = out.hidden[:, -1:]  # (1, 1, H)
        logits = self.model.compute_logits(last[:, 0])[0]  # (V,)
        self._record(int(command.position_ids.shape[-1]), command.handle, started)
        return LMStepResult(logits=logits.cpu(), last_hidden=last.cpu(),
                            captured=None if out.captured is None else out.captured.cpu())


    def _init_cache(self, command: LMInitCache) -> int:
        config, (start, end) = self.model.config, self.layer_range
        dtype = kv_cache_dtype(command.kv_cache_dtype, self.dtype)
        per_block = block_bytes(config, end - start, self.ps.tp_size, command.block_size, dtype)
        budget = command.kv_bytes if command.kv_bytes is not None else self._cuda_budget(command)
        blocks = torch.tensor([budget // per_block], dtype=torch.long)
        if self.ps.world_size > 1:  # every rank must hold the same block ids
            dist.all_reduce(blocks, op=dist.ReduceOp.MIN, group=self.ps.cpu_group)
        num_blocks = int(blocks)
        if num_blocks < 1:
            raise ValueError(f"the KV cache budget ({budget / 2**20:.1f} MiB per rank) holds no block of "
                             f"{command.block_size} tokens ({per_block / 2**20:.2f} MiB each); raise --kv-cache-memory "
                             f"or --gpu-memory-utilization")
        self.pool = None  # drop an older pool before allocating the new one
        self.pool = PagedKVPool(self.layer_range, num_blocks, command.block_size,
                                max(1, config.num_key_value_heads // self.ps.tp_size), text_arch(config).head_dim,
                                dtype, self.ps.device)
        log.info("%s rank %d: KV cache %d blocks x %d tokens (%.1f MiB, %s)", self.role, self.ps.rank, num_blocks,
                 command.block_size, self.pool.nbytes() / 2**20, str(dtype).removeprefix("torch."))
        return num_blocks

    def _cuda_budget(self, command: LMInitCache) -> int:
        """What `gpu_memory_utilization` of this rank's device leaves after THIS rank's own weights, the
        activations of a `profile_tokens` step (measured with a throw-away forward of its layers) and the
        largest keys and values its attention gathers at once (`paged_kv.gather_reserve`). Per
        instance, as vLLM's: other stages on the same device count against their own fractions, not this
        one's, so stages sharing a GPU split it by their fractions whatever order they start in (the CUDA
        context, ~0.5 GiB, is not counted: keep that much headroom). Never more than the device has free."""
        device = torch.device(self.ps.device)
        if device.type != "cuda":
            raise ValueError("give the KV cache size (--kv-cache-memory) on CPU")
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        weights = torch.cuda.memory_allocated(device)
        self.profile_step(device, command.profile_tokens, command.logit_rows)
        torch.cuda.synchronize(device)
        activations = torch.cuda.max_memory_allocated(device) - weights + self._gather_reserve(command.max_model_len)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        budget = min(int(total * command.gpu_memory_utilization) - weights - activations, free - activations)
        if budget <= 0:
            raise ValueError(f"no room for a KV cache on {device}: --gpu-memory-utilization "
                             f"{command.gpu_memory_utilization} x {total / 2**30:.1f} GiB leaves nothing after this "
                             f"rank's {weights / 2**30:.2f} GiB of weights and {activations / 2**30:.2f} GiB for "
                             f"activations and gathered decodes ({free / 2**30:.1f} GiB free on the device); raise it, "
                             f"lower "
                             f"--max-num-batched-tokens, or split the stage over more ranks (-tp / -pp)")
        return budget

    def _gather_reserve(self, max_model_len: int) -> int:
        """`paged_kv.gather_reserve` for this rank's heads (1/tp of them) in its compute dtype, on CUDA."""
        config = self.model.config
        tp = self.ps.tp_size
        heads, kv_heads = config.num_attention_heads // tp, max(1, config.num_key_value_heads // tp)
        return gather_reserve(max_model_len, kv_heads, heads, text_arch(config).head_dim,
                              self.dtype.itemsize, repeat=heads > kv_heads)

    def profile_step(self, device: torch.device, tokens: int, logit_rows: int) -> None:
        """A throw-away step of `tokens` rows through this rank's layers, and on the last pp rank the head over
        `logit_rows` of them scored as prompt_logprobs scores them (the (rows, V) logits and their log_softmax
        are a step's largest transient after the activations); its peak memory is what `_cuda_budget` keeps
        free. Rank-local but for the head's all-gather, which every TP rank of the last stage joins."""
        H = self.model.config.hidden_size
        x = torch.zeros(1, tokens, H, dtype=self.dtype, device=device)
        positions = torch.arange(tokens, device=device).view(1, 1, tokens).expand(3, 1, tokens)
        out = self.model(x, positions, self.model.new_cache())  # rank-local: collectives stay within the TP group
        if self.ps.is_last_pp_rank:  # as `_batch`: the step's logits stay while its scored rows are scored
            logits = self.model.compute_logits(out.hidden[0, :max(1, min(tokens, logit_rows))])
            scored = out.hidden[0, :max(1, min(tokens, SCORE_CHUNK))]
            score_rows(self.model.compute_logits, scored, torch.zeros(scored.shape[0], dtype=torch.long), 20)
            del logits

    def _batch(self, command: LMBatch) -> LMBatchResult | None:
        if self.pool is None:
            raise ValueError("LMBatch before LMInitCache: the stage has no KV cache yet")
        cache = PagedBatch(self.pool, command.layout)
        x = command.x.to(self.ps.device) if self.ps.is_first_pp_rank else None
        started = time.time()
        out = pipeline_step(self.model, x, command.position_ids, cache, visual_pos_mask=command.visual_pos_mask,
                            deepstack=command.deepstack, capture_layer=command.capture_layer)
        self._record(command.layout.num_tokens, -1, started)
        if not self.ps.is_last_pp_rank:
            return None
        rows = out.hidden[0, command.logit_rows.to(out.hidden.device)]  # (M, H)
        logits = self.model.compute_logits(rows)  # (M, V): the all-gather needs every TP rank
        scores = None
        if command.score_rows is not None and command.score_targets is not None:
            scored = out.hidden[0, command.score_rows.to(out.hidden.device)]  # (S, H)
            scores = score_rows(self.model.compute_logits, scored, command.score_targets, command.score_k)
        if self.ps.tp_rank != 0:
            return None
        captured = None
        if command.capture_rows is not None and out.captured is not None:
            captured = out.captured[0, command.capture_rows.to(out.captured.device)].cpu()  # (C, H)
        return LMBatchResult(logits=logits.cpu(), last_hidden=rows.cpu(), captured=captured, scores=scores)

    def _predict(self, command: LMPredict) -> LMPredictResult | None:
        if self.predictor is None:
            raise ValueError("LMPredict is for talker stages (this shard has no code predictor)")
        # seeded samplers live on the rank that samples; greedy requests need none
        samples = [None if p.greedy else Sampler(p).sample for p in command.params]
        out = predict_residuals(self.predictor, command.prefix if self.ps.is_first_pp_rank else None,
                                sample=samples, batch=len(command.params))
        owner = self.ps.is_last_pp_rank and self.ps.tp_rank == 0
        if self.ps.is_first_pp_rank and out.codec_sum is not None and not owner:
            self.codec_sums[command.key] = out.codec_sum.cpu()  # the driver (rank 0) takes it after the step
        return LMPredictResult(out.codes, out.codec_sum.cpu() if owner and out.codec_sum is not None else None) \
            if owner else None

    def _record(self, tokens: int, handle: int, started: float) -> None:
        """With OMNIMESH_TRACE_DIR set, each rank appends its busy interval per step (one JSON line)."""
        if self.trace is not None:
            with self.trace.open("a") as f:
                f.write(json.dumps({"role": self.role, "rank": self.ps.rank, "pp_rank": self.ps.pp_rank,
                                    "handle": handle, "tokens": tokens,
                                    "start": started, "end": time.time()}) + "\n")


def build_shard(spec: LMShardSpec, ps: ParallelState) -> LMShard:
    """The executor's program factory (module-level, so spawned ranks can unpickle it)."""
    return LMShard(spec, ps)
