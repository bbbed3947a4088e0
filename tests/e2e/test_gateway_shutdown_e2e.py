"""A gateway stopped with SIGTERM (gateway/server.py) while a streamed REST chat, a streamed gRPC Generate and
a spoken Realtime response are in flight: all three finish whole, the Realtime session is then told why
(`server_shutting_down`) and closed with 1012, and the gateway exits 0 within `omnimesh serve`'s 10 s. A second
gateway on the shared mesh's stages, real clients on loopback."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import httpx
from mesh_harness import REALTIME_BETA, free_port, start_gateway
from websockets.exceptions import ConnectionClosedError
from websockets.sync.client import connect

from omnimesh.v1 import omni_pb2, omni_pb2_grpc, stage_pb2

MODEL = "tiny-qwen3-omni"
TOKENS = 600  # ignore_eos: a few seconds of streaming here, most of it after the signal
TIMEOUT_S = 120.0
STOP_WITHIN_S = 10.0  # omnimesh serve's wait for its gateway (omnimesh/launcher.py STOP_GRACE_S)


def _rest(url: str, started: threading.Event) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the sea."}], "stream": True,
            "max_tokens": TOKENS, "ignore_eos": True, "temperature": 0, "modalities": ["text"],
            "stream_options": {"include_usage": True}}
    chunks, done = [], False
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=TIMEOUT_S) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
                started.set()
    return {"done": done, "usage": chunks[-1].get("usage"),
            "finish": [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")][-1]}


def _grpc(address: str, started: threading.Event) -> dict[str, Any]:
    req = omni_pb2.GenerateRequest(
        model=MODEL, modalities=["text"],
        messages=[omni_pb2.ChatMessage(role="user", content=[omni_pb2.ContentPart(text="Tell me about the sea.")])],
        sampling=stage_pb2.SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True))
    out = []
    with grpc.insecure_channel(address) as ch:
        for response in omni_pb2_grpc.OmniStub(ch).Generate(req, timeout=TIMEOUT_S):
            out.append(response)
            started.set()
    return {"last": out[-1]}


def _realtime(url: str, started: threading.Event) -> dict[str, Any]:
    events = []
    with connect(url.replace("http://", "ws://") + f"/v1/realtime?model={MODEL}",
                 additional_headers=REALTIME_BETA, open_timeout=TIMEOUT_S) as ws:
        ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell me about the sea."}]}}))
        ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": 200}}))
        try:
            while True:
                events.append(json.loads(ws.recv(timeout=TIMEOUT_S)))
                if events[-1]["type"] == "response.audio.delta":
                    started.set()
        except ConnectionClosedError:
            pass
        return {"events": events, "close": (ws.close_code, ws.close_reason)}


def test_sigterm_finishes_what_is_in_flight_on_every_front(mesh, tiny_model_dir) -> None:
    grpc_port = free_port()
    gw, url = start_gateway(tiny_model_dir, mesh.stages, "--grpc-port", str(grpc_port))
    try:
        clients: list[tuple[str, Callable[..., dict[str, Any]], str]] = [
            ("rest", _rest, url), ("grpc", _grpc, f"127.0.0.1:{grpc_port}"), ("realtime", _realtime, url)]
        results: dict[str, Any] = {}
        started = {name: threading.Event() for name, _, _ in clients}

        def run(name: str, fn: Callable[..., dict[str, Any]], where: str) -> None:
            try:
                results[name] = fn(where, started[name])
            except BaseException as e:  # noqa: BLE001  # reported below, by client
                results[name] = e
                started[name].set()

        threads = [threading.Thread(target=run, args=c, daemon=True) for c in clients]
        for t in threads:
            t.start()
        for name, event in started.items():
            assert event.wait(TIMEOUT_S), f"{name}: nothing streamed"
        assert not any(isinstance(r, BaseException) for r in results.values()), results  # all still running
        os.killpg(gw.proc.pid, signal.SIGTERM)
        signalled = time.monotonic()
        for t in threads:
            t.join(TIMEOUT_S)
        assert gw.proc.wait(timeout=STOP_WITHIN_S + 5) == 0, gw.output()
        assert time.monotonic() - signalled < STOP_WITHIN_S, gw.output()
        errors = {k: v for k, v in results.items() if isinstance(v, BaseException)}
        assert not errors, f"{errors}\n{gw.output()}"
        rest = results["rest"]  # whole: every token, the usage chunk, [DONE]
        assert rest["done"] and rest["finish"] == "length" and rest["usage"]["completion_tokens"] == TOKENS
        last = results["grpc"]["last"]
        assert last.WhichOneof("kind") == "done" and last.done.finish_reason == "length"
        assert last.done.usage.completion_tokens == TOKENS
        events = results["realtime"]["events"]
        done = [e for e in events if e["type"] == "response.done"]
        assert len(done) == 1 and done[0]["response"]["status"] in ("completed", "incomplete"), done
        assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "server_shutting_down"
        assert results["realtime"]["close"] == (1012, "server shutting down")
    finally:
        gw.stop()
