"""`/v1/audio/speech` in mp3 (OpenAI's default), streamed as it is encoded, against a file sent whole at the end
(the baseline: a wav of the same speech, which is how every compressed format went out before
gateway/audio_file_stream.py), side by side on one mesh in one run.

    python bench/speech_stream.py [--model DIR] [--requests 5] [--repeat 12] [--concurrency 1]

Workload: a sentence said `--repeat` times (the tiny model's random talker speaks until its own limit, so
the answer's length is whatever it says), greedy. Each round sends the same request in each format, the
baseline first, `--requests` rounds after one warm-up round. Prints per format the time to the first body
byte and to the whole body (p50 / p95), the audio seconds, and first byte mp3 / wav. Not part of the test
suite.
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import headline, model_folder, percentile  # noqa: E402
from bench.mesh_process import MeshProcess  # noqa: E402

SENTENCE = "Tides turn twice a day, slowly, then fast. "
FORMATS = ("wav", "mp3")  # the baseline first


def speak(url: str, text: str, fmt: str) -> tuple[float, float, bytes]:
    """One request -> (seconds to the first body byte, seconds to the whole body, the body)."""
    t0 = time.perf_counter()
    first, chunks = None, []
    with httpx.stream("POST", f"{url}/v1/audio/speech", timeout=600, json={
            "input": text, "voice": "ethan", "response_format": fmt}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{fmt}: HTTP {r.status_code}: {r.read()[:200]!r}")
        for chunk in r.iter_bytes():
            if first is None and chunk:
                first = time.perf_counter() - t0
            chunks.append(chunk)
    return first if first is not None else float("nan"), time.perf_counter() - t0, b"".join(chunks)


def audio_seconds(body: bytes) -> float:
    import av

    with av.open(io.BytesIO(body)) as container:
        frames = list(container.decode(audio=0))
    return sum(f.samples for f in frames) / frames[0].sample_rate if frames else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: the built-in tiny model)")
    ap.add_argument("--requests", type=int, default=5, help="measured rounds (one request per format each)")
    ap.add_argument("--repeat", type=int, default=12, help="times the sentence is said in one input")
    ap.add_argument("--concurrency", type=int, default=1, help="requests of one format in flight at once")
    args = ap.parse_args()
    model_dir = model_folder(args.model)
    text = SENTENCE * args.repeat
    print(headline(model_dir, f"speech of a {len(text)}-character input, {args.concurrency} in flight"))
    samples: dict[str, list[tuple[float, float, bytes]]] = {fmt: [] for fmt in FORMATS}
    with MeshProcess(model_dir) as mesh, ThreadPoolExecutor(args.concurrency) as pool:
        for fmt in FORMATS:  # warm-up
            speak(mesh.url, text, fmt)
        for _ in range(args.requests):
            for fmt in FORMATS:
                samples[fmt] += pool.map(lambda _: speak(mesh.url, text, fmt), range(args.concurrency))
    print(f"{'format':8}{'first byte p50':>16}{'p95':>8}{'whole p50':>12}{'p95':>8}{'audio s':>10}")
    first = {}
    for fmt, rows in samples.items():
        firsts, wholes = [r[0] for r in rows], [r[1] for r in rows]
        first[fmt] = percentile(firsts, 0.5)
        print(f"{fmt:8}{first[fmt]:16.3f}{percentile(firsts, 0.95):8.3f}{percentile(wholes, 0.5):12.3f}"
              f"{percentile(wholes, 0.95):8.3f}{audio_seconds(rows[0][2]):10.2f}")
    print(f"first byte, mp3 streamed / wav whole (the baseline): {first['mp3'] / first['wav']:.2f}x "
          f"({first['wav'] / first['mp3']:.1f}x sooner)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
