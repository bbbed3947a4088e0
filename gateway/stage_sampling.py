"""Client sampling settings -> the SamplingParams each stage receives.

Rules (see README "The API"): every top-level field (temperature, top_p, top_k, seed, max_tokens,
min_tokens, repetition_penalty, presence_penalty, frequency_penalty, stop_token_ids, stop,
include_stop_str_in_output) applies to the thinker; `stage_params[stage]` overrides per stage, field by
field (a stage's list replaces the top-level list); a top-level `temperature: 0` makes EVERY stage greedy (a stage's own explicit
temperature still wins) and a top-level seed seeds the talker too. Stop ids / strings and min_tokens
never pass from the thinker to the talker (other vocab, no text, codes rather than text tokens). Unset
fields stay unset, so each stage falls back to the defaults `transformers` generate uses for that model;
the stage itself checks `stop_token_ids` against its vocab.
"""

from __future__ import annotations

from gateway.events import ChatRequest, SamplingOverrides
from omnimesh.v1 import stage_pb2


def _to_proto(s: SamplingOverrides) -> stage_pb2.SamplingParams:
    msg = stage_pb2.SamplingParams()
    if s.temperature is not None:
        msg.temperature = s.temperature
    if s.top_p is not None:
        msg.top_p = s.top_p
    if s.top_k is not None:
        msg.top_k = max(s.top_k, 0)  # vLLM's -1 (off) is the stages' 0
    if s.seed is not None:
        msg.seed = s.seed
    if s.max_tokens is not None:
        msg.max_tokens = s.max_tokens
    if s.repetition_penalty is not None:
        msg.repetition_penalty = s.repetition_penalty
    if s.stop_token_ids:
        msg.stop_token_ids.extend(s.stop_token_ids)
    if s.stop:
        msg.stop.extend(s.stop)
    if s.min_tokens is not None:
        msg.min_tokens = s.min_tokens
    if s.include_stop_str_in_output is not None:
        msg.include_stop_str_in_output = s.include_stop_str_in_output
    if s.presence_penalty is not None:
        msg.presence_penalty = s.presence_penalty
    if s.frequency_penalty is not None:
        msg.frequency_penalty = s.frequency_penalty
    if s.logprobs is not None:
        msg.logprobs = s.logprobs
    if s.prompt_logprobs is not None:
        msg.prompt_logprobs = s.prompt_logprobs
    if s.skip_special_tokens is not None:
        msg.skip_special_tokens = s.skip_special_tokens
    if s.min_p is not None:
        msg.min_p = s.min_p
    if s.ignore_eos:
        msg.ignore_eos = True
    for token, bias in s.logit_bias or ():
        msg.logit_bias[token] = bias
    if s.allowed_token_ids:
        msg.allowed_token_ids.extend(s.allowed_token_ids)
    if s.bad_words:
        msg.bad_words.extend(s.bad_words)
    return msg


def _merge(base: SamplingOverrides, top: SamplingOverrides | None) -> SamplingOverrides:
    if top is None:
        return base
    return SamplingOverrides(
        **{name: getattr(top, name) if getattr(top, name) is not None else getattr(base, name) for name in base.__slots__}
    )


def thinker_sampling(req: ChatRequest) -> stage_pb2.SamplingParams:
    return _to_proto(_merge(req.sampling, req.stage_params.get("thinker")))


def talker_sampling(req: ChatRequest) -> stage_pb2.SamplingParams:
    # the talker inherits greediness and the seed (so a seeded request is reproducible end to end)
    inherited = SamplingOverrides(temperature=0.0 if req.sampling.temperature == 0 else None, seed=req.sampling.seed)
    return _to_proto(_merge(inherited, req.stage_params.get("talker")))
