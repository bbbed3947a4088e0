"""Structured outputs in the thinker (vLLM's guided decoding, with llguidance as its "guidance" backend).

Role: a request may ask that the thinker's text follow a JSON schema (OpenAI's `response_format`
json_object / json_schema, vLLM's `structured_outputs.json`), a regular expression, one of a list of
strings (`choice`) or a Lark grammar. The gateway checks the spec (`grammar_for`, no tokenizer needed) and
sends it as the thinker's `structured_output` option: JSON `[kind, spec]`. With the prompt (on the compute thread,
not the event loop) the thinker builds one
`llguidance.LLMatcher` per request over the stage's tokenizer (`Grammars`, the tokenizer's table built once),
and before each token masks the logits to what the grammar allows (`Constraint.allowed_logits`; the raw
logits still give `logprobs`, as vLLM's default), then feeds it the sampled token. Once the grammar is
complete only a stop id may follow: the request ends there ("stop").

With a reasoning model (--reasoning-parser) the `structured_after` option names the end of the reasoning
(`</think>`): the tokens before the text passes it are sampled freely, and the grammar shapes the answer after it,
as vLLM's structured outputs with reasoning do.

Data flow: gateway: request fields -> (kind, spec) -> `grammar_for` (400 on a bad spec) -> option;
thinker: option -> `Grammars.constraint` (ValueError -> INVALID_ARGUMENT) -> per token: allowed_logits (V,)
-> sample -> `accept(token)`.
"""

from __future__ import annotations

import copy
import json
import logging
from typing import Any

import torch

from omnimesh import json_text

log = logging.getLogger(__name__)

KINDS = ("json", "regex", "choice", "grammar")
OPTION = "structured_output"
AFTER_OPTION = "structured_after"  # the grammar starts once the text has passed this marker (reasoning's end)


def grammar_for(kind: str, spec: str) -> str:
    """The llguidance grammar of a spec; ValueError naming what is wrong. `json`: a JSON schema (text);
    `regex`; `choice`: a JSON list of strings; `grammar`: Lark (llguidance's dialect)."""
    from llguidance import LLMatcher

    if kind not in KINDS:
        raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, got {kind!r}")
    try:
        if kind == "json":
            schema = json_text.loads(spec)
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema must be an object")
            # no free whitespace between tokens (vLLM's disable_any_whitespace): a weak model cannot pad forever
            grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides={"whitespace_flexible": False})
        elif kind == "regex":
            grammar = LLMatcher.grammar_from_regex(spec)
        elif kind == "choice":
            options = json_text.loads(spec)
            if not isinstance(options, list) or not options or not all(isinstance(o, str) for o in options):
                raise ValueError("choice must be a non-empty list of strings")
            # one terminal (the lexer's automaton), not one parser rule per option: llguidance's Earley rows hold
            # at most 2,000 items, so 2,000 options as rules failed at the first token, and 50,000 took 7 s to
            grammar = LLMatcher.grammar_from_lark("start: CHOICE\nCHOICE: " + " | ".join(json.dumps(o) for o in options))
        else:
            grammar = LLMatcher.grammar_from_lark(spec)
    except ValueError as e:
        raise ValueError(f"invalid {kind}: {e}") from None
    error = LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise ValueError(f"invalid {kind}: {error}")
    return grammar


def option_value(kind: str, spec: str) -> str:
    return json.dumps([kind, spec])


class Constraint:
    """One request's grammar state (not thread-safe: its task uses it on one thread at a time)."""

    def __init__(self, matcher: Any, vocab_size: int, stop_id: int) -> None:
        from llguidance.numpy import allocate_token_bitmask

        self.matcher, self.stop_id = matcher, stop_id
        self._mask = allocate_token_bitmask(1, vocab_size)  # (1, words) int32, one bit per token

    @property
    def complete(self) -> bool:
        """The grammar accepts nothing more: only a stop id may follow."""
        return bool(self.matcher.is_stopped())

    def allowed_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """A float32 copy of `logits` (V,) (CPU, as the thinker's come back) with every token the grammar does not
        allow at -inf (llguidance's own mask helpers)."""
        from llguidance.numpy import apply_token_bitmask_inplace, fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, self._mask)
        out = logits.detach().to("cpu", torch.float32, copy=True)
        apply_token_bitmask_inplace(out.numpy(), self._mask)
        return out

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            reason = (self.matcher.get_error() or "no reason given").split("\n", 1)[0]  # not the parser's state
            raise ValueError(f"structured output: the grammar rejected token {token} ({reason})")


class Grammars:
    """The stage's grammar compiler over the tokenizer's llguidance table (built once, at start-up: about a
    second for a real vocabulary), shared by every request."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: tuple[int, ...]) -> None:
        self.vocab_size, self.stop_ids = vocab_size, stop_ids
        self.unavailable: str | None = None  # why structured outputs cannot work on this stage, if they cannot
        self._ll: Any = None
        try:
            self._ll = exact_tokenizer(tokenizer, vocab_size, stop_ids)
        except Exception as e:  # noqa: BLE001  # the stage serves everything else; such requests hear why
            self.unavailable = f"{type(e).__name__}: {e}"
            log.warning("thinker: structured outputs are unavailable: %s", self.unavailable)

    def constraint(self, option: str) -> Constraint:
        """The request's constraint from its `structured_output` option; ValueError for a bad one."""
        from llguidance import LLMatcher

        try:
            kind, spec = json.loads(option)
        except (ValueError, TypeError):
            raise ValueError(f"option {OPTION} must be a JSON [kind, spec] pair") from None
        if self.unavailable is not None:
            raise ValueError(f"structured outputs are unavailable on this thinker: {self.unavailable}")
        if not self.stop_ids:
            raise ValueError("structured output needs the model's stop ids (its generation config has none)")
        matcher = LLMatcher(self._ll, grammar_for(str(kind), str(spec)), log_level=0)
        constraint = Constraint(matcher, self.vocab_size, self.stop_ids[0])
        constraint.allowed_logits(torch.zeros(self.vocab_size))  # the first step's mask: a grammar no text can
        if matcher.is_error():  # match (a regex like [^\s\S], a rule that only refers to itself) fails it here
            reason = matcher.get_error().split("\n", 1)[0]  # the rest is llguidance's parser state
            what = "matches no text at all" if "NoExtensionBias" in reason else "cannot be used"
            raise ValueError(f"structured output: the {kind} {what} ({reason})")
        return constraint


def exact_tokenizer(tokenizer: Any, vocab_size: int, stop_ids: tuple[int, ...]) -> Any:
    """llguidance's table of the tokenizer (as `llguidance.hf.from_tokenizer` builds it), without the tokenizer's
    normalizer: Qwen's NFC would turn the text a grammar forces ("cafe" + U+0301, decomposed) into the tokens of
    "café", which the grammar's bytes then reject (a speech `input` in decomposed Unicode failed that way).
    Without it the forced bytes are tokenized as they are; the tokens' own bytes are the same either way."""
    from llguidance import LLTokenizer

    backend = copy.copy(tokenizer.backend_tokenizer)  # a fast tokenizer's Rust half (a copy: the stage's keeps NFC)
    backend.no_padding()
    backend.no_truncation()
    backend.normalizer = None
    return LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=list(stop_ids) or tokenizer.eos_token_id)
