"""Which stages a Qwen3-Omni checkpoint has: all four, or only the encoder and thinker.

Role: Qwen3-Omni ships thinker-only checkpoints beside the Instruct model — Qwen3-Omni-30B-A3B-Thinking and
-Captioner: text (and media) in, text out. Their config.json sets `enable_audio_output: false` (what
`transformers` reads to build no talker) and their weights hold `thinker.*` only. `omnimesh serve` starts just
the encoder and thinker for them, `omnimesh stage talker|vocoder` refuses them with this module's reason, and
the gateway answers a request for speech with a 400 that names it.

Data flow: MODEL/config.json -> `enable_audio_output` (absent = true, `transformers`' default) ->
`model_stages` (the launcher, the stage command) and `thinker_only` (the reason the gateway's 400 for speech
gives).
Reads the JSON only: the gateway imports this without the model code.
"""

from __future__ import annotations

import json
from pathlib import Path

from omnimesh.config.stage_config import STAGES

TEXT_STAGES: tuple[str, ...] = ("encoder", "thinker")  # what a thinker-only checkpoint runs


def has_audio_output(model_dir: Path) -> bool:
    """False for a thinker-only checkpoint (config.json `enable_audio_output: false`)."""
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    return bool(config.get("enable_audio_output", True))


def model_stages(model_dir: Path) -> tuple[str, ...]:
    """The stages the checkpoint has, in pipeline order."""
    return STAGES if has_audio_output(model_dir) else TEXT_STAGES


def thinker_only(model_dir: Path) -> str:
    """Why a thinker-only checkpoint speaks no audio (the start of every message that refuses speech for it)."""
    return (f"the model {Path(model_dir).name} has no audio output: its config.json sets enable_audio_output to false "
            f"(a thinker-only checkpoint such as Qwen3-Omni-30B-A3B-Thinking), so it has no talker or vocoder")
