"""Logging set-up shared by every omnimesh process (CLI commands and spawned rank processes)."""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


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


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level.upper(), format=FORMAT)
    for name in ("transformers.modeling_rope_utils", "transformers.configuration_utils"):
        logging.getLogger(name).addFilter(_KnownConfigNoise())
