"""vLLM's `prompt_logprobs` in the thinker stage, in-process on the tiny model folder, against `transformers`'
thinker forward over the same prompt ids (log_softmax of its logits at each row, scored against the next
prompt token):

- chunked prefills (8 tokens a step) beside a running decode, scored a few rows per head call: every prompt
  token from the second has one entry (its id, bytes, log-probability, rank and the k likeliest ids, k per
  request), all on the request's first chunk; the generated tokens equal a run without prompt logprobs;
- preemption: a request recomputed after losing its blocks scores each prompt row exactly once;
- prefix caching: a request asking for prompt logprobs takes no cached blocks (skipped rows have no scores);
- the talker refuses `prompt_logprobs` (no text) and the stage bounds k by its vocabulary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from omnimesh.config.serve_args import ServeArgs
from omnimesh.models.qwen3_omni import lm_shard
from omnimesh.models.qwen3_omni.sampling import SamplingParams
from omnimesh.transport.frames import StageChunk
from omnimesh.v1 import stage_pb2
from services.llm.sampling import merge_sampling
from services.llm.thinker_handler import build_handler as thinker_handler
from services.llm.token_logprobs import TokenBytes
from tests.services.test_lm_batching import Driver, assert_drained, block_bytes, open_thinker, prompts, token_ids

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Any:
    from transformers import Qwen3OmniMoeForConditionalGeneration

    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(model_dir).eval().thinker


@torch.no_grad()
def expected(reference: Any, ids: torch.Tensor) -> torch.Tensor:
    """log_softmax of transformers' logits at rows 0 .. n-2 (each predicts the next prompt token), (n-1, V)."""
    logits = reference(input_ids=ids.view(1, -1), attention_mask=torch.ones(1, ids.numel(), dtype=torch.long)).logits
    return torch.log_softmax(logits[0, :-1].float(), dim=-1)


def open_scored(handler: Any, rid: str, ids: torch.Tensor, max_tokens: int, k: int) -> Any:
    task = handler.open(stage_pb2.Open(request_id=rid, sampling=stage_pb2.SamplingParams(
        temperature=0, max_tokens=max_tokens, prompt_logprobs=k)))
    task.feed(StageChunk(tensors={"input_ids": ids}, final=True))
    return task


def check_entries(chunks: list[StageChunk], ids: torch.Tensor, want: torch.Tensor, k: int, token_bytes: TokenBytes
                  ) -> None:
    assert chunks[0].prompt_logprobs and not any(c.prompt_logprobs for c in chunks[1:])  # the first chunk's
    entries = chunks[0].prompt_logprobs
    assert [e.token_id for e in entries] == ids[1:].tolist()  # one per prompt token from the second
    for row, (e, target) in enumerate(zip(entries, ids[1:].tolist(), strict=True)):
        assert e.token == token_bytes(target)
        assert e.logprob == pytest.approx(float(want[row, target]), abs=TOLERANCE)
        value = float(want[row, target])  # rank: 1 + the ids likelier than the target (ties within rounding)
        assert int((want[row] > value + TOLERANCE).sum()) + 1 <= e.rank <= int((want[row] > value - TOLERANCE).sum()) + 1
        best = want[row].topk(k)
        assert len(e.top) == k
        assert [t.logprob for t in e.top] == pytest.approx(best.values.tolist(), abs=TOLERANCE)
        assert [t.token for t in e.top] == [token_bytes(i) for i in [t.token_id for t in e.top]]


def test_chunked_prefills_beside_a_decode_score_every_prompt_token(model_dir: Path, thinker: Any, reference: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lm_shard, "SCORE_CHUNK", 3)  # several head calls per step, concatenated in order
    short, long_a, long_b = prompts([5, 30, 19], seed=7)
    handler = thinker_handler(model_dir, ServeArgs(max_model_len=128, kv_cache_memory="1MiB",
                                                   max_num_batched_tokens=8, stream_interval=1))
    d = Driver(handler)
    d.add(open_thinker(handler, "short", short, 20))
    d.step()
    d.add(open_scored(handler, "a", long_a, 6, k=3), open_scored(handler, "b", long_b, 6, k=1))
    chunks = d.run()
    assert len(token_ids(chunks["short"])) == 20 and not any(c.prompt_logprobs for c in chunks["short"])
    token_bytes = TokenBytes(handler.tokenizer)
    check_entries(chunks["a"], long_a, expected(reference, long_a), 3, token_bytes)
    check_entries(chunks["b"], long_b, expected(reference, long_b), 1, token_bytes)
    for rid, ids in (("a", long_a), ("b", long_b)):  # scoring changes nothing about the answer
        plain = Driver(thinker)
        plain.add(open_thinker(thinker, rid, ids, 6))
        assert token_ids(chunks[rid]) == token_ids(plain.run()[rid])


def test_a_preempted_request_scores_each_row_once(model_dir: Path, reference: Any) -> None:
    args = ServeArgs(max_model_len=32, block_size=4, max_num_batched_tokens=6,
                     kv_cache_memory=str(10 * block_bytes(model_dir, 4)))
    handler = thinker_handler(model_dir, args)
    engine = handler.batcher.engine
    ids = prompts([6, 9, 4, 8, 7], seed=2)
    d = Driver(handler)
    d.add(*(open_scored(handler, f"r{i}", p, 20, k=2) for i, p in enumerate(ids)))
    d.run(2000)
    assert engine.scheduler.preemptions > 0
    token_bytes = TokenBytes(handler.tokenizer)
    for i, p in enumerate(ids):
        check_entries(d.chunks[f"r{i}"], p, expected(reference, p), 2, token_bytes)
    assert_drained(engine, 10)


def test_prompt_logprobs_skip_the_prefix_cache(model_dir: Path, reference: Any) -> None:
    handler = thinker_handler(model_dir, ServeArgs(max_model_len=128, kv_cache_memory="1MiB", block_size=4,
                                                   stream_interval=1, enable_prefix_caching=True))
    [ids] = prompts([22], seed=9)
    warm = Driver(handler)
    warm.add(open_thinker(handler, "warm", ids, 2))
    warm.run()
    again = Driver(handler)
    cached = open_thinker(handler, "cached", ids, 2)
    again.add(cached)
    again.run()
    assert cached.cached_tokens == 20  # the prompt's whole blocks are in the cache ...
    d = Driver(handler)
    scored = open_scored(handler, "scored", ids, 2, k=0)
    d.add(scored)
    chunks = d.run()
    assert scored.cached_tokens == 0  # ... yet a scored prompt runs whole
    check_entries(chunks["scored"], ids, expected(reference, ids), 0, TokenBytes(handler.tokenizer))


def test_only_the_thinker_scores_prompts() -> None:
    msg = stage_pb2.SamplingParams(prompt_logprobs=2)
    assert merge_sampling(SamplingParams(), msg).prompt_logprobs == 2
    with pytest.raises(ValueError, match="prompt_logprobs are for the thinker's text tokens"):
        merge_sampling(SamplingParams(), msg, text=False)
    with pytest.raises(ValueError, match=r"prompt_logprobs must be in \[0, 64\]"):
        SamplingParams(prompt_logprobs=65, vocab_size=64)


def test_the_memory_profile_step_runs_the_head_and_the_scoring(model_dir: Path) -> None:
    """`LMShard.profile_step` (what `--gpu-memory-utilization` measures on CUDA) runs the layers, a step's
    logits and a scored chunk; here on CPU, where only its shapes can be checked (tests/parallel/test_cuda_ranks.py
    measures it on a GPU)."""
    from omnimesh.models.qwen3_omni.lm_shard import LMShard, LMShardSpec
    from omnimesh.parallel.parallel_state import ParallelState

    shard = LMShard(LMShardSpec(model_dir, "thinker"), ParallelState.single("cpu"))
    calls: list[int] = []
    head = shard.model.compute_logits
    shard.model.compute_logits = lambda rows: calls.append(int(rows.shape[0])) or head(rows)  # type: ignore[method-assign]
    shard.profile_step(torch.device("cpu"), 300, 256)
    assert calls == [256, lm_shard.SCORE_CHUNK]  # the step's logits, then one scored chunk
