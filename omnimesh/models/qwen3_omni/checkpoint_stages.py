"""Which model family a checkpoint is, and which stages omnimesh runs for it: all four, or the encoder and thinker.

Role: Qwen3-Omni (`model_type` "qwen3_omni_moe") and Qwen2.5-Omni ("qwen2_5_omni") checkpoints run all four
stages. A thinker-only checkpoint (Qwen3-Omni-30B-A3B-Thinking and -Captioner: config.json
`enable_audio_output: false`, what `transformers` reads to build no talker; weights `thinker.*` only) is served
text out, by the encoder and thinker: `omnimesh serve` starts just those, `omnimesh stage talker|vocoder` refuses
it with this module's reason, and the gateway answers a request for speech with a 400 that names it.

Data flow: MODEL/config.json -> `model_type`, `enable_audio_output` (absent = true, `transformers`' default) ->
`model_family`, `model_stages` (the launcher, the stage command) and `text_only_reason` (the reason the
gateway's 400 for speech gives; None when the model speaks).
Reads the JSON only: the gateway imports this without the model code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omnimesh.config.stage_config import STAGES

TEXT_STAGES: tuple[str, ...] = ("encoder", "thinker")  # what a text-out deployment runs
FAMILIES: dict[str, str] = {"qwen3_omni_moe": "qwen3-omni", "qwen2_5_omni": "qwen2.5-omni"}  # model_type -> family


def _config(model_dir: Path) -> dict[str, Any]:
    return json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))


def model_family(model_dir: Path) -> str:
    """"qwen3-omni" or "qwen2.5-omni" (ValueError naming the supported model types for anything else)."""
    model_type = _config(model_dir).get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"{model_dir} holds a {model_type!r} model; omnimesh serves model_type "
                         f"{' or '.join(repr(t) for t in FAMILIES)} (Qwen3-Omni, Qwen2.5-Omni)")
    return FAMILIES[model_type]


def has_audio_output(model_dir: Path) -> bool:
    """False for a thinker-only checkpoint (config.json `enable_audio_output: false`)."""
    return bool(_config(model_dir).get("enable_audio_output", True))


def model_stages(model_dir: Path) -> tuple[str, ...]:
    """The stages omnimesh runs for the checkpoint, in pipeline order."""
    return STAGES if has_audio_output(model_dir) else TEXT_STAGES


def text_only_reason(model_dir: Path) -> str | None:
    """Why the model speaks no audio here (the start of every message that refuses speech for it); None if it does."""
    if has_audio_output(model_dir):
        return None
    name = Path(model_dir).name
    return (f"the model {name} has no audio output: its config.json sets enable_audio_output to false "
            f"(a thinker-only checkpoint such as Qwen3-Omni-30B-A3B-Thinking), so it has no talker or vocoder")
