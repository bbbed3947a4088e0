"""`--config FILE` (omnimesh/config/config_file.py), vLLM's YAML of flags: each key reaches the flag it names
(dashes or underscores, switches on and off, lists, mappings as JSON text, the model), a flag on the command
line wins over the file, a flag the file gives counts as given (the gateway's required --stages), and every
mistake exits 2 naming the file and the key; through the real CLI, `omnimesh plan` plans what the file says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from omnimesh.cli import build_parser
from omnimesh.config.config_file import apply_config
from omnimesh.config.serve_args import from_namespace


def _parse(*argv: str):
    parser = build_parser()
    apply_config(parser, list(argv))
    return parser.parse_args(list(argv))


def _file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "omnimesh.yaml"
    path.write_text(text)
    return str(path)


def test_every_kind_of_flag_from_the_file_and_the_command_line_wins(tmp_path: Path) -> None:
    cfg = _file(tmp_path, """
model: /models/qwen3-omni
max-model-len: 2048
max_num_seqs: 4                  # underscores as the ServeArgs field names
enable-prefix-caching: true      # a switch, on
enable-chunked-prefill: false    # an on-by-default switch, off (--no-enable-chunked-prefill)
enable-log-requests: false       # a switch left off
served-model-name: [omni, omni-2]
stage-overrides: {thinker: {tp: 2}, vocoder: {num_replicas: 2}}
kv-cache-memory: 64MiB
max-num-batched-tokens: 8k
port: 9000
grpc-port: null                  # null: the flag's own default
""")
    ns = _parse("serve", "--config", cfg, "--port", "9100")
    args = from_namespace(ns)
    assert (args.model, args.max_model_len, args.max_num_seqs) == ("/models/qwen3-omni", 2048, 4)
    assert args.enable_prefix_caching is True and args.enable_chunked_prefill is False
    assert args.enable_log_requests is False and list(args.served_model_name) == ["omni", "omni-2"]
    assert json.loads(args.stage_overrides) == {"thinker": {"tp": 2}, "vocoder": {"num_replicas": 2}}
    assert args.stage_configs()["thinker"].tp == 2 and args.stage_configs()["vocoder"].num_replicas == 2
    assert args.kv_cache_memory == "64MiB" and args.max_num_batched_tokens == 8000  # typed as on the command line
    assert args.port == 9100 and args.grpc_port == 8001  # the command line wins; null keeps the default
    ns = _parse("serve", "/other/model", f"--config={cfg}", "--enable-chunked-prefill", "--max-model-len", "512")
    assert (ns.model, ns.enable_chunked_prefill, ns.max_model_len, ns.port) == ("/other/model", True, 512, 9000)


def test_a_required_flag_from_the_file_and_an_empty_file(tmp_path: Path) -> None:
    cfg = _file(tmp_path, "stages: thinker=127.0.0.1:50052,encoder=127.0.0.1:50051\nmodel: /m\nport: 8100\n")
    ns = _parse("gateway", "--config", cfg)
    assert (ns.stages, ns.model, ns.port) == ("thinker=127.0.0.1:50052,encoder=127.0.0.1:50051", "/m", 8100)
    ns = _parse("stage", "thinker", "--config", _file(tmp_path, "host: 0.0.0.0\nport: 0\ntensor-parallel-size: 2\n"))
    assert (ns.stage_name, ns.stage_host, ns.stage_port, ns.tensor_parallel_size) == ("thinker", "0.0.0.0", 0, 2)
    assert _parse("serve", "--config", _file(tmp_path, "# nothing set yet\n")).port == 8000


def test_the_global_log_level_from_the_file(tmp_path: Path) -> None:
    """`log-level` is omnimesh's own flag (before the command), and a file may set it too; typed, it wins."""
    cfg = _file(tmp_path, "log-level: DEBUG\nport: 8100\n")
    assert (_parse("serve", "--config", cfg).log_level, _parse("serve", "--config", cfg).port) == ("DEBUG", 8100)
    assert _parse("--log-level", "WARNING", "serve", "--config", cfg).log_level == "WARNING"


@pytest.mark.parametrize(("command", "text", "message"), [
    ("serve", "max-model-lenght: 10\n", "'max-model-lenght' is not a flag of `omnimesh serve`"),
    ("serve", "stages: thinker=h:1\n", "'stages' is not a flag of `omnimesh serve`"),
    ("serve", "config: other.yaml\n", "'config' is not a flag"),
    ("serve", "version: true\n", "'version' is not a flag"),
    ("serve", "enable-prefix-caching: 'yes'\n", "enable-prefix-caching: a switch: give true or false, got 'yes'"),
    ("serve", "port: true\n", "port: takes a value"),
    ("serve", "max-model-len: [1, 2]\n", "max-model-len: takes one value, got a list"),
    ("serve", "chat-template-content-format: xml\n", "chat-template-content-format: 'xml' is not one of"),
    ("serve", "port: eighty\n", "argument --port: invalid int value: 'eighty'"),
    ("serve", "- port\n- 80\n", "must be a mapping of flag names to values, got list"),
    ("serve", "port: [80\n", "not YAML"),
    ("stage", "stage_name: talker\n", "'stage_name' goes on the command line"),
])
def test_mistakes_exit_2_naming_the_file_and_the_key(tmp_path: Path, capsys, command: str, text: str,
                                                     message: str) -> None:
    cfg = _file(tmp_path, text)
    argv = [command, "thinker"] if command == "stage" else [command]
    with pytest.raises(SystemExit) as exc:
        _parse(*argv, "--config", cfg)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err, err
    if "argument --port" not in message:
        assert f"--config {cfg}" in err


def test_a_missing_file_and_a_missing_name(tmp_path: Path, capsys) -> None:
    for argv, message in ((["serve", "--config", str(tmp_path / "none.yaml")], "cannot read it"),
                          (["serve", "--config"], "--config needs a file")):
        with pytest.raises(SystemExit) as exc:
            _parse(*argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err


def test_the_cli_plans_what_the_file_says(tmp_path: Path) -> None:
    from omnimesh.models.qwen3_omni.tiny import build_tiny_qwen3_omni

    model = build_tiny_qwen3_omni(tmp_path / "tiny")
    cfg = _file(tmp_path, f"model: {model}\ndevice: cpu\nstage-overrides:\n  thinker: {{pp: 2}}\n  talker:\n    tp: 2\n")
    done = subprocess.run([sys.executable, "-m", "omnimesh.cli", "plan", "--config", cfg], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line.split()[1:4] for line in done.stdout.splitlines() if line.split()[:1] in
            (["thinker"], ["talker"], ["encoder"])}
    assert rows["thinker"][:3] == ["2", "x", "1"] and rows["talker"][:3] == ["1", "x", "2"], done.stdout
