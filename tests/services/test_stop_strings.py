"""Stops in the LLM stages: `StopStrings` (the thinker's text ends before the first stop string, never
emitting part of one; with `include_stop_str_in_output` right after it; not before `min_tokens`, i.e. on
unarmed deltas) and `merge_sampling` (the caller's stop ids / strings / min_tokens over the model's
defaults, ids checked against the stage's vocab, min_tokens against max_tokens; the handlers refuse a bad
value before building a task).

Run: python -m pytest tests/services/test_stop_strings.py -q
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from omnimesh.models.qwen3_omni.sampling import SamplingParams, talker_sampling_params, thinker_sampling_params
from omnimesh.models.qwen3_omni.stage_loading import LMLayout
from omnimesh.models.qwen3_omni.tiny_config import CODEC_VOCAB, THINKER_VOCAB, tiny_qwen3_omni_config
from omnimesh.server.stage_failure import StageFailure
from omnimesh.v1 import stage_pb2
from services.llm.detokenizer import StopStrings
from services.llm.sampling import merge_sampling
from services.llm.talker_handler import TalkerHandler
from services.llm.thinker_handler import ThinkerHandler


def run(stops: list[str], deltas: list[str], include: bool = False, armed_from: int = 0
        ) -> tuple[list[str], bool, str]:
    """Feed `deltas` (armed from delta `armed_from` on); return what each push emitted, whether it stopped,
    and what finish() released."""
    s = StopStrings(stops, include_stop=include)
    emitted, stopped = [], False
    for i, d in enumerate(deltas):
        out, stopped = s.push(d, armed=i >= armed_from)
        emitted.append(out)
        if stopped:
            break
    return emitted, stopped, s.finish()


# ------------------------------------------------------------------------------------------ StopStrings
def test_no_stops_passes_through() -> None:
    assert run([], ["Hel", "lo"]) == (["Hel", "lo"], False, "")


def test_stop_inside_one_delta_excludes_it_and_the_rest() -> None:
    assert run(["END"], ["abc", "dEND xyz", "more"]) == (["abc", "d"], True, "")


def test_stop_split_across_tokens_is_caught_and_never_partly_emitted() -> None:
    emitted, stopped, rest = run(["</answer>"], ["The answer is 4", "</", "ans", "wer", "> trailing"])
    assert stopped and rest == ""
    assert "".join(emitted) == "The answer is 4"
    assert all("<" not in e for e in emitted)  # no prefix of the stop string ever left
    assert emitted[1:4] == ["", "", ""]  # held back while it could still become the stop string


def test_held_back_text_is_released_when_it_turns_out_not_to_be_a_stop() -> None:
    s = StopStrings(["\n\n"])
    assert s.push("line\n") == ("line", False)  # "\n" could start "\n\n"
    assert s.push("next") == ("\nnext", False)  # it did not: released in order
    assert s.push("!\n") == ("!", False)
    assert s.finish() == "\n"  # the request ended otherwise (EOS / length): nothing is lost
    assert s.finish() == ""


def test_only_a_possible_prefix_is_held_back() -> None:
    s = StopStrings(["abcdef"])
    assert s.push("xyz") == ("xyz", False)  # no suffix can start the stop string: nothing held
    assert s.push("ab") == ("", False)
    assert s.push("cx") == ("abcx", False)


def test_several_stops_the_earliest_match_wins() -> None:
    assert run(["world", "lo"], ["Hello world"]) == (["Hel"], True, "")
    assert run(["cd", "bcd"], ["abcde"]) == (["a"], True, "")  # "bcd" starts first
    # the longer stop is still incomplete; the shorter one completes first and stops
    assert run(["xyz!", "yz"], ["x", "y", "z"]) == (["", "", "x"], True, "")


def test_nothing_after_a_stop() -> None:
    s = StopStrings(["."])
    assert s.push("a.b") == ("a", True)
    assert s.stopped and s.push("c") == ("", True) and s.finish() == ""


def test_stop_at_the_very_start_emits_nothing() -> None:
    assert run(["Hi"], ["H", "i there"]) == (["", ""], True, "")


def test_empty_stop_string_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        StopStrings(["ok", ""])


def test_include_stop_str_in_output_ends_the_text_with_it() -> None:
    assert run(["END"], ["abc", "dEND xyz", "more"], include=True) == (["abc", "dEND"], True, "")
    emitted, stopped, _ = run(["</answer>"], ["4", "</", "ans", "wer", "> trailing"], include=True)
    assert stopped and "".join(emitted) == "4</answer>" and emitted[-1] == "</answer>"  # held back, then whole
    assert run(["cd", "bcd"], ["abcde"], include=True) == (["abcd"], True, "")  # the earliest start wins
    assert run(["cde", "cd"], ["abcde"], include=True) == (["abcd"], True, "")  # a tie: the shorter one
    assert run(["END"], ["no stop here"], include=True) == (["no stop here"], False, "")


def test_unarmed_deltas_are_never_matched_but_a_stop_ending_later_is() -> None:
    """min_tokens not reached: a stop string in those deltas is ordinary text; one that starts there and
    completes in an armed delta still stops (vLLM checks the text the first armed token completes)."""
    assert run(["."], ["a.b", "c.d", "e.f"], armed_from=2) == (["a.b", "c.d", "e"], True, "")
    emitted, stopped, _ = run(["END"], ["xEND", "yEN", "Dz"], armed_from=2)
    assert emitted == ["xEND", "y", ""] and stopped  # "EN" held back while unarmed, "END" found once armed
    emitted, stopped, _ = run(["END"], ["xEND", "yEN", "Dz"], armed_from=2, include=True)
    assert "".join(emitted) == "xENDyEND" and stopped
    assert run(["END"], ["xEND", "yEN"], armed_from=5) == (["xEND", "y"], False, "EN")  # released at the end


# --------------------------------------------------------------------------------------- merge_sampling
def wire(**kw: object) -> stage_pb2.SamplingParams:
    return stage_pb2.SamplingParams(**kw)  # type: ignore[arg-type]


def test_the_held_back_text_is_the_longest_suffix_that_starts_a_stop_string() -> None:
    """`_held` (which tries only the stop strings that start with a suffix's first character) against the
    definition, over random texts and stop strings on a 3-letter alphabet, where partial matches abound."""
    import random

    rng = random.Random(0)
    for _ in range(3000):
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 5))]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 9)))
        want = max((n for s in stops for n in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:n])),
                   default=0)
        assert StopStrings(stops)._held(text) == want, (stops, text)


def test_merge_keeps_defaults_and_adds_stops() -> None:
    config = tiny_qwen3_omni_config()
    thinker = thinker_sampling_params(config)
    assert thinker.vocab_size == THINKER_VOCAB and talker_sampling_params(config).vocab_size == CODEC_VOCAB
    assert merge_sampling(thinker, None) is thinker and merge_sampling(thinker, wire()) == thinker
    eos = config.im_end_token_id
    got = merge_sampling(thinker, wire(stop_token_ids=[7, eos, 7, 0], stop=["\n\n", "END"], top_k=5))
    assert got.stop_token_ids == (eos, 7, 0)  # the model's EOS stays first; duplicates dropped
    assert got.stop == ("\n\n", "END") and got.top_k == 5
    assert got.temperature == thinker.temperature and got.suppress_tokens == thinker.suppress_tokens


def test_merge_min_tokens_and_include_stop_str() -> None:
    thinker = thinker_sampling_params(tiny_qwen3_omni_config())
    got = merge_sampling(thinker, wire(min_tokens=5, include_stop_str_in_output=True, stop=["x"]))
    assert (got.min_tokens, got.include_stop_str_in_output, got.max_tokens) == (5, True, thinker.max_tokens)
    assert (thinker.min_tokens, thinker.include_stop_str_in_output) == (0, False)  # the defaults
    # checked against the merged max_tokens: the caller's, else the stage's default (1024 for the thinker)
    with pytest.raises(ValueError, match=r"min_tokens must be in \[0, max_tokens = 4\], got 5"):
        merge_sampling(thinker, wire(min_tokens=5, max_tokens=4))
    with pytest.raises(ValueError, match=r"min_tokens must be in \[0, max_tokens = 1024\], got 2000"):
        merge_sampling(thinker, wire(min_tokens=2000))
    with pytest.raises(ValueError, match="min_tokens"):
        merge_sampling(thinker, wire(min_tokens=-1))


def test_merge_penalties() -> None:
    """presence / frequency penalties pass through as set (0 when unset); the stage bounds them to [-2, 2]
    itself, so a caller that skips the gateway gets the same refusal."""
    thinker = thinker_sampling_params(tiny_qwen3_omni_config())
    assert (thinker.presence_penalty, thinker.frequency_penalty) == (0.0, 0.0) and not thinker.output_penalties
    got = merge_sampling(thinker, wire(presence_penalty=0.5, frequency_penalty=-1.0))
    assert (got.presence_penalty, got.frequency_penalty) == (0.5, -1.0) and got.output_penalties
    with pytest.raises(ValueError, match=r"frequency_penalty must be in \[-2, 2\]"):
        merge_sampling(thinker, wire(frequency_penalty=3.0))


@pytest.mark.parametrize("bad", [[THINKER_VOCAB], [3, -1], [2**40]])
def test_merge_refuses_ids_outside_the_vocab(bad: list[int]) -> None:
    thinker = thinker_sampling_params(tiny_qwen3_omni_config())
    with pytest.raises(ValueError, match=rf"stop_token_ids must be in \[0, {THINKER_VOCAB}\)"):
        merge_sampling(thinker, wire(stop_token_ids=bad))
    merge_sampling(thinker, wire(stop_token_ids=[0, THINKER_VOCAB - 1]))  # the bounds themselves are fine


def test_merge_without_a_known_vocab_checks_the_sign_only() -> None:
    assert merge_sampling(SamplingParams(), wire(stop_token_ids=[10**9])).stop_token_ids == (10**9,)
    with pytest.raises(ValueError, match=">= 0"):
        merge_sampling(SamplingParams(), wire(stop_token_ids=[-5]))
    with pytest.raises(ValueError, match="empty"):
        merge_sampling(SamplingParams(), wire(stop=[""]))


def test_handlers_refuse_out_of_range_ids_in_open() -> None:
    """Each stage bounds ids by its own head: 512 is a codec id for the talker but past the thinker's vocab.
    The stage servicer answers the ValueError as INVALID_ARGUMENT prefixed with `handler.name`."""
    config = tiny_qwen3_omni_config()
    thinker = ThinkerHandler(SimpleNamespace(config=config), None, None, "m", 64, LMLayout(),  # type: ignore[arg-type]
                             StageFailure())
    talker = TalkerHandler(SimpleNamespace(config=config, speakers=["ethan"], default_speaker="ethan"), "m", LMLayout(),  # type: ignore[arg-type]
                           StageFailure())
    bad = stage_pb2.Open(request_id="r", sampling=wire(stop_token_ids=[THINKER_VOCAB]))
    with pytest.raises(ValueError, match=rf"\[0, {THINKER_VOCAB}\)"):
        thinker.open(bad)
    assert thinker.name == "thinker" and talker.name == "talker"
    assert merge_sampling(talker.defaults, bad.sampling).stop_token_ids[-1] == THINKER_VOCAB  # a codec id
    with pytest.raises(ValueError, match=rf"\[0, {CODEC_VOCAB}\)"):
        talker.open(stage_pb2.Open(request_id="r", sampling=wire(stop_token_ids=[CODEC_VOCAB])))
