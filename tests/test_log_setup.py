"""The log filter every omnimesh process installs (omnimesh/log_setup.py): transformers' warnings about what the
real Qwen3-Omni and Qwen2.5-Omni checkpoints carry by design are dropped, anything else about a config passes."""

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
