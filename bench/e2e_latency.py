"""End-to-end latency: omnimesh (whole mesh, REST) vs `transformers` generate, same tiny model, same run.

    python bench/e2e_latency.py [--model DIR] [--max-tokens 32] [--talker-max-tokens 100] [--concurrency 8]
        [--malloc auto|tcmalloc|system]

Both sides do the same work: greedy thinker (`--max-tokens`) and talker (`--talker-max-tokens`), speaker
Ethan, text + audio out. transformers runs one request at a time (its `generate` takes one conversation
with audio output); omnimesh gets 1 request, then `--concurrency` requests at once. Prints latencies,
time to first audio chunk (streamed) and the ratios. Both sides run on the same malloc (`--malloc`, as in
bench/throughput.py). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import HFGenerate, chat_body, model_folder, percentile, prompt, stream_chat  # noqa: E402
from bench.mesh_process import MeshProcess  # noqa: E402
from omnimesh.allocator import MALLOC_CHOICES, use_allocator  # noqa: E402


def transformers_latencies(model_dir: Path, n: int, max_tokens: int, talker_max: int) -> list[float]:
    hf = HFGenerate(model_dir, "cpu")
    out = []
    for i in range(n + 1):  # the first run warms up and is not counted
        inputs = hf.inputs(prompt(i), None, max_tokens=max_tokens, talker_max=talker_max)
        t0 = time.perf_counter()
        hf.generate([inputs], max_tokens=max_tokens, talker_max=talker_max)
        if i:
            out.append(time.perf_counter() - t0)
    return out


def mesh_request(url: str, i: int, max_tokens: int, talker_max: int) -> tuple[float, float]:
    """One streamed request; returns (end-to-end latency, time to first audio chunk)."""
    r = stream_chat(url, chat_body(prompt(i), max_tokens=max_tokens, talker_max=talker_max, stream=True))
    if r.error:
        raise RuntimeError(f"request {i} failed: {r.error}")
    return r.latency, r.ttfp


p = percentile


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: the built-in tiny model)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--talker-max-tokens", type=int, default=100)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--malloc", default="auto", choices=MALLOC_CHOICES,
                    help="allocator of the mesh and of this process, where transformers runs (default: %(default)s)")
    args = ap.parse_args()
    allocator = use_allocator(args.malloc, "cpu")  # may re-execute this process on it
    torch.set_num_threads(1)
    model_dir = model_folder(args.model)
    c = args.concurrency
    hf = transformers_latencies(model_dir, c, args.max_tokens, args.talker_max_tokens)
    with MeshProcess(model_dir, "--malloc", args.malloc) as mesh:
        mesh_request(mesh.url, 0, args.max_tokens, args.talker_max_tokens)  # warm-up
        one = [mesh_request(mesh.url, i, args.max_tokens, args.talker_max_tokens) for i in range(1, 4)]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(c) as pool:
            many = list(pool.map(lambda i: mesh_request(mesh.url, i, args.max_tokens, args.talker_max_tokens), range(c)))
        wall_many = time.perf_counter() - t0
    hf_one = statistics.median(hf)
    mesh_one = statistics.median(x[0] for x in one)
    lat_many = [x[0] for x in many]
    print(f"model: {model_dir.name}; thinker {args.max_tokens} tokens, talker {args.talker_max_tokens} tokens, greedy, "
          f"text+audio; malloc {allocator} (--malloc {args.malloc}, both sides)")
    print(f"{'':34}{'transformers':>14}{'omnimesh':>12}{'ratio':>9}")
    print(f"{'1 request, latency (s)':34}{hf_one:14.3f}{mesh_one:12.3f}{hf_one / mesh_one:8.2f}x")
    print(f"{'1 request, first audio (s)':34}{hf_one:14.3f}{statistics.median(x[1] for x in one):12.3f}"
          f"{hf_one / statistics.median(x[1] for x in one):8.2f}x")
    hf_wall = sum(hf[:c])
    # all c requests arrive at once; transformers answers them one after another: request i waits for i runs
    hf_queued = [sum(hf[: i + 1]) for i in range(c)]
    print(f"{f'{c} requests, wall (s)':34}{hf_wall:14.3f}{wall_many:12.3f}{hf_wall / wall_many:8.2f}x")
    for q in (0.5, 0.95):
        a, b = p(hf_queued, q), p(lat_many, q)
        print(f"{f'{c} requests, p{int(q * 100)} latency (s)':34}{a:14.3f}{b:12.3f}{a / b:8.2f}x")
    ttfa = [x[1] for x in many]
    a, b = p(hf_queued, 0.5), p(ttfa, 0.5)
    print(f"{f'{c} requests, p50 first audio (s)':34}{a:14.3f}{b:12.3f}{a / b:8.2f}x")
    print(f"{f'{c} requests, requests/s':34}{c / hf_wall:14.2f}{c / wall_many:12.2f}{hf_wall / wall_many:8.2f}x")
    print("(transformers serves one request at a time: N requests arriving together wait for each other, "
          "and its first audio arrives with the whole answer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
