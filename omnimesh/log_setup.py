"""Logging set-up shared by every omnimesh process (CLI commands, stage and gateway processes, rank processes).

`omnimesh --log-level LEVEL ...` and `--log-config-file FILE` (vLLM's: a `logging.config.dictConfig` JSON, for
omnimesh's and uvicorn's records alike) reach the processes a command starts through the environment
(`LEVEL_ENV`, `CONFIG_ENV`), so every stage, rank and the gateway log the same way.
"""

from __future__ import annotations

import json
import logging
import logging.config
import os
from pathlib import Path
from typing import Any

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LEVEL_ENV = "OMNIMESH_LOG_LEVEL"
CONFIG_ENV = "OMNIMESH_LOGGING_CONFIG_PATH"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


# Qwen2.5-Omni's talker config carries the thinker's ids of these tokens (its talker reads the thinker's rows),
# which transformers 5.23 checks against the talker's codec vocabulary on every config load
THINKER_IDS_IN_TALKER = ("tts_text_start_token_id", "tts_text_end_token_id", "tts_text_pad_token_id",
                         "vision_start_token_id", "vision_end_token_id", "audio_start_token_id", "audio_end_token_id")


class _KnownConfigNoise(logging.Filter):
    """transformers 5.23 warns on every config load that Qwen3-Omni's own M-RoPE keys are unrecognised, and that
    Qwen2.5-Omni's talker config holds token ids outside its codec vocabulary (the real checkpoints carry both,
    and the models read them as meant); keep the log for real problems."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if "Unrecognized keys in `rope_parameters`" in msg and "mrope_section" in msg:
            return False
        return not (msg.startswith("Model config: ") and "must be `None` or an integer within the vocabulary" in msg
                    and msg.split()[2] in THINKER_IDS_IN_TALKER)


def check_level(level: str) -> str:
    """The level's name in capitals; ValueError naming the choices."""
    if level.upper() not in LEVELS:
        raise ValueError(f"--log-level must be one of {', '.join(LEVELS)}, got {level!r}")
    return level.upper()


def read_log_config(path: str | Path) -> dict[str, Any]:
    """The dictConfig a --log-config-file holds; ValueError saying what is wrong with it."""
    try:
        config = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"--log-config-file {path}: cannot read it ({exc.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"--log-config-file {path}: not JSON ({exc})") from None
    if not isinstance(config, dict) or config.get("version") != 1:
        raise ValueError(f"--log-config-file {path}: must be a JSON object for logging.config.dictConfig, with "
                         f"\"version\": 1")
    return config


def log_config_from_env() -> dict[str, Any] | None:
    """The dictConfig $OMNIMESH_LOGGING_CONFIG_PATH names, for a process on another host (a Ray actor)."""
    path = os.environ.get(CONFIG_ENV)
    return read_log_config(path) if path else None


def setup_logging(level: str = "INFO", config_path: str | None = None, config: dict[str, Any] | None = None) -> None:
    """The format and `level`, or a dictConfig (`config`, else the file at `config_path`, default
    $OMNIMESH_LOGGING_CONFIG_PATH), which then decides levels and formats itself; ValueError for one dictConfig
    refuses."""
    config_path = config_path or os.environ.get(CONFIG_ENV) or None
    if config is not None or config_path:
        try:
            logging.config.dictConfig(config if config is not None else read_log_config(str(config_path)))
        except (ValueError, TypeError, AttributeError, ImportError) as exc:
            raise ValueError(f"--log-config-file {config_path}: logging.config.dictConfig refuses it ({exc})") from None
    else:
        logging.basicConfig(level=level.upper(), format=FORMAT)
    for name in ("transformers.modeling_rope_utils", "transformers.configuration_utils"):
        logging.getLogger(name).addFilter(_KnownConfigNoise())
