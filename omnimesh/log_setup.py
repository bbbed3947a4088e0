"""Logging set-up shared by every omnimesh process (CLI commands and spawned rank processes)."""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _KnownConfigNoise(logging.Filter):
    """transformers 5.23 warns that Qwen3-Omni's own M-RoPE keys are unrecognised on every config load
    (the real checkpoints carry them too, and the model reads them); keep the log for real problems."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not ("Unrecognized keys in `rope_parameters`" in msg and "mrope_section" in msg)


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level.upper(), format=FORMAT)
    logging.getLogger("transformers.modeling_rope_utils").addFilter(_KnownConfigNoise())
