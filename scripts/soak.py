"""Soak check: mixed traffic against a running mesh, round after round; fails on any unexpected answer or on
anything a round leaves behind.

Role: what an operator (or a test) runs before trusting a build with real traffic. Each round sends
`--requests` requests, `--concurrency` at a time, cycling through KINDS: plain and streamed chat, audio and
image input, speech out, transcription, Responses, legacy completions with n=2, a Realtime session's spoken
turn, a gRPC Generate of three choices, and the paths that end early (a client that leaves after the first
event or times out mid-stream, a gRPC call cancelled after its first response, a broken image, a prompt over
max-model-len). After the round it waits up to `--drain-s` for every stage to settle: no request running, no
shared-memory slot held, no KV block in use (the gateway's /metrics). It prints per round the answers by kind,
the settle time, and the resident anonymous memory of every omnimesh process on this host, so growth across
rounds shows (a leak, or a pool being touched for the first time).

    python scripts/soak.py --rounds 5 --requests 400 --concurrency 24   # against localhost:8000

Exit status 1 when a request got an answer its kind does not expect (a 500, a 400 for good input, a broken
connection) or a round did not settle. Found at its first runs: a cancel racing a step failed whole batches
with 500s, a thinker's memory grew with every request (its KV blocks were taken round-robin), and the ranks
of a pp x tp stage died after two idle minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import re
import sys
import time
from collections import Counter
from pathlib import Path

import grpc
import httpx
import numpy as np
import websockets

from gateway.audio_encoding import pcm16_bytes, wav_bytes
from omnimesh.v1 import omni_pb2, omni_pb2_grpc, stage_pb2

LEFT = "left"  # the client gave up on purpose
SETTLE_GAUGES = ("omnimesh:num_requests_running", "omnimesh:shm_arena_slots_in_use", "omnimesh:kv_cache_usage_perc")


def tone(seconds: float, rate: int, freq: float) -> np.ndarray:
    """A sine of amplitude 0.3, float samples (the gateway's encoders make WAV or pcm16 of it)."""
    return 0.3 * np.sin(2 * np.pi * freq * np.arange(int(rate * seconds)) / rate)


def png_b64() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray((np.random.default_rng(0).random((64, 64, 3)) * 255).astype("uint8")).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


class Traffic:
    """One request of each kind; each returns its HTTP status or LEFT."""

    def __init__(self, client: httpx.AsyncClient, model: str, grpc_stub: omni_pb2_grpc.OmniStub, timeout: float):
        self.c, self.model, self.stub, self.timeout = client, model, grpc_stub, timeout
        self.wav, self.png = wav_bytes(tone(1.0, 16000, 440.0), 16000), png_b64()
        self.ws_url = str(client.base_url).replace("http", "ws", 1).rstrip("/") + f"/v1/realtime?model={model}"

    def chat(self, i: int, **body: object) -> dict:
        return {"model": self.model, "messages": [{"role": "user", "content": f"hello there {i}"}], **body}

    async def text(self, i: int) -> int | str:
        body = self.chat(i, max_tokens=8, modalities=["text"])
        return (await self.c.post("/v1/chat/completions", json=body)).status_code

    async def stream_cut(self, i: int) -> int | str:
        async with self.c.stream("POST", "/v1/chat/completions", json=self.chat(i, max_tokens=16, stream=True)) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    return LEFT
        return r.status_code

    async def audio_in(self, i: int) -> int | str:
        part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(self.wav).decode(), "format": "wav"}}
        body = self.chat(i, max_tokens=8)
        body["messages"] = [{"role": "user", "content": [part, {"type": "text", "text": "what is it?"}]}]
        return (await self.c.post("/v1/chat/completions", json=body)).status_code

    async def image_in(self, i: int) -> int | str:
        part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + self.png}}
        body = self.chat(i, max_tokens=8, modalities=["text"])
        body["messages"] = [{"role": "user", "content": [part, {"type": "text", "text": "what is it?"}]}]
        return (await self.c.post("/v1/chat/completions", json=body)).status_code

    async def transcription(self, i: int) -> int | str:
        form = {"model": self.model, "max_completion_tokens": "6"}
        r = await self.c.post("/v1/audio/transcriptions", data=form, files={"file": ("a.wav", self.wav, "audio/wav")})
        return r.status_code

    async def responses(self, i: int) -> int | str:
        body = {"model": self.model, "input": f"hi {i}", "max_output_tokens": 8}
        return (await self.c.post("/v1/responses", json=body)).status_code

    async def broken_image(self, i: int) -> int | str:
        body = self.chat(i)
        body["messages"] = [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
        return (await self.c.post("/v1/chat/completions", json=body)).status_code

    async def speech(self, i: int) -> int | str:
        body = {"model": self.model, "input": f"hello number {i}", "voice": "ethan"}
        return (await self.c.post("/v1/audio/speech", json=body)).status_code

    async def completions(self, i: int) -> int | str:
        body = {"model": self.model, "prompt": f"The sea {i}", "max_tokens": 6, "logprobs": 2, "n": 2,
                "temperature": 0.7}
        return (await self.c.post("/v1/completions", json=body)).status_code

    async def audio_stream(self, i: int) -> int | str:
        async with self.c.stream("POST", "/v1/chat/completions", json=self.chat(i, max_tokens=12, stream=True)) as r:
            async for _ in r.aiter_lines():
                pass
        return r.status_code

    async def too_long(self, i: int) -> int | str:
        body = self.chat(i, max_tokens=4)
        body["messages"] = [{"role": "user", "content": "word " * 40000}]
        return (await self.c.post("/v1/chat/completions", json=body)).status_code

    async def timeout_mid_stream(self, i: int) -> int | str:
        try:
            async with self.c.stream("POST", "/v1/chat/completions", json=self.chat(i, max_tokens=30, stream=True),
                                     timeout=0.08) as r:
                async for _ in r.aiter_lines():
                    pass
        except httpx.TimeoutException:
            return LEFT
        return r.status_code

    async def realtime_turn(self, i: int) -> int | str:
        """A Realtime session: one spoken turn (24 kHz pcm16), answered to its `response.done`."""
        pcm = pcm16_bytes(tone(1.0, 24000, 300.0))
        async with websockets.connect(self.ws_url, max_size=2**26, open_timeout=60) as ws:
            for event in ({"type": "session.update", "session": {"type": "realtime", "max_output_tokens": 8}},
                          {"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()},
                          {"type": "input_audio_buffer.commit"}, {"type": "response.create"}):
                await ws.send(json.dumps(event))
            while True:
                event = json.loads(await asyncio.wait_for(ws.recv(), self.timeout))
                if event["type"] == "error":
                    return f"error:{event['error'].get('code')}"
                if event["type"] == "response.done":  # incomplete: it reached max_response_output_tokens
                    status = event["response"]["status"]
                    return 200 if status in ("completed", "incomplete") else status

    def generate(self, i: int) -> grpc.aio.UnaryStreamCall:
        message = omni_pb2.ChatMessage(role="user", content=[omni_pb2.ContentPart(text=f"hi {i}")])
        return self.stub.Generate(omni_pb2.GenerateRequest(model=self.model, messages=[message], n=3,
                                                           sampling=stage_pb2.SamplingParams(max_tokens=8)),
                                  timeout=self.timeout)

    async def grpc_choices(self, i: int) -> int | str:
        """gRPC Generate with n=3: every choice ends with its `done`."""
        done = 0
        async for response in self.generate(i):
            if response.WhichOneof("kind") == "error":
                return f"error:{response.error.code}"
            done += response.WhichOneof("kind") == "done"
        return 200 if done == 3 else f"{done} of 3 choices done"

    async def grpc_cancel(self, i: int) -> int | str:
        call = self.generate(i)
        async for _ in call:
            call.cancel()
            return LEFT
        return 200


# kind -> the answers it may get (LEFT: the client left on purpose; 200 when the answer beat it)
KINDS: dict[str, set[int | str]] = {
    "text": {200}, "stream_cut": {LEFT, 200}, "audio_in": {200}, "image_in": {200}, "transcription": {200},
    "responses": {200}, "broken_image": {400}, "speech": {200}, "completions": {200}, "audio_stream": {200},
    "too_long": {400}, "timeout_mid_stream": {LEFT, 200}, "realtime_turn": {200}, "grpc_choices": {200},
    "grpc_cancel": {LEFT, 200},
}


def gauges(text: str) -> dict[str, float]:
    """The settle gauges' samples (name{labels} -> value) from Prometheus text."""
    out = {}
    for line in text.splitlines():
        if line.startswith(SETTLE_GAUGES):
            key, _, val = line.rpartition(" ")
            out[key] = float(val)
    return out


def rss_by_process() -> dict[str, int]:
    """RssAnon (MiB) of every omnimesh process on this host (stages, their rank processes, the gateway), by
    role and pid."""
    procs: dict[int, tuple[int, str, int]] = {}  # pid -> (parent pid, command line, RssAnon KiB)
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            status = (entry / "status").read_text()
        except OSError:
            continue
        anon, parent = re.search(r"RssAnon:\s+(\d+)", status), re.search(r"PPid:\s+(\d+)", status)
        if anon and parent:
            procs[int(entry.name)] = (int(parent.group(1)), cmd, int(anon.group(1)))
    roles: dict[int, str] = {}
    for pid, (_, cmd, _) in procs.items():
        if role := re.search(r"omnimesh(?:\.cli)? (stage \w+|gateway)\b", cmd):
            roles[pid] = role.group(1)
    for pid, (ppid, cmd, _) in procs.items():
        if pid not in roles and ppid in roles:  # a stage's rank process, the gateway's video decoder server
            roles[pid] = f"{roles[ppid]} {'rank' if 'spawn_main' in cmd else 'helper'}"
    return {f"{role} ({pid})": procs[pid][2] // 1024 for pid, role in sorted(roles.items(), key=lambda r: r[1])}


async def settle(client: httpx.AsyncClient, limit_s: float) -> tuple[float, dict[str, float]]:
    """Wait until every settle gauge is 0 -> (seconds it took, the gauges left non-zero at the limit)."""
    t0 = time.monotonic()
    while True:
        left = {k: v for k, v in gauges((await client.get("/metrics")).text).items() if v}
        if not left or time.monotonic() - t0 > limit_s:
            return time.monotonic() - t0, left
        await asyncio.sleep(0.2)


async def soak(url: str, grpc_address: str, rounds: int, requests: int, concurrency: int, kinds: list[str],
               drain_s: float, client_timeout: float = 300.0, out=sys.stdout) -> int:
    failed = False
    async with (httpx.AsyncClient(base_url=url, timeout=client_timeout) as client,
                grpc.aio.insecure_channel(grpc_address) as ch):
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        traffic = Traffic(client, model, omni_pb2_grpc.OmniStub(ch), client_timeout)
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int) -> tuple[str, int | str]:
            kind = kinds[i % len(kinds)]
            async with gate:
                try:
                    return kind, await getattr(traffic, kind)(i)
                except (httpx.HTTPError, grpc.aio.AioRpcError, websockets.WebSocketException, OSError,
                        asyncio.TimeoutError) as exc:
                    return kind, type(exc).__name__

        for n in range(rounds):
            t0 = time.monotonic()
            answers = Counter(await asyncio.gather(*(one(i) for i in range(requests))))
            took = time.monotonic() - t0
            settled_s, left = await settle(client, drain_s)
            bad = {f"{k}:{s}": c for (k, s), c in answers.items() if s not in KINDS[k]}
            failed |= bool(bad or left)
            by_kind: dict[str, list[str]] = {}
            for (kind, status), count in sorted(answers.items(), key=str):
                by_kind.setdefault(kind, []).append(f"{status}x{count}")
            summary = ", ".join(f"{kind} {'/'.join(seen)}" for kind, seen in by_kind.items())
            print(f"round {n + 1}/{rounds}: {requests} requests in {took:.1f}s ({summary}); settled in "
                  f"{settled_s:.1f}s", file=out)
            if bad:
                print(f"  UNEXPECTED answers: {bad}", file=out)
            if left:
                print(f"  NOT SETTLED after {drain_s:.0f}s: {left}", file=out)
            if rss := rss_by_process():
                print("  RssAnon MiB: " + ", ".join(f"{k} {v}" for k, v in rss.items()), file=out)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway (default: %(default)s)")
    p.add_argument("--grpc", default="127.0.0.1:8001", help="the gateway's gRPC API (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=240, help="per round (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=24)
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated, from: " + ", ".join(KINDS))
    p.add_argument("--drain-s", type=float, default=30.0, help="how long a round may take to settle")
    p.add_argument("--client-timeout", type=float, default=300.0,
                   help="seconds a client waits for an answer before it counts as unexpected (default: %(default)s; "
                        "more for a slow mesh: the tiny Qwen2.5-Omni's talker speaks to its max length)")
    a = p.parse_args(argv)
    kinds = a.kinds.split(",")
    if unknown := [k for k in kinds if k not in KINDS]:
        p.error(f"unknown kinds {unknown}; choose from {', '.join(KINDS)}")
    return asyncio.run(soak(a.url, a.grpc, a.rounds, a.requests, a.concurrency, kinds, a.drain_s, a.client_timeout))


if __name__ == "__main__":
    sys.exit(main())
