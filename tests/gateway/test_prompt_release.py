"""A request's built prompt is let go at its first event (gateway/pipeline.py `_HeldPrompt`): its media tensors
(a minute of 720p video is ~0.9 GB of float32 patches at Qwen3-Omni's sizes) are freed while the answer streams,
by reference counting, not kept for as long as the request lasts; before the first event a failed attempt still
runs again with them. The request's decoded media go too, once every choice has built
(gateway/media_release.py). Real encoder and thinker stages on loopback gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import weakref
from collections.abc import AsyncIterator, Callable

import numpy as np
import torch

from gateway.events import ChatMessage, ChatRequest, Finished, TextDelta
from gateway.pipeline import StagePipeline
from gateway.prompt import PromptInputs
from omnimesh.engine.loop import EngineLoop
from omnimesh.engine.task import StageTask
from omnimesh.transport.frames import StageChunk
from omnimesh.transport.stage_client import StageClient
from omnimesh.v1 import stage_pb2
from tests.gateway.test_replicas import WordTask
from tests.stage_harness import served_stage


class EncodeTask(StageTask):
    """One output part (stand-in embeddings) for the media it was fed."""

    def __init__(self, rid: str) -> None:
        super().__init__(rid)
        self.fed = False

    def feed(self, chunk: StageChunk) -> None:
        assert "pixel_values" in chunk.tensors
        self.fed = True

    def ready(self) -> bool:
        return self.fed and not self.finished

    def step(self) -> list[StageChunk]:
        self.finished = True
        return [StageChunk(tensors={"embeds": torch.zeros(4, 8)})]


class TwoWordTask(WordTask):
    """A first word at once; the second only when the test opens `gate` (the answer is still streaming)."""

    def step(self) -> list[StageChunk]:
        if self.steps == 1:
            assert self.gate is not None and self.gate.wait(30.0), "the test never opened the gate"
        self.steps += 1
        self.completion_tokens = self.steps
        self.finished = self.steps == 2
        return [StageChunk(text=f"{self.word}{self.steps} ")]


class Stage:
    def __init__(self, name: str, gate: threading.Event) -> None:
        self.name, self.gate = name, gate

    def info(self) -> stage_pb2.StageInfo:
        return stage_pb2.StageInfo(stage=self.name, model="m", host_id="h")

    def open(self, msg: stage_pb2.Open) -> StageTask:
        return EncodeTask(msg.request_id) if self.name == "encoder" else TwoWordTask(msg.request_id, "w", False, self.gate)


@contextlib.asynccontextmanager
async def _pipeline(gate: threading.Event,
                    build: Callable[[ChatRequest], PromptInputs]) -> AsyncIterator[StagePipeline]:
    """A StagePipeline over a real encoder and thinker stage on loopback, building prompts with `build`."""
    async with served_stage(Stage("encoder", gate), EngineLoop("encoder")) as enc, \
            served_stage(Stage("thinker", gate), EngineLoop("thinker")) as thk:
        pipe = StagePipeline({"encoder": [StageClient("encoder", f"127.0.0.1:{enc.port}")],
                              "thinker": [StageClient("thinker", f"127.0.0.1:{thk.port}")]},
                             build, served_models=("m",))
        await pipe.connect(timeout_s=10.0)
        try:
            yield pipe
        finally:
            await pipe.close()


async def test_the_prompts_media_is_freed_at_the_first_event() -> None:
    gate, pixels = threading.Event(), []

    def build(request: ChatRequest) -> PromptInputs:  # an image's patches, watched by a weak reference
        patches = torch.zeros(16, 1176)
        pixels.append(weakref.ref(patches))
        return PromptInputs(torch.arange(5), None, None, patches, torch.tensor([[1, 4, 4]]), 5)

    request = ChatRequest(request_id="r0", model="m", modalities=("text",),
                          messages=(ChatMessage(role="user", content=()),))
    async with _pipeline(gate, build) as pipe:
        gc.disable()  # freed by reference counting alone: full collections are rare in a gateway (a frozen heap)
        try:
            events = pipe.run(request)
            first = await anext(events)
            assert isinstance(first, TextDelta) and first.text == "w1 "
            assert len(pixels) == 1 and pixels[0]() is None  # gone while the answer is still streaming
            gate.set()
            rest = [event async for event in events]
        finally:
            gc.enable()
        assert "".join(e.text for e in rest if isinstance(e, TextDelta)) == "w2 "
        assert isinstance(rest[-1], Finished) and rest[-1].prompt_tokens == 5


async def test_the_decoded_media_go_once_every_run_has_built() -> None:
    """The decoded frames (gateway/media_release.py), shared by two runs through `fan_out` (as a request's parts
    are by its runs): they stay while one run has yet to build its prompt (the other's answer has started), then
    go once it has, while the answers still stream; both builds saw them."""
    from gateway.choices import fan_out
    from gateway.events import VideoPart

    gate, second_may_build, built_from = threading.Event(), threading.Event(), []

    def build(request: ChatRequest) -> PromptInputs:
        if request.request_id == "v1":
            assert second_may_build.wait(30.0)
        video = request.messages[0].content[0]
        assert isinstance(video, VideoPart) and not video.released
        built_from.append(video.frames.shape)
        return PromptInputs(torch.arange(5), None, None, torch.zeros(16, 1176), torch.tensor([[1, 4, 4]]), 5)

    frames = np.zeros((4, 32, 32, 3), np.uint8)
    watched = weakref.ref(frames)
    content = (VideoPart(frames, 2.0),)
    runs = [ChatRequest(request_id=f"v{i}", model="m", modalities=("text",),
                        messages=(ChatMessage(role="user", content=content),)) for i in range(2)]
    del frames
    async with _pipeline(gate, build) as pipe:
        gc.disable()
        try:
            events = fan_out(pipe, runs)
            assert (await anext(events))[0] == 0  # run 0 built and answers; run 1 has not built yet
            assert watched() is not None and built_from == [(4, 32, 32, 3)]
            second_may_build.set()
            for _ in range(500):
                if watched() is None:
                    break
                await asyncio.sleep(0.01)
            assert watched() is None and not gate.is_set()  # gone while both answers still stream
            assert content[0].released and content[0].frames.size == 0
            assert built_from == [(4, 32, 32, 3)] * 2
            gate.set()
            rest = [event async for event in events]
        finally:
            gc.enable()
            second_may_build.set()
            gate.set()
        assert sum(isinstance(e, Finished) for _, e in rest) == 2


async def test_the_choices_share_one_build_and_let_it_go() -> None:
    """n = 3 choices (gateway/shared_build.py): one build, its prompt in every run; the media go once all three
    have it (by the first event), and the prompt is not kept by the shared build once the runs are done with it
    (the runs, and so the shared build, are still referenced here)."""
    from gateway.choices import choice_requests, fan_out
    from gateway.events import ImagePart
    from PIL import Image

    gate, builds, pixels = threading.Event(), [], []
    gate.set()  # the answers run through

    def build(request: ChatRequest) -> PromptInputs:
        builds.append(request.request_id)
        patches = torch.zeros(16, 1176)
        pixels.append(weakref.ref(patches))
        return PromptInputs(torch.arange(5), None, None, patches, torch.tensor([[1, 4, 4]]), 5)

    image = ImagePart(Image.new("RGB", (32, 32)))
    request = ChatRequest(request_id="c", model="m", modalities=("text",),
                          messages=(ChatMessage(role="user", content=(image,)),))
    runs = choice_requests(request, 3)
    async with _pipeline(gate, build) as pipe:
        gc.disable()
        try:
            events = fan_out(pipe, runs)
            first = await anext(events)
            assert image.released and builds == ["c"]  # every run has the one build's prompt
            rest = [first] + [event async for event in events]
            assert pixels[0]() is None and runs[0].shared_build is not None
        finally:
            gc.enable()
        assert sum(isinstance(e, Finished) for _, e in rest) == 3 and builds == ["c"]
        assert {i for i, e in rest if isinstance(e, TextDelta)} == {0, 1, 2}
