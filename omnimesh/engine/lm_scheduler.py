"""LMScheduler: which requests of a thinker / talker stage run in the next batched step, and how many tokens.

Role: continuous batching with a token budget over a paged KV cache (vLLM's scheduler policy, simplified).
Each step, given the requests that have input waiting:
  1. running requests (they hold KV blocks), oldest first: a decode takes 1 token of the budget, a prefill
     takes what is left, up to `max_num_batched_tokens` (longer prompts are prefilled in chunks over several
     steps, so they never stall running decodes for their whole length). A request that needs a block when
     none is free preempts the NEWEST running request (its blocks freed at once; it is recomputed later
     from its stored inputs) — or itself when it is the newest;
  2. then waiting requests (new, or preempted earlier), first come first served, while there is budget,
     a free seat (`max_num_seqs`) and blocks for their next chunk (none newer than a request preempted in
     this very step). With `chunked_prefill` off (vLLM's --no-enable-chunked-prefill) a waiting request
     starts only when its whole prompt fits the step's budget, and waits (nobody overtaking it) until then:
     a long prompt's first token comes in one step, at the cost of a pause for the decodes beside it.
"First" and "newest" follow each request's `rank`: its admission order under the default policy ("fcfs"),
and (priority, admission order) under vLLM's "priority" policy (lower priority values first), where a
waiting request that outranks a running one also takes its seat or its blocks: the lowest-ranked running
request is preempted for it, as vLLM's priority scheduler does.
Finished and cancelled requests give their blocks back at once (`remove`).
Prefix caching (`BlockAllocator(prefix_caching=True)`): a request that starts (new, or again after a
preemption) first takes the cached blocks of its prompt's longest cached prefix (`ScheduledSeq.prefix`, set
by the engine): those tokens count as cached at once and take none of the step's budget. At least one
token is always left to compute (the prompt's last row gives the logits of the first output token).
The scheduler knows token counts only; what the tokens are is `lm_engine.py`'s business.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omnimesh.engine.kv_blocks import BlockAllocator


@dataclass(eq=False)
class ScheduledSeq:
    """A request as the scheduler sees it."""

    rid: str
    order: int  # admission order: smaller = older
    priority: int = 0  # vLLM's request priority (lower = sooner); only the "priority" policy reads it
    pending: int = 0  # input tokens not yet in the cache
    cached: int = 0  # tokens in the cache
    blocks: list[int] = field(default_factory=list)
    running: bool = False
    prefix: list[bytes] = field(default_factory=list)  # hashes of its prompt's cacheable whole blocks
    first_hit: int | None = None  # prompt tokens the prefix cache served when it first started

    @property
    def rank(self) -> tuple[int, int]:
        """Sort key: smaller runs first and is preempted last (see the module docstring)."""
        return self.priority, self.order


POLICIES = ("fcfs", "priority")


class LMScheduler:
    def __init__(self, allocator: BlockAllocator, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str = "fcfs", chunked_prefill: bool = True) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs and max_num_batched_tokens must be >= 1, got {max_num_seqs}, "
                             f"{max_num_batched_tokens}")
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy, self.chunked_prefill = policy, chunked_prefill
        self.allocator = allocator
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.running: list[ScheduledSeq] = []  # admission order
        self.waiting: list[ScheduledSeq] = []  # preempted first, then new ones in arrival order
        self.preemptions = 0
        self._order = 0

    def add(self, rid: str, priority: int = 0) -> ScheduledSeq:
        """A new request; `priority` counts only under the "priority" policy."""
        self._order += 1
        seq = ScheduledSeq(rid, self._order, priority if self.policy == "priority" else 0)
        self.waiting.append(seq)
        self.waiting.sort(key=lambda s: s.rank)
        return seq

    def remove(self, seq: ScheduledSeq) -> None:
        self.allocator.free(seq.blocks)
        seq.cached, seq.running = 0, False
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)

    def schedule(self, ready: set[str], busy: set[str] = frozenset()  # type: ignore[assignment]
                 ) -> tuple[list[tuple[ScheduledSeq, int]], list[ScheduledSeq]]:
        """Pick this step's (request, new tokens) among the `ready` ones; returns (plan, preempted). `busy`
        requests are in another step in flight (pipeline parallelism): never preempted."""
        budget = self.max_num_batched_tokens
        plan: list[tuple[ScheduledSeq, int]] = []
        preempted: list[ScheduledSeq] = []
        planned: set[str] = set(busy)
        runnable = [s for s in self.running if s.rid in ready and s.pending > 0]
        decodes_left = sum(s.pending == 1 for s in runnable)  # each running decode is owed 1 token of the budget
        for seq in runnable:
            if seq.pending == 1:
                decodes_left -= 1
            if budget <= 0:
                break
            if not seq.running:  # preempted earlier in this step
                continue
            # a prefill chunk (or a recompute after a preemption) takes what the later decodes leave
            n = min(seq.pending, budget if seq.pending == 1 else budget - decodes_left)
            if n <= 0:
                continue
            while not self.allocator.grow(seq.blocks, seq.cached + n):
                victim = next((s for s in reversed(self.running) if s.rid not in planned), None)
                if victim is None:  # everything else already runs this step: wait for the next one
                    break
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.running and len(seq.blocks) >= self.allocator.blocks_for(seq.cached + n):
                plan.append((seq, n))
                planned.add(seq.rid)
                budget -= n
        for seq in list(self.waiting):
            if budget <= 0:
                break
            if seq in preempted:
                break  # preempted in this step: it is not readmitted yet, and no newer request overtakes it
            if seq.rid not in ready or seq.pending <= 0:
                continue
            if len(self.running) >= self.max_num_seqs and not self._make_room(seq, planned, preempted):
                break
            hit = self._take_prefix(seq)
            n = min(seq.pending, budget)
            if n < seq.pending and not self.chunked_prefill:  # its prompt whole, in a later step
                self._drop_prefix(seq, hit)
                break
            while not self.allocator.grow(seq.blocks, seq.cached + n):
                if not self._make_room(seq, planned, preempted):
                    break
            if len(seq.blocks) < self.allocator.blocks_for(seq.cached + n):
                self._drop_prefix(seq, hit)
                break  # first come first served: nobody overtakes the first-ranked waiting request
            if seq.first_hit is None:
                seq.first_hit = hit
            self.waiting.remove(seq)
            self.running.append(seq)
            self.running.sort(key=lambda s: s.rank)
            seq.running = True
            plan.append((seq, n))
            planned.add(seq.rid)
            budget -= n
        return plan, preempted

    def _take_prefix(self, seq: ScheduledSeq) -> int:
        """A starting request takes its prompt's cached blocks (at most all but its last token): the tokens it
        got, now counted as cached."""
        if seq.cached or not seq.prefix:
            return 0
        tokens = seq.pending
        seq.blocks = self.allocator.match(seq.prefix[:(tokens - 1) // self.allocator.block_size], tokens)
        hit = len(seq.blocks) * self.allocator.block_size
        seq.cached, seq.pending = hit, tokens - hit
        return hit

    def _drop_prefix(self, seq: ScheduledSeq, hit: int) -> None:
        """Undo `_take_prefix` for a request that does not start in this step after all."""
        if seq.prefix:  # a waiting request holds no blocks but those `_take_prefix` gave it
            self.allocator.unmatch(seq.blocks, seq.pending + hit)
            seq.cached, seq.pending = 0, seq.pending + hit

    def _make_room(self, seq: ScheduledSeq, planned: set[str], preempted: list[ScheduledSeq]) -> bool:
        """Under the "priority" policy: preempt the lowest-ranked running request not in this step when it
        ranks below `seq` (a seat and its blocks for `seq`); False when there is none (always under fcfs)."""
        if self.policy != "priority":
            return False
        victim = next((s for s in reversed(self.running) if s.rid not in planned), None)
        if victim is None or victim.rank <= seq.rank:
            return False
        self._preempt(victim)
        preempted.append(victim)
        return True

    def _preempt(self, seq: ScheduledSeq) -> None:
        self.allocator.free(seq.blocks)
        seq.pending += seq.cached  # everything it had cached is recomputed when it runs again
        seq.cached, seq.running = 0, False
        self.running.remove(seq)
        self.waiting.append(seq)
        self.waiting.sort(key=lambda s: s.rank)  # older first: a preempted request goes before newer ones
        self.preemptions += 1

    def stats(self) -> dict[str, float]:
        out = {"running": len(self.running), "waiting": len(self.waiting),
               "kv_cache_usage": self.allocator.usage(), "preemptions": self.preemptions}
        if self.allocator.prefix_caching:
            out.update(prefix_cache_queries=self.allocator.queried_tokens, prefix_cache_hits=self.allocator.hit_tokens,
                       prefix_cache_kept_bytes=self.allocator.payload_bytes)
        return out
