"""LMEngine: the driver side of a thinker / talker stage's continuous batching.

Role: keeps, per request, the input rows not yet in the KV cache (`pending`) and those already fed
(`history`, kept so a preempted request can be recomputed), asks `LMScheduler` what runs, packs the
chosen rows of all chosen requests into one `LMBatch` (embeddings, M-RoPE positions, deepstack rows,
capture rows), runs it on the stage's ranks, and hands each request the logits of its last row when
that row ended an input run that wants them.

Admission (`admit`, from the stage handler's `open`, before the request reaches the engine loop): a new
request is refused with RESOURCE_EXHAUSTED when `max_waiting_requests` admitted requests already wait
beyond the free seats (`max_num_seqs` minus those running), so a burst queues up to a bound and the rest
hear at once that they should retry (HTTP 429), instead of waiting past their deadlines. Requests already
admitted are never dropped; one leaves the count when it runs or ends (`remove`, on its task's close).

Data flow per step:
    admit(task)                                                       open: refused when the queue is full
    feed(rid, InputRun(embeds (n, H), positions (P, n), ...))        the task's next input rows
    step(ready rids) -> LMScheduler.schedule -> BatchLayout + LMBatch -> ranks -> LMBatchResult
        -> {rid: RunOutput(logits (V,) | None, last_hidden (1, 1, H), captured rows, scores)} for the
           requests that ran (logits None: a prefill chunk that did not finish its run, or a recompute;
           scores: the step's rows of a run with `targets`, vLLM's prompt_logprobs, scored on the last rank
           and trimmed to the request's own `score_k`; a recompute after a preemption scores nothing again)
    remove(rid)                                                        blocks back to the free list

Prefix caching (`enable_prefix_caching`, vLLM's --enable-prefix-caching): a request's first input run may
name, in `prefix_keys`, integers per row for its leading rows whose keys and values they fix (the thinker:
token id or media item digest, offset and M-RoPE positions: services/llm/prefix_keys.py). Their whole blocks are
hashed once (`kv_blocks.prefix_hashes`); when the request starts, the scheduler hands it the cached blocks
of its longest cached prefix and the engine moves those rows from `pending` to `history` unrun; each whole
block the request computes is registered for later requests as soon as its step returns. Capture rows (the
thinker's media rows, whose hidden states the talker reads) are kept with their block (`BlockAllocator.attach`)
when computed, and a request that skips them gets them from there, in order, with its next output; a block
of a capturing request is registered only once every capture row in it is kept (a recompute after a
preemption captures nothing: its blocks are not offered).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field, replace

import grpc
import torch

from omnimesh.engine.kv_blocks import BlockAllocator, prefix_hashes
from omnimesh.engine.lm_scheduler import LMScheduler, ScheduledSeq
from omnimesh.engine.task import BatchedTask, StageRequestError
from omnimesh.models.qwen3_omni.lm_backend import ShardedBackend
from omnimesh.models.qwen3_omni.lm_shard import LMBatch, LMBatchResult, LMInitCache, PromptScores
from omnimesh.models.qwen3_omni.paged_kv import BatchLayout
from omnimesh.parallel.mp_executor import RankFailure

log = logging.getLogger(__name__)

DEFAULT_BATCHED_TOKENS = 2048


@dataclass
class InputRun:
    """Consecutive input rows of one request."""

    embeds: torch.Tensor  # (n, H)
    positions: torch.Tensor  # (P, n) M-RoPE rows (P = 4 or 3)
    visual: torch.Tensor | None = None  # (n,) bool: rows that get deepstack features
    deepstack: torch.Tensor | None = None  # (k, n_visual, H) features of the visual rows, per deepstack layer
    capture: torch.Tensor | None = None  # (n,) bool: rows whose hidden at the capture layer comes back
    want_logits: bool = True  # False for rows re-fed after a preemption (their token was already sampled)
    prefix_keys: torch.Tensor | None = None  # (m, k) int64: see the module docstring (a request's first run only)
    targets: torch.Tensor | None = None  # (n,) int64: the token after each row, scored (prompt logprobs); -1: none
    score_k: int = 0  # with targets: alternatives per scored row

    @property
    def n(self) -> int:
        return int(self.embeds.shape[0])

    def split(self, k: int) -> tuple[InputRun, InputRun]:
        """The first k rows, and the rest."""
        cut_vis = int(self.visual[:k].sum()) if self.visual is not None else 0

        def part(sl: slice, vis: slice, want_logits: bool) -> InputRun:
            return InputRun(
                self.embeds[sl], self.positions[:, sl],
                None if self.visual is None else self.visual[sl],
                None if self.deepstack is None else self.deepstack[:, vis],
                None if self.capture is None else self.capture[sl], want_logits,
                targets=None if self.targets is None else self.targets[sl], score_k=self.score_k)

        # only the run's last row yields logits: the first part never does
        return (part(slice(0, k), slice(0, cut_vis), False),
                part(slice(k, None), slice(cut_vis, None), self.want_logits))


@dataclass
class RunOutput:
    logits: torch.Tensor | None  # (V,) after the request's last row of this step, if its run wants them
    last_hidden: torch.Tensor  # (1, 1, H) final-norm hidden of that row
    captured: torch.Tensor | None  # (c, H) hidden at the capture layer of this step's capture rows
    cached_tokens: int = 0  # prompt tokens the prefix cache served when the request first started
    scores: PromptScores | None = None  # this step's scored rows of the request, in order (prompt logprobs)


@dataclass(eq=False)
class _Seq:
    sched: ScheduledSeq
    pending: list[InputRun] = field(default_factory=list)
    history: list[InputRun] = field(default_factory=list)
    fed: int = 0  # rows in `history` (= tokens in the cache once the step in flight, if any, returns)
    registered: int = 0  # leading blocks of its table registered in the prefix cache
    capture_mask: torch.Tensor | None = None  # (L,) bool: its first run's capture rows (prefix caching only)
    deliver: list[torch.Tensor] = field(default_factory=list)  # captured rows the cache served, for its next output


class LMEngine:
    def __init__(self, backend: ShardedBackend, *, role: str, block_size: int, kv_bytes: int | None,
                 gpu_memory_utilization: float, max_num_seqs: int, max_num_batched_tokens: int | None,
                 max_model_len: int, capture_layer: int | None = None,
                 max_waiting_requests: int | None = None, scheduling_policy: str = "fcfs",
                 enable_prefix_caching: bool = False, kv_cache_dtype: str = "auto",
                 enable_chunked_prefill: bool = True) -> None:
        """`backend` runs commands on every rank of the stage. Sizes the KV pool on the ranks and refuses to
        start when it cannot hold one request of `max_model_len` tokens. `max_waiting_requests`: see
        `admit` (None: no bound). `scheduling_policy`: fcfs or priority (`LMScheduler`). `enable_prefix_caching`:
        see the module docstring. `kv_cache_dtype`: the pool's dtype (--kv-cache-dtype; auto: the model's).
        `enable_chunked_prefill` off: a prompt is prefilled in one step (`LMScheduler`), so a step must hold
        `max_model_len` tokens (the default step then does, as vLLM's)."""
        if max_waiting_requests is not None and max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0 (0: never queue), got {max_waiting_requests}")
        self.backend, self.role, self.capture_layer = backend, role, capture_layer
        self.max_waiting_requests = max_waiting_requests
        self._lock = threading.Lock()
        self._inflight: set[str] = set()
        self._admitted: set[str] = set()  # requests opened through `admit` and not yet removed
        tokens = max_num_batched_tokens or max(DEFAULT_BATCHED_TOKENS, block_size,
                                               0 if enable_chunked_prefill else max_model_len)
        if not enable_chunked_prefill and tokens < max_model_len:
            raise ValueError(f"{role}: with --no-enable-chunked-prefill a prompt is prefilled in one step, so "
                             f"--max-num-batched-tokens ({tokens}) must be at least max_model_len ({max_model_len}); "
                             f"raise it, lower --max-model-len, or leave chunked prefill on")
        init = LMInitCache(block_size, kv_bytes, gpu_memory_utilization, profile_tokens=tokens, logit_rows=max_num_seqs,
                           kv_cache_dtype=kv_cache_dtype, max_model_len=max_model_len)
        num_blocks = int(backend.submit(init).result())
        self.allocator = BlockAllocator(num_blocks, block_size, enable_prefix_caching)
        if self.allocator.capacity_tokens < max_model_len:
            raise ValueError(
                f"{role}: the KV cache holds {self.allocator.capacity_tokens} tokens ({num_blocks} blocks of "
                f"{block_size}), fewer than max_model_len {max_model_len}: a single long request could never "
                f"finish. Raise --kv-cache-memory (or --gpu-memory-utilization) or lower --max-model-len")
        self.scheduler = LMScheduler(self.allocator, max_num_seqs, tokens, scheduling_policy, enable_chunked_prefill)
        self._priorities: dict[str, int] = {}  # admitted task key -> its priority, until its first input
        self.seqs: dict[str, _Seq] = {}
        log.info("%s KV cache: %d blocks x %d tokens = %d tokens (kv-cache-dtype %s); batches of up to %d sequences "
                 "/ %d tokens; chunked prefill %s; prefix caching %s", role, num_blocks, block_size,
                 self.allocator.capacity_tokens, kv_cache_dtype, max_num_seqs, tokens,
                 "on" if enable_chunked_prefill else "off", "on" if enable_prefix_caching else "off")

    def has(self, rid: str) -> bool:
        return rid in self.seqs

    def admit(self, task: BatchedTask) -> None:
        """Called by the stage handler's `open` with the new task, before the engine loop gets it: raises
        StageRequestError(RESOURCE_EXHAUSTED) when taking it would leave more than `max_waiting_requests`
        requests waiting beyond the free seats; else counts it until its task closes (the close calls `remove`)."""
        rid = task.key  # this task's, not its request id's: see BatchedTask
        with self._lock:
            idle, free = self._queue()
            limit = self.max_waiting_requests
            if limit is not None and rid not in self._admitted and idle + 1 - free > limit:
                why = (f"{idle - free} requests already waiting in {self.role}" if limit else
                       f"no free seat in {self.role} (--max-num-seqs {self.scheduler.max_num_seqs})")
                raise StageRequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                        f"{why} (--max-waiting-requests {limit}); retry later or raise it")
            self._admitted.add(rid)
            self._priorities[rid] = task.priority
        task.on_close.append(self.remove)

    def _queue(self) -> tuple[int, int]:
        """(admitted or fed requests that are not running, free seats); the lock is held."""
        running = {s.rid for s in self.scheduler.running}
        idle = len((self._admitted | self.seqs.keys()) - running)
        return idle, max(0, self.scheduler.max_num_seqs - len(running))

    def pending_tokens(self, rid: str) -> int:
        seq = self.seqs.get(rid)
        return 0 if seq is None else seq.sched.pending

    def feed(self, rid: str, run: InputRun) -> None:
        with self._lock:
            self._feed(rid, run)

    def _feed(self, rid: str, run: InputRun) -> None:
        seq = self.seqs.get(rid)
        if seq is None:
            seq = self.seqs[rid] = _Seq(self.scheduler.add(rid, self._priorities.pop(rid, 0)))
            if self.allocator.prefix_caching and run.prefix_keys is not None:
                seq.sched.prefix = prefix_hashes(run.prefix_keys.numpy(), self.allocator.block_size)
                seq.capture_mask = run.capture
        seq.pending.append(run)
        seq.sched.pending += run.n

    def remove(self, rid: str) -> None:
        """Give the request's blocks back (a request still in a step in flight keeps them until it returns:
        the engine loop closes a cancelled request only after its step)."""
        with self._lock:
            self._admitted.discard(rid)
            self._priorities.pop(rid, None)
            seq = self.seqs.pop(rid, None)
            if seq is not None:
                self.scheduler.remove(seq.sched)

    def stats(self) -> dict[str, float]:
        with self._lock:
            return self.scheduler.stats()

    def step(self, ready: list[str]) -> dict[str, RunOutput]:
        """One batched forward over the scheduled part of the `ready` requests' pending rows. Thread-safe:
        with pp > 1 the stage steps pp disjoint batches at once; scheduling, submitting (in command order)
        and bookkeeping hold the lock, waiting for the ranks does not."""
        with self._lock:
            runs = self._plan(ready)
            if not runs:
                return {}
            command = self._command(runs)
            future = None if self.backend.in_process else self.backend.submit(command)
            self._inflight.update(seq.sched.rid for seq, _ in runs)
        try:
            result: LMBatchResult = (self.backend.run(command) if future is None
                                     else future.result(timeout=self.backend.result_timeout_s))
        except TimeoutError:
            raise RankFailure(f"{self.role}: a batched step got no result within "
                              f"{self.backend.result_timeout_s:.0f}s") from None
        finally:
            with self._lock:
                self._inflight.difference_update(seq.sched.rid for seq, _ in runs)
        with self._lock:
            return self._apply(runs, result)

    def _plan(self, ready: list[str]) -> list[tuple[_Seq, list[InputRun]]]:
        plan, preempted = self.scheduler.schedule({rid for rid in ready if rid in self.seqs}, busy=self._inflight)
        for sched in preempted:
            seq = self.seqs[sched.rid]
            # recomputed rows: their token was sampled and their captured rows were handed over already
            seq.pending = [replace(r, want_logits=False, capture=None, targets=None) for r in seq.history] + seq.pending
            seq.history, seq.fed, seq.registered = [], 0, 0
            log.info("%s: preempted request %s (KV cache full); it is recomputed when blocks free up", self.role, sched.rid)
        runs: list[tuple[_Seq, list[InputRun]]] = []
        for sched, n in plan:
            seq = self.seqs[sched.rid]
            if sched.cached > seq.fed:  # it just took cached blocks: those rows are in the cache already
                hit = sched.cached - seq.fed
                skipped = self._take(seq, hit)
                seq.deliver.extend(self._served_captures(seq, skipped, seq.fed))
                seq.history.extend(skipped)
                seq.fed += hit
            runs.append((seq, self._take(seq, n)))
        return runs

    @staticmethod
    def _take(seq: _Seq, n: int) -> list[InputRun]:
        """The first `n` pending rows of `seq` (a run split where `n` ends inside it)."""
        taken: list[InputRun] = []
        while n > 0:
            head = seq.pending[0]
            if head.n <= n:
                taken.append(seq.pending.pop(0))
                n -= head.n
            else:
                first, rest = head.split(n)
                taken.append(first)
                seq.pending[0] = rest
                n = 0
        return taken

    def _apply(self, runs: list[tuple[_Seq, list[InputRun]]], result: LMBatchResult) -> dict[str, RunOutput]:
        out: dict[str, RunOutput] = {}
        cap_at = score_at = 0
        for i, (seq, taken) in enumerate(runs):
            n = sum(r.n for r in taken)
            scored = sum(int((r.targets >= 0).sum()) for r in taken if r.targets is not None)
            scores = None
            if scored and result.scores is not None:
                k = max(r.score_k for r in taken)
                s = result.scores.rows(score_at, score_at + scored)
                scores = replace(s, top_logprobs=s.top_logprobs[:, :k], top_ids=s.top_ids[:, :k])
                score_at += scored
            caps = sum(int(r.capture.sum()) for r in taken if r.capture is not None)
            captured = None
            if caps and result.captured is not None:
                captured = result.captured[cap_at:cap_at + caps]
                cap_at += caps
            if self.seqs.get(seq.sched.rid) is not seq:
                continue  # removed (cancelled) while its step ran
            if captured is not None and seq.sched.prefix:
                self._keep_captures(seq, taken, seq.fed, captured)
            seq.sched.cached += n
            seq.sched.pending -= n
            seq.history.extend(taken)
            seq.fed += n
            self._register(seq)
            if seq.deliver:  # rows the cache served come first: they precede this step's in the prompt
                captured = torch.cat(seq.deliver + ([] if captured is None else [captured]))
                seq.deliver = []
            wants = taken[-1].want_logits  # the last row of a whole run (a split's first part says False)
            out[seq.sched.rid] = RunOutput(logits=result.logits[i] if wants else None,
                                           last_hidden=result.last_hidden[i].view(1, 1, -1), captured=captured,
                                           cached_tokens=seq.sched.first_hit or 0, scores=scores)
        return out

    def _capture_positions(self, runs: list[InputRun], start: int) -> list[int]:
        """The absolute positions of the capture rows of `runs`, which begin at position `start`."""
        positions: list[int] = []
        for r in runs:
            if r.capture is not None:
                positions.extend((start + torch.nonzero(r.capture).view(-1)).tolist())
            start += r.n
        return positions

    def _keep_captures(self, seq: _Seq, taken: list[InputRun], start: int, captured: torch.Tensor) -> None:
        """Attach this step's captured rows to their blocks (those the prefix cache may offer)."""
        bs, limit = self.allocator.block_size, len(seq.sched.prefix) * self.allocator.block_size
        rows = captured.detach().clone()  # not a view of the whole batch's tensor
        for j, p in enumerate(self._capture_positions(taken, start)):
            if p < limit:
                self.allocator.attach(seq.sched.blocks[p // bs], p % bs, rows[j])

    def _served_captures(self, seq: _Seq, skipped: list[InputRun], start: int) -> list[torch.Tensor]:
        """The kept hidden states of the capture rows among `skipped` (rows the cache served), in order."""
        bs = self.allocator.block_size
        rows = []
        for p in self._capture_positions(skipped, start):
            row = self.allocator.payload(seq.sched.blocks[p // bs]).get(p % bs)
            if row is None:  # `_register` offers no block of a capturing request without them
                raise RuntimeError(f"{self.role}: a cached block lacks the captured row at position {p}")
            rows.append(row)
        return [torch.stack(rows)] if rows else []

    def _register(self, seq: _Seq) -> None:
        """Offer the prefix cache the request's whole blocks of cacheable rows computed so far."""
        sched, bs = seq.sched, self.allocator.block_size
        upto = min(sched.cached // bs, len(sched.prefix))
        pairs = []
        for i in range(seq.registered, upto):
            block = sched.blocks[i]
            if seq.capture_mask is not None:  # every capture row of the block must be kept with it
                need = torch.nonzero(seq.capture_mask[i * bs:(i + 1) * bs]).view(-1).tolist()
                if not all(o in self.allocator.payload(block) for o in need):
                    break
            pairs.append((block, sched.prefix[i]))
        if pairs:
            self.allocator.register(pairs)
            seq.registered += len(pairs)

    def _command(self, runs: list[tuple[_Seq, list[InputRun]]]) -> LMBatch:
        embeds, positions, visual, deep, capture, logit_rows, seqs = [], [], [], [], [], [], []
        score_rows: list[torch.Tensor] = []
        score_targets: list[torch.Tensor] = []
        score_k = row = 0
        any_visual = any(r.visual is not None for _, taken in runs for r in taken)
        any_capture = any(r.capture is not None for _, taken in runs for r in taken)
        for seq, taken in runs:
            n = sum(r.n for r in taken)
            seqs.append((n, seq.sched.cached, seq.sched.blocks))
            at = row
            for r in taken:
                if r.targets is not None:
                    keep = r.targets >= 0
                    score_rows.append(at + torch.nonzero(keep).view(-1))
                    score_targets.append(r.targets[keep])
                    score_k = max(score_k, r.score_k)
                at += r.n
                embeds.append(r.embeds)
                positions.append(r.positions)
                if any_visual:
                    visual.append(r.visual if r.visual is not None else torch.zeros(r.n, dtype=torch.bool))
                    if r.deepstack is not None:
                        deep.append(r.deepstack)
                if any_capture:
                    capture.append(r.capture if r.capture is not None else torch.zeros(r.n, dtype=torch.bool))
            row += n
            logit_rows.append(row - 1)
        x = torch.cat(embeds).unsqueeze(0)  # (1, N, H)
        pos = torch.cat(positions, dim=1).unsqueeze(1)  # (P, 1, N)
        vis = torch.cat(visual).view(1, -1) if any_visual else None
        deepstack = list(torch.cat(deep, dim=1).unbind(0)) if deep else None
        cap_rows = torch.nonzero(torch.cat(capture)).view(-1) if any_capture else None
        return LMBatch(x=x, position_ids=pos, layout=BatchLayout.build(seqs, self.allocator.block_size),
                       logit_rows=torch.tensor(logit_rows, dtype=torch.long),
                       visual_pos_mask=vis if deepstack is not None else None, deepstack=deepstack,
                       capture_layer=self.capture_layer if cap_rows is not None and cap_rows.numel() else None,
                       capture_rows=cap_rows if cap_rows is not None and cap_rows.numel() else None,
                       score_rows=_cat(score_rows), score_targets=_cat(score_targets), score_k=score_k)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The parts end to end, or None when they hold nothing."""
    out = torch.cat(parts) if parts else None
    return out if out is not None and out.numel() else None
