"""The checked loader: each stage's part of the tiny folder equals the whole model's, gaps raise."""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import Qwen3OmniMoeForConditionalGeneration
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as q3

import omnimesh.models.loader as loader_mod
from omnimesh.config.stage_config import fmt_bytes
from omnimesh.models.loader import HF_PER_EXPERT_MOE, StackedParam, build_submodule, load_state_dict
from omnimesh.models.qwen3_omni.tiny import build_tiny_model, build_tiny_qwen3_omni

Omni = Qwen3OmniMoeForConditionalGeneration


def _lm_head(cfg: Any) -> torch.nn.Module:
    return torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)


# (config path, factory, checkpoint prefix, the same part inside the whole model). The checkpoint keeps the
# real Qwen3-Omni layout, so the prefixes are not the module paths (thinker.audio_tower vs
# thinker.model.audio_tower); that mapping belongs to the family adapter, not to the loader.
PARTS: dict[str, tuple[str, Callable[[Any], torch.nn.Module], str, Callable[[Any], torch.nn.Module]]] = {
    "code2wav": ("code2wav_config", q3.Qwen3OmniMoeCode2Wav, "code2wav.", lambda m: m.code2wav),
    "talker": ("talker_config", q3.Qwen3OmniMoeTalkerForConditionalGeneration, "talker.", lambda m: m.talker),
    "audio": ("thinker_config.audio_config", q3.Qwen3OmniMoeAudioEncoder, "thinker.audio_tower.",
              lambda m: m.thinker.model.audio_tower),
    "vision": ("thinker_config.vision_config", q3.Qwen3OmniMoeVisionEncoder, "thinker.visual.",
               lambda m: m.thinker.model.visual),
    "text": ("thinker_config.text_config", q3.Qwen3OmniMoeThinkerTextModel, "thinker.model.",
             lambda m: m.thinker.model.language_model),
    "lm_head": ("thinker_config.text_config", _lm_head, "thinker.lm_head.", lambda m: m.thinker.lm_head),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen3_omni(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def reference() -> Omni:
    return build_tiny_model(seed=0)


def _copy_without(folder: Path, dest: Path, drop: set[str], add: dict[str, torch.Tensor] | None = None) -> Path:
    shutil.copytree(folder, dest)
    tensors = load_file(dest / "model.safetensors")
    assert drop <= tensors.keys()
    kept = {k: v for k, v in tensors.items() if k not in drop}
    save_file({**kept, **(add or {})}, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


@pytest.mark.parametrize("part", sorted(PARTS))
def test_part_equals_the_whole_models_submodule(part: str, folder: Path, reference: Omni) -> None:
    config_path, factory, prefix, pick = PARTS[part]
    module = build_submodule(folder, config_path=config_path, factory=factory, prefix=prefix,
                             stacked=HF_PER_EXPERT_MOE, strict_unexpected=True)
    want = pick(reference)
    got_state, want_state = module.state_dict(), want.state_dict()
    assert got_state.keys() == want_state.keys()
    assert [k for k in want_state if not torch.equal(got_state[k], want_state[k])] == []
    # Non-persistent buffers (rotary inv_freq, ...) are rebuilt by the constructor, not loaded: check them too.
    got_buf, want_buf = dict(module.named_buffers()), dict(want.named_buffers())
    assert got_buf.keys() == want_buf.keys()
    assert [k for k in want_buf if not torch.equal(got_buf[k], want_buf[k])] == []
    assert not module.training


def test_checkpoint_keeps_experts_per_expert(folder: Path) -> None:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "talker.model.layers.0.mlp.experts.7.gate_proj.weight" in keys
    assert "talker.model.layers.0.mlp.experts.gate_up_proj" not in keys


def test_missing_expert_keys_are_named_without_stacking(folder: Path) -> None:
    with pytest.raises(ValueError, match=r"missing .*talker\.model\.layers\.0\.mlp\.experts\.gate_up_proj"):
        build_submodule(folder, config_path="talker_config", prefix="talker.",
                        factory=q3.Qwen3OmniMoeTalkerForConditionalGeneration)


def test_a_removed_key_is_named(folder: Path, tmp_path: Path) -> None:
    gone = "code2wav.pre_transformer.norm.weight"
    broken = _copy_without(folder, tmp_path / "broken", {gone})
    message = r"1 weight\(s\) of Qwen3OmniMoeCode2Wav are missing .*" + re.escape(gone)
    with pytest.raises(ValueError, match=message):
        build_submodule(broken, config_path="code2wav_config", factory=q3.Qwen3OmniMoeCode2Wav,
                        prefix="code2wav.")


def test_a_removed_expert_piece_is_named(folder: Path, tmp_path: Path) -> None:
    gone = "talker.model.layers.1.mlp.experts.3.up_proj.weight"
    broken = _copy_without(folder, tmp_path / "broken", {gone})
    with pytest.raises(ValueError, match=re.escape(gone)):
        build_submodule(broken, config_path="talker_config", prefix="talker.", stacked=HF_PER_EXPERT_MOE,
                        factory=q3.Qwen3OmniMoeTalkerForConditionalGeneration)


def test_many_missing_keys_are_counted_and_cut_short(folder: Path, reference: Omni) -> None:
    module = q3.Qwen3OmniMoeAudioEncoder(reference.config.thinker_config.audio_config)
    with pytest.raises(ValueError, match=r"45 weight\(s\) .* missing .*\.\.\. \(40 more\)"):
        load_state_dict(folder, "thinker.visual.", module)


def test_unexpected_keys_are_reported_or_refused(folder: Path, tmp_path: Path, reference: Omni) -> None:
    extra = "code2wav.not_a_weight"
    odd = _copy_without(folder, tmp_path / "odd", set(), add={extra: torch.zeros(2)})
    module = q3.Qwen3OmniMoeCode2Wav(reference.config.code2wav_config)
    report = load_state_dict(odd, "code2wav.", module)
    assert report.unexpected == (extra,) and report.loaded == len(module.state_dict())
    with pytest.raises(ValueError, match="not used by Qwen3OmniMoeCode2Wav: " + extra):
        load_state_dict(odd, "code2wav.", module, strict_unexpected=True)


def test_shape_mismatch_raises(folder: Path) -> None:
    wrong = torch.nn.Linear(64, 100, bias=False)
    with pytest.raises(ValueError, match=r"shape mismatch.*thinker\.lm_head\.weight: checkpoint \(512, 64\)"):
        load_state_dict(folder, "thinker.lm_head.", wrong)


def test_bad_prefixes_raise(folder: Path) -> None:
    head = torch.nn.Linear(64, 512, bias=False)
    with pytest.raises(ValueError, match="must end with '.'"):
        load_state_dict(folder, "thinker.lm_head", head)
    with pytest.raises(ValueError, match=r"no checkpoint keys start with 'token2wav\.'.*'code2wav\.'"):
        load_state_dict(folder, "token2wav.", head)
    with pytest.raises(ValueError, match="neither model.safetensors nor"):
        load_state_dict(folder.parent, "thinker.", head)


def test_meta_module_gets_tensors_assigned(folder: Path, reference: Omni) -> None:
    with torch.device("meta"):
        head = torch.nn.Linear(64, 512, bias=False)
    load_state_dict(folder, "thinker.lm_head.", head)
    assert not head.weight.is_meta
    assert torch.equal(head.weight, reference.thinker.lm_head.weight)


@pytest.fixture(scope="module")
def sharded(folder: Path, reference: Omni, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny folder with its weights in 1 MB shards and an index, as a real checkpoint's are."""
    out = tmp_path_factory.mktemp("sharded") / "model"
    shutil.copytree(folder, out, ignore=shutil.ignore_patterns("model.safetensors"))
    reference.save_pretrained(out, max_shard_size="1MB")
    assert len(list(out.glob("model-*.safetensors"))) > 2 and (out / "model.safetensors.index.json").is_file()
    return out


def test_sharded_folder_reads_only_the_shards_it_needs(
    sharded: Path, reference: Omni, monkeypatch: pytest.MonkeyPatch
) -> None:
    shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))

    opened: list[str] = []
    real_open = loader_mod.safe_open

    def spy(path: str, framework: str) -> Any:
        opened.append(Path(path).name)
        return real_open(path, framework=framework)

    monkeypatch.setattr(loader_mod, "safe_open", spy)
    module = build_submodule(sharded, config_path="code2wav_config", factory=q3.Qwen3OmniMoeCode2Wav,
                             prefix="code2wav.")
    assert set(opened) < set(shards)  # the index says where code2wav lives; other shards stay closed
    want = reference.code2wav.state_dict()
    assert all(torch.equal(module.state_dict()[k], want[k]) for k in want)


def test_a_long_read_says_how_far_it_is(sharded: Path, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """A read that takes PROGRESS_EVERY_S logs its bytes and files as it goes (here every tensor: the interval
    is 0) and a last line with the rate; the bytes are those of the tensors read; a quick read logs nothing."""
    caplog.set_level(logging.INFO, logger="omnimesh.models.loader")
    files = loader_mod.checkpoint_files(sharded)
    n = len(set(files.values()))
    dict(loader_mod.iter_tensors(files, files, "the whole model"))
    assert not caplog.records  # the default interval: ~0.1 s of reading says nothing
    monkeypatch.setattr(loader_mod, "PROGRESS_EVERY_S", 0.0)
    got = dict(loader_mod.iter_tensors(files, files, "the whole model"))
    total = fmt_bytes(sum(t.numel() * t.element_size() for t in got.values()))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == len(files) + 1, lines
    assert re.fullmatch(r"the whole model: read .* of .* \(\d+%\) from 1 of \d+ checkpoint file\(s\) in \d+ s", lines[0])
    assert re.fullmatch(rf"the whole model: read {re.escape(total)} of {re.escape(total)} \(100%\) from {n} of {n} "
                        r"checkpoint file\(s\) in \d+ s", lines[-2])
    assert re.fullmatch(rf"the whole model: read {re.escape(total)} from {n} checkpoint file\(s\) in \d+ s \(.*/s\)",
                        lines[-1])


def test_stacked_param_needs_an_expert_field() -> None:
    with pytest.raises(ValueError, match="needs an '\\{e\\}' field"):
        StackedParam("mlp.experts.down_proj", ("mlp.experts.down_proj.weight",))
