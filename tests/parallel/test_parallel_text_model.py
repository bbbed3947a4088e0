"""Our ParallelTextModel at pp = tp = 1 equals transformers' thinker / talker LMs (via decoder.run_decoder).

Reference: `Qwen3OmniMoeThinkerTextModel` + `lm_head` and `Qwen3OmniMoeTalkerModel` + `codec_head` loaded by
`stage_loading` from the tiny folder, run by `decoder.run_decoder` with a DynamicCache. Ours: the same folder
through `ParallelTextModel.load_weights`. The folder's talker routers are made non-zero first (the tiny
build leaves them zero, so every token would tie over all experts). Prefill (M-RoPE positions with a 2-D
visual block, deepstack adds, a captured layer) and greedy decode steps must agree within 1e-5 (hidden,
captured, logits, tokens).

Run: python -m pytest tests/parallel/test_parallel_text_model.py -q
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from gloo_harness import build_tiny, one_thread, with_talker_routers, without_key  # noqa: F401  (one_thread: autouse)
from lm_scenario import decode_pos
from transformers import DynamicCache

from omnimesh.kernels import cpu_kernels
from omnimesh.models.qwen3_omni.decoder import run_decoder
from omnimesh.models.qwen3_omni.parallel_text_model import ParallelTextModel, apply_rope, gqa_attention, signed_sin
from omnimesh.models.model_config import load_config
from omnimesh.parallel.parallel_state import ParallelState

TOL = 1e-5
DECODE_STEPS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_talker_routers(build_tiny(tmp_path_factory), tmp_path_factory.mktemp("routed") / "qwen3-omni")


def mrope_positions(T: int, vis_start: int, grid: tuple[int, int]) -> tuple[torch.Tensor, int]:
    """(4, 1, T) float32 positions with one image block of grid h x w at `vis_start`, and the rope delta."""
    h, w = grid
    rows = torch.zeros(3, T)
    p = 0.0
    i = 0
    while i < T:
        if i == vis_start:
            hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            n = h * w
            rows[0, i:i + n] = p
            rows[1, i:i + n] = p + hh.flatten()
            rows[2, i:i + n] = p + ww.flatten()
            p += max(h, w)
            i += n
        else:
            rows[:, i] = p
            p += 1
            i += 1
    text = torch.arange(T, dtype=torch.float32).view(1, 1, T)
    delta = int(rows.max().item()) + 1 - T
    return torch.cat([text, rows.view(3, 1, T)], dim=0), delta  # (4, 1, T)


def ours(model_dir: Path, is_talker: bool) -> ParallelTextModel:
    config = load_config(model_dir)
    text_config = (config.talker_config if is_talker else config.thinker_config).text_config
    model = ParallelTextModel(text_config, ParallelState.single(), (0, text_config.num_hidden_layers),
                              is_talker=is_talker)
    model.load_weights(model_dir)
    return model


def run_both(ref_model: Any, ref_head: Any, ref_embed: Any, model: ParallelTextModel, *, n_deep: int,
             capture: int) -> None:
    T, vis_start, grid = 12, 3, (2, 3)
    ids = torch.randint(0, 300, (1, T), generator=torch.Generator().manual_seed(1))
    positions, delta = mrope_positions(T, vis_start, grid)
    mask = torch.zeros(1, T, dtype=torch.bool)
    mask[0, vis_start:vis_start + grid[0] * grid[1]] = True
    gen = torch.Generator().manual_seed(2)
    deep = [torch.randn(int(mask.sum()), 64, generator=gen) * 0.5 for _ in range(n_deep)] or None

    with torch.no_grad():
        ref_x = ref_embed(ids)  # (1, T, H)
        x = model.embed_ids(ids)
        assert torch.equal(x, ref_x)
        ref_cache = DynamicCache(config=ref_model.config)
        ref = run_decoder(ref_model, ref_x, positions, ref_cache, visual_pos_mask=mask if deep else None,
                          deepstack=deep, capture_layer=capture)
        cache = model.new_cache()
        out = model(x, positions, cache, visual_pos_mask=mask if deep else None, deepstack=deep, capture_layer=capture)
        assert ref.captured is not None and out.captured is not None
        assert (out.hidden - ref.last_hidden).abs().max() < TOL
        assert (out.captured - ref.captured).abs().max() < TOL
        ref_logits = ref_head(ref.last_hidden[:, -1])  # (1, V)
        logits = model.compute_logits(out.hidden[:, -1])
        assert logits.shape == ref_logits.shape
        assert (logits - ref_logits).abs().max() < TOL

        seq = T
        for _ in range(DECODE_STEPS):
            token = int(ref_logits.argmax(-1))
            assert int(logits.argmax(-1)) == token
            tok = torch.tensor([[token]])
            pos = decode_pos(seq, delta)
            ref = run_decoder(ref_model, ref_embed(tok), pos, ref_cache)
            out = model(model.embed_ids(tok), pos, cache)
            ref_logits, logits = ref_head(ref.last_hidden[:, -1]), model.compute_logits(out.hidden[:, -1])
            assert (out.hidden - ref.last_hidden).abs().max() < TOL
            assert (logits - ref_logits).abs().max() < TOL
            seq += 1
        assert cache.get_seq_length() == ref_cache.get_seq_length() == T + DECODE_STEPS


def _transformers_model(model_dir: Path):  # noqa: ANN202
    from transformers import Qwen3OmniMoeForConditionalGeneration

    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(model_dir).eval()


def test_thinker_matches_transformers(model_dir: Path) -> None:
    thinker = _transformers_model(model_dir).thinker
    text_model = thinker.model.language_model
    model = ours(model_dir, is_talker=False)
    # 3 deepstack tensors: adds after layers 0, 1 and 2 (the real model has 3, the tiny config 1)
    run_both(text_model, thinker.lm_head, text_model.embed_tokens, model, n_deep=3, capture=2)


def test_talker_matches_transformers(model_dir: Path) -> None:
    talker = _transformers_model(model_dir).talker
    model = ours(model_dir, is_talker=True)
    run_both(talker.model, talker.codec_head, talker.model.codec_embedding, model, n_deep=0, capture=1)


@pytest.mark.parametrize("capture", [0, 4])
def test_capture_edges(model_dir: Path, capture: int) -> None:
    """Index 0 is the layer input (inputs_embeds), num_layers the final-norm output."""
    model = ours(model_dir, is_talker=False)
    x = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(3))
    positions, _ = mrope_positions(5, 99, (1, 1))
    out = model(x, positions, model.new_cache(), capture_layer=capture)
    assert out.captured is not None
    assert torch.equal(out.captured, x if capture == 0 else out.hidden)


def test_chunked_prefill_equals_one_prefill(model_dir: Path) -> None:
    """A prompt run as 7 + 5 tokens (the explicit causal mask with a non-empty cache) equals one 12-token run."""
    model = ours(model_dir, is_talker=True)
    x = torch.randn(1, 12, 64, generator=torch.Generator().manual_seed(4))
    positions, _ = mrope_positions(12, 2, (2, 2))
    whole = model(x, positions, model.new_cache()).hidden
    cache = model.new_cache()
    first = model(x[:, :7], positions[..., :7], cache).hidden
    second = model(x[:, 7:], positions[..., 7:], cache).hidden
    assert (torch.cat([first, second], dim=1) - whole).abs().max() < TOL


def test_missing_key_is_named(model_dir: Path, tmp_path: Path) -> None:
    gone = "thinker.model.layers.1.mlp.experts.3.up_proj.weight"
    broken = without_key(model_dir, tmp_path / "broken", gone)
    model = ParallelTextModel(load_config(model_dir).thinker_config.text_config, ParallelState.single(), (0, 4),
                              is_talker=False)
    with pytest.raises(ValueError, match=r"1 weight\(s\) for thinker layers \[0, 4\) are missing .*" + gone):
        model.load_weights(broken)


def test_layer_range_must_fit_the_rank(model_dir: Path) -> None:
    config = load_config(model_dir).thinker_config.text_config
    with pytest.raises(ValueError, match=r"first rank must start at 0 and the last must end at 4"):
        ParallelTextModel(config, ParallelState.single(), (0, 2), is_talker=False)
    with pytest.raises(ValueError, match=r"0 <= start < end <= 4"):
        ParallelTextModel(config, ParallelState.single(), (0, 5), is_talker=False)


def test_deepstack_needs_the_visual_mask(model_dir: Path) -> None:
    model = ours(model_dir, is_talker=False)
    positions, _ = mrope_positions(4, 99, (1, 1))
    with pytest.raises(ValueError, match="deepstack features given without visual_pos_mask"):
        model(torch.zeros(1, 4, 64), positions, model.new_cache(), deepstack=[torch.zeros(1, 64)])


@pytest.mark.parametrize("masked", [False, True])
def test_gqa_attention_equals_repeated_kv_heads(masked: bool) -> None:
    """On CPU the kernel reads each kv head for its n_rep query heads itself: the same bits as repeating them."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 4, 5, 16, generator=g), torch.randn(3, 2, 9, 16, generator=g), torch.randn(3, 2, 9, 16, generator=g)
    mask = torch.rand(3, 1, 5, 9, generator=g) > 0.3 if masked else None
    if mask is not None:
        mask[..., 0] = True  # every query sees a key
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask,
                                          scale=0.25)
    assert torch.equal(gqa_attention(q, k, v, 2, 0.25, mask), want)
    assert torch.equal(gqa_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), 1, 0.25, mask), want)


def test_apply_rope_is_transformers_rotate_half_bit_for_bit() -> None:
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 4, 5, 16, generator=g), torch.randn(2, 2, 5, 16, generator=g)
    cos, sin = torch.randn(2, 5, 16, generator=g), torch.randn(2, 5, 16, generator=g)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)  # unsqueezes cos / sin at dim 1
    s = signed_sin(sin).unsqueeze(1)
    assert torch.equal(apply_rope(q, cos.unsqueeze(1), s), want_q)
    assert torch.equal(apply_rope(k, cos.unsqueeze(1), s), want_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qkv_heads_equals_norming_and_rotating_q_and_k_apart(dtype: torch.dtype) -> None:
    from omnimesh.models.qwen3_omni.parallel_text_model import RMSNorm, qkv_heads
    from omnimesh.parallel.layers import default_weight_loader

    g = torch.Generator().manual_seed(4)
    heads, kv_heads, D, B, T = 4, 2, 16, 2, 3
    norms = (RMSNorm(D, 1e-6, dtype), RMSNorm(D, 1e-6, dtype))
    for n in norms:
        default_weight_loader(n.weight, torch.randn(D, generator=g).to(dtype))
    qkv = torch.randn(B, T, (heads + 2 * kv_heads) * D, generator=g).to(dtype)
    cos, sin = torch.randn(B, 1, T, D, generator=g).to(dtype), signed_sin(torch.randn(B, 1, T, D, generator=g)).to(dtype)

    def apart() -> tuple[torch.Tensor, ...]:
        q, k, v = qkv.split([heads * D, kv_heads * D, kv_heads * D], -1)
        q = norms[0](q.view(B, T, heads, D)).transpose(1, 2)
        k = norms[1](k.view(B, T, kv_heads, D)).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.view(B, T, kv_heads, D).transpose(1, 2)

    with cpu_kernels.disabled():  # the eager path's claim (the fused CPU kernel: tests/kernels, within rounding)
        for got, want in zip(qkv_heads(qkv, heads, kv_heads, D, norms, cos, sin), apart()):
            assert torch.equal(got, want)
        default_weight_loader(norms[1].weight, torch.randn(D, generator=g).to(dtype))  # loaded again: remade
        for got, want in zip(qkv_heads(qkv, heads, kv_heads, D, norms, cos, sin), apart()):
            assert torch.equal(got, want)
