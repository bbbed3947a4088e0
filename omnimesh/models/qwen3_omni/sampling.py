"""Per-request token sampling that reproduces transformers' `generate` logits processing exactly.

Role: the thinker, the talker and the code predictor each pick tokens through a `Sampler`, one per request
(it owns the request's seeded `torch.Generator`). The order of operations is the order in which
`GenerationMixin._get_logits_processor` stacks its processors for the options used here:

    logits (V,) -> repetition penalty (over `history`) -> frequency / presence penalties (over the tokens
                   this Sampler picked) -> min new tokens (stop ids -inf while fewer than
                   `min_tokens` were sampled) -> suppress tokens (-inf)
                -> [sampling only] temperature -> top-k -> top-p -> softmax -> multinomial(generator)
                -> [greedy]       argmax

`temperature == 0` means greedy (`do_sample=False`): transformers then skips temperature / top-k / top-p
but still applies the repetition penalty and suppressed tokens, and so does this file. A temperature in
(0, MIN_TEMPERATURE) samples at MIN_TEMPERATURE, as vLLM does: dividing by less overflows the scores (1e-45
made every probability NaN). A step with no token left to pick (allowed_token_ids, bad_words and min_tokens
excluding them all) or with scores no distribution can come from (an extreme repetition_penalty) fails its
request with a ValueError that says which (the stage: INVALID_ARGUMENT); `torch.multinomial` would raise
on CPU and assert on the device under CUDA, and argmax would pick id 0 from nothing. `min_tokens` is
`generate`'s `min_new_tokens` (`MinNewTokensLengthLogitsProcessor`, over every stop id, the EOS included);
0 (the default) changes nothing. `frequency_penalty` / `presence_penalty` are OpenAI's (transformers has
none; the arithmetic is vLLM's): each id's score loses `frequency_penalty` per time the request generated
it plus `presence_penalty` once if it generated it at all — generated tokens only, never the prompt; 0 (the
default) changes nothing. The Sampler counts the tokens it picked, so it is made before a request's
first token and used once per token.

What `history` holds is the caller's choice and mirrors `generate`: the thinker is called with `input_ids`,
so it penalises prompt + generated tokens; the talker is called with `inputs_embeds` only, so it penalises
its generated codec tokens only; the code predictor has no penalty.

The `*_sampling_params` functions give the defaults `Qwen3OmniMoeForConditionalGeneration.generate` uses.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeConfig

from omnimesh.config.stage_config import typed_number
from omnimesh.kernels import cpu_kernels

MIN_TEMPERATURE = 0.01  # vLLM's _MAX_TEMP: a lower non-zero temperature samples at this one


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks tokens. `temperature == 0` is greedy; `top_k == 0` / `top_p == 1` are off.

    `stop` and `include_stop_str_in_output` are carried for the task's text (the Sampler never looks at
    them); `vocab_size` only bounds ids. `min_tokens`: no stop id can be picked before that many tokens.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0  # vLLM's / `MinPLogitsWarper`: drop ids below min_p x the top probability (0 = off)
    seed: int | None = None
    max_tokens: int = 1024
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    suppress_tokens: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings on the detokenized text (thinker; see services/llm/detokenizer.py)
    include_stop_str_in_output: bool = False  # the matched stop string ends the text instead of being cut
    min_tokens: int = 0  # stop ids are suppressed (-inf) until this many tokens were sampled
    presence_penalty: float = 0.0  # OpenAI's, in [-2, 2]: minus this once for every id generated so far
    frequency_penalty: float = 0.0  # OpenAI's, in [-2, 2]: minus this per time an id was generated so far
    vocab_size: int = 0  # ids the head can produce (0 = unknown); bounds the caller's stop_token_ids
    # the thinker returns each token's log-probability (raw model distribution) and this many alternatives
    logprobs: int | None = None
    # vLLM's: each prompt token's log-probability (from the second) and this many alternatives (thinker only)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True  # vLLM's: the thinker's text leaves special tokens out
    logit_bias: tuple[tuple[int, float], ...] = ()  # OpenAI's: (id, added to its logit in [-100, 100])
    allowed_token_ids: tuple[int, ...] = ()  # vLLM's: only these ids may be picked (empty = all)
    # vLLM's bad_words as token sequences: a sequence's last id is banned where the generated tokens end with the
    # rest of it (always, for a one-token word)
    bad_words_ids: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if 0.0 < self.temperature < MIN_TEMPERATURE:  # less overflows the scores (see the module docstring)
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}; use 1.0 to disable it")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}; use 0 to disable it")
        if self.top_k == -1:  # vLLM's "off", as the gateway takes it (a direct stage call, --default-sampling)
            object.__setattr__(self, "top_k", 0)
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}; use 0 (or -1) to disable it")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}; 1.0 disables it")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2] (0 disables it), got {getattr(self, name)}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= (self.vocab_size or k):
                raise ValueError(f"{name} must be in [0, {self.vocab_size}] alternatives per token (the vocabulary), "
                                 f"got {k}")
        for i, bias in self.logit_bias:
            if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
                raise ValueError(f"logit_bias of token {i} must be in [-100, 100], got {bias}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens = {self.max_tokens}], got {self.min_tokens}; "
                             f"lower min_tokens or raise max_tokens")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def output_penalties(self) -> bool:
        """Whether the frequency / presence penalties change anything (they need the generated ids)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


class Sampler:
    """Picks tokens for ONE request: logits processing as transformers does it, then argmax or a seeded draw.

    Pass `generator` to share one random stream between samplers of the same request (the talker and its
    code predictor draw from one stream in `generate`, interleaved in a fixed order).
    """

    def __init__(self, params: SamplingParams, generator: torch.Generator | None = None) -> None:
        self.params = params
        if generator is None:
            generator = torch.Generator()
            if params.seed is None:
                generator.seed()
            else:
                generator.manual_seed(params.seed)
        self.generator = generator
        self._suppress_mask: torch.Tensor | None = None  # (V,) bool, built on first use
        self._suppress: torch.Tensor | None = (
            torch.tensor(params.suppress_tokens, dtype=torch.long) if params.suppress_tokens else None
        )
        self._min_stop: torch.Tensor | None = (  # (k,) the stop ids min_tokens holds back
            torch.tensor(params.stop_token_ids, dtype=torch.long)
            if params.min_tokens and params.stop_token_ids else None
        )
        self._bias = (torch.tensor([i for i, _ in params.logit_bias], dtype=torch.long),
                      torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32)) if params.logit_bias else None
        self._allowed = torch.tensor(params.allowed_token_ids, dtype=torch.long) if params.allowed_token_ids else None
        # bad words by the length of their prefix: {n: {the n ids before the last: [last ids]}}, so a step looks up
        # one tuple per distinct length, however many words a request bans
        self._bad: dict[int, dict[tuple[int, ...], list[int]]] = {}
        for word in params.bad_words_ids:
            self._bad.setdefault(len(word) - 1, {}).setdefault(tuple(word[:-1]), []).append(word[-1])
        single = self._bad.pop(0, {}).get((), [])  # one-id words: banned at every step, one tensor
        self._bad_always = torch.tensor(sorted(set(single)), dtype=torch.long) if single else None
        self._bad_longest = max(self._bad, default=0)
        self.num_sampled = 0  # tokens picked so far by `sample` (what min_tokens counts)
        self.keep_processed = False  # set: `processed` holds the scores of the last `sample` (--logprobs-mode)
        self.processed: torch.Tensor | None = None
        self._generated: dict[int, int] = {}  # id -> times picked; kept only when the output penalties are on

    def process(self, logits: torch.Tensor, history: torch.Tensor | None = None) -> torch.Tensor:
        """The processed scores (V,) the next token is picked from (penalty, min_tokens, suppression, and the
        warpers if sampling)."""
        p = self.params
        scores = logits.to(torch.float32)  # (V,)
        if p.repetition_penalty != 1.0 and history is not None and history.numel() > 0:
            scores = apply_repetition_penalty(scores, history, p.repetition_penalty)
        if self._generated:
            scores = apply_output_penalties(scores, self._generated, p.frequency_penalty, p.presence_penalty)
        if self._allowed is not None:  # vLLM's allowed_token_ids: every other id is out
            allowed = self._allowed.to(scores.device)
            keep = scores.new_full(scores.shape, -float("inf"))
            scores = keep.index_copy(0, allowed, scores.index_select(0, allowed))
        if p.bad_words_ids:
            scores = self._ban_bad_words(scores, history)
        if self._bias is not None:  # OpenAI's logit_bias, added to the (penalised) logits
            ids, bias = self._bias
            scores = scores.index_add(0, ids.to(scores.device), bias.to(scores.device, scores.dtype))
        if self._min_stop is not None and self.num_sampled < p.min_tokens:
            ids = self._min_stop.to(scores.device)
            scores = scores.index_fill(0, ids[ids < scores.shape[-1]], -float("inf"))  # (V,)
        if self._suppress is not None:
            mask = self._suppress_mask
            if mask is None or mask.shape[0] != scores.shape[-1] or mask.device != scores.device:
                vocab = torch.arange(scores.shape[-1], device=scores.device)  # (V,)
                mask = self._suppress_mask = torch.isin(vocab, self._suppress.to(scores.device))  # built once
            scores = scores.masked_fill(mask, -float("inf"))
        if p.greedy:
            return scores
        if p.temperature != 1.0:
            scores = scores / p.temperature
        if p.top_k > 0:
            scores = apply_top_k(scores, p.top_k)
        if p.top_p < 1.0:
            scores = apply_top_p(scores, p.top_p)
        if p.min_p > 0.0:
            scores = apply_min_p(scores, p.min_p)
        return scores

    def _ban_bad_words(self, scores: torch.Tensor, history: torch.Tensor | None) -> torch.Tensor:
        """vLLM's bad_words: the last id of each word whose other ids the generated tokens end with."""
        recent: list[int] = []  # the generated tokens a prefix can end with (the longest prefix's worth)
        if history is not None and self.num_sampled and self._bad_longest:
            recent = history[-min(self.num_sampled, self._bad_longest):].tolist()
        if self._bad_always is not None:
            always = self._bad_always[self._bad_always < scores.shape[-1]].to(scores.device)
            scores = scores.index_fill(0, always, -float("inf"))
        banned = [last for n, prefixes in self._bad.items() if len(recent) >= n
                  for last in prefixes.get(tuple(recent[len(recent) - n:]), ())]
        banned = [i for i in banned if i < scores.shape[-1]]
        if not banned:
            return scores
        return scores.index_fill(0, torch.tensor(banned, dtype=torch.long, device=scores.device), -float("inf"))

    def sample(self, logits: torch.Tensor, history: torch.Tensor | None = None) -> int:
        """One token id from `logits` (V,), given the tokens `history` (n,) the penalty looks at."""
        scores = self.process(logits, history)  # (V,)
        if self.keep_processed:
            self.processed = scores
        if self.params.greedy:
            best, index = torch.max(scores, dim=-1)  # one pass, as argmax
            if math.isnan(top := float(best)) or top == -math.inf:
                self._no_distribution(logits, top)
            token = int(index)
        else:
            if not math.isfinite(top := float(scores.max())):  # NaN probabilities: checked before the draw
                self._no_distribution(logits, top)
            probs = torch.softmax(scores.view(1, -1), dim=-1)  # (1, V)
            if probs.device != self.generator.device:  # a CUDA rank's logits (the code predictor's), a CPU stream:
                probs = probs.to(self.generator.device)  # the draw stays on the request's one stream, as on CPU
            token = int(torch.multinomial(probs, num_samples=1, generator=self.generator).item())
        self.num_sampled += 1
        if self.params.output_penalties:
            self._generated[token] = self._generated.get(token, 0) + 1
        return token

    def _no_distribution(self, logits: torch.Tensor, top: float) -> None:
        """Raise why this step has no token to pick: the model's fault (RuntimeError: INTERNAL) or the request's
        settings' (ValueError: INVALID_ARGUMENT). A structured output's grammar masks the logits it passes in to
        -inf, so only NaN or +inf there is the model's."""
        if bool(torch.isnan(logits).any()) or bool(torch.isposinf(logits).any()):
            raise RuntimeError("the model's logits hold NaN or infinite values")
        p = self.params
        if top == -math.inf:
            raise ValueError("no token can be picked at this step: allowed_token_ids, bad_words, min_tokens (which "
                             "holds the stop ids back) and a structured output's grammar exclude every one; allow "
                             "more tokens")
        raise ValueError(f"the scores overflow float32 (repetition_penalty {p.repetition_penalty:g}, temperature "
                         f"{p.temperature:g}): there is no distribution to sample from; use a repetition_penalty "
                         "nearer 1")

    def is_stop(self, token_id: int) -> bool:
        return token_id in self.params.stop_token_ids


@functools.lru_cache(maxsize=16)
def _suppress_mask(ids: tuple[int, ...], vocab: int, device: str) -> torch.Tensor:
    """(V,) bool: True at the suppressed ids (made once per id set; every request of a stage shares it)."""
    return torch.isin(torch.arange(vocab, device=device), torch.tensor(ids, dtype=torch.long, device=device))


def greedy_batch(samplers: list[Sampler], logits: torch.Tensor,
                 histories: Sequence[Sequence[int] | torch.Tensor]) -> list[int] | None:
    """`sample` for B greedy requests at once: logits (B, V), per request its penalty history (ids: a list, or
    a tensor (n,) the caller keeps, which joins the batch's without a copy per element) -> ids,
    each what its own `sample` would pick (the same per-element arithmetic, one op per step instead of a
    dozen per request). None when the batch does not qualify (a request samples, holds stop ids back for
    min_tokens now, has frequency / presence penalties, a logit_bias or allowed_token_ids, or the requests
    differ in penalty or suppressed tokens): the caller samples one by one."""
    first = samplers[0].params
    if not all(s.params.greedy and not s.params.output_penalties and not s.params.logit_bias
               and not s.params.allowed_token_ids and not s.params.bad_words_ids
               and s.params.repetition_penalty == first.repetition_penalty
               and s.params.suppress_tokens == first.suppress_tokens
               and not (s._min_stop is not None and s.num_sampled < s.params.min_tokens) for s in samplers):
        return None
    V = logits.shape[-1]
    if cpu_kernels.use(logits):  # the same arithmetic in one call (no per-request tensors)
        lengths = [len(h) for h in histories]
        history = _joined(histories)  # (sum n_b,)
        offsets = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.long)  # (B + 1,)
        suppress = _suppress_mask(first.suppress_tokens, V, "cpu") if first.suppress_tokens else None
        tokens = cpu_kernels.ops().greedy_pick(logits, history, offsets, first.repetition_penalty, suppress).tolist()
        for s in samplers:
            s.num_sampled += 1
        return tokens
    scores = logits.to(torch.float32)  # (B, V)
    if first.repetition_penalty != 1.0:
        counts = torch.tensor([len(h) for h in histories], device=scores.device)
        rows = torch.repeat_interleave(torch.arange(len(histories), device=scores.device), counts)  # (sum n_b,)
        cols = _joined(histories).to(scores.device)  # (sum n_b,)
        keep = cols < V  # ids past the head cannot be generated: ignored
        seen = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
        seen[rows[keep], cols[keep]] = True  # (B, V)
        p = first.repetition_penalty
        scores = torch.where(seen, torch.where(scores < 0, scores * p, scores / p), scores)
    if first.suppress_tokens:
        scores = scores.masked_fill(_suppress_mask(first.suppress_tokens, V, str(scores.device)), -float("inf"))
    tokens = torch.argmax(scores, dim=-1).tolist()
    for s in samplers:  # only now: a failure above leaves every sampler as it was
        s.num_sampled += 1
    return tokens


def _joined(histories: Sequence[Sequence[int] | torch.Tensor]) -> torch.Tensor:
    """The histories end to end as one int64 tensor."""
    parts = [h.long().view(-1) if isinstance(h, torch.Tensor) else torch.tensor(list(h), dtype=torch.long)
             for h in histories]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def apply_repetition_penalty(scores: torch.Tensor, history: torch.Tensor, penalty: float) -> torch.Tensor:
    """`RepetitionPenaltyLogitsProcessor`: each id seen once or more is divided (>0) / multiplied (<0) once."""
    ids = history.to(scores.device).long().view(-1)  # (n,)
    ids = torch.unique(ids[ids < scores.shape[-1]])  # (u,) ids past the head cannot be generated: ignored
    picked = scores.gather(0, ids)  # (u,)
    picked = torch.where(picked < 0, picked * penalty, picked / penalty)  # (u,)
    return scores.scatter(0, ids, picked)  # (V,)


def apply_output_penalties(scores: torch.Tensor, generated: dict[int, int], frequency: float,
                           presence: float) -> torch.Tensor:
    """OpenAI's penalties as vLLM applies them: score[id] -= frequency * count + presence, over the ids the
    request generated (`generated`: id -> count; ids past the head cannot be generated and are ignored)."""
    ids = torch.tensor(list(generated), dtype=torch.long, device=scores.device)  # (u,)
    counts = torch.tensor(list(generated.values()), dtype=torch.float32, device=scores.device)  # (u,)
    keep = ids < scores.shape[-1]
    return scores.index_add(0, ids[keep], -(frequency * counts[keep] + presence))  # (V,)


def apply_top_k(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """`TopKLogitsWarper`: keep every score >= the k-th largest (ties at the boundary survive)."""
    k = min(top_k, scores.shape[-1])
    kth = torch.topk(scores, k)[0][..., -1, None]  # (1,)
    return scores.masked_fill(scores < kth, -float("inf"))


def apply_top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """`TopPLogitsWarper`: drop the low tail whose cumulative probability is <= 1 - top_p (keeps >= 1)."""
    sorted_scores, sorted_idx = torch.sort(scores, descending=False)  # (V,)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)  # (V,)
    remove_sorted = cumulative <= (1 - top_p)  # (V,)
    remove_sorted[-1:] = False
    remove = remove_sorted.scatter(0, sorted_idx, remove_sorted)  # (V,)
    return scores.masked_fill(remove, -float("inf"))


def apply_min_p(scores: torch.Tensor, min_p: float) -> torch.Tensor:
    """`MinPLogitsWarper`: drop the ids whose probability is below min_p x the top one's (the top always stays)."""
    probs = scores.softmax(dim=-1)  # (V,)
    return scores.masked_fill(probs < min_p * probs.max(), -float("inf"))


def thinker_sampling_params(
    config: Any, generation_config: GenerationConfig | None = None, max_tokens: int = 1024,
    seed: int | None = None,
) -> SamplingParams:
    """What `generate` uses for the thinker (config: `Qwen3OmniMoeConfig` or `Qwen2_5OmniConfig`): its generation config over transformers' global defaults.

    EOS is `config.im_end_token_id` (pass it as `thinker_eos_token_id` to `generate`: its own default is the
    real model's 151645). `thinker_max_new_tokens` defaults to 1024 in `generate`. A Qwen2.5-Omni config names
    no `im_end_token_id`: there the generation config's `eos_token_id` (one id or a list) stops the thinker.
    """
    defaults = GenerationConfig._get_default_generation_params()
    gc = generation_config if generation_config is not None else GenerationConfig()

    def pick(name: str) -> Any:
        value = getattr(gc, name, None)
        return defaults[name] if value is None else value

    do_sample = bool(pick("do_sample"))
    tc: Any = config.thinker_config
    stops = _eos_ids(getattr(config, "im_end_token_id", None)) or _eos_ids(gc.eos_token_id)
    if not stops:
        raise ValueError("the model names no end-of-turn token: its config has no im_end_token_id and its "
                         "generation_config.json no eos_token_id")
    return SamplingParams(
        temperature=float(pick("temperature")) if do_sample else 0.0,
        top_p=float(pick("top_p")), top_k=int(pick("top_k") or 0), seed=seed, max_tokens=max_tokens,
        repetition_penalty=float(pick("repetition_penalty")),
        stop_token_ids=stops,
        suppress_tokens=tuple(gc.suppress_tokens or ()),
        vocab_size=int(tc.text_config.vocab_size),
    )


def _eos_ids(value: int | list[int] | None) -> tuple[int, ...]:
    return () if value is None else tuple(int(i) for i in (value if isinstance(value, list | tuple) else [value]))


def talker_sampling_params(
    config: Qwen3OmniMoeConfig, do_sample: bool = True, max_tokens: int = 4096, seed: int | None = None,
    temperature: float = 0.9, top_k: int = 50, top_p: float = 1.0, repetition_penalty: float = 1.05,
) -> SamplingParams:
    """`generate`'s talker defaults: sampled, top-k 50, T 0.9, penalty 1.05, the top 1024 ids suppressed."""
    tk: Any = config.talker_config
    vocab = tk.text_config.vocab_size
    eos = int(tk.codec_eos_token_id)
    return SamplingParams(
        temperature=temperature if do_sample else 0.0, top_p=top_p, top_k=top_k, seed=seed,
        max_tokens=max_tokens, repetition_penalty=repetition_penalty, stop_token_ids=(eos,),
        suppress_tokens=tuple(i for i in range(vocab - 1024, vocab) if i != eos), vocab_size=int(vocab),
    )


# what an operator may set as a stage's default sampling (`default_sampling_params` in --stage-overrides, vLLM's
# --override-generation-config for the thinker); `max_new_tokens` is generation_config.json's name for max_tokens
DEFAULT_SAMPLING_KEYS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "max_tokens": int,
                         "repetition_penalty": float, "presence_penalty": float, "frequency_penalty": float}
SAMPLING_ALIASES = {"max_new_tokens": "max_tokens"}


def with_defaults(params: SamplingParams, overrides: Mapping[str, Any] | None, what: str) -> SamplingParams:
    """A stage's default sampling with the operator's `overrides` on top (requests still override both);
    ValueError naming `what` and the key for an unknown key, a wrong type or a value out of range."""
    if not overrides:
        return params
    changes: dict[str, Any] = {}
    for key, value in overrides.items():
        name = SAMPLING_ALIASES.get(key, key)
        kind = DEFAULT_SAMPLING_KEYS.get(name)
        if kind is None:
            raise ValueError(f"{what}: unknown key {key!r}; keys: {', '.join(DEFAULT_SAMPLING_KEYS)} (max_new_tokens "
                             f"for max_tokens)")
        changes[name] = typed_number(value, kind, f"{what}[{key!r}]")
    try:
        return replace(params, **changes)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None


def code_predictor_sampling_params(talker: SamplingParams) -> SamplingParams:
    """The code predictor follows the talker's do_sample; when sampling: top-k 50, top-p 0.8, T 1.0."""
    if talker.greedy:
        return replace(SamplingParams(temperature=0.0), seed=talker.seed)
    return SamplingParams(temperature=1.0, top_k=50, top_p=0.8, seed=talker.seed)
