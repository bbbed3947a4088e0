"""merge_token_chunks: several thinker token chunks as one — what --stream-interval sends and what the stage
writes when its chunks queue up (ThinkerHandler.merge_outputs).

Run: python -m pytest tests/services/test_thinker_merge.py -q
"""

from __future__ import annotations

import pytest
import torch

from omnimesh.transport.frames import StageChunk
from omnimesh.v1 import stage_pb2
from services.llm.thinker_handler import ThinkerHandler
from services.llm.thinker_task import merge_token_chunks


def token(i: int, *, prompt: bool = False, spoken: bool = True, final: bool = False) -> StageChunk:
    tensors = {"token_ids": torch.tensor([i])}
    if spoken:
        tensors["token_embeds"] = torch.full((1, 4), float(i))
    if prompt:
        tensors["prompt_embeds"] = torch.ones(3, 4)
    return StageChunk(tensors=tensors, text=f"t{i}", final=final,
                      logprobs=[stage_pb2.TokenLogprob(token_id=i, token=f"t{i}".encode(), logprob=-float(i))])


def test_tokens_stack_and_the_prompt_stays() -> None:
    first, last = token(1, prompt=True), token(3, spoken=False, final=True)  # the final token is never spoken
    merged = merge_token_chunks([first, token(2), last])
    assert merged.text == "t1t2t3" and merged.final
    assert [(e.token_id, e.logprob) for e in merged.logprobs] == [(1, -1.0), (2, -2.0), (3, -3.0)]  # with the text
    assert merged.tensors["token_ids"].tolist() == [1, 2, 3]
    assert merged.tensors["token_embeds"][:, 0].tolist() == [1.0, 2.0]
    assert merged.tensors["prompt_embeds"] is first.tensors["prompt_embeds"]
    assert ThinkerHandler.merge_outputs([first]) is first


def test_two_chunks_with_the_same_other_tensor_do_not_merge() -> None:
    with pytest.raises(ValueError, match="two chunks both carry 'prompt_embeds'"):
        merge_token_chunks([token(1, prompt=True), token(2, prompt=True)])
