"""Qwen2.5-Omni's dense LMs through our ParallelTextModel equal transformers', on one rank and over gloo ranks.

Reference: `Qwen2_5OmniForConditionalGeneration.from_pretrained` of the tiny Qwen2.5-Omni folder (its q/k/v
biases drawn non-zero, so a model that ignored them would differ): the thinker's
`Qwen2_5OmniThinkerTextModel` + `lm_head`, and the talker's `Qwen2_5OmniTalkerModel` + `codec_head`, each run
on a DynamicCache. Ours: `ParallelTextModel` over the same folder (text_arch.py: no q/k norm, q/k/v biases,
contiguous M-RoPE sections, dense MLPs). A prefill with an image block of distinct t/h/w positions, then
greedy decode steps: hidden, logits and tokens within 1e-5. The pp x tp layouts (2,1), (1,2), (2,2) run the
shared gloo scenario (lm_scenario.py, without deepstack) in spawned processes, each loading only its shard, and
must give the single rank's tokens, logits and captured hidden (1e-4).

Run: python -m pytest tests/parallel/test_qwen2_5_text_model.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gloo_harness import assert_memory_split, layers_read, one_thread, run_single  # noqa: F401
from gloo_harness import run_layout as spawn_layout
from lm_scenario import T, decode_pos, prompt, scenario, text_config
from transformers import DynamicCache

from omnimesh.models.qwen3_omni.parallel_text_model import MRotary, ParallelTextModel
from omnimesh.models.qwen3_omni.text_arch import text_arch
from omnimesh.parallel.parallel_state import ParallelState

TOL = 1e-5
DECODE_STEPS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omnimesh.models.qwen2_5_omni.tiny import build_tiny_qwen2_5_omni

    return build_tiny_qwen2_5_omni(tmp_path_factory.mktemp("tiny") / "qwen2.5-omni")


def inputs(role: str, ids: torch.Tensor, hidden: int) -> torch.Tensor:
    """The layer-0 input: the thinker embeds its ids; the talker's comes projected from the thinker (random here)."""
    gen = torch.Generator().manual_seed(int(ids.sum()))
    return torch.randn(1, ids.shape[1], hidden, generator=gen) * 0.5


def test_arch_of_each_family(model_dir: Path) -> None:
    arch = text_arch(text_config(model_dir, "thinker"))
    assert (arch.family, arch.head_dim, arch.qk_norm, arch.qkv_bias, arch.o_bias, arch.interleaved_mrope) == \
        ("qwen2_5_omni", 16, False, True, False, False)
    assert not any(arch.sparse(i, is_talker=True) for i in range(4))
    assert text_arch(text_config(model_dir, "talker")).family == "qwen2_5_omni"
    config = text_config(model_dir, "thinker")
    config.use_sliding_window = True
    with pytest.raises(ValueError, match="use_sliding_window=true is not supported"):
        text_arch(config)
    config.model_type = "llama"
    with pytest.raises(ValueError, match="text model type 'llama' is not supported; supported: qwen3_omni_moe_text"):
        text_arch(config)


def test_sectioned_mrope_equals_transformers(model_dir: Path) -> None:
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniRotaryEmbedding

    config = text_config(model_dir, "thinker")
    positions = prompt()[1]  # the image block: t, h and w all differ
    cos, sin = MRotary(config)(positions[1:], torch.float32)
    ref_cos, ref_sin = Qwen2_5OmniRotaryEmbedding(config)(torch.zeros(1), positions[1:])
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    bad = text_config(model_dir, "thinker")
    bad.rope_parameters = {**bad.rope_parameters, "mrope_section": [2, 3, 2]}
    with pytest.raises(ValueError, match=r"mrope_section \[2, 3, 2\] must sum to head_dim / 2 = 8"):
        MRotary(bad)


@pytest.mark.parametrize("role", ["thinker", "talker"])
def test_matches_transformers(model_dir: Path, role: str) -> None:
    from transformers import Qwen2_5OmniForConditionalGeneration

    full = Qwen2_5OmniForConditionalGeneration.from_pretrained(model_dir).eval()
    if role == "thinker":
        ref_model, ref_head, embed = full.thinker.model.language_model, full.thinker.lm_head, full.thinker.get_input_embeddings()
    else:
        ref_model, ref_head, embed = full.talker.model, full.talker.codec_head, full.talker.model.embed_tokens
    config = text_config(model_dir, role)
    model = ParallelTextModel(config, ParallelState.single(), (0, config.num_hidden_layers), is_talker=role == "talker",
                              with_embed=role == "thinker")
    keys = model.load_weights(model_dir)
    assert not any("q_norm" in k for k in keys) and any(k.endswith("q_proj.bias") for k in keys)
    ids, positions, delta, _, _ = prompt()
    with torch.no_grad():
        x = embed(ids) if role == "thinker" else inputs(role, ids, config.hidden_size)
        if role == "thinker":
            assert torch.equal(model.embed_ids(ids), x)
        ref_cache = DynamicCache(config=ref_model.config)
        ref = ref_model(inputs_embeds=x, position_ids=positions, past_key_values=ref_cache, use_cache=True)
        cache = model.new_cache()
        out = model(x, positions, cache)
        assert (out.hidden - ref.last_hidden_state).abs().max() < TOL
        ref_logits, logits = ref_head(ref.last_hidden_state[:, -1]), model.compute_logits(out.hidden[:, -1])
        assert (logits - ref_logits).abs().max() < TOL
        seq = T
        for _ in range(DECODE_STEPS):
            token = int(ref_logits.argmax(-1))
            assert int(logits.argmax(-1)) == token
            tok = torch.tensor([[token]])
            step_x = embed(tok)
            ref = ref_model(inputs_embeds=step_x, position_ids=decode_pos(seq, delta), past_key_values=ref_cache,
                            use_cache=True)
            out = model(step_x, decode_pos(seq, delta), cache)
            ref_logits, logits = ref_head(ref.last_hidden_state[:, -1]), model.compute_logits(out.hidden[:, -1])
            assert (out.hidden - ref.last_hidden_state).abs().max() < TOL
            assert (logits - ref_logits).abs().max() < TOL
            seq += 1
        assert cache.get_seq_length() == ref_cache.get_seq_length() == T + DECODE_STEPS


@pytest.mark.parametrize(("pp", "tp"), [(2, 1), (1, 2), (2, 2)])
def test_layout_matches_single_rank(pp: int, tp: int, model_dir: Path) -> None:
    ref = run_single(scenario, model_dir, "thinker", False)  # Qwen2.5-Omni: no deepstack adds
    outs = spawn_layout(pp, tp, scenario, model_dir, "thinker", False)
    for o in outs:
        assert o["tokens"] == ref["tokens"], f"rank {o['rank']}: greedy tokens differ"
        start, end = o["layer_range"]
        assert layers_read(o["keys"]) == set(range(start, end))
    for o in outs[(pp - 1) * tp:]:
        assert (o["logits"] - ref["logits"]).abs().max() < 1e-4
        assert (o["captured"] - ref["captured"]).abs().max() < 1e-4
    assert_memory_split(outs, ref, pp, tp, ("norm",), sharded_whole=("embed.", "head."))
