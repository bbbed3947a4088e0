"""Prefix caching: the same mesh with and without `--enable-prefix-caching`, same tiny model, same run.

    python bench/prefix_cache.py [--model DIR] [--system-tokens 1500] [--requests 24] [--concurrency 1,8]
        [--max-tokens 8] [--rounds 2] [--audio]

Workload: chats that share one long system prompt (a document the questions are about) and each ask their
own short question, greedy, text out (`--audio`: text + speech). Both meshes run side by side; in each round
and at each concurrency the same requests go to the mesh without the cache (the baseline), then to the one
with it, so drift of the host's speed hits both alike. Prints, per concurrency: TTFT p50 / p95 (streamed,
first text delta), end-to-end p50 and requests/s, each with the ratio cache / no cache, and the thinker's
prompt tokens computed vs served from the cache (its /metrics: prompt_tokens_total, prefix_cache_hits_total).
The cache's first request pays for the prefix like the baseline; every later one reuses it. Not part of the
test suite.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import SideBySide, headline, measure_streams, model_folder  # noqa: E402
from bench.mesh_process import MeshProcess  # noqa: E402

PARAGRAPH = ("The harbour office keeps the tide tables, the weather reports and the list of moorings. Boats "
             "longer than twelve metres berth on the outer pier; smaller ones use the inner basin. ")


def system_prompt(url: str, tokens: int) -> tuple[str, int]:
    """A system text of about `tokens` tokens (measured with the mesh's /tokenize) and its exact count."""
    def count(text: str) -> int:
        return len(httpx.post(f"{url}/tokenize", json={"prompt": text, "add_special_tokens": False},
                              timeout=60).json()["tokens"])

    text = PARAGRAPH * max(1, tokens // count(PARAGRAPH))
    while (n := count(text)) < tokens:
        text += PARAGRAPH
    return text, n


def body(system: str, i: int, max_tokens: int, audio: bool) -> dict:
    return {"messages": [{"role": "system", "content": system},
                         {"role": "user", "content": f"Question {i}: where does boat number {i} berth?"}],
            "modalities": ["text", "audio"] if audio else ["text"], "max_tokens": max_tokens, "temperature": 0,
            "stream": True}


def thinker_counter(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = re.search(rf'^{re.escape(name)}\{{[^}}]*stage="thinker"[^}}]*\}} ([\d.e+]+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: the built-in tiny model)")
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--requests", type=int, default=24, help="requests per concurrency and round, per mesh")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--audio", action="store_true", help="text + speech out (default: text)")
    args = ap.parse_args()
    model_dir = model_folder(args.model)
    levels = [int(c) for c in args.concurrency.split(",")]
    with MeshProcess(model_dir) as plain, MeshProcess(model_dir, "--enable-prefix-caching") as cached:
        system, n_system = system_prompt(plain.url, args.system_tokens)
        for mesh in (plain, cached):  # warm-up; the cache's first prefix is computed here, as a deployment's would be
            measure_streams(mesh.url, [body(system, 10_000, args.max_tokens, args.audio)], 1)
        tokens = {name: (thinker_counter(m.url, "omnimesh:prompt_tokens_total"),
                         thinker_counter(m.url, "omnimesh:prefix_cache_hits_total"))
                  for name, m in (("off", plain), ("on", cached))}
        table = SideBySide([("no cache", plain.url), ("cache", cached.url)], levels)
        table.run(args.rounds, args.requests,
                  lambda first, n: [body(system, first + i, args.max_tokens, args.audio) for i in range(n)], measure_streams)
        computed = {}
        for name, m in (("off", plain), ("on", cached)):
            prompt = thinker_counter(m.url, "omnimesh:prompt_tokens_total") - tokens[name][0]
            hits = thinker_counter(m.url, "omnimesh:prefix_cache_hits_total") - tokens[name][1]
            computed[name] = (prompt, hits)
    print(headline(model_dir, f"system prompt {n_system} tokens + a question each; {args.max_tokens} tokens out, "
                              f"greedy, {'text+audio' if args.audio else 'text'}; {args.requests} requests x "
                              f"{args.rounds} rounds per concurrency and mesh"))
    table.print([("TTFT p50 (s)", "ttft", 0.5), ("TTFT p95 (s)", "ttft", 0.95), ("latency p50 (s)", "latency", 0.5),
                 ("requests/s", "rps", None)])
    for name, (prompt, hits) in computed.items():
        print(f"thinker, cache {name}: {prompt:.0f} prompt tokens, {hits:.0f} from the cache, "
              f"{prompt - hits:.0f} computed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
