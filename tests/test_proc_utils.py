"""proc_utils.tune_malloc: glibc keeps freed message buffers (mallopt succeeds), and an operator's own
GLIBC_TUNABLES wins (nothing is changed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

CODE = "from omnimesh.proc_utils import tune_malloc; print(tune_malloc())"


def _run(env_extra: dict[str, str]) -> str:
    import os

    env = {**os.environ, **env_extra}
    return subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=env, timeout=60).stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_tune_malloc_applies_and_yields_to_the_operator() -> None:
    assert _run({}) == "True"
    assert _run({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1048576"}) == "False"
