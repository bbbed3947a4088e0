"""Qwen2.5-Omni's dense LMs through our ParallelTextModel equal transformers', on one rank and over gloo ranks.

Reference: `Qwen2_5OmniForConditionalGeneration.from_pretrained` of the tiny Qwen2.5-Omni folder (its q/k/v
biases drawn non-zero, so a model that ignored them would differ): the thinker's
`Qwen2_5OmniThinkerTextModel` + `lm_head`, and the talker's `Qwen2_5OmniTalkerModel` + `codec_head`, each run
on a DynamicCache. Ours: `ParallelTextModel` over the same folder (text_arch.py: no q/k norm, q/k/v biases,
contiguous M-RoPE sections, dense MLPs). A prefill with an image block of distinct t/h/w positions, then
greedy decode steps: hidden, logits and tokens within 1e-5. The pp x tp layouts (2,1), (1,2), (2,2) run in
spawned gloo processes, each loading only its shard, and must give the single rank's tokens and logits
(1e-4).

Run: python -m pytest tests/parallel/test_qwen2_5_text_model.py -q
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from gloo_harness import assert_memory_split, layers_read, one_thread, param_sizes, run_single  # noqa: F401
from gloo_harness import run_layout as spawn_layout
from transformers import DynamicCache

from omnimesh.models.qwen3_omni.parallel_text_model import MRotary, ParallelTextModel, pipeline_step
from omnimesh.models.qwen3_omni.text_arch import text_arch
from omnimesh.parallel.parallel_state import ParallelState
from omnimesh.parallel.partition import partition_layers

TOL = 1e-5
DECODE_STEPS = 4
T = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omnimesh.models.qwen2_5_omni.tiny import build_tiny_qwen2_5_omni

    return build_tiny_qwen2_5_omni(tmp_path_factory.mktemp("tiny") / "qwen2.5-omni")


def text_config(model_dir: Path, role: str) -> Any:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    return config.talker_config if role == "talker" else config.thinker_config.text_config


def prompt() -> tuple[torch.Tensor, torch.Tensor, int]:
    """ids (1, T), positions (4, 1, T) with a 2 x 3 image block at 3..8 (t, h and w all differ), rope delta."""
    ids = torch.randint(0, 300, (1, T), generator=torch.Generator().manual_seed(1))
    t = torch.tensor([0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7, 8], dtype=torch.float32)
    h = torch.tensor([0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7, 8], dtype=torch.float32)
    w = torch.tensor([0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8], dtype=torch.float32)
    return ids, torch.stack([torch.arange(T, dtype=torch.float32), t, h, w]).view(4, 1, T), 9 - T


def decode_pos(seq: int, delta: int) -> torch.Tensor:
    return torch.tensor([seq] + [seq + delta] * 3, dtype=torch.float32).view(4, 1, 1)


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
    _, positions, _ = prompt()
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
    ids, positions, delta = prompt()
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


def thinker_scenario(ps: ParallelState, model_dir: Path) -> dict[str, Any]:
    """Prefill + greedy decode on this rank (logits only on the last pp rank)."""
    config = text_config(model_dir, "thinker")
    layer_range = partition_layers(config.num_hidden_layers, ps.pp_size)[ps.pp_rank]
    model = ParallelTextModel(config, ps, layer_range, is_talker=False)
    keys = model.load_weights(model_dir)
    ids, positions, delta = prompt()
    cache = model.new_cache()
    out = pipeline_step(model, model.embed_ids(ids) if ps.is_first_pp_rank else None, positions, cache)
    tokens: list[int] = []
    logits_seen: list[torch.Tensor] = []
    seq = T
    for step in range(DECODE_STEPS + 1):
        token = torch.zeros(1, dtype=torch.long)
        if ps.is_last_pp_rank:
            logits = model.compute_logits(out.hidden[:, -1])
            logits_seen.append(logits[0])
            token[0] = logits.argmax(-1)[0]
        if ps.world_size > 1:
            dist.broadcast(token, src=ps.last_pp_rank_driver, group=ps.cpu_group)
        tokens.append(int(token))
        if step == DECODE_STEPS:
            break
        x = model.embed_ids(token.view(1, 1)) if ps.is_first_pp_rank else None
        out = pipeline_step(model, x, decode_pos(seq, delta), cache)
        seq += 1
    return {"rank": ps.rank, "layer_range": layer_range, "keys": keys, "tokens": tokens,
            "logits": torch.stack(logits_seen) if logits_seen else None, "param_bytes": model.param_bytes(),
            "sizes": param_sizes(model)}


@pytest.mark.parametrize(("pp", "tp"), [(2, 1), (1, 2), (2, 2)])
def test_layout_matches_single_rank(pp: int, tp: int, model_dir: Path) -> None:
    ref = run_single(thinker_scenario, model_dir)
    outs = spawn_layout(pp, tp, thinker_scenario, model_dir)
    for o in outs:
        assert o["tokens"] == ref["tokens"], f"rank {o['rank']}: greedy tokens differ"
        start, end = o["layer_range"]
        assert layers_read(o["keys"]) == set(range(start, end))
    for o in outs[(pp - 1) * tp:]:
        assert (o["logits"] - ref["logits"]).abs().max() < 1e-4
    assert_memory_split(outs, ref, pp, tp, ("norm",), sharded_whole=("embed.", "head."))
