"""The wire SamplingParams (what the caller set) over the model's defaults -> the stage's SamplingParams.

Runs in each LLM stage handler's `open`. Unset fields keep the default `transformers` generate uses for
this model and role. `stop_token_ids` add to the model's own stop ids (its EOS stays one unless vLLM's
`ignore_eos` drops the model's own: the stage then runs to max_tokens or a caller's stop) and must
lie in [0, vocab) of this stage's head (`defaults.vocab_size`; the gateway does not know it). `stop`
strings (and `include_stop_str_in_output`) are carried on the params for the task's text (`StopStrings`
in detokenizer.py); `min_tokens` is checked against the merged `max_tokens` (the stage's default when the
caller set none). Bad values (negative temperature, top_p outside (0, 1], an id out of range, min_tokens
above max_tokens, ...) raise ValueError, which the stage servicer answers as INVALID_ARGUMENT prefixed with
the stage's name.
"""

from __future__ import annotations

import logging
import random
from dataclasses import replace
from typing import Any

from omnimesh.models.qwen3_omni.sampling import SAMPLING_ALIASES, SamplingParams, with_defaults
from omnimesh.v1 import stage_pb2

log = logging.getLogger(__name__)


def merge_sampling(defaults: SamplingParams, msg: stage_pb2.SamplingParams | None, *, text: bool = True
                   ) -> SamplingParams:
    """`text`: the stage emits text tokens (the thinker); a stage that does not refuses `logprobs`."""
    if msg is None:
        return defaults
    for name in ("logprobs", "prompt_logprobs", "skip_special_tokens"):
        if msg.HasField(name) and not text:
            raise ValueError(f"{name} are for the thinker's text tokens; this stage emits audio codes")
    if msg.bad_words and not text:
        raise ValueError("bad_words are for the thinker's text; this stage emits audio codes")
    changes: dict[str, Any] = {}
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "repetition_penalty", "min_tokens",
                 "include_stop_str_in_output", "presence_penalty", "frequency_penalty", "logprobs", "prompt_logprobs",
                 "skip_special_tokens"):
        if msg.HasField(name):
            changes[name] = getattr(msg, name)
    own = () if msg.ignore_eos else defaults.stop_token_ids  # vLLM's ignore_eos: the model's own stop ids go
    if msg.ignore_eos:
        changes["stop_token_ids"] = own
    if msg.stop_token_ids:
        ids = [int(i) for i in msg.stop_token_ids]
        vocab = defaults.vocab_size
        bad = [i for i in ids if i < 0 or (vocab > 0 and i >= vocab)]
        if bad:
            bound = f"[0, {vocab})" if vocab > 0 else ">= 0"
            raise ValueError(f"stop_token_ids must be in {bound} (this stage's vocabulary), got {bad[:8]}")
        changes["stop_token_ids"] = tuple(dict.fromkeys((*own, *ids)))
    vocab = defaults.vocab_size
    for name, ids in (("logit_bias", list(msg.logit_bias)), ("allowed_token_ids", list(msg.allowed_token_ids))):
        bad = [i for i in ids if i < 0 or (vocab > 0 and i >= vocab)]
        if bad:
            raise ValueError(f"{name}: token ids must be in [0, {vocab}) (this stage's vocabulary), got {sorted(bad)[:8]}")
    if msg.logit_bias:
        changes["logit_bias"] = tuple(sorted((int(i), float(b)) for i, b in msg.logit_bias.items()))
    if msg.allowed_token_ids:
        changes["allowed_token_ids"] = tuple(dict.fromkeys(int(i) for i in msg.allowed_token_ids))
    if msg.stop:
        if any(s == "" for s in msg.stop):
            raise ValueError("stop strings must not be empty")
        changes["stop"] = tuple(dict.fromkeys((*defaults.stop, *msg.stop)))
    return replace(defaults, **changes)


class SeedStream:
    """--seed (vLLM's): the seed of each request that brings none, drawn in turn from a stream that is a function of
    --seed and the stage, so the stage's Nth unseeded request gets the same seed in every run. Without --seed
    requests stay unseeded (fresh randomness each). Drawn on the stage's event loop, in the order requests open."""

    def __init__(self, seed: int | None, stage: str) -> None:
        self._draw = None if seed is None else random.Random(f"omnimesh:{stage}:{seed}")

    def fill(self, params: SamplingParams) -> SamplingParams:
        if self._draw is None or params.seed is not None:
            return params
        return replace(params, seed=self._draw.getrandbits(63))


def bad_word_texts(words: Any) -> tuple[str, ...]:
    """vLLM's bad_words as the texts to tokenize: each word as it starts the text and after a space (both
    spellings a BPE vocabulary may generate); an empty word is a ValueError. Cheap: checked when a request
    opens, tokenized (`bad_word_ids`) with its prompt, on the compute thread (1024 words take ~0.1 s)."""
    texts: list[str] = []
    for word in words:
        stripped = str(word).lstrip()
        if not stripped:
            raise ValueError("bad_words must not be empty or only spaces")
        texts += [stripped, " " + stripped]
    return tuple(texts)


def bad_word_ids(tokenizer: Any, texts: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """`bad_word_texts` -> the token sequences the sampler bans (duplicates once, the first spelling first)."""
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []  # one batched call
    return tuple(dict.fromkeys(tuple(int(i) for i in ids) for ids in encoded if ids))  # first spelling first


def operator_defaults(defaults: SamplingParams, overrides: dict[str, Any] | None, stage: str) -> SamplingParams:
    """The stage's defaults with the operator's `default_sampling_params` (--stage-overrides; the thinker's also
    from --override-generation-config) on top, said once in the start-up log."""
    if not overrides:
        return defaults
    merged = with_defaults(defaults, overrides, f"{stage} default_sampling_params")
    said = ", ".join(f"{k}={getattr(merged, k)}" for k in dict.fromkeys(SAMPLING_ALIASES.get(k, k) for k in overrides))
    log.info("%s: default sampling %s (the operator's; requests still set their own)", stage, said)
    return merged
