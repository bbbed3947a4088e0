"""Test harness for the gateway front ends: a scripted `Pipeline` double and real servers on loopback.

Role: `ScriptedPipeline` yields the events a test scripts (and raises `PipelineError` where told), so the
REST and gRPC front ends are tested against the `Pipeline` protocol without any stage running.
`RestServer` runs a FastAPI app under uvicorn in a thread on a pre-bound 127.0.0.1 socket (no port race)
and stops it with a bounded join; `GrpcServer` runs a `grpc.aio` server on its own event loop thread.
Imported by tests, never by the package.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import numpy as np
import uvicorn

from gateway.events import AudioDelta, ChatRequest, Event, Finished, PipelineError, TextDelta
from gateway.grpc_api import create_grpc_server
from gateway.input_limits import InputLimits

SAMPLE_RATE = 24_000


def tone(seconds: float, freq: float = 440.0, rate: int = SAMPLE_RATE, amp: float = 0.5) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)  # (samples,)


def default_script(request: ChatRequest) -> list[Event | BaseException]:
    """Two text deltas, then (when audio is asked for) two 0.1 s audio chunks, then Finished."""
    events: list[Event | BaseException] = [TextDelta("Hello"), TextDelta(" world")]
    if "audio" in request.modalities:
        wave = tone(0.2)
        events += [AudioDelta(wave[:2400], SAMPLE_RATE), AudioDelta(wave[2400:], SAMPLE_RATE)]
    events.append(Finished(finish_reason="stop", prompt_tokens=7, completion_tokens=2))
    return events


class ScriptedPipeline:
    """A `Pipeline` whose events come from `script(request)`; exceptions in the list are raised there."""

    served_models: tuple[str, ...] = ("tiny-omni",)
    voices: tuple[str, ...] = ("Ethan", "Chelsie")
    no_audio: str | None = None
    media_budget = None  # decodes and builds are not bounded here
    default_voice = "Ethan"
    sample_rate = SAMPLE_RATE

    def __init__(self) -> None:
        self.script: Callable[[ChatRequest], list[Event | BaseException]] = default_script
        self.requests: list[ChatRequest] = []
        self.closed: list[str] = []  # request ids whose event iterator was closed (finished or abandoned)
        self.stages: dict[str, bool] = {"encoder": True, "thinker": True, "talker": True, "vocoder": True}
        self.event_delay_s = 0.0

    def reset(self) -> None:
        self.script = default_script
        self.requests.clear()
        self.closed.clear()
        self.stages = {k: True for k in self.stages}
        self.event_delay_s = 0.0

    async def run(self, request: ChatRequest) -> AsyncIterator[Event]:
        self.requests.append(request)
        try:
            for item in self.script(request):
                if self.event_delay_s:
                    await asyncio.sleep(self.event_delay_s)
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.closed.append(request.request_id)

    async def health(self) -> dict[str, bool]:
        return dict(self.stages)

    def building(self, request: ChatRequest) -> contextlib.AbstractAsyncContextManager[None]:
        return contextlib.nullcontext()  # no media budget: scripted prompts are built by no processor


def stage_down(stage: str = "talker") -> PipelineError:
    return PipelineError(f"stage '{stage}' is not serving (connection refused)", http_status=503, grpc_code=14,
                         kind="service_unavailable")


def _loopback_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


class RestServer:
    """uvicorn serving `app` from a background thread; `with RestServer(app) as s: s.base_url`."""

    def __init__(self, app: Any) -> None:
        self._sock = _loopback_socket()
        self.port = self._sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name="uvicorn-test", daemon=True)

    def start(self, timeout_s: float = 10.0) -> RestServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start within {timeout_s} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout_s)
        self._sock.close()
        if self._thread.is_alive():
            raise RuntimeError(f"uvicorn did not stop within {timeout_s} s")

    def __enter__(self) -> RestServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class GrpcServer:
    """A `grpc.aio` server with `OmniServicer(pipeline)` + health + reflection on its own loop thread."""

    def __init__(self, pipeline: Any, limits: InputLimits | None = None, api_keys: tuple[str, ...] = (),
                 max_logprobs: int = 20, auto_tool_choice: bool = False, reasoning: Any = None) -> None:
        self.pipeline = pipeline
        self.auto_tool_choice = auto_tool_choice
        self.reasoning = reasoning
        self.limits = limits or InputLimits()
        self.max_logprobs = max_logprobs
        self.api_keys = api_keys
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="grpc-test", daemon=True)
        self.port = 0
        self.server: grpc.aio.Server | None = None
        self.health: Any = None

    async def _start(self) -> None:
        self.server, self.health = await create_grpc_server(self.pipeline, limits=self.limits, api_keys=self.api_keys,
                                                            max_logprobs=self.max_logprobs,
                                                            auto_tool_choice=self.auto_tool_choice,
                                                            reasoning=self.reasoning)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()

    def call(self, coro: Any, timeout_s: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def start(self) -> GrpcServer:
        self._thread.start()
        self.call(self._start())
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.server is not None:
            self.call(self.server.stop(grace=1.0), timeout_s)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise RuntimeError(f"the gRPC server thread did not stop within {timeout_s} s")
        self.loop.close()

    def __enter__(self) -> GrpcServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"
