"""Where `omnimesh serve` (with no MODEL) keeps the built-in tiny model, built once per version (Qwen3-Omni; the
tiny Qwen2.5-Omni too, for the benchmarks that measure its family).

The folder is built into a temporary sibling and renamed into place, so a crash mid-build never leaves
a half-written model that a later start would trust.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

TINY_VERSION = "v4"  # v2: video_preprocessor_config.json; v3: the chat template renders tools; v4: <tool_call> tokens


def cache_root() -> Path:
    return Path(os.environ.get("OMNIMESH_CACHE", Path.home() / ".cache" / "omnimesh"))


def _builder(family: str) -> Callable[[Path], Path]:
    if family == "qwen3-omni":
        from omnimesh.models.qwen3_omni.tiny import build_tiny_qwen3_omni

        return build_tiny_qwen3_omni
    if family == "qwen2.5-omni":
        from omnimesh.models.qwen2_5_omni.tiny import build_tiny_qwen2_5_omni

        return build_tiny_qwen2_5_omni
    raise ValueError(f"no built-in tiny model for family {family!r}; known: qwen3-omni, qwen2.5-omni")


def tiny_model_dir(family: str = "qwen3-omni") -> Path:
    """Return the cached tiny model folder of `family`, building it first if needed."""
    build = _builder(family)
    target = cache_root() / f"tiny-{family}-{TINY_VERSION}"
    if (target / "config.json").exists():
        return target

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; use its folder
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
