"""ParallelCodePredictor equals transformers' code predictor (pp = tp = 1) and itself over gloo ranks.

Reference: `talker.code_predictor` of `Qwen3OmniMoeForConditionalGeneration.from_pretrained(tiny folder)`, run
the way `Qwen3OmniTalker._predict_residuals` runs it (`decoder.run_code_predictor` on a DynamicCache,
`lm_head[j]`, greedy) for several talker steps: same residual codes, same summed codec embedding, hidden
within 1e-5; `_predict_residuals` itself (greedy and seeded sampling) gives the same codes and sum.
Gloo layouts (2,1), (1,2), (2,2), with replicated and with vocab-parallel tables, equal the (1,1) run: same
codes, hidden and codec sum within 1e-4, per-rank parameter bytes <= 1.1 x total / (pp*tp) + the named
replicated parts, and each rank reads only its own tensors.

Run: python -m pytest tests/parallel/test_parallel_code_predictor.py -q
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from gloo_harness import (  # one_thread: autouse here
    assert_memory_split,
    build_tiny,
    fake_tp3,
    layers_read,
    one_thread,  # noqa: F401
    param_sizes,
    run_layout,
    run_single,
)

from omnimesh.models.qwen3_omni.parallel_code_predictor import (
    ParallelCodePredictor,
    check_dense_layout,
    predict_residuals,
)
from omnimesh.parallel.parallel_state import ParallelState
from omnimesh.parallel.partition import partition_layers

TOL, GLOO_TOL = 1e-5, 1e-4
TALKER_STEPS = 4
PREFIX = "talker.code_predictor."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(tmp_path_factory)


def predictor_config(model_dir: Path) -> Any:
    from transformers import AutoConfig  # the config classes only

    return AutoConfig.from_pretrained(model_dir, local_files_only=True).talker_config.code_predictor_config


def talker_inputs(n: int, H: int = 64) -> list[tuple[torch.Tensor, int]]:
    """n talker steps: (talker last hidden (1, 1, H), codec token c0)."""
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(1, 1, H, generator=gen), int(torch.randint(0, 256, (1,), generator=gen))) for _ in range(n)]


def ours(model_dir: Path, ps: ParallelState, vocab_parallel: bool = False) -> tuple[ParallelCodePredictor, tuple]:
    config = predictor_config(model_dir)
    layer_range = partition_layers(config.num_hidden_layers, ps.pp_size)[ps.pp_rank]
    model = ParallelCodePredictor(config, ps, layer_range, vocab_parallel=vocab_parallel)
    return model, model.load_weights(model_dir)


def test_matches_transformers_residual_prediction(model_dir: Path) -> None:
    from transformers import DynamicCache, Qwen3OmniMoeForConditionalGeneration

    from omnimesh.models.qwen3_omni.decoder import run_code_predictor
    from omnimesh.models.qwen3_omni.sampling import Sampler, SamplingParams
    from omnimesh.models.qwen3_omni.talker import Qwen3OmniTalker

    hf = Qwen3OmniMoeForConditionalGeneration.from_pretrained(model_dir).eval()
    talker, predictor = hf.talker, hf.talker.code_predictor
    step_talker = Qwen3OmniTalker(talker, hf.config)
    model, _ = ours(model_dir, ParallelState.single())
    G = model.num_code_groups
    all_codes: list[int] = []
    with torch.no_grad():
        for h, code in talker_inputs(TALKER_STEPS):
            first = talker.get_input_embeddings()(torch.tensor([[code]]))  # (1, 1, H)
            # the reference loop, spelled out so its hidden states can be compared
            cache = DynamicCache(config=predictor.model.config)
            hidden = run_code_predictor(predictor.model, torch.cat([h, first], 1), torch.arange(2).view(1, 2), cache)
            ref_hidden, ref_codes, embeds = [hidden], [], [first]
            for j in range(G - 1):
                if j > 0:
                    embeds.append(predictor.model.codec_embedding[j - 1](torch.tensor([[ref_codes[-1]]])))
                    hidden = run_code_predictor(predictor.model, embeds[-1], torch.tensor([[1 + j]]), cache)
                    ref_hidden.append(hidden)
                ref_codes.append(int(predictor.lm_head[j](hidden)[0, -1].argmax()))
            embeds.append(predictor.model.codec_embedding[G - 2](torch.tensor([[ref_codes[-1]]])))
            ref_sum = torch.cat(embeds, 1).sum(1, keepdim=True)  # (1, 1, H)

            out = predict_residuals(model, torch.cat([h, first], 1))
            assert list(out.codes[0]) == ref_codes
            assert out.codec_sum is not None and (out.codec_sum - ref_sum).abs().max() < TOL
            assert len(out.hidden) == len(ref_hidden) == G - 1
            for mine, ref in zip(out.hidden, ref_hidden):
                assert mine.shape == ref.shape and (mine - ref).abs().max() < TOL

            # and the talker's own step function agrees
            state = types.SimpleNamespace(last_hidden=h, predictor_sampler=Sampler(SamplingParams(temperature=0.0)))
            codes, codec_sum = step_talker._predict_residuals(state, code)  # type: ignore[arg-type]
            assert codes == ref_codes and (codec_sum - out.codec_sum).abs().max() < TOL
            all_codes += ref_codes
    assert len(set(all_codes)) > G, f"degenerate greedy codes {all_codes}: the comparison would be vacuous"


def test_seeded_sampling_matches_the_talker(model_dir: Path) -> None:
    """A sampler passed as `sample` draws in `_predict_residuals`' order (one draw per residual)."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from omnimesh.models.qwen3_omni.sampling import Sampler, SamplingParams
    from omnimesh.models.qwen3_omni.talker import Qwen3OmniTalker

    hf = Qwen3OmniMoeForConditionalGeneration.from_pretrained(model_dir).eval()
    step_talker = Qwen3OmniTalker(hf.talker, hf.config)
    model, _ = ours(model_dir, ParallelState.single())
    params = SamplingParams(temperature=0.9, top_k=50, seed=7)
    mine, theirs = Sampler(params), Sampler(params)
    with torch.no_grad():
        for h, code in talker_inputs(3):
            first = hf.talker.get_input_embeddings()(torch.tensor([[code]]))
            out = predict_residuals(model, torch.cat([h, first], 1), sample=[mine.sample])
            state = types.SimpleNamespace(last_hidden=h, predictor_sampler=theirs)
            codes, codec_sum = step_talker._predict_residuals(state, code)  # type: ignore[arg-type]
            assert list(out.codes[0]) == codes
            assert out.codec_sum is not None and (out.codec_sum - codec_sum).abs().max() < TOL


def test_a_batch_equals_each_request_alone(model_dir: Path) -> None:
    """B requests in one call (a batched talker step) give each request's solo codes and sum; a greedy and
    a seeded request can share the batch."""
    from omnimesh.models.qwen3_omni.sampling import Sampler, SamplingParams

    model, _ = ours(model_dir, ParallelState.single())
    gen = torch.Generator().manual_seed(3)
    prefixes = torch.cat([torch.randn(4, 1, 64, generator=gen), 0.02 * torch.randn(4, 1, 64, generator=gen)], 1)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_k=50, seed=5),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.8, seed=9)]
    solo = [predict_residuals(model, prefixes[b:b + 1], sample=[None if p.greedy else Sampler(p).sample])
            for b, p in enumerate(params)]
    batch = predict_residuals(model, prefixes, sample=[None if p.greedy else Sampler(p).sample for p in params],
                              batch=4)
    assert batch.codec_sum is not None and batch.codec_sum.shape == (4, 1, 64)
    for b, one in enumerate(solo):
        assert batch.codes[b] == one.codes[0]
        assert one.codec_sum is not None and (batch.codec_sum[b:b + 1] - one.codec_sum).abs().max() < TOL
    assert len({c for one in solo for c in one.codes[0]}) > 4  # not degenerate


def scenario(ps: ParallelState, model_dir: Path) -> dict[str, Any]:
    """TALKER_STEPS residual predictions on this rank, once with replicated and once with vocab-parallel tables."""
    gen = torch.Generator().manual_seed(1)
    prefixes = [torch.cat([torch.randn(1, 1, 64, generator=gen), 0.02 * torch.randn(1, 1, 64, generator=gen)], 1)
                for _ in range(TALKER_STEPS)]  # (1, 2, H): talker hidden, codec embedding of c0
    out: dict[str, Any] = {"rank": ps.rank}
    for variant, vocab_parallel in (("replicated", False), ("vocab_parallel", True)):
        model, keys = ours(model_dir, ps, vocab_parallel)
        codes, sums, hidden = [], [], []
        for prefix in prefixes:
            res = predict_residuals(model, prefix if ps.is_first_pp_rank else None)
            codes.append(list(res.codes[0]))
            if res.codec_sum is not None:
                sums.append(res.codec_sum.view(-1))
            hidden += list(res.hidden)
        out[variant] = {
            "codes": codes, "keys": list(keys), "layer_range": (model.start, model.end),
            "codec_sum": torch.stack(sums) if sums else None,  # (steps, H), first pp rank
            "hidden": torch.cat(hidden, dim=1) if hidden else None,  # (1, steps * G, H), last pp rank
            "param_bytes": model.param_bytes(), "sizes": param_sizes(model),
        }
    return out


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> dict[str, Any]:
    return run_single(scenario, model_dir)


@pytest.mark.parametrize(("pp", "tp"), [(2, 1), (1, 2), (2, 2)])
def test_layout_matches_single_rank(pp: int, tp: int, model_dir: Path, reference: dict[str, Any]) -> None:
    check_dense_layout(predictor_config(model_dir), pp, tp)
    ranks = run_layout(pp, tp, scenario, model_dir)
    for variant, replicated in (("replicated", ("norm", "codec_embedding", "lm_head")), ("vocab_parallel", ("norm",))):
        ref, outs = reference[variant], [r[variant] for r in ranks]
        n_layers = ref["layer_range"][1]
        for o in outs:
            start, end = o["layer_range"]
            assert o["codes"] == ref["codes"], f"{variant} rank {outs.index(o)}: residual codes differ"
            if start == 0:
                assert (o["codec_sum"] - ref["codec_sum"]).abs().max() < GLOO_TOL, variant
            if end == n_layers:
                assert (o["hidden"] - ref["hidden"]).abs().max() < GLOO_TOL, variant
            # only its own layers, and the tables / heads only where they live
            assert layers_read(o["keys"]) == set(range(start, end))
            assert any("codec_embedding" in k for k in o["keys"]) == (start == 0)
            assert any("lm_head" in k for k in o["keys"]) == (end == n_layers)
        assert_memory_split(outs, ref, pp, tp, replicated)


def test_tp_that_does_not_divide_the_heads_is_named(model_dir: Path) -> None:
    config = predictor_config(model_dir)
    message = (r"tp=3 must divide num_attention_heads=4 and num_key_value_heads=2; "
               r"valid tp values for this model: \[1, 2\]")
    with pytest.raises(ValueError, match=message):
        check_dense_layout(config, 1, 3)
    with pytest.raises(ValueError, match=message):
        ParallelCodePredictor(config, fake_tp3(), (0, config.num_hidden_layers))  # construction fails first
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"first rank must start at 0 and the last must end at 2"):
        ParallelCodePredictor(config, ParallelState.single(), (0, 1))
