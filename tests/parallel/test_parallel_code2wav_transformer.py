"""ParallelCode2WavTransformer equals transformers' code2wav pre-transformer, one piece or streamed, and over gloo.

Reference: `code2wav.pre_transformer` of `Qwen3OmniMoeForConditionalGeneration.from_pretrained(folder)` run in
one piece over N = 160 codes (more than twice the sliding window of 72). Ours at pp = tp = 1 fed windows of
1, 7 and 30 codes (positions seen..seen+n, as `Code2WavStreamer` feeds it) must equal it within 1e-5, with
the cache holding at most 71 positions. The folder is the tiny one with code2wav's q/k projections x 8 and
layer scales U(0.5, 1.5): the tiny init (layer scale 0.01, std-0.02 q/k) leaves attention nearly uniform,
so a RoPE or window error would move the output by less than 1e-3; `test_the_window_matters` proves the
comparison sees the window. Gloo layouts (2,1), (1,2), (2,2) equal the (1,1) stream within 1e-4, with
per-rank parameter bytes <= 1.1 x total / (pp*tp) + norms and layer scales, each rank reading only its layers.

Run: python -m pytest tests/parallel/test_parallel_code2wav_transformer.py -q
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from gloo_harness import (  # one_thread: autouse here
    assert_memory_split,
    build_tiny,
    fake_tp3,
    layers_read,
    one_thread,  # noqa: F401
    param_sizes,
    rewrite_folder,
    run_layout,
    run_single,
    without_key,
)

from omnimesh.models.qwen3_omni.parallel_code2wav_transformer import (
    ParallelCode2WavTransformer,
    check_code2wav_layout,
    pipeline_step,
)
from omnimesh.parallel.parallel_state import ParallelState
from omnimesh.parallel.partition import partition_layers

TOL, GLOO_TOL = 1e-5, 1e-4
N_CODES = 160
WINDOW = 72
GLOO_FEED = (30, 1, 7)  # window sizes, cycled until N_CODES codes are in
PREFIX = "code2wav.pre_transformer."


def sharpened(src: Path, dst: Path, seed: int = 0) -> Path:
    """A copy of the folder whose code2wav attention is peaked (q/k x 8) and layer scales ~1 (see above)."""
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        gen = torch.Generator().manual_seed(seed)
        for key in sorted(k for k in tensors if k.startswith(PREFIX)):
            if key.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
                tensors[key] = tensors[key] * 8
            elif key.endswith("layer_scale.scale"):
                tensors[key] = 0.5 + torch.rand(tensors[key].shape, generator=gen)

    return rewrite_folder(src, dst, edit)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sharpened(build_tiny(tmp_path_factory), tmp_path_factory.mktemp("sharp") / "qwen3-omni")


def code2wav_config(model_dir: Path) -> Any:
    from transformers import AutoConfig  # the config classes only

    return AutoConfig.from_pretrained(model_dir, local_files_only=True).code2wav_config


def ours(model_dir: Path, ps: ParallelState, config: Any = None) -> tuple[ParallelCode2WavTransformer, tuple]:
    config = config if config is not None else code2wav_config(model_dir)
    layer_range = partition_layers(config.num_hidden_layers, ps.pp_size)[ps.pp_rank]
    model = ParallelCode2WavTransformer(config, ps, layer_range)
    return model, model.load_weights(model_dir)


def stream(model: ParallelCode2WavTransformer, x: torch.Tensor | None, sizes: list[int]) -> tuple[torch.Tensor, Any]:
    """Feed windows of `sizes` codes through `pipeline_step` on one cache -> (1, sum(sizes), H) and the cache."""
    cache = model.new_cache()
    outs, seen = [], 0
    for n in sizes:
        positions = torch.arange(seen, seen + n).view(1, n)  # (1, n)
        outs.append(pipeline_step(model, None if x is None else x[:, seen:seen + n], positions, cache))
        seen += n
    return torch.cat(outs, dim=1), cache


def windows(n: int, pattern: tuple[int, ...]) -> list[int]:
    sizes: list[int] = []
    while sum(sizes) < n:
        sizes.append(min(pattern[len(sizes) % len(pattern)], n - sum(sizes)))
    return sizes


@pytest.fixture(scope="module")
def hf_reference(model_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs (1, N, H) from real codes, transformers' one-piece pre-transformer output (1, N, H))."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    c2w = Qwen3OmniMoeForConditionalGeneration.from_pretrained(model_dir).eval().code2wav
    codes = torch.randint(0, 256, (1, c2w.config.num_quantizers, N_CODES), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        x = c2w.code_embedding(codes + c2w.code_offset).mean(1)  # (1, N, H)
        return x, c2w.pre_transformer(inputs_embeds=x).last_hidden_state


@pytest.mark.parametrize("window", [N_CODES, 1, 7, 30])
def test_stream_matches_transformers(window: int, model_dir: Path, hf_reference: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, ref = hf_reference
    model, _ = ours(model_dir, ParallelState.single())
    out, cache = stream(model, x, windows(N_CODES, (window,)))
    assert out.shape == ref.shape
    assert (out - ref).abs().max() < TOL
    assert cache.get_seq_length() == N_CODES
    assert cache.stored_length() == WINDOW - 1  # bounded, however long the stream


def test_the_window_matters(model_dir: Path, hf_reference: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Without the window the first 72 frames agree and later ones do not: the comparison above sees it."""
    x, ref = hf_reference
    unwindowed = copy.deepcopy(code2wav_config(model_dir))
    unwindowed.sliding_window = 10 * N_CODES
    model, _ = ours(model_dir, ParallelState.single(), unwindowed)
    out, _ = stream(model, x, [N_CODES])
    assert (out[:, :WINDOW] - ref[:, :WINDOW]).abs().max() < TOL
    assert (out[:, WINDOW:] - ref[:, WINDOW:]).abs().max() > 1e-2


def scenario(ps: ParallelState, model_dir: Path) -> dict[str, Any]:
    """Stream N_CODES codes in GLOO_FEED windows through this rank's part of the pre-transformer."""
    model, keys = ours(model_dir, ps)
    x = 0.02 * torch.randn(1, N_CODES, model.hidden_size, generator=torch.Generator().manual_seed(1))
    hidden, cache = stream(model, x if ps.is_first_pp_rank else None, windows(N_CODES, GLOO_FEED))
    return {
        "hidden": hidden, "keys": list(keys), "layer_range": (model.start, model.end),
        "seen": cache.get_seq_length(), "stored": cache.stored_length(),
        "param_bytes": model.param_bytes(), "sizes": param_sizes(model),
    }


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> dict[str, Any]:
    return run_single(scenario, model_dir)


@pytest.mark.parametrize(("pp", "tp"), [(2, 1), (1, 2), (2, 2)])
def test_layout_matches_single_rank(pp: int, tp: int, model_dir: Path, reference: dict[str, Any]) -> None:
    check_code2wav_layout(code2wav_config(model_dir), pp, tp)
    outs = run_layout(pp, tp, scenario, model_dir)
    n_layers = reference["layer_range"][1]
    replicated = ("norm", "layer_scale")
    for o in outs:
        start, end = o["layer_range"]
        assert (o["seen"], o["stored"]) == (N_CODES, WINDOW - 1)
        if end == n_layers:
            assert (o["hidden"] - reference["hidden"]).abs().max() < GLOO_TOL
        assert layers_read(o["keys"]) == set(range(start, end))
        assert (PREFIX + "norm.weight" in o["keys"]) == (end == n_layers)
    assert_memory_split(outs, reference, pp, tp, replicated)


def test_tp_that_does_not_divide_the_heads_is_named(model_dir: Path) -> None:
    config = code2wav_config(model_dir)
    message = (r"tp=3 must divide num_attention_heads=4 and num_key_value_heads=4; "
               r"valid tp values for this model: \[1, 2, 4\]")
    with pytest.raises(ValueError, match=message):
        check_code2wav_layout(config, 1, 3)
    with pytest.raises(ValueError, match=message):
        ParallelCode2WavTransformer(config, fake_tp3(), (0, config.num_hidden_layers))  # construction fails first


def test_missing_key_is_named(model_dir: Path, tmp_path: Path) -> None:
    gone = PREFIX + "layers.1.mlp_layer_scale.scale"
    broken = without_key(model_dir, tmp_path / "broken", gone)
    model = ParallelCode2WavTransformer(code2wav_config(model_dir), ParallelState.single(), (0, 2))
    with pytest.raises(ValueError, match=r"1 weight\(s\) for code2wav pre-transformer layers \[0, 2\) are missing .*"
                                         + gone):
        model.load_weights(broken)
