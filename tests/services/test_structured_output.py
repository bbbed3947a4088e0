"""Structured outputs in the thinker (services/llm/structured_output.py, llguidance): on the tiny model (random
weights, which would never write JSON on their own) the text follows a regex, one of a list of choices, a JSON
schema (compact: no free whitespace) and a Lark grammar, and the request ends ("stop") when the grammar is
complete, even under ignore_eos; logprobs stay the raw distribution's; a bad spec is a ValueError at open
(INVALID_ARGUMENT) when the prompt is prepared, failing that request alone, naming the kind; a grammar
longer than max_tokens ends there ("length")."""

from __future__ import annotations

import json
import re
import time
import unicodedata
from pathlib import Path
from typing import Any

import pytest

from omnimesh.config.serve_args import ServeArgs
from omnimesh.v1 import stage_pb2
from services.llm.structured_output import grammar_for, option_value
from services.llm.thinker_handler import build_handler as thinker_handler
from tests.services.test_lm_batching import Driver, open_thinker, prompts

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "enum": [1, 2, 3]}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def handler(model_dir: Path) -> Any:
    return thinker_handler(model_dir, ServeArgs(max_model_len=256, kv_cache_memory="1MiB", stream_interval=1))


def answer(handler: Any, kind: str, spec: str, max_tokens: int = 64, seed: int = 3, **sampling: Any) -> tuple[str, Any]:
    task = open_thinker(handler, "r", prompts([12], seed=seed)[0], max_tokens,
                        structured_output=option_value(kind, spec))
    if sampling:
        task.sampler.params = task.sampler.params.__class__(**{**task.sampler.params.__dict__, **sampling})
    d = Driver(handler)
    d.add(task)
    return "".join(c.text for c in d.run()["r"]), task


@pytest.mark.parametrize("seed", [3, 4])
def test_the_text_follows_each_kind_of_spec(handler: Any, seed: int) -> None:
    text, task = answer(handler, "regex", "[ab]{3}-[0-9]{2}", seed=seed)
    assert re.fullmatch(r"[ab]{3}-[0-9]{2}", text) and task.finish_reason == "stop"
    text, task = answer(handler, "choice", json.dumps(["yes", "no", "maybe so"]), seed=seed)
    assert text in ("yes", "no", "maybe so") and task.finish_reason == "stop"
    text, task = answer(handler, "json", json.dumps(SCHEMA), seed=seed)
    value = json.loads(text)
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and value["n"] in (1, 2, 3)
    assert " " not in text and "\n" not in text and task.finish_reason == "stop"
    text, task = answer(handler, "grammar", 'start: "(" item ("," item)? ")"\nitem: /[xyz]/', seed=seed)
    assert re.fullmatch(r"\([xyz](,[xyz])?\)", text) and task.finish_reason == "stop"


def test_the_grammar_ends_the_answer_even_under_ignore_eos_and_logprobs_stay_raw(handler: Any) -> None:
    ids = prompts([12], seed=3)[0]
    sampling = stage_pb2.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    task = handler.open(stage_pb2.Open(request_id="e", sampling=sampling,
                                       options={"structured_output": option_value("regex", "ab")}))
    from omnimesh.transport.frames import StageChunk

    task.feed(StageChunk(tensors={"input_ids": ids}, final=True))
    d = Driver(handler)
    d.add(task)
    chunks = d.run()["e"]
    assert "".join(c.text for c in chunks) == "ab" and task.finish_reason == "stop"
    first = [e for c in chunks for e in c.logprobs][0]
    free = handler.open(stage_pb2.Open(request_id="f", sampling=sampling))  # the same prompt, unconstrained
    free.feed(StageChunk(tensors={"input_ids": ids}, final=True))
    d = Driver(handler)
    d.add(free)
    unconstrained = [e for c in d.run()["f"] for e in c.logprobs][0]
    # the first token's alternatives are the raw distribution's, the same as without the grammar, though the
    # grammar made it pick "a"
    assert [(t.token_id, round(t.logprob, 5)) for t in first.top] == [
        (t.token_id, round(t.logprob, 5)) for t in unconstrained.top]
    assert first.token == b"a" and unconstrained.token != b"a"


def test_a_grammar_longer_than_max_tokens_stops_there(handler: Any) -> None:
    text, task = answer(handler, "regex", "a{50}", max_tokens=7)
    assert set(text) == {"a"} and task.finish_reason == "length" and task.completion_tokens == 7


def test_bad_specs_are_refused_naming_the_kind(handler: Any) -> None:
    for kind, spec, needle in [("json", "[1, 2]", "invalid json: a JSON schema must be an object"),
                               ("json", "{not json", "invalid json"),
                               ("regex", "(unclosed", "invalid regex"),
                               ("choice", "[]", "invalid choice: choice must be a non-empty list of strings"),
                               ("grammar", "start: undefined_rule", "invalid grammar"),
                               ("regex", "[^\\s\\S]", "the regex matches no text at all"),
                               ("grammar", "start: start", "the grammar matches no text at all"),
                               ("json", json.dumps({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
                                "the json matches no text at all"),
                               ("yaml", "x: 1", "kind must be one of json, regex, choice, grammar")]:
        with pytest.raises(ValueError, match=re.escape(needle)):
            run_bad(handler, option_value(kind, spec))
        if "matches no text" not in needle:  # that shows only over a tokenizer: at the thinker
            with pytest.raises(ValueError, match=re.escape(needle)):
                grammar_for(kind, spec)
    with pytest.raises(ValueError, match="must be a JSON \\[kind, spec\\] pair"):
        run_bad(handler, "json")
    assert handler.batcher.engine.seqs == {}  # nothing of them stays in the engine


def run_bad(handler: Any, option: str) -> None:
    """The spec is compiled with the prompt, on the compute thread: the step fails this request alone."""
    task = open_thinker(handler, "bad", prompts([4])[0], 8, structured_output=option)
    try:
        result = handler.batcher.step_batch([task])["bad"]
        if isinstance(result, BaseException):
            raise result
    finally:
        task.close()


def test_a_tokenizer_llguidance_cannot_read_leaves_the_stage_serving() -> None:
    """The stage still starts (it serves everything else); a structured request there hears why it cannot run."""
    from services.llm.structured_output import Grammars

    grammars = Grammars(object(), 10, (1,))  # not a fast tokenizer
    assert grammars.unavailable is not None
    with pytest.raises(ValueError, match="structured outputs are unavailable on this thinker"):
        grammars.constraint(option_value("regex", "a"))


def test_one_choice_holds_the_thinker_to_any_text(handler: Any) -> None:
    """What /v1/audio/speech relies on: a choice of one string makes the thinker say exactly it, quotes,
    newlines, backslashes and non-ASCII characters included."""
    said = 'Say "héllo wörld" — 世界!\nA back\\slash, a tab\tand 🎉.'
    text, task = answer(handler, "choice", json.dumps([said]), max_tokens=128)
    assert text == said and task.finish_reason == "stop"
    # decomposed Unicode as it is: the tokenizer's NFC would force the composed form, which the grammar refused
    said = unicodedata.normalize("NFD", "Café, Ångström, naïve.")
    assert said != unicodedata.normalize("NFC", said)
    text, task = answer(handler, "choice", json.dumps([said]), max_tokens=128)
    assert text == said and task.finish_reason == "stop"


def test_a_choice_among_many_thousands(handler: Any) -> None:
    """The options are one lexer terminal: 50,000 of them compile in well under a second and the answer is one of
    them (as parser rules, 2,000 or more failed at the first token: llguidance's Earley rows stop at 2,000)."""
    options = [f"option {i}" for i in range(50_000)] + ["yes"]
    t0 = time.monotonic()
    text, task = answer(handler, "choice", json.dumps(options), seed=5)
    assert text in set(options) and task.finish_reason == "stop"
    assert time.monotonic() - t0 < 5


def test_the_grammar_waits_for_the_end_of_the_reasoning(handler: Any) -> None:
    """`structured_after` (a reasoning model under --reasoning-parser: `</think>`): the tokens up to the one whose
    text passes the marker are the model's own (as with no grammar), and the grammar shapes what follows. The
    marker here is a piece of the free answer's own text, so the random model surely writes it."""
    ids = prompts([12], seed=3)[0]

    def run(**options: str) -> list[str]:
        task = open_thinker(handler, "r", ids, 24, **options)
        d = Driver(handler)
        d.add(task)
        return [c.text for c in d.run()["r"]]

    free = run()  # stream_interval 1: one token a chunk
    so_far = ["".join(free[:k]) for k in range(len(free) + 1)]
    # the first token whose text completes a 2-character piece not seen before: the marker ends in it
    k = next(k for k in range(1, len(free)) if len(so_far[k]) >= 2 and so_far[k][-2:] not in so_far[k - 1])
    shaped = run(structured_output=option_value("regex", "[ab]{3}-[0-9]{2}"), structured_after=so_far[k][-2:])
    assert shaped[:k] == free[:k]  # reasoning: untouched
    assert re.fullmatch(r"[ab]{3}-[0-9]{2}", "".join(shaped[k:]))  # the answer: the grammar's
    assert not re.fullmatch(r"[ab]{3}-[0-9]{2}", "".join(free[k:]))
