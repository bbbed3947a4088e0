"""OpenAI's `logit_bias` and vLLM's `allowed_token_ids` and `bad_words` in the stages' sampler
(models/qwen3_omni/sampling.py) and the thinker: a +100 bias makes greedy decoding pick that id every time, a
-100 bias keeps the model's own first pick out, allowed ids bound every pick (stop ids too, as vLLM's); a bad
word's last token is banned where the generated tokens end with the rest of it, so the thinker's greedy answer
changes exactly there; the batched greedy path of the talker steps aside for requests that set them; ids
outside the vocabulary, biases outside [-100, 100] and bad words for the talker are refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from omnimesh.config.serve_args import ServeArgs
from omnimesh.models.qwen3_omni.sampling import Sampler, SamplingParams, greedy_batch
from omnimesh.transport.frames import StageChunk
from omnimesh.v1 import stage_pb2
from services.llm.sampling import merge_sampling
from services.llm.thinker_handler import build_handler as thinker_handler
from tests.services.test_lm_batching import Driver, prompts, token_ids


def test_the_sampler_adds_the_bias_and_keeps_only_allowed_ids() -> None:
    logits = torch.tensor([0.0, 5.0, 1.0, 2.0, 3.0])
    assert Sampler(SamplingParams(temperature=0)).sample(logits) == 1
    assert Sampler(SamplingParams(temperature=0, logit_bias=((3, 4.0),))).sample(logits) == 3  # 2 + 4 > 5
    assert Sampler(SamplingParams(temperature=0, logit_bias=((1, -100.0),))).sample(logits) == 4
    assert Sampler(SamplingParams(temperature=0, allowed_token_ids=(0, 2))).sample(logits) == 2
    sampled = {Sampler(SamplingParams(temperature=1.0, seed=s, allowed_token_ids=(0, 3))).sample(logits)
               for s in range(40)}
    assert sampled == {0, 3}
    biased = Sampler(SamplingParams(temperature=0, logit_bias=((0, 10.0),)))
    assert greedy_batch([biased, biased], torch.stack([logits, logits]), [[], []]) is None  # one by one instead
    with pytest.raises(ValueError, match="logit_bias of token 2 must be in \\[-100, 100\\]"):
        SamplingParams(logit_bias=((2, 101.0),))


def test_bad_words_ban_the_token_that_would_complete_one() -> None:
    logits = torch.tensor([0.0, 5.0, 1.0, 2.0, 3.0])
    one = Sampler(SamplingParams(temperature=0, bad_words_ids=((1,),)))
    assert one.sample(logits) == 4  # a one-token word: never
    seq = Sampler(SamplingParams(temperature=0, bad_words_ids=((4, 1),)))
    assert seq.sample(logits, torch.tensor([9, 9])) == 1  # nothing generated yet ends with 4
    seq.num_sampled = 1
    assert seq.sample(logits, torch.tensor([9, 4])) == 4  # the last generated token is 4: 1 is out
    with pytest.raises(ValueError, match="bad_words are for the thinker's text"):
        merge_sampling(SamplingParams(), stage_pb2.SamplingParams(bad_words=["x"]), text=False)


def test_many_bad_words_ban_exactly_what_the_plain_rule_bans() -> None:
    """The prefix table (one lookup per prefix length) against vLLM's rule word by word: the last id of every
    word whose other ids end the generated tokens, over random words of 1-4 ids and random histories."""
    rng = torch.Generator().manual_seed(3)
    words = tuple(tuple(torch.randint(0, 6, (int(n),), generator=rng).tolist())
                  for n in torch.randint(1, 5, (300,), generator=rng))
    sampler = Sampler(SamplingParams(temperature=0, bad_words_ids=words))
    for _ in range(200):
        generated = torch.randint(0, 6, (int(torch.randint(0, 6, (1,), generator=rng)),), generator=rng).tolist()
        history = torch.tensor([9, 9, *generated])
        sampler.num_sampled = len(generated)
        want = {w[-1] for w in words if len(generated) >= len(w) - 1 and generated[len(generated) - len(w) + 1:] == list(w[:-1])}
        scores = sampler._ban_bad_words(torch.zeros(8), history)
        assert {i for i in range(8) if scores[i] == -float("inf")} == want, (generated, want)


def test_the_stage_checks_ids_against_its_vocabulary() -> None:
    defaults = SamplingParams(vocab_size=10)
    merged = merge_sampling(defaults, stage_pb2.SamplingParams(logit_bias={3: 1.5, 1: -2.0}, allowed_token_ids=[4, 4, 2]))
    assert merged.logit_bias == ((1, -2.0), (3, 1.5)) and merged.allowed_token_ids == (4, 2)
    for msg, name in ((stage_pb2.SamplingParams(logit_bias={10: 1.0}), "logit_bias"),
                      (stage_pb2.SamplingParams(allowed_token_ids=[11]), "allowed_token_ids")):
        with pytest.raises(ValueError, match=f"{name}: token ids must be in \\[0, 10\\)"):
            merge_sampling(defaults, msg)


@pytest.fixture(scope="module")
def handler(model_dir: Path) -> Any:
    return thinker_handler(model_dir, ServeArgs(max_model_len=128, kv_cache_memory="1MiB", stream_interval=1))


def run(handler: Any, **sampling: Any) -> list[int]:
    task = handler.open(stage_pb2.Open(request_id="r", sampling=stage_pb2.SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True, **sampling)))
    task.feed(StageChunk(tensors={"input_ids": prompts([9], seed=8)[0]}, final=True))
    d = Driver(handler)
    d.add(task)
    return token_ids(d.run()["r"])


def test_the_thinker_follows_bias_and_allowed_ids(handler: Any) -> None:
    plain = run(handler)
    assert len(set(plain)) > 1, "the greedy answer repeats one id anyway: the test would prove little"
    assert run(handler, logit_bias={77: 100.0}) == [77] * 8
    avoided = run(handler, logit_bias={plain[0]: -100.0})
    assert avoided[0] != plain[0]
    allowed = run(handler, allowed_token_ids=[plain[1], 91, 92])
    assert set(allowed) <= {plain[1], 91, 92} and len(allowed) == 8
    tok = handler.tokenizer
    # a token of the greedy answer that is a plain word on its own (it encodes back to itself)
    word, t = next((tok.decode([t]), t) for t in plain
                   if tok.decode([t]).strip().isalpha() and tok.encode(tok.decode([t]), add_special_tokens=False) == [t])
    banned = run(handler, bad_words=[word])
    assert t not in banned and banned[:plain.index(t)] == plain[:plain.index(t)]  # the same answer up to it
    # opening only checks the words: the tokenizer runs with the prompt, on the compute thread, not the event loop
    task = handler.open(stage_pb2.Open(request_id="w", sampling=stage_pb2.SamplingParams(bad_words=[f" {word}"])))
    assert task.bad_words == (word, f" {word}") and not task.sampler.params.bad_words_ids
    task.close()  # leaves the engine's admitted set
    with pytest.raises(ValueError, match="must not be empty"):
        handler.open(stage_pb2.Open(request_id="e", sampling=stage_pb2.SamplingParams(bad_words=["  "])))
