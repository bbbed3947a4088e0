"""services/llm/detokenizer.py's `Detokenizer` on the tiny model's real byte-level BPE tokenizer: the deltas of
any id sequence (text split mid-character, special tokens between, random ids that are no valid UTF-8) join
into exactly `decode(ids, skip_special_tokens=True)`; no delta but the last ends in a partial character; and
each step decodes a short window, not every id so far (a long answer stays linear)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from services.llm.detokenizer import Detokenizer

TEXT = "Hello, wörld! 世界 🎉 naïve\ttabs\n and a long tail of ordinary words " * 3


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(model_dir)


def run(tokenizer: Any, ids: list[int]) -> list[str]:
    d = Detokenizer(tokenizer)
    return [d.push(i) for i in ids] + [d.finish()]


def test_text_split_mid_character_with_special_tokens_between(tokenizer: Any) -> None:
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    mixed = [t for i in ids for t in ((i, im_end) if i % 5 == 0 else (i,))]
    for seq in (ids, mixed):
        deltas = run(tokenizer, seq)
        assert "".join(deltas) == tokenizer.decode(seq, skip_special_tokens=True) == TEXT
        assert not any(d.endswith("\ufffd") for d in deltas[:-1])
        assert sum(bool(d) for d in deltas) < len(seq)  # a split character waited for its last byte


@pytest.mark.parametrize("seed", range(5))
def test_random_ids_join_into_the_whole_decode(tokenizer: Any, seed: int) -> None:
    rng = random.Random(seed)
    ids = [rng.randrange(len(tokenizer)) for _ in range(300)]
    assert "".join(run(tokenizer, ids)) == tokenizer.decode(ids, skip_special_tokens=True)


def test_each_step_decodes_a_short_window(tokenizer: Any) -> None:
    class Counting:
        def __init__(self) -> None:
            self.longest = 0

        def decode(self, ids: list[int], **kw: Any) -> str:
            self.longest = max(self.longest, len(ids))
            return str(tokenizer.decode(ids, **kw))

    counting = Counting()
    ids = tokenizer(TEXT * 20, add_special_tokens=False)["input_ids"]
    d = Detokenizer(counting)
    assert "".join([d.push(i) for i in ids] + [d.finish()]) == TEXT * 20
    assert len(ids) > 1000 and counting.longest <= 8


def test_special_tokens_stay_when_asked(tokenizer: Any) -> None:
    """vLLM's skip_special_tokens=False: the same deltas with the special tokens' spellings in them."""
    ids = tokenizer("Hi there", add_special_tokens=False)["input_ids"]
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    seq = [*ids, im_end, *ids]
    d = Detokenizer(tokenizer, skip_special_tokens=False)
    assert "".join([d.push(i) for i in seq] + [d.finish()]) == "Hi there<|im_end|>Hi there"


def test_the_thinker_keeps_special_tokens_when_asked(model_dir: Path, thinker: Any, tokenizer: Any) -> None:
    import torch

    from omnimesh.transport.frames import StageChunk
    from omnimesh.v1 import stage_pb2
    from tests.services.test_lm_batching import Driver, token_ids

    ids = torch.tensor(tokenizer("The sea is")["input_ids"])

    reserved = tokenizer.convert_tokens_to_ids("<|reserved_420|>")  # a special token the tiny model can say

    def run(**sampling: Any) -> tuple[str, list[int]]:
        task = thinker.open(stage_pb2.Open(request_id="s", sampling=stage_pb2.SamplingParams(
            temperature=0, max_tokens=5, logit_bias={reserved: 0.5}, **sampling)))
        task.feed(StageChunk(tensors={"input_ids": ids}, final=True))
        d = Driver(thinker)
        d.add(task)
        chunks = d.run()["s"]
        return "".join(c.text for c in chunks), token_ids(chunks)

    kept, generated = run(skip_special_tokens=False)
    plain, same = run()
    assert generated == same
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    assert any(t in special for t in generated) and set(generated) - special, generated  # the bias: some, not all
    assert kept == tokenizer.decode(generated, skip_special_tokens=False) != plain
    assert plain == tokenizer.decode(generated, skip_special_tokens=True)
