"""Tensor hand-off between two processes: shared memory, inline gRPC pieces (and CUDA IPC) next to a plain
in-process memcpy; then the thinker -> talker edge of the real mesh with `--transport grpc` and `shm`.

    python bench/handoff.py [--sizes 256B,1,16,128] [--reps 7] [--warmup 2] [--threads T] [--skip-mesh]
        [--skip-handoff] [--mesh-requests 16,32] [--concurrency 1,16] [--max-tokens 32]
        [--talker-max-tokens 32] [--device auto] [--transports shm,grpc,cuda-ipc] [--piece-bytes N,...]
        [--grpc-option KEY=VALUE] [--serve-args "..."] [--malloc auto|tcmalloc|system] [--json out.json]

1. Hand-off. A producer process runs the real stage runner (`run_stage`: StageServicer + EngineLoop +
   its Transport with an shm arena) around a tiny "source" stage whose one step returns a preallocated
   float32 tensor of the asked size. This process is the consumer: a `StageClient` opens one request per
   hand-off with `open.transport` = shm | grpc | cuda-ipc and assembles the output (`ChunkAssembler`).
   Timed, per hand-off: from the end of the producer's `step` (the tensor exists in the producer) to the
   consumer holding the assembled tensor, i.e. engine -> servicer hop + encode (shm: one copy into the
   arena; grpc: split into pieces and serialize) + gRPC stream + the consumer's mapping (shm) or
   reassembly (grpc). Both ends read CLOCK_MONOTONIC (`time.perf_counter`), which is one clock for every
   process on a Linux host. The "+read" columns add the consumer summing every element (a shm tensor is a
   view into the producer's arena: its bytes are only touched when read). The request's open / done
   messages are outside the timed span. memcpy: `dst.copy_(src)` into a preallocated tensor in this
   process, the same torch thread count as both processes. "CPU ms": CPU time of all threads of each
   process over the whole request, from /proc (steadier than wall time when other work shares the
   cores). Median of --reps after --warmup hand-offs; the rows are interleaved, in a new order each rep,
   so load from other processes hits them alike. The first (warm-up) hand-off of each row and size is
   checked bit for bit against the producer's tensor. `--piece-bytes` adds inline rows with other piece
   sizes, `--grpc-option` changes the gRPC options of both processes (experiments).
2. Mesh. `omnimesh serve` (built-in tiny model unless --model) twice, `--transport grpc` then `shm` (with
   `--shm-min-tensor-size 0`: every tensor by reference, as the row's name says);
   streamed audio-out chat requests at each concurrency (closed loop). Per transport: requests/s, mean /
   p50 latency, and what the gateway receives from the thinker per request (serialized message bytes and
   the tensor bytes its frames describe), measured by a client that opens the thinker stream exactly as
   the gateway does (the gateway's /metrics does not expose those counters).

   Also per row, "streamed": N tensors of the size in one request (one per producer step, ~64 MiB in all),
   each dropped once held: N x size / (first tensor produced -> last held), the rate a stage edge sustains.

Targets from the issue are printed next to the results: shm >= 70% of memcpy at 128 MiB (one tensor,
hold); inline gRPC >= 1 GB/s (streamed; one tensor alone printed beside it). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    chat_body,
    machine_info,
    model_folder,
    percentile,
    prompt,
    resolve_device,
    stream_chat,
)
from bench.mesh_process import MeshProcess  # noqa: E402
from omnimesh.allocator import MALLOC_CHOICES, use_allocator  # noqa: E402
from omnimesh.engine.task import StageTask  # noqa: E402
from omnimesh.proc_utils import tune_malloc  # noqa: E402
from omnimesh.transport.frames import StageChunk  # noqa: E402
from omnimesh.v1 import stage_pb2  # noqa: E402

TARGET_SHM_X_MEMCPY = 0.70  # at 128 MiB
TARGET_GRPC_GBPS = 1.0
MiB = 2**20
REPO = Path(__file__).resolve().parents[1]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def source_tensor(nbytes: int, device: str = "cpu") -> torch.Tensor:
    """The producer's tensor for a size (the consumer rebuilds it to check the bytes that arrived)."""
    g = torch.Generator().manual_seed(nbytes)
    return torch.randn(nbytes // 4, generator=g).to(device)


# ----------------------------------------------------------------------------------- producer (a stage)


class SourceTask(StageTask):
    """Waits for its (empty, final) input chunk, then returns the tensor, `count` times, one per step."""

    def __init__(self, request_id: str, tensor: torch.Tensor, count: int = 1):
        super().__init__(request_id)
        self.tensor = tensor
        self.left = count
        self.go = False

    def feed(self, chunk: StageChunk) -> None:
        self.go = self.go or chunk.final

    def ready(self) -> bool:
        return self.go and not self.finished

    def step(self) -> list[StageChunk]:
        self.left -= 1
        self.finished = self.left <= 0
        # "the producer has the tensor": the stamp rides along as the chunk's text
        return [StageChunk(tensors={"x": self.tensor}, text=repr(time.perf_counter()))]


class SourceHandler:
    name = "source"

    def __init__(self) -> None:
        self._tensors: dict[tuple[int, str], torch.Tensor] = {}

    def info(self) -> stage_pb2.StageInfo:
        return stage_pb2.StageInfo(stage=self.name, model="handoff-bench", device="cpu")

    def open(self, msg: stage_pb2.Open) -> StageTask:
        key = (int(msg.options["nbytes"]), msg.options.get("device", "cpu"))
        if key not in self._tensors:  # preallocated once per size: the hand-off, not the allocation, is timed
            self._tensors[key] = source_tensor(*key)
        return SourceTask(msg.request_id, self._tensors[key], int(msg.options.get("count", "1")))


def apply_grpc_options(options: list[str]) -> None:
    """--grpc-option: add / replace gRPC channel and server options of this process, in place (an
    experiment knob; the default is omnimesh's GRPC_OPTIONS, what the mesh runs with)."""
    from omnimesh.server import grpc_server

    for item in options:
        key, _, value = item.partition("=")
        grpc_server.GRPC_OPTIONS[:] = [o for o in grpc_server.GRPC_OPTIONS if o[0] != key]
        grpc_server.GRPC_OPTIONS.append((key, int(value) if value.lstrip("-").isdigit() else value))


def serve_source(arena_bytes: int) -> None:
    from omnimesh.server.stage_server import run_stage
    from omnimesh.transport.transport import Transport

    encoder = Transport.encoder

    def encoder_with_piece(self: Transport, mode: str, request_id: str, deadline: float = 0.0) -> Any:
        """--piece-bytes variants: a request id ending in `-pieceN` gets inline pieces of N bytes."""
        enc = encoder(self, mode, request_id, deadline)
        m = re.search(r"-piece(\d+)$", request_id)
        if m:
            enc.piece_bytes = int(m.group(1))
        return enc

    Transport.encoder = encoder_with_piece  # type: ignore[method-assign]
    run_stage(SourceHandler, "127.0.0.1", 0, transport="shm", shm_arena_size=arena_bytes, shm_min_tensor_size=0)


class SourceProcess:
    """The producer process: `python bench/handoff.py --serve-source`, on a free port."""

    def __init__(self, arena_bytes: int, threads: int, extra: list[str]):
        self.arena_bytes = arena_bytes
        self.threads = threads
        self.extra = extra
        self.lines: list[str] = []

    def __enter__(self) -> SourceProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMNIMESH_CPU_THREADS": str(self.threads)}
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--serve-source", "--arena-bytes", str(self.arena_bytes),
             *self.extra],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            m = re.search(r"omnimesh stage source listening on (\S+)$", line)
            if m:
                self.address = m.group(1)
                break
        else:
            raise RuntimeError("the source stage did not start:\n" + "\n".join(self.lines[-30:]))
        out = self.proc.stdout
        threading.Thread(target=lambda: [None for _ in out], daemon=True).start()  # keep the pipe drained
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


# ------------------------------------------------------------------------------------- consumer (here)


def memcpy_s(nbytes: int, reps: int, warmup: int, device: str = "cpu") -> list[float]:
    src = source_tensor(nbytes, device)
    dst = torch.empty_like(src)
    out = []
    for i in range(warmup + reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            out.append(time.perf_counter() - t)
    return out


def cpu_s(pid: int) -> float:
    """CPU time of every thread of a process so far (ns precision, from /proc/PID/task/*/schedstat)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that just ended
    return total / 1e9


async def hand_off(client: Any, mode: str, nbytes: int, rid: str, check: bool, producer: int) -> dict[str, float]:
    """One request: the producer's tensor to this process -> seconds to hold it, to hold and read it, and
    the CPU seconds both processes spent on the whole request (open to done, the hold span and more)."""
    device = "cuda" if mode == "cuda-ipc" else "cpu"
    cpu0 = cpu_s(producer), cpu_s(os.getpid())
    stream = await client.open(rid, options={"nbytes": str(nbytes), "device": device}, transport=mode)
    await stream.send(StageChunk(final=True))
    t0 = t_hold = t_read = float("nan")
    async for part in stream.parts():
        chunk = stream.assemble(part)
        if chunk is None:
            continue
        t_hold = time.perf_counter()
        x = chunk.tensors["x"]
        x.sum()
        if x.is_cuda:
            torch.cuda.synchronize()
        t_read = time.perf_counter()
        t0 = float(chunk.text)
        if check and not torch.equal(x.cpu(), source_tensor(nbytes)):
            raise RuntimeError(f"{mode}: the {nbytes}-byte tensor arrived with different bytes")
        del chunk, x  # drop the consumer's tensor: a shm slot / IPC handle goes back to the producer
    if math.isnan(t0):
        raise RuntimeError(f"{mode}: request {rid} ended without its tensor")
    cpu1 = cpu_s(producer), cpu_s(os.getpid())
    return {"hold_s": t_hold - t0, "read_s": t_read - t0, "wire_bytes": stream.received_bytes,
            "producer_cpu_s": cpu1[0] - cpu0[0], "consumer_cpu_s": cpu1[1] - cpu0[1]}


def stream_count(nbytes: int) -> int:
    """Tensors per streamed request: ~64 MiB in all, 2 to 32 of them."""
    return max(2, min(32, (64 * MiB) // max(nbytes, 1)))


async def stream_off(client: Any, mode: str, nbytes: int, rid: str) -> float:
    """One request streaming `stream_count` tensors, one per producer step, each dropped once held (as a
    next stage consumes chunks) -> seconds from the first tensor's production to the last one held."""
    count = stream_count(nbytes)
    stream = await client.open(rid, options={"nbytes": str(nbytes), "count": str(count),
                                             "device": "cuda" if mode == "cuda-ipc" else "cpu"}, transport=mode)
    await stream.send(StageChunk(final=True))
    t0 = t_last = float("nan")
    got = 0
    async for part in stream.parts():
        chunk = stream.assemble(part)
        if chunk is None:
            continue
        t_last = time.perf_counter()
        if got == 0:
            t0 = float(chunk.text)
        got += 1
        del chunk
    if got != count:
        raise RuntimeError(f"{mode}: request {rid} streamed {got} of {count} tensors")
    return t_last - t0


def variants(modes: list[str], pieces: list[int]) -> list[tuple[str, str, int]]:
    """(row label, transport, producer piece bytes or 0 = chunk_codec.PIECE_BYTES) of every measured row."""
    out = []
    for mode in modes:
        out.append((mode, mode, 0))
        if mode == "grpc":
            out += [(f"grpc {size_label(p)} pieces", "grpc", p) for p in pieces]
    return out


async def handoff_side(args: argparse.Namespace, sizes: list[int], rows: list[tuple[str, str, int]]) -> dict[str, Any]:
    from omnimesh.transport.stage_client import StageClient
    from omnimesh.transport.transport import Transport

    arena = max(2 * max(sizes), 2 * 64 * MiB) + 16 * MiB  # room for the streamed run's tensors in flight
    results: dict[str, Any] = {}
    with SourceProcess(arena, args.threads, [f"--grpc-option={o}" for o in args.grpc_option]) as src:
        log(f"hand-off: source stage (producer) pid {src.proc.pid} at {src.address}, consumer pid {os.getpid()}")
        client = StageClient("source", src.address, Transport("handoff-consumer", "grpc"))
        try:
            for nbytes in sizes:
                log(f"hand-off: {size_label(nbytes)}, {args.warmup} warm-up + {args.reps} reps of "
                    + ", ".join(label for label, _, _ in rows))
                row: dict[str, Any] = {"memcpy": {"copy_s": memcpy_s(nbytes, args.reps, args.warmup)}}
                if any(mode == "cuda-ipc" for _, mode, _ in rows):
                    row["memcpy-cuda"] = {"copy_s": memcpy_s(nbytes, args.reps, args.warmup, "cuda")}
                runs: dict[str, list[dict[str, float]]] = {label: [] for label, _, _ in rows}
                for i in range(args.warmup + args.reps):
                    order = list(rows)
                    random.Random(i).shuffle(order)  # interleaved, in a new order each rep: load from elsewhere
                    for label, mode, piece in order:  # and one row's after-effects hit every row alike
                        rid = f"{mode}-{nbytes}-{i}" + (f"-piece{piece}" if piece else "")
                        r = await hand_off(client, mode, nbytes, rid, i == 0, src.proc.pid)
                        r["stream_s"] = await stream_off(client, mode, nbytes, rid + "-stream")
                        if i >= args.warmup:
                            runs[label].append(r)
                for label, _, _ in rows:
                    row[label] = {k: [r[k] for r in runs[label]] for k in runs[label][0]}
                results[str(nbytes)] = row
        finally:
            await client.close()
    return results


# ------------------------------------------------------------------------------------------------- mesh


async def thinker_bytes(address: str, model_dir: Path, mode: str, n: int, max_tokens: int,
                        talker_max: int) -> dict[str, float]:
    """What the gateway receives from the thinker for an audio-out request: the thinker stream opened as
    `gateway.pipeline` opens it (talker inputs on, output transport `mode`), parts assembled and dropped."""
    from gateway.prompt import PromptBuilder
    from gateway.stage_sampling import thinker_sampling
    from omnimesh.transport.stage_client import StageClient
    from omnimesh.transport.transport import Transport
    from tests.e2e.reference import chat_request

    builder = PromptBuilder(model_dir, max_model_len=4096)
    client = StageClient("thinker", address, Transport("handoff-probe", "grpc"))
    totals = {"received_bytes": 0, "tensor_bytes": 0, "messages": 0, "tensor_frames": 0}
    try:
        for i in range(n):
            request = chat_request(prompt(i), None, None, max_tokens=max_tokens, talker_max=talker_max)
            inputs = builder(request)
            stream = await client.open(f"probe-{mode}-{i}", thinker_sampling(request), {"talker_inputs": "1"},
                                       time.time() + 120, transport=mode)
            await stream.send(StageChunk(tensors={"input_ids": inputs.input_ids}, final=True))
            async for part in stream.parts():
                totals["messages"] += 1
                totals["tensor_frames"] += len(part.tensors)
                stream.assemble(part)  # maps (and, dropped, releases) shm slots as the talker would
            totals["received_bytes"] += stream.received_bytes
            totals["tensor_bytes"] += stream.tensor_bytes
            await stream.cancel()
    finally:
        await client.close()
    return {k: v / n for k, v in totals.items()}


def run_requests(url: str, c: int, n: int, max_tokens: int, talker_max: int) -> dict[str, Any]:
    def body(i: int) -> dict[str, Any]:
        return chat_body(prompt(i), max_tokens=max_tokens, talker_max=talker_max, stream=True)

    limits = httpx.Limits(max_connections=c + 4, max_keepalive_connections=c + 4)
    with httpx.Client(limits=limits) as client, ThreadPoolExecutor(c) as pool:
        t0 = time.perf_counter()
        results = list(pool.map(lambda i: stream_chat(url, body(i), client=client), range(n)))
        wall = time.perf_counter() - t0
    ok = [r for r in results if not r.error]
    lat = [r.latency for r in ok]
    return {"concurrency": c, "requests": n, "ok": len(ok), "errors": [r.error for r in results if r.error][:3],
            "wall_s": wall, "req_per_s": len(ok) / wall,
            "latency_mean_s": statistics.fmean(lat) if lat else float("nan"),
            "latency_p50_s": percentile(lat, 0.5), "without_audio": sum(1 for r in ok if r.ttfp != r.ttfp)}


def fallbacks(url: str) -> float | None:
    """The thinker's shm arena fallbacks (tensors sent inline because the arena was full), from /metrics."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    m = re.search(r'^omnimesh:shm_arena_fallbacks(?:_total)?\{[^}]*stage="thinker"[^}]*\} (\S+)$', text, re.MULTILINE)
    return float(m.group(1)) if m else None


def mesh_side(args: argparse.Namespace, model_dir: Path, concurrencies: list[int], counts: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for transport in ("grpc", "shm"):
        # shm: every tensor by reference, however small (the default --shm-min-tensor-size would send the
        # tiny model's frames inline, and the row would measure grpc twice)
        flags = ["--device", args.device, "--malloc", args.malloc, "--transport", transport, *(["--shm-min-tensor-size", "0"] if transport == "shm" else []),
                 *args.serve_args.split()]
        log(f"mesh: starting `omnimesh serve {' '.join(flags)}`")
        t = time.perf_counter()
        with MeshProcess(model_dir, *flags) as mesh:
            log(f"mesh: up in {time.perf_counter() - t:.0f} s; warming up")
            for i in range(2):
                r = stream_chat(mesh.url, chat_body(prompt(500 + i), max_tokens=args.max_tokens,
                                                    talker_max=args.talker_max_tokens, stream=True))
                if r.error:
                    raise RuntimeError(f"mesh warm-up request failed: {r.error}")
            res: dict[str, Any] = {"runs": {}}
            res["thinker_per_request"] = asyncio.run(thinker_bytes(
                mesh.stages["thinker"], model_dir, transport, 2, args.max_tokens, args.talker_max_tokens))
            for c, n in zip(concurrencies, counts):
                log(f"mesh --transport {transport}: concurrency {c}, {n} requests")
                res["runs"][str(c)] = run_requests(mesh.url, c, n, args.max_tokens, args.talker_max_tokens)
                if res["runs"][str(c)]["errors"]:
                    log(f"mesh: failures at c={c}: {res['runs'][str(c)]['errors']}")
            res["thinker_shm_fallbacks"] = fallbacks(mesh.url)
        out[transport] = res
    return out


# ----------------------------------------------------------------------------------------------- report


def size_label(nbytes: int) -> str:
    if nbytes >= MiB:
        return f"{nbytes / MiB:g} MiB"
    return f"{nbytes / 1024:g} KiB" if nbytes >= 1024 else f"{nbytes} B"


def parse_size(text: str) -> int:
    """'128' (MiB), '256B', '64KiB', '1GiB' -> bytes, rounded down to whole float32 elements (at least one)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*(B|KiB|MiB|GiB)?\s*", text)
    if not m:
        raise ValueError(f"{text!r} is not a size (e.g. 128, 256B, 64KiB)")
    scale = {"B": 1, "KiB": 1024, "MiB": MiB, "GiB": 1024 * MiB}[m.group(2) or "MiB"]
    return max(4, int(float(m.group(1)) * scale) // 4 * 4)


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown CPU"


def report_handoff(res: dict[str, Any], sizes: list[int], rows: list[tuple[str, str, int]], cuda: bool,
                   transports: list[str]) -> dict[str, Any]:
    from omnimesh.transport.chunk_codec import PIECE_BYTES

    print()
    print("Hand-off of one float32 tensor, producer process -> consumer process (median; GB = 1e9 bytes)")
    print("  hold = from the end of the producer's step to the consumer holding the assembled tensor (encode,")
    print("         gRPC stream, map / reassemble); +read = hold, then the consumer sums every element")
    print("  memcpy = dst.copy_(src) into a preallocated tensor in one process (x memcpy = GB/s / memcpy GB/s)")
    print("  CPU ms = CPU time of all threads of the producer / consumer process for the whole request (open to")
    print("         done): less sensitive than wall time to other load; wire bytes = serialized messages received")
    print("  streamed = N tensors of the size in one request, one per producer step, each dropped once held (as")
    print("         a next stage consumes chunks): N x size / (first tensor produced -> last one held), GB/s")
    print(f"  grpc = inline pieces of chunk_codec.PIECE_BYTES = {size_label(PIECE_BYTES)}"
          + ("; 'grpc N pieces' rows: the producer's piece size set to N (--piece-bytes)"
             if any(p for _, _, p in rows) else ""))
    label_w = max([10, *(len(label) + 1 for label, _, _ in rows)])
    print(f"{'size':>9}  {'transport':{label_w}}{'hold ms':>9}{'GB/s':>8}{'x memcpy':>10}{'+read ms':>10}{'GB/s':>8}"
          f"{'x memcpy':>10}{'prod CPU ms':>13}{'cons CPU ms':>13}{'wire bytes':>12}{'streamed GB/s':>16}")
    for nbytes in sizes:
        row = res[str(nbytes)]
        size = size_label(nbytes)
        copy = med(row["memcpy"]["copy_s"])
        print(f"{size:>9}  {'memcpy':{label_w}}{copy * 1e3:9.3f}{nbytes / copy / 1e9:8.2f}{1:10.2f}{'':>10}{'':>8}"
              f"{'':>10}{'':>13}{copy * 1e3:13.3f}{'-':>12}")
        for label, mode, _ in rows:
            base = med(row["memcpy-cuda"]["copy_s"]) if mode == "cuda-ipc" else copy
            r = row[label]
            hold, read = med(r["hold_s"]), med(r["read_s"])
            r["hold_gbps"], r["read_gbps"] = nbytes / hold / 1e9, nbytes / read / 1e9
            r["hold_x_memcpy"], r["read_x_memcpy"] = base / hold, base / read
            r["stream_gbps"] = stream_count(nbytes) * nbytes / med(r["stream_s"]) / 1e9
            print(f"{size:>9}  {label:{label_w}}{hold * 1e3:9.3f}{r['hold_gbps']:8.2f}{r['hold_x_memcpy']:10.2f}"
                  f"{read * 1e3:10.3f}{r['read_gbps']:8.2f}{r['read_x_memcpy']:10.2f}"
                  f"{med(r['producer_cpu_s']) * 1e3:13.3f}{med(r['consumer_cpu_s']) * 1e3:13.3f}"
                  f"{int(med(r['wire_bytes'])):12d}{stream_count(nbytes):>6d} x{r['stream_gbps']:8.2f}")
        if "cuda-ipc" in transports and not cuda:
            print(f"{size:>9}  {'cuda-ipc':{label_w}}n/a (no CUDA device)")
        elif cuda and "memcpy-cuda" in row:
            print(f"{'':>9}  (cuda-ipc: x memcpy against a device-to-device copy_ of the same size, "
                  f"{nbytes / med(row['memcpy-cuda']['copy_s']) / 1e9:.1f} GB/s)")
    labels = {label for label, _, _ in rows}
    targets: dict[str, Any] = {}
    big = str(128 * MiB)
    print()
    if big in res and "shm" in labels:
        x = res[big]["shm"]["hold_x_memcpy"]
        ok = x >= TARGET_SHM_X_MEMCPY
        targets["shm_128MiB_x_memcpy"] = {"value": x, "target": f">= {TARGET_SHM_X_MEMCPY}", "pass": ok}
        print(f"{'PASS' if ok else 'FAIL'}  shm at 128 MiB: {x:.0%} of memcpy (hold; target >= "
              f"{TARGET_SHM_X_MEMCPY:.0%}); with the consumer reading every byte: "
              f"{res[big]['shm']['read_x_memcpy']:.0%}")
    else:
        print("n/a   shm at 128 MiB: not measured (needs 128 in --sizes and shm in --transports)")
    if "grpc" in labels:
        for nbytes in [n for n in sizes if n >= MiB]:  # a throughput target: small tensors measure latency
            g, st = res[str(nbytes)]["grpc"]["hold_gbps"], res[str(nbytes)]["grpc"]["stream_gbps"]
            ok = st >= TARGET_GRPC_GBPS
            targets[f"grpc_{size_label(nbytes).replace(' ', '')}_gbps"] = {
                "value": st, "hold": g, "target": f">= {TARGET_GRPC_GBPS}", "pass": ok}
            print(f"{'PASS' if ok else 'FAIL'}  inline gRPC at {size_label(nbytes)}: {st:.2f} GB/s streamed, "
                  f"{g:.2f} GB/s for one tensor alone (hold) (target >= {TARGET_GRPC_GBPS:g} GB/s)")
    return targets


def report_mesh(res: dict[str, Any], concurrencies: list[int], args: argparse.Namespace) -> None:
    print()
    print(f"Mesh, thinker -> talker edge: `omnimesh serve --transport grpc | shm`, tiny model unless --model; "
          f"audio-out chat, thinker {args.max_tokens} tokens, talker {args.talker_max_tokens} code groups, streamed")
    print(f"{'transport':10}{'c':>4}{'reqs':>6}{'err':>5}{'req/s':>8}{'x grpc':>8}{'mean s':>9}{'p50 s':>8}"
          f"{'thinker msg B/req':>19}{'tensor B/req':>14}{'msgs/req':>10}{'frames/req':>12}")
    for c in concurrencies:
        for transport in ("grpc", "shm"):
            if transport not in res:
                continue
            r = res[transport]["runs"][str(c)]
            p = res[transport]["thinker_per_request"]
            g = res.get("grpc", {}).get("runs", {}).get(str(c))
            x = r["req_per_s"] / g["req_per_s"] if g and g["req_per_s"] else float("nan")
            print(f"{transport:10}{c:4}{r['requests']:6}{r['requests'] - r['ok']:5}{r['req_per_s']:8.2f}{x:8.2f}"
                  f"{r['latency_mean_s']:9.3f}{r['latency_p50_s']:8.3f}{p['received_bytes']:19.0f}"
                  f"{p['tensor_bytes']:14.0f}{p['messages']:10.1f}{p['tensor_frames']:12.1f}")
    print("  thinker msg B/req: serialized bytes of the thinker's messages to the gateway per request; tensor B/req:")
    print("  the tensor bytes those frames describe (inline or by reference); measured by a client opening the")
    print("  thinker stream as the gateway does (2 requests, same prompts and token limits).")
    if "shm" in res and res["shm"].get("thinker_shm_fallbacks") is not None:
        print(f"  thinker shm arena fallbacks to inline during the shm run: {res['shm']['thinker_shm_fallbacks']:.0f}")


def main() -> int:
    tune_malloc()  # as every stage and the gateway do (the producer is a stage: run_stage does it there)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="256B,1,16,128",
                    help="tensor sizes, comma-separated, in MiB unless they end in B, KiB or GiB; 256B is one "
                         "token_embeds frame of the tiny model (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=7, help="timed hand-offs per transport and size (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed hand-offs first (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads of producer, consumer and memcpy (default: what a mesh stage "
                         "uses here)")
    ap.add_argument("--transports", default="shm,grpc,cuda-ipc",
                    help="hand-off transports (cuda-ipc only with a CUDA device) (default: %(default)s)")
    ap.add_argument("--skip-handoff", action="store_true", help="only the mesh part")
    ap.add_argument("--skip-mesh", action="store_true", help="only the hand-off part")
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: the built-in tiny Qwen3-Omni)")
    ap.add_argument("--device", default="auto", help="mesh device: auto, cpu or cuda (default: %(default)s)")
    ap.add_argument("--concurrency", default="1,16", help="mesh requests in flight (default: %(default)s)")
    ap.add_argument("--mesh-requests", default="16,32", help="requests per concurrency (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=32, help="thinker tokens per request (default: %(default)s)")
    ap.add_argument("--talker-max-tokens", type=int, default=32, help="talker code groups (default: %(default)s)")
    ap.add_argument("--serve-args", default="", help="extra `omnimesh serve` flags, one string")
    ap.add_argument("--malloc", default="auto", choices=MALLOC_CHOICES,
                    help="allocator of every process here: this one and the producer it starts re-execute / inherit "
                         "it, the meshes get it as --malloc (default: %(default)s, what omnimesh runs on)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here as JSON")
    ap.add_argument("--grpc-option", action="append", default=[], metavar="KEY=VALUE",
                    help="experiment: add a gRPC channel / server option in both hand-off processes, e.g. "
                         "grpc.http2.max_frame_size=1048576 (repeatable; default: omnimesh's GRPC_OPTIONS)")
    ap.add_argument("--piece-bytes", default="",
                    help="experiment: extra inline gRPC rows with these producer piece sizes in bytes, e.g. "
                         "262144,1048576 (interleaved with the default rows)")
    ap.add_argument("--serve-source", action="store_true", help=argparse.SUPPRESS)  # the producer process
    ap.add_argument("--arena-bytes", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.reps < 1 or args.warmup < 1:
        ap.error("--reps and --warmup need at least 1 (the first warm-up hand-off is checked bit for bit)")
    apply_grpc_options(args.grpc_option)
    if args.serve_source:  # the producer: it inherits the consumer's LD_PRELOAD (below)
        serve_source(args.arena_bytes)
        return 0
    args.device = resolve_device(args.device)
    log(f"malloc: {use_allocator(args.malloc, args.device)} (--malloc {args.malloc}; every process of this bench)")

    from omnimesh.server.stage_server import cpu_threads

    if args.threads is None:
        args.threads = cpu_threads()
    torch.set_num_threads(args.threads)
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError as exc:
        ap.error(f"--sizes: {exc}")
    cuda = torch.cuda.is_available()
    transports = [m.strip() for m in args.transports.split(",") if m.strip()]
    if any(m not in ("shm", "grpc", "cuda-ipc") for m in transports):
        ap.error("--transports: shm, grpc, cuda-ipc")
    rows = variants([m for m in transports if m != "cuda-ipc" or cuda],
                    [int(x) for x in args.piece_bytes.split(",") if x.strip()])
    concurrencies = [int(x) for x in args.concurrency.split(",") if x.strip()]
    counts = [int(x) for x in args.mesh_requests.split(",") if x.strip()]
    if len(counts) == 1:
        counts *= len(concurrencies)
    if len(counts) != len(concurrencies):
        ap.error("--mesh-requests needs one count, or one per --concurrency value")
    machine = machine_info()
    machine["cpu_model"] = cpu_model()
    started = time.perf_counter()
    load0 = os.getloadavg()[0]

    doc: dict[str, Any] = {"machine": machine, "settings": {k: str(v) if isinstance(v, Path) else v
                                                            for k, v in vars(args).items()}}
    handoff = asyncio.run(handoff_side(args, sizes, rows)) if not args.skip_handoff else None
    mesh = None
    if not args.skip_mesh:
        model_dir = model_folder(args.model)
        mesh = mesh_side(args, model_dir, concurrencies, counts)

    print(f"machine: {machine['cpu_model']}, {machine['cpu_count']} CPUs ({machine['cpus_usable']} usable), "
          f"{machine['cuda'] or 'no CUDA'}; torch {machine['torch']}, python {machine['python']}; "
          f"torch threads per process {args.threads}; load average (1 min) {load0:.2f} at start, "
          f"{os.getloadavg()[0]:.2f} at end; commit {machine['commit']}; {machine['date']}"
          + (f"; GLIBC_TUNABLES={os.environ['GLIBC_TUNABLES']}" if os.environ.get("GLIBC_TUNABLES") else ""))
    if handoff is not None:
        doc["handoff"] = handoff
        doc["targets"] = report_handoff(handoff, sizes, rows, cuda, transports)
    if mesh is not None:
        doc["mesh"] = mesh
        report_mesh(mesh, concurrencies, args)
    print(f"(whole run {time.perf_counter() - started:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2, default=str) + "\n")
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
