"""--load-format dummy (vLLM's flag): every stage of both families builds from a folder that holds no weight file,
each parameter drawn from a generator seeded by its checkpoint key; `omnimesh plan` counts the tensors the config
implies; a folder without weights is refused before anything starts unless dummy; vLLM's other formats are
refused with the fix. The served mesh on such a folder: tests/e2e/test_load_format_e2e.py."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from omnimesh.cli import main
from omnimesh.config.serve_args import ServeArgs
from omnimesh.memory_plan import read_checkpoint, shape_checkpoint
from omnimesh.models.loader import DUMMY_RANGE, fill_dummy, load_state_dict, set_load_format
from omnimesh.models.qwen2_5_omni.tiny import build_tiny_qwen2_5_omni
from omnimesh.models.qwen3_omni.stage_loading import load_code2wav, load_talker, load_thinker, rank_factory
from omnimesh.models.qwen3_omni.tiny import build_tiny_qwen3_omni
from omnimesh.parallel.parallel_state import ParallelState


def _without_weights(folder: Path, dest: Path) -> Path:
    return Path(shutil.copytree(folder, dest, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json")))


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Per family: (the tiny folder with its weights, a copy with every file but the weights)."""
    root = tmp_path_factory.mktemp("load-format")
    out = {}
    for family, build in (("qwen3-omni", build_tiny_qwen3_omni), ("qwen2.5-omni", build_tiny_qwen2_5_omni),
                          ("qwen3-omni-thinking", lambda d: build_tiny_qwen3_omni(d, audio_output=False))):
        full = build(root / family)
        out[family] = (full, _without_weights(full, root / f"{family}-bare"))
    return out


@pytest.fixture
def dummy() -> Iterator[None]:
    set_load_format("dummy")
    try:
        yield
    finally:
        set_load_format("auto")


def _check_dummy(module: nn.Module, what: str) -> int:
    """Every floating parameter of `module` lies in the dummy range and is not constant (so it was filled, not
    left as torch.empty's memory or an initialiser's ones/zeros); the count checked."""
    n = 0
    for name, p in module.named_parameters():
        if p.is_floating_point() and p.numel() > 1:
            assert p.abs().max() <= DUMMY_RANGE and p.float().std() > DUMMY_RANGE / 10, (what, name)
            n += 1
    return n


def test_values_depend_on_the_checkpoint_key_only() -> None:
    """Same key, same values (a tensor every tp rank keeps whole is equal on each); another key, other values;
    bfloat16 too; integer tensors are left alone."""
    a, b, c = torch.empty(4, 8), torch.empty(4, 8), torch.empty(4, 8)
    fill_dummy(a, "thinker.model.norm.weight")
    fill_dummy(b, "thinker.model.norm.weight")
    fill_dummy(c, "talker.model.norm.weight")
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.abs().max() <= DUMMY_RANGE and a.std() > DUMMY_RANGE / 10
    half = torch.empty(4, 8, dtype=torch.bfloat16)
    fill_dummy(half, "thinker.model.norm.weight")
    assert half.abs().max() <= DUMMY_RANGE and half.float().std() > 0
    ids = torch.zeros(5, dtype=torch.long)
    fill_dummy(ids, "codes")
    assert ids.eq(0).all()


def test_a_module_on_meta_is_refused_not_left_without_storage(dummy) -> None:
    """A real load assigns tensors to a `meta` module; a dummy one fills in place, so it names the device instead
    of handing back a module with no storage; a module with storage is filled, tied weights once."""
    with torch.device("meta"):
        on_meta = nn.Linear(4, 4)
    with pytest.raises(RuntimeError, match="meta device"):
        load_state_dict(Path("/nonexistent"), "proj.", on_meta)
    real = nn.Linear(4, 4)
    report = load_state_dict(Path("/nonexistent"), "proj.", real)  # no file is opened
    assert report.loaded == 2 and _check_dummy(real, "proj") == 2  # nn.Linear's own init is far outside the range


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                     reason="needs a CUDA device")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("family", ["qwen3-omni", "qwen2.5-omni"])
def test_every_stage_builds_from_a_folder_without_weights(folders, family: str, device: str, dummy) -> None:
    """Each stage's rank program (what its ranks run, in-process here; on CUDA the values are drawn there) and the
    parts its own process keeps."""
    _, bare = folders[family]
    for stage in ("encoder", "thinker", "talker", "vocoder"):
        program = rank_factory(stage, bare)(ParallelState.single(device))
        modules = [m for m in vars(program).values() if isinstance(m, nn.Module)]
        assert modules and sum(_check_dummy(m, f"{family} {stage} rank") for m in modules) > 0, stage
        assert {p.device.type for m in modules for p in m.parameters()} == {device}, stage
    if device != "cpu":
        return
    assert _check_dummy(load_thinker(bare).embed_tokens, "thinker embedding") == 1
    talker = load_talker(bare)
    if family == "qwen3-omni":
        assert _check_dummy(talker.talker, "talker projections") > 0
        c2w, _ = load_code2wav(bare)
        assert _check_dummy(c2w, "code2wav convs") > 0
    else:  # the projection, the codec table and the speakers' thinker rows
        assert _check_dummy(talker.proj, "talker projection") == 2 and _check_dummy(talker.codec_embed, "codec") == 1
        rows = [talker.text_rows.text_end, talker.text_rows.text_pad, *(r for _, r in talker.text_rows.speakers.values())]
        assert all(r.abs().max() <= DUMMY_RANGE and r.std() > 0 for r in rows)


def test_without_dummy_the_folder_must_hold_weights(folders, capsys) -> None:
    _, bare = folders["qwen3-omni"]
    for command in (["serve", str(bare)], ["stage", "thinker", "--model", str(bare)], ["plan", str(bare)]):
        assert main(command) == 2, command
        err = capsys.readouterr().err
        assert "holds no weights (neither model.safetensors nor model.safetensors.index.json)" in err, command
        assert "give --load-format dummy" in err
    with pytest.raises(ValueError, match="holds neither model.safetensors"):  # the load itself, had it started
        load_thinker(bare)


def test_a_truncated_config_or_checkpoint_is_refused_before_anything_loads(folders, tmp_path, capsys) -> None:
    """A config.json or model.safetensors cut short (a copy interrupted): exit 2 with the file named, from every
    command, not a JSONDecodeError traceback or a SafetensorError in each stage after seconds of loading."""
    import shutil

    full, _ = folders["qwen3-omni"]
    cut_config, cut_weights, listed = (shutil.copytree(full, tmp_path / name) for name in ("c", "w", "l"))
    (cut_config / "config.json").write_text((full / "config.json").read_text()[:3000])
    (cut_weights / "model.safetensors").write_bytes((full / "model.safetensors").read_bytes()[:1000])
    (listed / "config.json").write_text("[1]")
    for folder, said in ((cut_config, "its config.json cannot be read (Expecting"),
                         (cut_weights, "its model.safetensors cannot be read (SafetensorError"),
                         (listed, "its config.json holds a JSON list, not the object")):
        for command in (["serve", str(folder)], ["stage", "thinker", "--model", str(folder)], ["plan", str(folder)],
                        ["gateway", "--model", str(folder), "--stages", "thinker=127.0.0.1:1"]):
            if folder is cut_weights and command[0] == "gateway":
                continue  # the gateway reads no weights
            assert main(command) == 2, command
            err = capsys.readouterr().err
            assert said in err and "Traceback" not in err, (command, err)


@pytest.mark.parametrize("family", ["qwen3-omni", "qwen2.5-omni", "qwen3-omni-thinking"])
def test_the_plan_counts_the_tensors_the_config_implies(folders, family: str, capsys) -> None:
    """The meta-device model's state dict under the checkpoint's key names equals the saved checkpoint's tensors
    (names, element counts, integer dtypes), so `omnimesh plan --load-format dummy` on the bare folder prints the
    same table as the real checkpoint's."""
    full, bare = folders[family]
    assert shape_checkpoint(bare) == read_checkpoint(full)
    assert main(["plan", str(full), "--device", "cpu"]) == 0
    real = capsys.readouterr().out
    assert main(["plan", str(bare), "--device", "cpu", "--load-format", "dummy"]) == 0
    assert capsys.readouterr().out == real.replace(str(full), str(bare))


def test_other_formats_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="--load-format gguf is not supported: omnimesh reads safetensors "
                                         r"checkpoints \(--load-format auto or safetensors\) or none \(dummy\)"):
        ServeArgs(load_format="gguf")
    with pytest.raises(ValueError, match="--load-format must be one of auto, safetensors, dummy, got 'random'"):
        ServeArgs(load_format="random")
    with pytest.raises(ValueError, match="load format must be one of auto, safetensors, dummy"):
        set_load_format("pt")
