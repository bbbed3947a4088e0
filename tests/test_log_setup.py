"""The log filter every omnimesh process installs (omnimesh/log_setup.py): transformers' warnings about what the
real Qwen3-Omni and Qwen2.5-Omni checkpoints carry by design are dropped, anything else about a config passes.
The CLI's --log-level and --log-config-file are checked (exit 2 with the reason) and reach the processes a command
starts through the environment; `omnimesh --version`."""

from __future__ import annotations

import logging

from omnimesh.log_setup import _KnownConfigNoise, setup_logging


def _record(msg: str) -> logging.LogRecord:
    return logging.LogRecord("transformers.configuration_utils", logging.WARNING, __file__, 1, msg, None, None)


def test_known_config_noise_is_dropped_and_the_rest_kept() -> None:
    keep = _KnownConfigNoise().filter
    noise = ("Model config: tts_text_start_token_id must be `None` or an integer within the vocabulary (between 0 "
             "and 8447), got 151860. This may result in unexpected behavior.")
    assert not keep(_record(noise))
    assert not keep(_record("Unrecognized keys in `rope_parameters` for 'rope_type'='default': {'mrope_section'}"))
    assert keep(_record(noise.replace("tts_text_start_token_id", "pad_token_id")))  # a real problem stays
    assert keep(_record("Unrecognized keys in `rope_parameters`: {'something_else'}"))
    setup_logging()
    assert any(isinstance(f, _KnownConfigNoise) for f in logging.getLogger("transformers.configuration_utils").filters)


def test_levels_and_log_config_files_are_checked(tmp_path) -> None:
    import json

    import pytest

    from omnimesh.log_setup import check_level, read_log_config

    assert check_level("debug") == "DEBUG"
    with pytest.raises(ValueError, match=r"--log-level must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL, got 'loud'"):
        check_level("loud")
    bad = tmp_path / "bad.json"
    for text, message in (("{nope", "not JSON"), ('{"handlers": {}}', 'with "version": 1'), ("[1]", "JSON object")):
        bad.write_text(text)
        with pytest.raises(ValueError, match=message):
            read_log_config(bad)
    with pytest.raises(ValueError, match="cannot read it"):
        read_log_config(tmp_path / "missing.json")
    good = {"version": 1, "root": {"level": "WARNING"}}
    bad.write_text(json.dumps(good))
    assert read_log_config(bad) == good


def test_the_cli_hands_its_level_and_log_config_to_what_it_starts(tmp_path) -> None:
    """In a process of its own (dictConfig changes the process's logging): a bad level or config is exit 2 with
    the reason; a good one is applied here and put in the environment the stages and gateway inherit."""
    import json
    import subprocess
    import sys

    def cli(*argv: str, probe: str = "") -> subprocess.CompletedProcess:
        code = ("import logging, os, sys; from omnimesh import cli; sys.argv = ['omnimesh', *sys.argv[1:]]; "
                "rc = cli.main(); " + probe + "sys.exit(rc)")
        return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)

    loud = cli("--log-level", "loud", "plan")
    assert loud.returncode == 2 and "--log-level must be one of DEBUG" in loud.stderr
    config = tmp_path / "logging.json"
    config.write_text("{}")
    refused = cli("plan", "--log-config-file", str(config))
    assert refused.returncode == 2 and 'with "version": 1' in refused.stderr
    config.write_text(json.dumps({"version": 1, "handlers": {"h": {"class": "no.such.Handler"}}}))
    refused = cli("plan", "--log-config-file", str(config))
    assert refused.returncode == 2 and "logging.config.dictConfig refuses it" in refused.stderr, refused.stderr
    config.write_text(json.dumps({"version": 1, "disable_existing_loggers": False,
                                  "formatters": {"f": {"format": "TAGGED %(name)s: %(message)s"}},
                                  "handlers": {"h": {"class": "logging.StreamHandler", "formatter": "f"}},
                                  "root": {"level": "DEBUG", "handlers": ["h"]}}))
    probe = ("logging.getLogger('omnimesh.x').debug('hello'); "
             "print(os.environ['OMNIMESH_LOG_LEVEL'], os.environ['OMNIMESH_LOGGING_CONFIG_PATH']); ")
    ok = cli("--log-level", "warning", "plan", "--device", "cpu", "--log-config-file", str(config), probe=probe)
    assert ok.returncode == 0, ok.stderr
    assert "TAGGED omnimesh.x: hello" in ok.stderr and "memory plan for" in ok.stdout
    assert ok.stdout.split()[-2:] == ["WARNING", str(config.resolve())]


def test_omnimesh_version() -> None:
    import importlib.metadata
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "omnimesh.cli", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"omnimesh {importlib.metadata.version('omnimesh')}"
