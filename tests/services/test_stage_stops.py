"""`min_tokens` and `include_stop_str_in_output` in the thinker and talker stages, on the tiny model folder
(greedy, stepped by each stage's batcher as the engine loop does). What it proves:

- min_tokens vs a stop id the model emits at once: without it the request ends after one token; with
  min_tokens 6 it runs on, no stop id among the first 6 tokens, and every token is exactly the argmax of
  its logits with the stop ids (EOS included) at -inf until then and untouched after (greedy exactness);
- min_tokens above what the context holds is cut with max_tokens (no error): no stop before the end;
- min_tokens vs a stop string: the text the request would stop at is passed over until min_tokens tokens
  are out; the request stops at the next occurrence that completes after that, with the same tokens as the
  plain run (stop strings never change what is sampled);
- include_stop_str_in_output: the same stop ends the text before the stop string (default) or right after
  it (set), for a stop string inside one token's text and for one split over two tokens;
- the talker (stage_params.talker.min_tokens): a stop id it emits first ends it at once; with min_tokens 5
  it speaks at least 5 code groups, none of them starting with a stop id.

Run: python -m pytest tests/services/test_stage_stops.py -q
"""

from __future__ import annotations

from itertools import accumulate
from pathlib import Path
from typing import Any

import torch

from omnimesh.config.serve_args import ServeArgs
from omnimesh.transport.frames import StageChunk
from omnimesh.v1 import stage_pb2
from services.llm.talker_handler import build_handler as talker_handler
from tests.services.test_lm_batching import Driver, Recorder, codes, open_thinker, prompts, token_ids

MAX_TOKENS = 24


class Run:
    """One greedy request alone on the stage: its tokens, per-token text deltas, finish reason, logits (n, V)."""

    def __init__(self, handler: Any, ids: torch.Tensor, **sampling: Any):
        sampling.setdefault("max_tokens", MAX_TOKENS)
        task = handler.open(stage_pb2.Open(request_id="r", sampling=stage_pb2.SamplingParams(temperature=0,
                                                                                             **sampling)))
        task.feed(StageChunk(tensors={"input_ids": ids}, final=True))
        rec = Recorder(handler.batcher.engine)
        try:
            d = Driver(handler)
            d.add(task)
            chunks = d.run()["r"]
        finally:
            rec.stop()
        self.tokens = token_ids(chunks)
        self.deltas = [c.text for c in chunks]
        self.text = "".join(self.deltas)
        self.finish_reason = task.finish_reason
        self.stop_reason = task.stop_reason
        self.logits = rec.stacked("r")
        assert len(chunks) == len(self.tokens) == task.completion_tokens  # one chunk per token


def test_min_tokens_holds_back_a_stop_id_exactly(thinker: Any) -> None:
    ids = prompts([7], seed=0)[0]
    plain = Run(thinker, ids)
    first = plain.tokens[0]
    assert first not in plain.tokens[1:6], "pick a prompt whose first token does not recur at once"
    stopped = Run(thinker, ids, stop_token_ids=[first])
    assert stopped.tokens == [first] and stopped.finish_reason == "stop"  # the stop id the model emits first
    assert stopped.stop_reason == first and plain.stop_reason is None  # vLLM's stop_reason names the request's id

    got = Run(thinker, ids, stop_token_ids=[first], min_tokens=6)
    stop_ids = [*thinker.defaults.stop_token_ids, first]  # the model's EOS is held back too
    assert len(got.tokens) >= 6 and not set(got.tokens[:6]) & set(stop_ids)
    for i, (token, row) in enumerate(zip(got.tokens, got.logits)):
        masked = row.clone()
        if i < 6:
            masked[stop_ids] = -float("inf")
        assert token == int(masked.argmax()), f"token {i} is not the greedy pick"
    if got.finish_reason == "stop":
        assert got.tokens[-1] in stop_ids and len(got.tokens) > 6
    else:
        assert len(got.tokens) == MAX_TOKENS
    # min_tokens 0 is the plain request, token for token
    assert Run(thinker, ids, min_tokens=0).tokens == plain.tokens


def test_min_tokens_shrinks_with_max_tokens_to_what_the_context_holds(thinker: Any) -> None:
    """A long prompt leaves max_model_len - prompt tokens: max_tokens is cut to that and min_tokens with it
    (no error), so the request runs to the end of the context with no stop."""
    ids = prompts([100], seed=1)[0]  # max_model_len 128: room for 28 tokens
    first = Run(thinker, ids, max_tokens=5).tokens[0]
    got = Run(thinker, ids, max_tokens=1000, min_tokens=1000, stop_token_ids=[first])
    assert len(got.tokens) == 28 and got.finish_reason == "length" and first not in got.tokens


def _repeating_delta(run: Run) -> str:
    """A token's non-empty text that occurs again later in the text (the stop string for the tests)."""
    ends = list(accumulate(len(d) for d in run.deltas))
    for k, d in enumerate(run.deltas):
        if d and run.text.find(d, ends[k]) >= 0:
            return d
    raise AssertionError(f"the tiny model's greedy text repeats no token's text: {run.deltas}")


def test_min_tokens_passes_over_a_stop_string_until_it_is_reached(thinker: Any) -> None:
    ids = prompts([7], seed=3)[0]
    plain = Run(thinker, ids)
    stop = _repeating_delta(plain)
    ends = list(accumulate(len(d) for d in plain.deltas))  # text length after each token

    early = Run(thinker, ids, stop=[stop])
    p0 = plain.text.index(stop)
    assert early.finish_reason == "stop" and early.text == plain.text[:p0] and early.stop_reason == stop
    n0 = len(early.tokens)  # the token that completed the first occurrence

    got = Run(thinker, ids, stop=[stop], min_tokens=n0 + 1)
    # the first occurrence is plain text now; the next one that completes after token n0 stops the request
    p1 = plain.text.find(stop, ends[n0 - 1] - len(stop) + 1)
    assert p1 > p0, "the stop string must occur again after min_tokens"
    n1 = next(k + 1 for k, e in enumerate(ends) if e >= p1 + len(stop))
    assert got.finish_reason == "stop" and got.text == plain.text[:p1]
    assert got.tokens == plain.tokens[:n1] and n1 >= n0 + 1


def test_include_stop_str_in_output(thinker: Any) -> None:
    ids = prompts([7], seed=3)[0]
    plain = Run(thinker, ids)
    stop = _repeating_delta(plain)
    p = plain.text.index(stop)
    # a stop string that spans two tokens' texts: the last char of one and the first of the next
    ends = list(accumulate(len(d) for d in plain.deltas))
    k = next(k for k, e in enumerate(ends[:-1]) if 0 < e < len(plain.text) and plain.deltas[k + 1])
    split = plain.text[ends[k] - 1:ends[k] + 1]
    q = plain.text.index(split)
    assert q == ends[k] - 1, f"{split!r} occurs earlier, inside one token's text"
    for stops, at in (([stop], p), ([split], q)):
        s = stops[0]
        excluded = Run(thinker, ids, stop=stops)
        included = Run(thinker, ids, stop=stops, include_stop_str_in_output=True)
        assert excluded.text == plain.text[:at], s
        assert included.text == plain.text[:at + len(s)] and included.text.endswith(s), s
        assert excluded.tokens == included.tokens and excluded.finish_reason == included.finish_reason == "stop"


def test_talker_min_tokens_holds_back_its_stop_id(model_dir: Path, thinker: Any) -> None:
    # what the thinker sends the talker for one spoken answer (a user turn, then the assistant start)
    ids = torch.cat([torch.tensor([400, 413, 10]), prompts([6], seed=5)[0], torch.tensor([401, 10, 400, 414, 10])])
    d = Driver(thinker)
    d.add(open_thinker(thinker, "t", ids, 8, talker_inputs="1"))
    spoken = d.run()["t"]
    talker = talker_handler(model_dir, ServeArgs(max_model_len=128))

    def speak(**sampling: Any) -> tuple[Any, torch.Tensor]:
        task = talker.open(stage_pb2.Open(request_id="t", options={"speaker": "ethan"},
                                          sampling=stage_pb2.SamplingParams(temperature=0, max_tokens=20, **sampling)))
        for n, c in enumerate(spoken):
            task.feed(StageChunk(tensors=c.tensors, seq=n, final=n == len(spoken) - 1))
        run = Driver(talker)
        run.add(task)
        out = [c for c in run.run()["t"] if "codes" in c.tensors]
        return task, codes(out) if out else torch.zeros(0, 0, dtype=torch.long)

    _, plain_codes = speak()
    first = int(plain_codes[0, 0])  # c0 of the first group: the first token the talker samples
    stopped, _ = speak(stop_token_ids=[first])
    assert stopped.completion_tokens == 1 and stopped.finish_reason == "stop"
    got, got_codes = speak(stop_token_ids=[first], min_tokens=5)
    stop_ids = {*talker.defaults.stop_token_ids, first}
    assert got.completion_tokens >= 5 and got_codes.shape[1] >= 5
    assert not set(got_codes[0, :5].tolist()) & stop_ids


def test_the_models_own_stop_leaves_stop_reason_unset(thinker: Any) -> None:
    """vLLM's stop_reason stays None when the model's own EOS ends the answer, even when the request lists it."""
    eos = thinker.defaults.stop_token_ids[0]
    ids = prompts([7], seed=0)[0]
    first = Run(thinker, ids).tokens[0]
    got = Run(thinker, ids, stop_token_ids=[first, eos], logit_bias={eos: 100.0})
    assert got.tokens == [eos] and got.finish_reason == "stop" and got.stop_reason is None
