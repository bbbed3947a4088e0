"""What tracing costs: the same mesh with and without `--otlp-traces-endpoint`, same tiny model, same run.

    python bench/tracing_overhead.py [--model DIR] [--requests 32] [--concurrency 1,8] [--max-tokens 16]
        [--talker-max-tokens 48] [--rounds 2]

Workload: streamed chats, greedy, text + speech out (every stage writes a span). Both meshes run side by side;
the traced one exports to an OTLP/gRPC receiver in this process (`bench/otlp_receiver.py`, as a collector on
the same host would receive them). In each round and at each concurrency the same requests go to the mesh
without tracing (the baseline), then to the traced one, so drift of the host's speed hits both alike. Prints,
per concurrency: TTFT and TTFP p50, end-to-end p50 and requests/s, each with the ratio traced / plain, and the
spans the receiver got per traced request (4 here: the gateway's, the thinker's, the talker's and the
vocoder's; a request with audio or images in also has the encoder's). Not part of the
test suite; needs the `otel` extra.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import SideBySide, headline, measure_streams, model_folder  # noqa: E402
from bench.mesh_process import MeshProcess  # noqa: E402
from bench.otlp_receiver import TraceCollector  # noqa: E402

QUESTIONS = ("Tell me about the sea.", "What is rain?", "Describe a forest.", "Why is the sky blue?")


def body(i: int, max_tokens: int, talker_max: int) -> dict:
    return {"messages": [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} ({i})"}],
            "modalities": ["text", "audio"], "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stage_params": {"talker": {"max_tokens": talker_max, "temperature": 0}}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: the built-in tiny model)")
    ap.add_argument("--requests", type=int, default=32, help="requests per concurrency and round, per mesh")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--talker-max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    model_dir = model_folder(args.model)
    levels = [int(c) for c in args.concurrency.split(",")]
    receiver = TraceCollector()
    try:
        with MeshProcess(model_dir) as plain, \
                MeshProcess(model_dir, "--otlp-traces-endpoint", receiver.endpoint) as traced:
            for mesh in (plain, traced):  # warm-up
                measure_streams(mesh.url, [body(10_000, args.max_tokens, args.talker_max_tokens)], 1)
            table = SideBySide([("plain", plain.url), ("traced", traced.url)], levels)
            table.run(args.rounds, args.requests,
                      lambda first, n: [body(first + i, args.max_tokens, args.talker_max_tokens) for i in range(n)],
                      measure_streams)
            time.sleep(6)  # the batch exporters' last flush (every 5 s by default)
    finally:
        receiver.stop()
    traced_requests = args.rounds * len(levels) * args.requests
    print(headline(model_dir, f"{args.max_tokens} text tokens, talker up to {args.talker_max_tokens} code groups, "
                              f"greedy, text+audio, streamed; {args.requests} requests x {args.rounds} rounds per "
                              "concurrency and mesh"))
    table.print([("TTFT p50 (s)", "ttft", 0.5), ("TTFP p50 (s)", "ttfp", 0.5), ("latency p50 (s)", "latency", 0.5),
                 ("requests/s", "rps", None)])
    names: dict[str, int] = {}
    for span in receiver.spans:
        names[span.name] = names.get(span.name, 0) + 1
    per = len(receiver.spans) / max(1, traced_requests + 1)  # + the warm-up
    print(f"spans received: {len(receiver.spans)} for {traced_requests + 1} traced requests ({per:.2f} each): "
          + ", ".join(f"{k} {v}" for k, v in sorted(names.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
