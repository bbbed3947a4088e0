"""`omnimesh serve` with no MODEL builds the tiny model once into the cache folder and reuses it."""

from pathlib import Path

import pytest

from omnimesh import tiny_cache


def test_tiny_model_is_built_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNIMESH_CACHE", str(tmp_path))
    first = tiny_cache.tiny_model_dir()
    assert first.parent == tmp_path and (first / "config.json").is_file() and (first / "model.safetensors").is_file()
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert tiny_cache.tiny_model_dir() == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp, "a cached model must not be rebuilt"
    assert [p.name for p in tmp_path.iterdir()] == [first.name], "no temporary build folder may be left behind"


def test_the_qwen2_5_family_has_its_own_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNIMESH_CACHE", str(tmp_path))
    folder = tiny_cache.tiny_model_dir("qwen2.5-omni")
    assert folder.name.startswith("tiny-qwen2.5-omni-") and (folder / "spk_dict.pt").is_file()


def test_unknown_family_is_refused() -> None:
    with pytest.raises(ValueError, match="no built-in tiny model for family 'llama'; known: qwen3-omni, qwen2.5-omni"):
        tiny_cache.tiny_model_dir("llama")


def test_make_tiny_into_a_place_it_cannot_write_is_an_error_not_a_traceback(tmp_path: Path, capsys) -> None:
    from omnimesh.cli import main

    a_file = tmp_path / "file"
    a_file.write_text("x")
    for out, said in ((a_file, "exists and is not a directory"), (a_file / "under", "Not a directory")):
        assert main(["make-tiny", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"omnimesh: error: --out {out}: cannot write the model there (" in err and said in err, err
