"""Thinker tokens/s for pp=1 vs pp=2 (and tp=2), at concurrency 1 and 8, through a whole mesh, same run.

    python bench/parallel_layouts.py [--model DIR] [--max-tokens 64]

Each layout gets its own mesh (`omnimesh serve --stage-overrides ...`) on the same model; requests are
text-only (they stop at the thinker), greedy, `--max-tokens` each. Prints generated tokens per second
and the ratio to pp=1 tp=1. Not part of the test suite. On a CPU host the ranks share its cores, so this
measures the overhead of the split, not a speed-up; pipelining several requests at once is future work.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.mesh_process import MeshProcess  # noqa: E402

LAYOUTS = {
    "pp=1 tp=1": '{"thinker": {"pp": 1, "tp": 1}}',
    "pp=2 tp=1": '{"thinker": {"pp": 2, "tp": 1}}',
    "pp=1 tp=2": '{"thinker": {"pp": 1, "tp": 2}}',
}


def one(url: str, i: int, max_tokens: int) -> int:
    body = {"messages": [{"role": "user", "content": f"Story number {i}, please."}], "max_tokens": max_tokens,
            "temperature": 0, "modalities": ["text"]}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    return int(r.json()["usage"]["completion_tokens"])


def tokens_per_s(url: str, concurrency: int, max_tokens: int) -> float:
    one(url, 999, 4)  # warm-up
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(lambda i: one(url, i, max_tokens), range(concurrency)))
    return tokens / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory()
    model = args.model
    if model is None:
        from omnimesh.models.qwen3_omni.tiny import build_tiny_qwen3_omni

        model = build_tiny_qwen3_omni(Path(tmp.name) / "tiny-qwen3-omni")
    results: dict[str, dict[int, float]] = {}
    for name, layout in LAYOUTS.items():
        with MeshProcess(model, "--stage-overrides", layout) as mesh:
            results[name] = {c: tokens_per_s(mesh.url, c, args.max_tokens) for c in (1, 8)}
    base = results["pp=1 tp=1"]
    print(f"thinker tokens/s, {args.max_tokens} tokens per request, model {model.name}")
    print(f"{'layout':12}{'conc 1':>10}{'ratio':>8}{'conc 8':>10}{'ratio':>8}")
    for name, r in results.items():
        print(f"{name:12}{r[1]:10.1f}{r[1] / base[1]:7.2f}x{r[8]:10.1f}{r[8] / base[8]:7.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
