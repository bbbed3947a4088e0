"""`omnimesh serve`'s checks before any stage starts (layout, memory) read the config with `transformers`'
configuration classes only: importing the modeling code as well took ~1.5 s more of every start, spent
before the stage processes were even spawned. A fresh interpreter runs the checks and lists what they
imported."""

from __future__ import annotations

import json
import subprocess
import sys

from omnimesh.cli import _model_dir

CHECKS = """
import json, sys
from omnimesh.cli import _check_layout, _check_memory, _model_dir, resolve_device
from omnimesh.config.serve_args import ServeArgs
args = resolve_device(ServeArgs())
model_dir = _model_dir(None)
assert _check_layout(args, model_dir) is None and _check_memory(args, model_dir) is None
print(json.dumps(sorted(m for m in sys.modules if "modeling" in m or m.startswith("omnimesh."))))
"""


def test_the_checks_before_the_stages_start_import_no_modeling_code() -> None:
    _model_dir(None)  # the built-in tiny folder, built once here if this machine lacks it
    out = subprocess.run([sys.executable, "-c", CHECKS], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    imported = json.loads(out.stdout.strip().splitlines()[-1])
    assert "omnimesh.memory_plan" in imported and "omnimesh.models.model_config" in imported  # the checks ran
    heavy = [m for m in imported if m.startswith("transformers.models.qwen") and ".modeling_" in m]
    heavy += [m for m in imported if m in ("omnimesh.models.qwen3_omni.stage_loading", "omnimesh.stage_registry",
                                           "omnimesh.models.qwen3_omni.lm_engine")]
    assert not heavy, heavy
