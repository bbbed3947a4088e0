"""Throughput and streaming latency at several concurrencies: omnimesh (whole mesh, streaming REST) vs
`transformers` `generate` on the same model, side by side in one run.

    python bench/throughput.py [--model DIR] [--concurrency 1,4,8,16,32] [--requests N] [--max-tokens 32]
        [--talker-max-tokens 64] [--audio-every K] [--hf-requests N] [--no-hf-batched] [--hf-threads T]
        [--device auto|cpu|cuda] [--serve-args "--max-num-seqs 64 --kv-cache-memory 2GiB"] [--rounds N]
        [--malloc auto|tcmalloc|system] [--json out.json]

The workload is the same on both sides: requests with a fixed text prompt each (every K-th also carries a
1 s audio clip of its own, a tone at its own pitch, with --audio-every K), text + audio out, speaker Ethan, greedy thinker (`--max-tokens`)
and talker (`--talker-max-tokens` code groups); request i is the same request on both sides. Each
concurrency c runs requests 0..n-1, n = `--requests` (default max(16, 8c): the start, with all c arriving at
once, and the tail, with fewer than c left in flight, stay a small part of the run).

- omnimesh: one `omnimesh serve` on free ports (plus `--serve-args`), warmed up, then for each c the
  requests with c in flight (closed loop: a client sends its next request when its last one ends), each
  streamed (SSE): time to first text delta (TTFT), to first audio delta (TTFP), to the end; audio seconds
  are the streamed pcm16 samples at the rate the mesh serves (read from a WAV answer).
- transformers: (a) `generate` one request at a time (`--hf-requests` of them); (b) batched `generate`,
  c requests per call (left-padded), for each c > 1. `generate` does not stream, so its TTFT and TTFP are
  the whole call's latency. On CPU it runs with torch's default threads or 1, whichever a short probe
  finds faster (on a shared machine the default can be many times slower); `--hf-threads` fixes it.
- both sides run on the same malloc (`--malloc`, default auto: tcmalloc where installed, as `omnimesh serve`
  does on CPU): this process re-executes itself on it before `transformers` loads (omnimesh/allocator.py).

Prints both tables, the ratios to sequential (and batched) transformers, per concurrency the CPU each
mesh process spent per request and how long its threads waited for a core (`bench/process_cpu.py`), how each stage batched (engine steps per
request, requests per step, ms per step; and per request the steps that its first output waited for, with
their ms per step: `bench/stage_steps.py`, from /metrics), and the two targets: throughput
at c=16 >= 8x sequential transformers, TTFP p50 at c=8 <= 2x its value at c=1. With `--rounds N` it measures
both sides N times, alternating (a fresh mesh each round, `transformers` loaded once), prints each round,
then judges the targets on their medians (`bench/rounds.py`). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import process_cpu, stage_steps  # noqa: E402
from bench import rounds as rounds_summary  # noqa: E402
from bench.common import (  # noqa: E402
    HFGenerate,
    chat_body,
    machine_info,
    model_folder,
    percentile,
    playback_stall,
    prompt,
    resolve_device,
    served_sample_rate,
    sine_wav,
    stream_chat,
)
from bench.mesh_process import MeshProcess  # noqa: E402
from omnimesh.allocator import MALLOC_CHOICES, use_allocator  # noqa: E402


def default_requests(c: int) -> int:
    """8 requests per client: a closed loop starts all c at once and ends with a tail of fewer than c in
    flight, so a short run under-reports the sustained rate (3 per client measured ~8% under 8 per client
    at c=16 on the 2-core machine)."""
    return max(16, 8 * c)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def stats(values: list[float]) -> dict[str, float]:
    return {"p50": percentile(values, 0.5), "p95": percentile(values, 0.95)}


class Workload:
    def __init__(self, args: argparse.Namespace):
        self.max_tokens = args.max_tokens
        self.talker_max = args.talker_max_tokens
        self.audio_every = args.audio_every

    def wav_for(self, i: int) -> bytes | None:
        """Request i's clip: a tone of its own (the encoder cache serves no request another one's encoding,
        which `transformers` would not have either)."""
        if not self.audio_every or i % self.audio_every != self.audio_every - 1:
            return None
        return sine_wav(1.0, freq=220.0 + 5.0 * i)

    def body(self, i: int) -> dict[str, Any]:
        return chat_body(prompt(i), wav=self.wav_for(i), max_tokens=self.max_tokens, talker_max=self.talker_max,
                         stream=True)


# ------------------------------------------------------------------------------------------------ omnimesh


def run_mesh(url: str, work: Workload, c: int, n: int, rate: int) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=c + 4, max_keepalive_connections=c + 4)
    with httpx.Client(limits=limits) as client, ThreadPoolExecutor(c) as pool:
        t0 = time.perf_counter()
        results = list(pool.map(lambda i: stream_chat(url, work.body(i), client=client), range(n)))
        wall = time.perf_counter() - t0
    ok = [r for r in results if not r.error]
    samples = sum(r.audio_samples for r in ok)
    stalls = [playback_stall(r.audio_at, rate) for r in ok if r.audio_at]
    return {
        "concurrency": c, "requests": n, "ok": len(ok), "errors": [r.error for r in results if r.error],
        "wall_s": wall, "req_per_s": len(ok) / wall, "audio_s": samples / rate, "audio_s_per_s": samples / rate / wall,
        "audio_s_per_request": samples / rate / max(1, len(ok)),
        "ttft_s": stats([r.ttft for r in ok if r.ttft == r.ttft]),
        "ttfp_s": stats([r.ttfp for r in ok if r.ttfp == r.ttfp]),
        "latency_s": stats([r.latency for r in ok]),
        "without_audio": sum(1 for r in ok if r.ttfp != r.ttfp),
        "stall_s": stats(stalls),
        "stalled": sum(1 for x in stalls if x > 0),
    }


def omnimesh_side(model: Path, work: Workload, args: argparse.Namespace, device: str,
                  concurrencies: list[int]) -> tuple[int, dict[int, dict[str, Any]], list[str], dict[str, str]]:
    serve = ["--device", device, "--malloc", args.malloc, *shlex.split(args.serve_args)]
    log(f"omnimesh: starting `omnimesh serve {model} {' '.join(serve)}`")
    t = time.perf_counter()
    with MeshProcess(model, *serve) as mesh:
        log(f"omnimesh: up in {time.perf_counter() - t:.1f}s at {mesh.url} (quiet {mesh.settled_s:.1f}s after /health "
            "answered); warming up")
        rate = served_sample_rate(mesh.url, {**work.body(0), "stream": False})
        for i in range(2):
            r = stream_chat(mesh.url, work.body(1000 + i))
            if r.error:
                raise RuntimeError(f"omnimesh warm-up request failed: {r.error}")
        mesh.settle()  # what the warm-up left running (a stage's allocator handing memory back) ends first
        out: dict[int, dict[str, Any]] = {}
        allocs = process_cpu.allocators(mesh.proc.pid) if process_cpu.available() else {}
        meter = process_cpu.CpuMeter(mesh.proc.pid) if process_cpu.available() else None
        for c in concurrencies:
            n = args.requests or default_requests(c)
            log(f"omnimesh: concurrency {c}, {n} requests")
            if meter is not None:
                meter.start()
            client = time.process_time()
            steps = stage_steps.scrape(mesh.url)
            out[c] = run_mesh(mesh.url, work, c, n, rate)
            if meter is not None:  # CPU seconds by process over this concurrency's run, and the waits for a core
                out[c]["cpu_s"] = {**meter.stop(), "bench client": time.process_time() - client}
                out[c]["core_waits_s"] = meter.waits()
            out[c]["engine_steps"] = stage_steps.since(steps, stage_steps.scrape(mesh.url))
            if out[c]["errors"]:
                log(f"omnimesh: {len(out[c]['errors'])} request(s) failed at c={c}; first: {out[c]['errors'][0]}")
    return rate, out, serve, allocs


# ------------------------------------------------------------------------------------------- transformers


class HFSide:
    """`transformers` loaded once (warmed up, its thread count chosen); `hf_side` is one round of it."""

    def __init__(self, model: Path, work: Workload, args: argparse.Namespace, device: str):
        import torch

        log("transformers: loading")
        self.work = work
        self.hf = HFGenerate(model, device)
        self.inputs: dict[int, Any] = {}
        self.gen([999])  # warm-up, not counted
        self.probe: dict[int, float] = {}
        if args.hf_threads:
            torch.set_num_threads(args.hf_threads)
        elif not device.startswith("cuda") and torch.get_num_threads() > 1:
            # torch's default (every core) can be many times slower than 1 thread when other processes share the
            # cores (OpenMP threads wait on each other): take whichever is faster here, so the baseline is the
            # best transformers does on this machine, not a strawman
            default = torch.get_num_threads()
            for threads in sorted({default, 1}, reverse=True):
                torch.set_num_threads(threads)
                self.gen([998])
                t = time.perf_counter()
                self.gen([997])
                self.gen([996])
                self.probe[threads] = (time.perf_counter() - t) / 2
            torch.set_num_threads(min(self.probe, key=self.probe.__getitem__))
            log("transformers: torch threads " + ", ".join(f"{k}: {v:.3f} s/request" for k, v in self.probe.items())
                + f"; using {torch.get_num_threads()}")
        self.threads = torch.get_num_threads()

    def gen(self, batch: list[int]) -> list[tuple[list[int], int]]:
        work = self.work
        for i in batch:
            if i not in self.inputs:
                self.inputs[i] = self.hf.inputs(prompt(i), work.wav_for(i), max_tokens=work.max_tokens,
                                                talker_max=work.talker_max)
        return self.hf.generate([self.inputs[i] for i in batch], max_tokens=work.max_tokens, talker_max=work.talker_max)


def hf_side(side: HFSide, args: argparse.Namespace, device: str, concurrencies: list[int]) -> dict[str, Any]:
    """One round of `transformers`: sequential `generate`, then batched at each c > 1."""
    import torch

    hf, gen = side.hf, side.gen

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    result: dict[str, Any] = {"threads_probe_s_per_request": side.probe, "torch_threads": side.threads}
    log(f"transformers: sequential generate, {args.hf_requests} requests")
    seq_lat: list[float] = []
    seq_samples = 0
    seq_rows: dict[int, tuple[list[int], int]] = {}
    t0 = time.perf_counter()
    for i in range(args.hf_requests):
        t = time.perf_counter()
        ((tokens, samples),) = gen([i])
        sync()
        seq_lat.append(time.perf_counter() - t)
        seq_samples += samples
        seq_rows[i] = (tokens, samples)
    seq_wall = time.perf_counter() - t0
    result["sequential"] = {"requests": args.hf_requests, "wall_s": seq_wall, "req_per_s": args.hf_requests / seq_wall,
                            "audio_samples": seq_samples, "latency_s": stats(seq_lat)}
    result["batched"] = {}
    unsupported = ""
    for c in [c for c in concurrencies if c > 1] if not args.no_hf_batched else []:
        n = args.requests or default_requests(c)
        if unsupported:
            result["batched"][c] = {"error": unsupported}
            continue
        log(f"transformers: batched generate, batch {c}, {n} requests")
        lat: list[float] = []
        samples = 0
        same = compared = 0
        try:
            gen(list(range(990 - c, 990)))  # warm-up of this batch size, not counted
            t0 = time.perf_counter()
            for start in range(0, n, c):
                batch = list(range(start, min(n, start + c)))
                t = time.perf_counter()
                rows = gen(batch)
                sync()
                lat += [time.perf_counter() - t] * len(batch)
                for i, (tokens, s) in zip(batch, rows):
                    samples += s
                    if i in seq_rows:
                        compared += 1
                        same += (_trim_eos(tokens, hf), s) == (_trim_eos(seq_rows[i][0], hf), seq_rows[i][1])
            wall = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - reported, and the run goes on
            unsupported = (f"batched generate: not supported by transformers for "
                           f"{type(hf.model).__name__}.generate (batch {c}, text + audio out): {type(e).__name__}: {e}")
            log(unsupported)
            result["batched"][c] = {"error": unsupported}
            continue
        result["batched"][c] = {"batch": c, "requests": n, "wall_s": wall, "req_per_s": n / wall,
                                "audio_samples": samples, "latency_s": stats(lat),
                                "rows_equal_to_sequential": [same, compared]}
    return result


def _trim_eos(tokens: list[int], hf: HFGenerate) -> list[int]:
    """Generated ids up to and including the first end id (a batch row goes on with pads after it)."""
    ends = [i for i, t in enumerate(tokens) if t in hf.end_ids]
    return tokens[: ends[0] + 1] if ends else tokens


# ------------------------------------------------------------------------------------------------- report


def fmt(x: float, width: int, digits: int = 3) -> str:
    return f"{x:{width}.{digits}f}" if x == x else f"{'n/a':>{width}}"


def report(machine: dict[str, Any], args: argparse.Namespace, rate: int, mesh: dict[int, dict[str, Any]],
           hf: dict[str, Any]) -> dict[str, Any]:
    seq = hf["sequential"]
    seq["audio_s_per_s"] = seq["audio_samples"] / rate / seq["wall_s"]
    seq["audio_s_per_request"] = seq["audio_samples"] / rate / seq["requests"]
    for b in hf["batched"].values():
        if "error" not in b:
            b["audio_s_per_s"] = b["audio_samples"] / rate / b["wall_s"]
            b["audio_s_per_request"] = b["audio_samples"] / rate / b["requests"]

    print()
    print("transformers generate (not streaming: its TTFT and TTFP are the whole request's latency)")
    print(f"{'mode':12}{'batch':>6}{'reqs':>6}{'wall s':>9}{'req/s':>8}{'audio s/s':>11}{'audio s/req':>13}"
          f"{'lat=TTFP p50':>14}{'p95':>8}   rows equal to sequential (tokens, audio length)")
    print(f"{'sequential':12}{1:6}{seq['requests']:6}{seq['wall_s']:9.2f}{seq['req_per_s']:8.2f}"
          f"{seq['audio_s_per_s']:11.2f}{seq['audio_s_per_request']:13.2f}{seq['latency_s']['p50']:14.3f}"
          f"{seq['latency_s']['p95']:8.3f}   -")
    for c, b in hf["batched"].items():
        if "error" in b:
            print(f"{'batched':12}{c:6}   {b['error']}")
            continue
        same, compared = b["rows_equal_to_sequential"]
        print(f"{'batched':12}{c:6}{b['requests']:6}{b['wall_s']:9.2f}{b['req_per_s']:8.2f}{b['audio_s_per_s']:11.2f}"
              f"{b['audio_s_per_request']:13.2f}{b['latency_s']['p50']:14.3f}{b['latency_s']['p95']:8.3f}"
              f"   {same}/{compared} rows")

    print()
    print("omnimesh (streaming REST, c requests in flight); ratios = omnimesh / transformers")
    print(f"{'c':>4}{'reqs':>6}{'err':>5}{'wall s':>9}{'req/s':>8}{'audio s/s':>11}{'audio s/req':>13}"
          f"{'TTFT p50':>10}{'p95':>8}{'TTFP p50':>10}{'p95':>8}{'lat p50':>9}{'p95':>8}"
          f"{'x seq req/s':>13}{'x seq aud/s':>13}{'x batched':>11}")
    for c, m in mesh.items():
        m["x_sequential_req_per_s"] = m["req_per_s"] / seq["req_per_s"]
        m["x_sequential_audio_s_per_s"] = m["audio_s_per_s"] / seq["audio_s_per_s"] if seq["audio_s_per_s"] else float("nan")
        b = hf["batched"].get(c, {})
        m["x_batched_req_per_s"] = m["req_per_s"] / b["req_per_s"] if "req_per_s" in b else (
            m["x_sequential_req_per_s"] if c == 1 else float("nan"))
        print(f"{c:4}{m['requests']:6}{len(m['errors']):5}{m['wall_s']:9.2f}{m['req_per_s']:8.2f}"
              f"{m['audio_s_per_s']:11.2f}{m['audio_s_per_request']:13.2f}"
              f"{fmt(m['ttft_s']['p50'], 10)}{fmt(m['ttft_s']['p95'], 8)}{fmt(m['ttfp_s']['p50'], 10)}"
              f"{fmt(m['ttfp_s']['p95'], 8)}{fmt(m['latency_s']['p50'], 9)}{fmt(m['latency_s']['p95'], 8)}"
              f"{fmt(m['x_sequential_req_per_s'], 12, 2)}x{fmt(m['x_sequential_audio_s_per_s'], 12, 2)}x"
              f"{fmt(m['x_batched_req_per_s'], 10, 2)}x")
    print("(x batched: vs batched generate with batch = c; at c=1 that is sequential generate)")
    stall_table(mesh)
    cpu_table(mesh)
    waits_table(mesh)
    steps_table(mesh)
    if any(m["without_audio"] for m in mesh.values()):
        print("note: some omnimesh requests finished without any audio delta: "
              + ", ".join(f"c={c}: {m['without_audio']}" for c, m in mesh.items() if m["without_audio"]))

    targets: dict[str, Any] = {}
    print()
    if 16 in mesh:
        x = mesh[16]["x_sequential_req_per_s"]
        targets["throughput_c16_x_sequential"] = judged = rounds_summary.judge("throughput_c16_x_sequential", x)
        ok = judged["pass"]
        print(f"{'PASS' if ok else 'FAIL'}  throughput at c=16: {x:.2f}x sequential transformers "
              f"({mesh[16]['req_per_s']:.2f} vs {seq['req_per_s']:.2f} req/s; target {judged['target']}x)")
    else:
        print("n/a   throughput at c=16: not measured (16 not in --concurrency)")
    if 8 in mesh and 1 in mesh:
        y = mesh[8]["ttfp_s"]["p50"] / mesh[1]["ttfp_s"]["p50"]
        targets["ttfp_p50_c8_over_c1"] = judged = rounds_summary.judge("ttfp_p50_c8_over_c1", y)
        ok = judged["pass"]
        print(f"{'PASS' if ok else 'FAIL'}  TTFP p50 at c=8 / c=1: {y:.2f} ({mesh[8]['ttfp_s']['p50']:.3f} s / "
              f"{mesh[1]['ttfp_s']['p50']:.3f} s; target {judged['target']})")
    else:
        print("n/a   TTFP p50 at c=8 / c=1: not measured (--concurrency needs both 1 and 8)")
    return targets


CPU_ROLES = ("encoder", "thinker", "talker", "vocoder", "gateway", "serve", "bench client")


def stall_table(mesh: dict[int, dict[str, Any]]) -> None:
    """How the streamed audio plays: a player that starts at the first audio delta, and the silences it
    hears when the next delta comes after the audio it holds has run out (bench/common.playback_stall)."""
    print()
    print("omnimesh audio playback from the first delta: requests with a stall (buffer ran dry), stall per request")
    print(f"{'c':>4}{'stalled':>9}{'of':>5}{'stall p50 s':>13}{'p95 s':>8}")
    for c, m in mesh.items():
        with_audio = m["ok"] - m["without_audio"]
        print(f"{c:4}{m['stalled']:9}{with_audio:5}{fmt(m['stall_s']['p50'], 13)}{fmt(m['stall_s']['p95'], 8)}")


def cpu_table(mesh: dict[int, dict[str, Any]]) -> None:
    """Per concurrency: CPU ms per finished request, by process (see bench/process_cpu.py), and the cores busy."""
    rows = {c: m for c, m in mesh.items() if m.get("cpu_s") and m["ok"]}
    if not rows:
        return
    print()
    print("omnimesh CPU per request (ms), by process; cores busy = all of it / wall time")
    print(f"{'c':>4}" + "".join(f"{r:>14}" for r in CPU_ROLES) + f"{'total':>9}{'cores busy':>12}")
    for c, m in rows.items():
        cpu = m["cpu_s"]
        total = sum(cpu.values())
        print(f"{c:4}" + "".join(f"{cpu.get(r, 0.0) * 1000 / m['ok']:14.1f}" for r in CPU_ROLES)
              + f"{total * 1000 / m['ok']:9.1f}{total / m['wall_s']:12.2f}")


def waits_table(mesh: dict[int, dict[str, Any]]) -> None:
    """Per concurrency and process: how long its threads sat runnable waiting for a core, per second they ran
    (from schedstat): urgent = the compute threads of steps with a request waiting for its first output."""
    rows = {c: m["core_waits_s"] for c, m in mesh.items() if m.get("core_waits_s")}
    roles = [r for r in CPU_ROLES if any(r in w for w in rows.values()) and r != "serve"]
    if not rows or not roles:
        return
    classes = ("urgent", "bulk", "other")
    print()
    print("omnimesh threads' wait for a core: seconds runnable but not running per second run, by process "
          "and thread (urgent / bulk / other: event loops, gRPC)")
    print(f"{'c':>4}" + "".join(f"{r:>20}" for r in roles))
    for c, waits in rows.items():
        cells = []
        for role in roles:
            got = waits.get(role, {})
            cells.append(" /".join(f"{got[k][1] / got[k][0]:5.2f}" if got.get(k, (0, 0))[0] > 0.01 else f"{'-':>5}"
                                   for k in classes))
        print(f"{c:4}" + "".join(f"{cell:>20}" for cell in cells))


def steps_table(mesh: dict[int, dict[str, Any]]) -> None:
    """Per concurrency and stage: engine steps per request, requests per step, ms per step; then the steps
    that carried a request waiting for its first output, per request, and their ms per step (from /metrics)."""
    rows = {c: m for c, m in mesh.items() if m.get("engine_steps") and m["ok"]}
    stages = [s for s in ("encoder", "thinker", "talker", "vocoder") if any(s in m["engine_steps"] for m in rows.values())]
    if not rows or not stages:
        return

    def table(title: str, cell: Callable[[stage_steps.StageSteps, int], str]) -> None:
        print(title)
        print(f"{'c':>4}" + "".join(f"{s:>22}" for s in stages))
        for c, m in rows.items():
            steps = [m["engine_steps"].get(s, stage_steps.StageSteps()) for s in stages]
            print(f"{c:4}" + "".join(f"{cell(st, m['ok']):>22}" for st in steps))

    print()
    table("omnimesh engine steps by stage: steps per request / requests per step / ms per step (wall)",
          lambda st, ok: f"{st.steps / ok:8.1f} /{st.requests / st.steps:5.1f} /{st.seconds * 1000 / st.steps:5.1f}"
          if st.steps else "-")
    table("the steps that carried a request still waiting for its first output: per request / ms per step (wall)",
          lambda st, ok: f"{st.first_steps / ok:8.1f} /{st.first_seconds * 1000 / st.first_steps:5.1f}"
          if st.first_steps else "-")


def _no_nan(x: Any) -> Any:
    """JSON has no NaN: a value never measured becomes null."""
    if isinstance(x, float) and x != x:
        return None
    if isinstance(x, dict):
        return {k: _no_nan(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_no_nan(v) for v in x]
    return x


def print_setting(machine: dict[str, Any], args: argparse.Namespace, hf: dict[str, Any], loads: list[float],
                  model: Path, device: str, rate: int, serve: list[str], allocs: dict[str, str]) -> None:
    print(f"machine: {machine['host']}, {machine['cpu_count']} CPUs ({machine['cpus_usable']} usable), "
          f"{machine['cuda'] or 'no CUDA'}; {machine['platform']}; {machine['date']}")
    print(f"software: python {machine['python']}, torch {machine['torch']}, transformers {machine['transformers']}, "
          f"omnimesh commit {machine['commit']}")
    probe = hf["threads_probe_s_per_request"]
    print(f"threads: transformers torch {hf['torch_threads']} intra-op"
          + (" (" + ", ".join(f"{k} thread(s) {v:.3f} s/request" for k, v in probe.items()) + " in a probe)"
             if probe else "")
          + f"; each mesh stage {machine['mesh_stage_cpu_threads']} (OMNIMESH_CPU_THREADS="
          f"{machine['OMNIMESH_CPU_THREADS']}); OMP_NUM_THREADS={machine['OMP_NUM_THREADS']}")
    print(f"malloc (--malloc {args.malloc}, both sides): transformers {machine['allocator']}; mesh "
          + (", ".join(f"{role} {name}" for role, name in allocs.items()) or "not read (no /proc)"))
    print("load average (1 min) at start / after omnimesh / after transformers: "
          + " / ".join(f"{x:.2f}" for x in loads) + " (other processes on this machine skew both sides)")
    print(f"model: {model}; device {device}; thinker {args.max_tokens} tokens, talker {args.talker_max_tokens} code "
          f"groups, greedy, text + audio out at {rate} Hz, speaker Ethan; "
          + (f"1 request in {args.audio_every} with 1 s audio in" if args.audio_every else "text prompts"))
    print(f"omnimesh serve flags: {' '.join(serve)}; the bench client shares this machine's CPUs with the mesh")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: the built-in tiny Qwen3-Omni)")
    ap.add_argument("--concurrency", default="1,4,8,16,32", help="comma-separated requests in flight (default: %(default)s)")
    ap.add_argument("--requests", type=int, default=None, help="requests per concurrency (default: max(16, 8c))")
    ap.add_argument("--max-tokens", type=int, default=32, help="thinker tokens per request (default: %(default)s)")
    ap.add_argument("--talker-max-tokens", type=int, default=64,
                    help="talker code groups per request (default: %(default)s)")
    ap.add_argument("--audio-every", type=int, default=0, metavar="K",
                    help="every K-th request also carries a 1 s audio clip (default: 0 = text prompts only)")
    ap.add_argument("--hf-requests", type=int, default=None,
                    help="requests for sequential transformers (default: as many as the largest concurrency runs, "
                         "at most 96; batched rows are compared with the sequential ones it made)")
    ap.add_argument("--no-hf-batched", action="store_true", help="skip batched transformers generate")
    ap.add_argument("--hf-threads", type=int, default=None,
                    help="torch intra-op threads for transformers (default on CPU: torch's default or 1, whichever "
                         "a short probe finds faster)")
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda, for both sides (default: %(default)s)")
    ap.add_argument("--malloc", default="auto", choices=MALLOC_CHOICES,
                    help="memory allocator of both sides: the mesh's `--malloc`, and this process (where transformers "
                         "runs) re-executes itself on the same (default: %(default)s: tcmalloc where installed)")
    ap.add_argument("--serve-args", default="", help="extra `omnimesh serve` flags, one string, e.g. "
                    "\"--max-num-seqs 64 --kv-cache-memory 2GiB\"")
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure both sides this many times, alternating, and judge the targets on the median "
                         "(default: %(default)s; on a host whose speed drifts, 3 or more)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here as JSON")
    args = ap.parse_args()
    concurrencies = sorted({int(x) for x in args.concurrency.split(",") if x.strip()})
    if not concurrencies or min(concurrencies) < 1 or (args.requests is not None and args.requests < 1):
        ap.error("--concurrency needs whole numbers >= 1, --requests >= 1")
    if args.rounds < 1:
        ap.error("--rounds needs a whole number >= 1")
    if args.hf_requests is None:
        args.hf_requests = min(96, max(args.requests or default_requests(c) for c in concurrencies))
    device = resolve_device(args.device)
    allocator = use_allocator(args.malloc, device)  # transformers runs on what the mesh runs on (may re-execute)
    model = model_folder(args.model)
    work = Workload(args)
    machine = {**machine_info(), "allocator": allocator}
    started = time.perf_counter()

    hf_runner = HFSide(model, work, args, device)
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        if args.rounds > 1:
            log(f"round {r + 1} of {args.rounds}")
        loads = [os.getloadavg()[0]]
        rate, mesh, serve, allocs = omnimesh_side(model, work, args, device, concurrencies)
        loads.append(os.getloadavg()[0])
        hf = hf_side(hf_runner, args, device, concurrencies)
        loads.append(os.getloadavg()[0])
        print()
        if args.rounds > 1:
            print(f"===== round {r + 1} of {args.rounds}")
        print_setting(machine, args, hf, loads, model, device, rate, serve, allocs)
        targets = report(machine, args, rate, mesh, hf)
        hf["batched"] = {str(c): b for c, b in hf["batched"].items()}
        rounds.append({"load_average_1min": {"start": loads[0], "after_omnimesh": loads[1],
                                             "after_transformers": loads[2]}, "sample_rate": rate,
                       "transformers": hf, "omnimesh": {str(c): m for c, m in mesh.items()}, "targets": targets,
                       "omnimesh_malloc": allocs})
    summary = rounds_summary.summarize([r["targets"] for r in rounds])
    if args.rounds > 1:
        rounds_summary.print_summary(summary)
    print(f"(whole run {time.perf_counter() - started:.0f} s)")
    if args.json:
        doc = {"machine": machine, "settings": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                                                "device": device, "model": str(model), "concurrency": concurrencies,
                                                "serve_flags": serve},
               "rounds": rounds, "targets": summary}
        args.json.write_text(json.dumps(_no_nan(doc), indent=2) + "\n")
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
