"""Per-token log-probabilities of the thinker's text (OpenAI's `logprobs` / `top_logprobs`).

Data flow: the logits (V,) the engine returned for one request's step -> log_softmax, the model's raw
distribution (vLLM's default logprobs mode: before temperature, penalties and top-k / top-p) -> the
sampled id's value and the `k` most likely ids with theirs -> `stage_pb2.TokenLogprob`, each token with
its exact bytes (`TokenBytes`: a byte-level BPE symbol mapped back to the bytes it stands for, so a token
that holds part of a UTF-8 character says which bytes) -> the token's chunk (`StageChunk.logprobs`),
merged with the text it belongs to, on to the gateway. -inf (a masked id) is sent as -9999.0, as OpenAI
and vLLM do, so the JSON stays valid.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from omnimesh.v1 import stage_pb2

if TYPE_CHECKING:
    from omnimesh.models.qwen3_omni.lm_shard import PromptScores

FLOOR = -9999.0  # what -inf is sent as


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the printable character that stands for each byte -> the byte."""
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(visible)
    extra = 0
    for b in range(256):
        if b not in visible:
            visible.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(visible, chars, strict=True)}


class TokenBytes:
    """token id -> the bytes it stands for (cached; one per tokenizer)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        got = self._cache.get(token_id)
        if got is None:
            got = self._cache[token_id] = self._bytes(token_id)
        return got

    def _bytes(self, token_id: int) -> bytes:
        symbol = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(symbol, str):
            return b""
        decoder = _byte_decoder()
        if all(c in decoder for c in symbol):  # a byte-level symbol (or an ASCII special token: the same)
            return bytes(decoder[c] for c in symbol)
        return str(self.tokenizer.decode([token_id])).encode("utf-8")  # other vocabularies


def prompt_logprobs(scores: PromptScores, token_bytes: TokenBytes) -> list[stage_pb2.TokenLogprob]:
    """The engine's scored prompt rows (each row's next prompt token, its rank and the likeliest ids) as
    entries, as `token_logprob` makes them for generated tokens."""
    out = []
    for token, value, rank, top_values, top_ids in zip(scores.targets.tolist(), scores.logprobs.tolist(),
                                                         scores.ranks.tolist(), scores.top_logprobs.tolist(),
                                                         scores.top_ids.tolist(), strict=True):
        entry = stage_pb2.TokenLogprob(token_id=token, token=token_bytes(token), logprob=max(value, FLOOR), rank=rank)
        for v, i in zip(top_values, top_ids, strict=True):
            entry.top.add(token_id=i, token=token_bytes(i), logprob=max(v, FLOOR))
        out.append(entry)
    return out


def token_logprob(logits: torch.Tensor, token: int, k: int, token_bytes: TokenBytes,
                  normalize: bool = True) -> stage_pb2.TokenLogprob:
    """The sampled `token`'s entry from the step's `logits` (V,) (raw or processed: --logprobs-mode), with the `k`
    most likely alternatives; `normalize`: their log-softmax, else the values themselves."""
    logprobs = logits.to(torch.float32)  # (V,)
    if normalize:
        logprobs = torch.log_softmax(logprobs, dim=-1)
    entry = stage_pb2.TokenLogprob(token_id=token, token=token_bytes(token),
                                   logprob=max(float(logprobs[token]), FLOOR))
    if k:
        values, ids = torch.topk(logprobs, k)
        for value, i in zip(values.tolist(), ids.tolist(), strict=True):
            entry.top.add(token_id=i, token=token_bytes(i), logprob=max(value, FLOOR))
    return entry
