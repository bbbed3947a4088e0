"""`Sampler` follows transformers' logits processors: penalty, min new tokens, suppression, temperature,
top-k, top-p, seeds; OpenAI's frequency / presence penalties (which transformers lacks) follow vLLM's formula.

Run: python -m pytest tests/models/test_sampling.py -q
"""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from omnimesh.models.qwen3_omni.sampling import (
    MIN_TEMPERATURE,
    Sampler,
    SamplingParams,
    code_predictor_sampling_params,
    talker_sampling_params,
    thinker_sampling_params,
)
from omnimesh.models.qwen3_omni.tiny_config import CODEC_IDS, CODEC_VOCAB, THINKER_VOCAB, tiny_qwen3_omni_config


def logits(seed: int = 0, vocab: int = 64) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3  # (V,) both signs


def test_greedy_is_argmax_after_penalty() -> None:
    raw = logits()
    top = int(raw.argmax())
    sampler = Sampler(SamplingParams(temperature=0.0, repetition_penalty=1e6))
    assert sampler.sample(raw, torch.tensor([], dtype=torch.long)) == top
    picked = sampler.sample(raw, torch.tensor([top]))  # the penalty pushes the favourite out
    assert picked != top
    assert picked == int(RepetitionPenaltyLogitsProcessor(1e6)(torch.tensor([[top]]), raw.view(1, -1)).argmax())
    # greedy ignores the warpers, like transformers with do_sample=False
    assert Sampler(SamplingParams(temperature=0.0, top_k=1, top_p=0.01)).sample(raw) == top


@pytest.mark.parametrize("penalty", [1.05, 1.3, 0.8])
def test_repetition_penalty_matches_transformers(penalty: float) -> None:
    raw = logits(1)
    pos = torch.nonzero(raw > 0).flatten()[:3].tolist()
    neg = torch.nonzero(raw < 0).flatten()[:3].tolist()
    history = torch.tensor([pos[0], neg[0], pos[0], pos[1], neg[1], neg[1], pos[2], neg[2]])  # repeats count once
    expected = RepetitionPenaltyLogitsProcessor(penalty)(history.view(1, -1), raw.view(1, -1).clone())[0]
    ours = Sampler(SamplingParams(temperature=0.0, repetition_penalty=penalty)).process(raw, history)
    assert torch.equal(ours, expected)
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[history] = False
    assert torch.equal(ours[untouched], raw[untouched])


def test_full_chain_matches_transformers_processors() -> None:
    raw = logits(2)
    history = torch.tensor([1, 2, 5])
    suppress = (0, 5, 9)
    params = SamplingParams(temperature=0.7, top_k=10, top_p=0.8, min_p=0.2, repetition_penalty=1.2,
                            suppress_tokens=suppress)
    ids = history.view(1, -1)
    expected = raw.view(1, -1).clone()
    for proc in (
        RepetitionPenaltyLogitsProcessor(1.2), SuppressTokensLogitsProcessor(list(suppress)),
        TemperatureLogitsWarper(0.7), TopKLogitsWarper(10), TopPLogitsWarper(0.8), MinPLogitsWarper(0.2),
    ):
        expected = proc(ids, expected)
    assert torch.equal(Sampler(params).process(raw, history), expected[0])


def test_suppressed_tokens_never_sampled() -> None:
    raw = torch.zeros(32)
    raw[:4] = 10.0  # the favourites are suppressed
    sampler = Sampler(SamplingParams(temperature=1.0, seed=0, suppress_tokens=(0, 1, 2, 3)))
    draws = {sampler.sample(raw) for _ in range(300)}
    assert draws.isdisjoint({0, 1, 2, 3}) and len(draws) > 10
    assert Sampler(SamplingParams(temperature=0.0, suppress_tokens=(0, 1, 2, 3))).sample(raw) >= 4


def test_top_k_and_top_p_restrict_support() -> None:
    raw = logits(3)
    order = torch.argsort(raw, descending=True)
    top_k = {Sampler(SamplingParams(top_k=5, seed=s)).sample(raw) for s in range(200)}
    assert top_k <= set(order[:5].tolist()) and len(top_k) >= 3
    probs = torch.softmax(raw, -1)[order]
    nucleus = int((torch.cumsum(probs, 0) < 0.5).sum()) + 1  # smallest prefix reaching 0.5
    top_p = {Sampler(SamplingParams(top_p=0.5, seed=s)).sample(raw) for s in range(200)}
    assert top_p <= set(order[:nucleus].tolist())
    assert nucleus < 64


def test_same_seed_same_samples() -> None:
    raw = logits(4)
    params = SamplingParams(temperature=1.3, seed=7)
    s1, s2, s3 = Sampler(params), Sampler(params), Sampler(SamplingParams(temperature=1.3, seed=8))
    seq1 = [s1.sample(raw) for _ in range(50)]
    seq2 = [s2.sample(raw) for _ in range(50)]
    seq3 = [s3.sample(raw) for _ in range(50)]
    assert seq1 == seq2 and seq1 != seq3
    # the draw is torch.multinomial on the same generator stream as transformers' sampling step
    torch.manual_seed(7)
    assert seq1[0] == int(torch.multinomial(torch.softmax(raw / 1.3, -1).view(1, -1), 1))


def test_generate_defaults() -> None:
    config = tiny_qwen3_omni_config()
    talker = talker_sampling_params(config)
    eos = CODEC_IDS["codec_eos_token_id"]
    assert (talker.temperature, talker.top_k, talker.top_p, talker.repetition_penalty) == (0.9, 50, 1.0, 1.05)
    assert talker.max_tokens == 4096 and talker.stop_token_ids == (eos,)
    assert set(talker.suppress_tokens) == set(range(CODEC_VOCAB - 1024, CODEC_VOCAB)) - {eos}
    assert talker_sampling_params(config, do_sample=False).greedy
    assert code_predictor_sampling_params(talker_sampling_params(config, do_sample=False)).greedy
    cp = code_predictor_sampling_params(talker)
    assert (cp.temperature, cp.top_k, cp.top_p) == (1.0, 50, 0.8)
    thinker = thinker_sampling_params(config)
    assert thinker.greedy and thinker.stop_token_ids == (config.im_end_token_id,)
    # stop-id bounds of each head (services/llm/sampling.py checks a caller's ids); no stop strings by default
    assert (thinker.vocab_size, talker.vocab_size, thinker.stop, talker.stop) == (THINKER_VOCAB, CODEC_VOCAB, (), ())
    sampled = thinker_sampling_params(config, GenerationConfig(do_sample=True, temperature=0.6, top_p=0.95))
    assert (sampled.temperature, sampled.top_p, sampled.top_k) == (0.6, 0.95, 50)  # top_k: global default


def test_invalid_params() -> None:
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match=r"min_tokens must be in \[0, max_tokens = 8\], got 9"):
        SamplingParams(max_tokens=8, min_tokens=9)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=-1)
    with pytest.raises(ValueError, match=r"presence_penalty must be in \[-2, 2\]"):
        SamplingParams(presence_penalty=2.5)
    with pytest.raises(ValueError, match="frequency_penalty must be a finite number"):
        SamplingParams(frequency_penalty=float("nan"))
    SamplingParams(max_tokens=8, min_tokens=8)  # every token then: the request ends by length
    assert SamplingParams(top_k=-1).top_k == 0  # vLLM's "off" (a direct stage call, --default-sampling-params)
    with pytest.raises(ValueError, match=r"top_k must be >= 0, got -2; use 0 \(or -1\) to disable it"):
        SamplingParams(top_k=-2)


def test_stop_strings_and_vocab_do_not_change_the_draw() -> None:
    """`stop` is for the task's text and `vocab_size` only bounds ids: the same tokens come out."""
    raw = logits(5)
    plain = Sampler(SamplingParams(temperature=0.8, top_k=10, seed=3))
    extra = Sampler(SamplingParams(temperature=0.8, top_k=10, seed=3, stop=("\n",), vocab_size=64))
    assert [plain.sample(raw) for _ in range(20)] == [extra.sample(raw) for _ in range(20)]
    assert not extra.is_stop(0) and Sampler(SamplingParams(stop_token_ids=(0,))).is_stop(0)


def test_min_tokens_matches_transformers_min_new_tokens() -> None:
    """Stop ids are -inf until `min_tokens` tokens were sampled (as `generate(min_new_tokens=...)`), then the
    scores are untouched; penalty and suppression compose in transformers' order."""
    raw = logits(6)
    stops = (int(raw.argmax()), 7)  # the favourite is a stop id: greedy would stop at once
    params = SamplingParams(temperature=0.0, stop_token_ids=stops, min_tokens=3, repetition_penalty=1.3,
                            suppress_tokens=(1,))
    sampler = Sampler(params)
    prompt = torch.tensor([2, 3])
    ids = prompt.clone()
    picked = []
    for _ in range(5):
        expected = raw.view(1, -1).clone()
        for proc in (RepetitionPenaltyLogitsProcessor(1.3), MinNewTokensLengthLogitsProcessor(2, 3, list(stops)),
                     SuppressTokensLogitsProcessor([1])):
            expected = proc(ids.view(1, -1), expected)
        assert torch.equal(sampler.process(raw, ids), expected[0])
        picked.append(sampler.sample(raw, ids))
        ids = torch.cat([ids, torch.tensor([picked[-1]])])
    assert all(t not in stops for t in picked[:3]) and picked[3] == stops[0]
    assert sampler.num_sampled == 5 and sampler.is_stop(picked[3])


def test_min_tokens_zero_or_without_stop_ids_changes_nothing() -> None:
    """Greedy exactness: min_tokens 0 is the plain sampler, bit for bit; a stop id past the head is ignored."""
    raw = logits(7)
    plain = Sampler(SamplingParams(temperature=0.0, stop_token_ids=(int(raw.argmax()),)))
    zero = Sampler(SamplingParams(temperature=0.0, stop_token_ids=(int(raw.argmax()),), min_tokens=0))
    assert torch.equal(plain.process(raw), zero.process(raw)) and plain.sample(raw) == zero.sample(raw)
    beyond = Sampler(SamplingParams(temperature=0.0, stop_token_ids=(int(raw.argmax()), 10_000), min_tokens=2))
    assert beyond.sample(raw) == int(raw.topk(2).indices[1])  # the runner-up; id 10000 >= V is skipped
    seeded = [Sampler(SamplingParams(temperature=0.9, seed=4, min_tokens=m)) for m in (0, 5)]
    assert [seeded[0].sample(raw) for _ in range(20)] == [seeded[1].sample(raw) for _ in range(20)]  # no stop ids


def test_greedy_batch_picks_what_each_sampler_would() -> None:
    """Talker-like requests (penalty 1.05, suppressed ids, histories of different lengths, some with ids
    past the head, an empty one): one batched pick equals each Sampler.sample; a batch that does not
    qualify is refused (None) and changes no sampler."""
    from dataclasses import replace

    from omnimesh.models.qwen3_omni.sampling import greedy_batch

    gen = torch.Generator().manual_seed(7)
    params = SamplingParams(temperature=0, repetition_penalty=1.05, suppress_tokens=tuple(range(200, 260)),
                            stop_token_ids=(300,), max_tokens=100)
    logits = torch.randn(6, 320, generator=gen) * 3
    histories = [torch.randint(0, 330, (n,), generator=gen) for n in (0, 1, 5, 17, 40, 3)]
    want = [Sampler(params).sample(logits[b].clone(), histories[b]) for b in range(6)]
    samplers = [Sampler(params) for _ in range(6)]
    assert greedy_batch(samplers, logits.clone(), [h.tolist() for h in histories]) == want
    assert all(s.num_sampled == 1 for s in samplers)
    # the talker hands its histories as views of its code buffers: the same picks
    assert greedy_batch([Sampler(params) for _ in range(6)], logits.clone(), histories) == want
    for odd in (replace(params, temperature=0.7), replace(params, repetition_penalty=1.1),
                replace(params, suppress_tokens=()), replace(params, min_tokens=3),
                replace(params, presence_penalty=0.5), replace(params, frequency_penalty=-0.5)):
        mixed = [Sampler(params), Sampler(odd)]
        assert greedy_batch(mixed, logits[:2], [h.tolist() for h in histories[:2]]) is None
        assert all(s.num_sampled == 0 for s in mixed)


def test_frequency_and_presence_penalties_follow_vllm() -> None:
    """Each generated id loses frequency * count + presence (vLLM's `apply_penalties`), after the repetition
    penalty over the whole history; the prompt's ids get no frequency / presence penalty, and ids past the
    head are ignored. Greedy and sampled picks see the same scores; both penalties 0 is the plain sampler."""
    raw = logits(8)
    params = SamplingParams(temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.7, presence_penalty=-0.3)
    sampler = Sampler(params)
    prompt = [5, 6]
    history = list(prompt)
    counts: dict[int, int] = {}
    for _ in range(12):
        expected = RepetitionPenaltyLogitsProcessor(1.2)(torch.tensor([history]), raw.view(1, -1).clone())[0]
        for t, c in counts.items():
            expected[t] -= 0.7 * c - 0.3
        assert torch.allclose(sampler.process(raw, torch.tensor(history)), expected, rtol=0, atol=1e-6)
        token = sampler.sample(raw, torch.tensor(history))
        assert token == int(expected.argmax())
        counts[token] = counts.get(token, 0) + 1
        history.append(token)
    assert len(counts) > 1  # the penalty moved greedy off its favourite
    sampler._generated[10_000] = 3  # an id past the head (cannot come from this head): skipped, no error
    sampler.process(raw, torch.tensor(history))
    plain, zero = Sampler(SamplingParams(temperature=0.9, seed=2)), Sampler(
        SamplingParams(temperature=0.9, seed=2, frequency_penalty=0.0, presence_penalty=0.0))
    assert [plain.sample(raw) for _ in range(20)] == [zero.sample(raw) for _ in range(20)] and not zero._generated
    repeated = Sampler(SamplingParams(temperature=0.9, seed=2, frequency_penalty=2.0))
    picks = [repeated.sample(raw) for _ in range(40)]
    assert len(set(picks)) > len(set([plain.sample(raw) for _ in range(40)]))  # spread over more ids


def test_min_p_keeps_what_transformers_keeps() -> None:
    """vLLM's min_p (transformers' MinPLogitsWarper): ids below min_p x the top probability are dropped; the top
    stays at min_p 1; 0 changes nothing."""
    raw = logits(5)
    for min_p in (0.05, 0.3, 1.0):
        expected = MinPLogitsWarper(min_p)(torch.zeros(1, 1, dtype=torch.long), raw.view(1, -1).clone())[0]
        ours = Sampler(SamplingParams(temperature=1.0, min_p=min_p)).process(raw)
        assert torch.equal(ours, expected)
        assert torch.isfinite(ours[raw.argmax()])
    assert torch.equal(Sampler(SamplingParams(min_p=0.0)).process(raw), raw)
    with pytest.raises(ValueError, match=r"min_p must be in \[0, 1\], got 1.5"):
        SamplingParams(min_p=1.5)


def test_ignore_eos_drops_only_the_models_stop_ids() -> None:
    """vLLM's ignore_eos at a stage: the model's own stop ids no longer stop it; the caller's still do."""
    from omnimesh.v1 import stage_pb2
    from services.llm.sampling import merge_sampling

    defaults = SamplingParams(stop_token_ids=(7, 8), vocab_size=64)
    assert merge_sampling(defaults, stage_pb2.SamplingParams(ignore_eos=True)).stop_token_ids == ()
    assert merge_sampling(defaults, stage_pb2.SamplingParams(ignore_eos=True, stop_token_ids=[3])).stop_token_ids == (3,)
    assert merge_sampling(defaults, stage_pb2.SamplingParams(stop_token_ids=[3])).stop_token_ids == (7, 8, 3)
    assert merge_sampling(defaults, stage_pb2.SamplingParams(min_p=0.25)).min_p == 0.25


def test_operator_defaults_go_over_the_models() -> None:
    """default_sampling_params / --override-generation-config: named keys replace the model's defaults (HF's
    max_new_tokens is max_tokens); bad keys, types and values are errors naming where they came from."""
    from omnimesh.models.qwen3_omni.sampling import with_defaults

    model = SamplingParams(temperature=0.0, top_k=50, max_tokens=4096, stop_token_ids=(7,))
    ours = with_defaults(model, {"temperature": 0.7, "max_new_tokens": 300, "min_p": 0.05}, "thinker")
    assert (ours.temperature, ours.max_tokens, ours.min_p, ours.top_k, ours.stop_token_ids) == (0.7, 300, 0.05, 50, (7,))
    assert with_defaults(model, None, "x") is model
    for bad, message in [({"temprature": 1}, "x: unknown key 'temprature'; keys: temperature, top_p"),
                         ({"top_k": 2.5}, r"x\['top_k'\]: 2.5 is not a whole number"),
                         ({"temperature": "hot"}, r"x\['temperature'\]: 'hot' is not a number"),
                         ({"top_p": 0}, r"x: top_p must be in \(0, 1\]")]:
        with pytest.raises(ValueError, match=message):
            with_defaults(model, bad, "x")


def test_the_talkers_code_buffer_is_its_codes() -> None:
    """`talker.history(state)` is a view of a buffer written once per code (doubled when full): always the
    codes sampled so far, past the first 64."""
    from omnimesh.models.qwen3_omni.talker import Qwen3OmniTalker, TalkerState, history

    state = TalkerState(sampler=Sampler(SamplingParams(max_tokens=1000)), predictor_sampler=None, handle=None,
                        prefill_embeds=None, prefill_positions=None, rope_delta=0, tts_eos=torch.zeros(1),
                        tts_pad=torch.zeros(1))
    for t in range(200):
        Qwen3OmniTalker._took(None, state, (t * 7) % 31)  # type: ignore[arg-type]  # touches only the state
        assert history(state).tolist() == state.codes
    assert state.code_buffer.numel() == 256


def test_a_tiny_temperature_samples_at_vllms_floor() -> None:
    """1e-45 (a float32 subnormal, what a fuzzed gRPC request sent) divided the scores into infinities and the
    draw failed on NaN probabilities (INTERNAL); as vLLM, a temperature in (0, 0.01) samples at 0.01."""
    assert SamplingParams(temperature=1.4e-45).temperature == MIN_TEMPERATURE == 0.01
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(temperature=0.02).temperature == 0.02
    x = logits(5)
    tiny = Sampler(SamplingParams(temperature=1.4e-45, seed=1))
    floor = Sampler(SamplingParams(temperature=0.01, seed=1))
    assert [tiny.sample(x) for _ in range(5)] == [floor.sample(x) for _ in range(5)]


def test_a_step_with_no_token_to_pick_says_why() -> None:
    """Settings that exclude every id, or overflow the scores, fail the request (ValueError: the stage's
    INVALID_ARGUMENT) with the reason; before, a draw raised on NaN probabilities (and would assert on the
    device under CUDA) and argmax picked id 0 from nothing. The model's own NaN is a RuntimeError (INTERNAL)."""
    x = logits(6)
    for temperature in (0.0, 0.7):
        shut = Sampler(SamplingParams(temperature=temperature, allowed_token_ids=(3,), bad_words_ids=((3,),)))
        with pytest.raises(ValueError, match="no token can be picked at this step"):
            shut.sample(x)
        held = Sampler(SamplingParams(temperature=temperature, allowed_token_ids=(7,), stop_token_ids=(7,),
                                      min_tokens=2))
        with pytest.raises(ValueError, match="no token can be picked"):
            held.sample(x)
        grammar = torch.full_like(x, -float("inf"))  # a structured output's grammar allows id 5 only
        grammar[5] = x[5]
        with pytest.raises(ValueError, match="no token can be picked.*a structured output's grammar"):
            Sampler(SamplingParams(temperature=temperature, allowed_token_ids=(3,))).sample(grammar)
    history = torch.arange(64)  # every id seen: each positive score divided by 1e-40 is inf
    with pytest.raises(ValueError, match=r"the scores overflow float32 \(repetition_penalty 1e-40"):
        Sampler(SamplingParams(temperature=0.7, repetition_penalty=1e-40)).sample(x, history)
    assert 0 <= Sampler(SamplingParams(temperature=0.0, repetition_penalty=1e-40)).sample(x, history) < 64  # argmax
    broken = x.clone()
    broken[4] = float("nan")
    for temperature in (0.0, 0.7):
        with pytest.raises(RuntimeError, match="the model's logits hold NaN"):
            Sampler(SamplingParams(temperature=temperature)).sample(broken)
