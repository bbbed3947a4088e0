"""Where `omnimesh serve` (with no MODEL) keeps the built-in tiny model, built once per version (Qwen3-Omni; the
tiny Qwen2.5-Omni too, for the benchmarks that measure its family).

The folder is built into a temporary sibling and renamed into place, so a crash mid-build never leaves
a half-written model that a later start would trust.
"""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

TINY_VERSION = "v4"  # v2: video_preprocessor_config.json; v3: the chat template renders tools; v4: <tool_call> tokens


def cache_root() -> Path:
    return Path(os.environ.get("OMNIMESH_CACHE", Path.home() / ".cache" / "omnimesh"))


# family -> (module, builder); the module is imported only to build, so a start that finds the folder cached
# never loads the modeling code (the checks before the stages start rely on that: tests/test_start_checks.py).
_BUILDERS = {
    "qwen3-omni": ("omnimesh.models.qwen3_omni.tiny", "build_tiny_qwen3_omni"),
    "qwen2.5-omni": ("omnimesh.models.qwen2_5_omni.tiny", "build_tiny_qwen2_5_omni"),
}


def _builder(family: str) -> Callable[[Path], Path]:
    module, name = _BUILDERS[family]
    build: Callable[[Path], Path] = getattr(importlib.import_module(module), name)
    return build


def tiny_model_dir(family: str = "qwen3-omni") -> Path:
    """Return the cached tiny model folder of `family`, building it first if needed."""
    if family not in _BUILDERS:
        raise ValueError(f"no built-in tiny model for family {family!r}; known: {', '.join(_BUILDERS)}")
    target = cache_root() / f"tiny-{family}-{TINY_VERSION}"
    if (target / "config.json").exists():
        return target
    build = _builder(family)

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
