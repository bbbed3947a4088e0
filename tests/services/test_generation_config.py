"""vLLM's --generation-config for the thinker's default sampling (services/llm/thinker_handler.py): auto reads the
model folder's generation_config.json, vllm takes vLLM's neutral defaults (temperature 1, top_p 1, no top_k)
with the model's end-of-turn ids, a folder its own file; a folder without one (or with a broken one) stops start-up
naming the flag, before any stage starts;
`serve` hands the choice to the thinker stage (a folder as an absolute path)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoConfig, GenerationConfig

from omnimesh.config.serve_args import ServeArgs
from omnimesh.models.qwen3_omni.sampling import thinker_sampling_params
from services.llm.thinker_handler import build_handler, generation_config


def defaults(model_dir: Path, source: str):  # type: ignore[no-untyped-def]
    return thinker_sampling_params(AutoConfig.from_pretrained(model_dir), generation_config(model_dir, source))


def test_the_three_sources(model_dir: Path, tmp_path: Path) -> None:
    own = GenerationConfig.from_pretrained(model_dir)
    auto = defaults(model_dir, "auto")
    assert auto == thinker_sampling_params(AutoConfig.from_pretrained(model_dir), own)
    neutral = defaults(model_dir, "vllm")
    assert (neutral.temperature, neutral.top_p, neutral.top_k, neutral.repetition_penalty) == (1.0, 1.0, 0, 1.0)
    assert neutral.stop_token_ids == auto.stop_token_ids
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.3, "top_p": 0.5, "top_k": 7, "eos_token_id": own.eos_token_id}))
    folder = defaults(model_dir, str(tmp_path))
    assert (folder.temperature, folder.top_p, folder.top_k) == (0.3, 0.5, 7)
    handler = build_handler(model_dir, ServeArgs(max_model_len=64, kv_cache_memory="1MiB",
                                                 generation_config=str(tmp_path)))
    assert handler.defaults.temperature == 0.3  # the stage's defaults come from it


def test_a_folder_without_one_stops_start_up(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--generation-config .*not auto, vllm or a folder with a readable"):
        generation_config(model_dir, str(tmp_path / "nowhere"))


def test_a_bad_folder_stops_serve_before_any_stage_starts(tmp_path: Path) -> None:
    """Checked with the other flags (exit 2 from `omnimesh serve` / `stage`), not when the thinker has loaded."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "generation_config.json").write_text("{temperature: 1")
    (tmp_path / "list").mkdir()
    (tmp_path / "list" / "generation_config.json").write_text("[1]")
    for folder, why in [("nowhere", "no such folder"), ("empty", "the folder holds no generation_config.json"),
                        ("broken", "its generation_config.json is not readable JSON"),
                        ("list", "its generation_config.json is not a JSON object")]:
        with pytest.raises(ValueError, match=f"--generation-config '{tmp_path / folder}': {why}"):
            ServeArgs(generation_config=str(tmp_path / folder))
    (tmp_path / "list" / "generation_config.json").write_text('{"temperature": 0.3}')
    assert ServeArgs(generation_config=str(tmp_path / "list")).generation_config == str(tmp_path / "list")


def test_serve_hands_it_to_the_thinker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from omnimesh.launcher import MeshLauncher

    monkeypatch.chdir(tmp_path)
    (tmp_path / "gen").mkdir()
    (tmp_path / "gen" / "generation_config.json").write_text("{}")
    argv = MeshLauncher(ServeArgs(generation_config="gen"), tmp_path)._stage_argv("thinker", 1)
    assert argv[argv.index("--generation-config") + 1] == str(tmp_path / "gen")
    assert "--generation-config" not in MeshLauncher(ServeArgs(generation_config="gen"), tmp_path)._stage_argv(
        "talker", 1)
    assert "--generation-config" not in MeshLauncher(ServeArgs(), tmp_path)._stage_argv("thinker", 1)
