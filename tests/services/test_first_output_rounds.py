"""`first_output_rounds`: the thinker and talker run several model rounds in one step call while every request
of the step waits for its first output, with the same tokens and codes as one round per call.

What it proves, in-process on the tiny model:
- thinker: the eager tokens, the first one included, come out of the prefill's call, bounded by
  first_output_rounds; a step with a request past its eager tokens runs one round; a text-only request's
  first token leaves alone; every token equals the one-round-per-call run;
- talker: a new request's whole first window of codes comes out of its first call when its text is in;
  the codes equal the one-round-per-call run;
- the setting: defaults (8 for the thinker and talker), --stage-overrides reaches the batchers, bad values
  are refused naming the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from omnimesh.config.serve_args import ServeArgs
from omnimesh.config.stage_config import StageConfig
from services.llm.talker_handler import build_handler as talker_handler
from services.llm.thinker_handler import build_handler as thinker_handler
from tests.services.test_lm_batching import Driver, codes, open_talker, open_thinker, prompts, token_ids


def rounds(n: int, **kwargs: Any) -> ServeArgs:
    return ServeArgs(max_model_len=128, stage_overrides=f'{{"thinker": {{"first_output_rounds": {n}}}, '
                                                        f'"talker": {{"first_output_rounds": {n}}}}}', **kwargs)


def chat(bodies: list[torch.Tensor]) -> list[torch.Tensor]:
    """Prompts the talker can speak: a user turn, then `<|im_start|>assistant\\n` (tiny ids)."""
    return [torch.cat([torch.tensor([400, 413, 10]), b, torch.tensor([401, 10, 400, 414, 10])]) for b in bodies]


def test_the_thinker_runs_its_eager_tokens_in_one_call(model_dir: Path) -> None:
    ids = chat(prompts([4, 9, 6], seed=3))
    runs: dict[int, tuple[list[list[int]], dict[str, list[int]]]] = {}
    for n in (1, 3, 8):
        handler = thinker_handler(model_dir, rounds(n, stream_interval=1))
        d = Driver(handler)
        d.add(*(open_thinker(handler, f"r{i}", p, 12, talker_inputs="1", eager_tokens="6") for i, p in enumerate(ids)))
        per_call = []
        with torch.inference_mode():
            while d.live:
                got = d.step()
                per_call.append(sorted({len(token_ids(chunks)) for chunks in got.values()}))
        runs[n] = (per_call, {rid: token_ids(chunks) for rid, chunks in d.chunks.items()})
    assert runs[1][1] == runs[3][1] == runs[8][1]  # the same tokens however many rounds a call runs
    assert all(len(t) == 12 for t in runs[8][1].values())
    # one round per call: a token each; 8: tokens 1..6 in the prefill's call, then one a call
    assert runs[1][0] == [[1]] * 12
    assert runs[8][0][:2] == [[6], [1]] and len(runs[8][0]) == 12 - 5
    assert runs[3][0][:3] == [[3], [3], [1]] and len(runs[3][0]) == 12 - 4  # bounded: 3 rounds a call


def test_a_text_only_first_token_leaves_alone(model_dir: Path) -> None:
    handler = thinker_handler(model_dir, rounds(8, stream_interval=1))
    d = Driver(handler)
    d.add(*(open_thinker(handler, f"t{i}", p, 6) for i, p in enumerate(chat(prompts([4, 7], seed=6)))))
    with torch.inference_mode():
        first = d.step()
    assert {rid: len(token_ids(chunks)) for rid, chunks in first.items()} == {"t0": 1, "t1": 1}


def test_a_thinker_step_with_a_streaming_request_runs_one_round(model_dir: Path) -> None:
    handler = thinker_handler(model_dir, rounds(8, stream_interval=1))
    a, b = chat(prompts([5, 7], seed=4))
    d = Driver(handler)
    d.add(open_thinker(handler, "old", a, 20, talker_inputs="1", eager_tokens="2"))
    with torch.inference_mode():
        d.step()  # "old" gets its 2 eager tokens from its prefill's call: it streams now
        d.step()
        d.add(open_thinker(handler, "new", b, 20, talker_inputs="1", eager_tokens="6"))
        d.step()  # the prefill of "new" beside a decode of "old"
        got = d.step()  # "new" is still urgent, "old" is not: one round
    assert {rid: len(token_ids(chunks)) for rid, chunks in got.items()} == {"old": 1, "new": 1}


def test_the_talker_makes_its_first_window_in_one_call(model_dir: Path) -> None:
    thinker = thinker_handler(model_dir, rounds(1, stream_interval=1))
    d = Driver(thinker)
    d.add(*(open_thinker(thinker, f"t{i}", p, 10, talker_inputs="1") for i, p in enumerate(chat(prompts([3, 8], seed=5)))))
    with torch.inference_mode():
        text = d.run()
    results = {}
    for n in (1, 8):
        handler = talker_handler(model_dir, rounds(n))
        talker = Driver(handler)
        talker.add(*(open_talker(handler, text, f"t{i}", chunk_schedule="5,25") for i in range(2)))
        with torch.inference_mode():
            first = talker.step()
            out = talker.run()
        results[n] = (first, {rid: codes(chunks) for rid, chunks in out.items()})
    for rid in ("t0", "t1"):
        assert torch.equal(results[1][1][rid], results[8][1][rid])
        assert results[1][0][rid] == []  # one round: the prefill alone, no codes yet
        (chunk,) = results[8][0][rid]  # 8: prefill + 5 code groups, the whole first window
        assert chunk.tensors["codes"].shape[1] == 5


def test_the_setting_defaults_overrides_and_refusals(model_dir: Path) -> None:
    defaults = ServeArgs().stage_configs()
    assert {s: c.effective_first_output_rounds(s) for s, c in defaults.items()} == {
        "encoder": 1, "thinker": 8, "talker": 8, "vocoder": 1}
    assert thinker_handler(model_dir, rounds(3)).batcher.first_output_rounds == 3
    assert talker_handler(model_dir, rounds(2)).batcher.first_output_rounds == 2
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="first_output_rounds must be a whole number >= 1"):
            StageConfig(first_output_rounds=bad)  # type: ignore[arg-type]
