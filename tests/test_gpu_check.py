"""The prepared GPU run (`scripts/gpu_check.sh`) runs every gpu-marked test: its list of test files is exactly the
files that hold one (it names them instead of collecting all of tests/, whose other modules import packages the
GPU machine lacks), each of them exists, and the wheels it installs are pinned."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GPU_MARK = re.compile(r"pytest\.mark\.gpu\b")


def test_the_gpu_run_names_every_file_with_gpu_tests() -> None:
    script = (REPO / "scripts" / "gpu_check.sh").read_text()
    listed = re.search(r"GPU_TESTS=\((.*?)\)", script, re.S)
    assert listed, "scripts/gpu_check.sh has no GPU_TESTS=( ... ) list"
    named = set(listed.group(1).split())
    marked = {str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py") if GPU_MARK.search(p.read_text())}
    assert marked, "no gpu-marked test found: the pattern no longer matches how the tests mark them"
    assert named == marked, (f"missing from the list: {sorted(marked - named)}; "
                             f"listed without gpu tests: {sorted(named - marked)}")


def test_the_gpu_wheels_are_pinned() -> None:
    lines = [ln.strip() for ln in (REPO / "scripts" / "gpu_wheels.txt").read_text().splitlines()]
    wheels = [ln for ln in lines if ln and not ln.startswith("#")]
    assert wheels and all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[0-9][A-Za-z0-9.]*", w) for w in wheels), wheels
