"""StagePipeline: chains encoder -> thinker -> talker -> vocoder for one request over the Stage RPC.

Data flow for `run(request)`:
  prepare (chat template + processor, in a thread) -> encoder (only with audio/images) -> thinker;
  thinker chunks: text deltas go to the client, tensors go on to the talker; talker chunks (codes) go
  on to the vocoder; vocoder chunks (pcm) go to the client. With `async_chunk` every chunk is forwarded
  the moment it arrives, so the talker and vocoder start before the thinker finishes; without it each
  stage gets its whole input in one final chunk. Text-only requests stop at the thinker.
Three relay coroutines run concurrently and feed one event queue; the first failure cancels the rest
and every open stage stream, and is raised as a `PipelineError` with the HTTP status / gRPC code the
front ends answer with (a stage that is down: 503 / UNAVAILABLE).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc
import torch

from gateway.events import AudioDelta, ChatRequest, Event, Finished, PipelineError, TextDelta
from gateway.prompt import PromptInputs
from gateway.stage_sampling import talker_sampling, thinker_sampling
from omnimesh.transport.frames import StageChunk
from omnimesh.transport.stage_client import StageCallError, StageClient, StageStream

log = logging.getLogger(__name__)

_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


def stage_error(exc: StageCallError) -> PipelineError:
    status, kind = _HTTP.get(exc.code, (500, "internal_error"))
    return PipelineError(exc.message, http_status=status, grpc_code=exc.code.value[0], kind=kind)


class StagePipeline:
    def __init__(
        self,
        stages: dict[str, StageClient],
        prepare: Callable[[ChatRequest], PromptInputs],
        *,
        served_models: tuple[str, ...],
        async_chunk: bool = True,
        request_timeout_s: float = 600.0,
    ):
        missing = {"thinker"} - set(stages)
        if missing:
            raise ValueError(f"the gateway needs at least a thinker stage; missing: {sorted(missing)}")
        self.stages = stages
        self.prepare = prepare
        self.served_models = served_models
        self.async_chunk = async_chunk
        self.request_timeout_s = request_timeout_s
        self.voices: tuple[str, ...] = ()
        self.default_voice = ""
        self.sample_rate = 24000

    async def connect(self, timeout_s: float = 60.0) -> None:
        """Read each stage's Info (voices, sample rate), waiting up to `timeout_s` for them to come up."""
        deadline = time.monotonic() + timeout_s
        for name, client in self.stages.items():
            while True:
                try:
                    info = await client.info(timeout_s=2.0)
                    break
                except StageCallError as exc:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"stage {name} at {client.address} did not answer within {timeout_s:.0f}s: {exc.message}") from exc
                    await asyncio.sleep(0.5)
            if name == "talker":
                self.voices = tuple(info.speakers)
                self.default_voice = info.speakers[0] if info.speakers else ""
            if name == "vocoder" and info.sample_rate:
                self.sample_rate = info.sample_rate

    async def health(self) -> dict[str, bool]:
        names = list(self.stages)
        states = await asyncio.gather(*(self.stages[n].serving() for n in names))
        return dict(zip(names, states))

    def _client(self, name: str) -> StageClient:
        client = self.stages.get(name)
        if client is None:
            raise PipelineError(
                f"this gateway has no {name} stage (start it and pass --stages {name}=HOST:PORT)",
                http_status=503, grpc_code=grpc.StatusCode.UNAVAILABLE.value[0], kind="service_unavailable",
            )
        return client

    async def run(self, request: ChatRequest) -> AsyncIterator[Event]:
        want_audio = "audio" in request.modalities
        voice = (request.voice or self.default_voice).lower()
        if want_audio and voice not in self.voices:
            raise PipelineError(
                f"unknown voice {request.voice!r}; available: {', '.join(self.voices)}",
                http_status=400, grpc_code=grpc.StatusCode.INVALID_ARGUMENT.value[0], kind="invalid_request_error", param="audio.voice",
            )
        prompt = await asyncio.to_thread(self.prepare, request)
        rid = request.request_id
        deadline = time.time() + self.request_timeout_s
        streams: list[StageStream] = []
        events: asyncio.Queue = asyncio.Queue()
        relays: list[asyncio.Task] = []
        try:
            features = await self._encode(rid, prompt, deadline, streams)
            thinker = await self._client("thinker").open(
                rid, thinker_sampling(request), {"talker_inputs": "1" if want_audio else "0"}, deadline
            )
            streams.append(thinker)
            inputs = {"input_ids": prompt.input_ids, **features}
            await thinker.send(StageChunk(tensors=inputs, final=True))
            talker = vocoder = None
            if want_audio:
                whole = not self.async_chunk
                talker = await self._client("talker").open(
                    rid, talker_sampling(request), {"speaker": voice}, deadline, whole_input=whole
                )
                streams.append(talker)
                vocoder = await self._client("vocoder").open(rid, None, {}, deadline, whole_input=whole)
                streams.append(vocoder)
            relays.append(asyncio.create_task(self._relay(thinker, talker, events, text=True)))
            if talker is not None and vocoder is not None:
                relays.append(asyncio.create_task(self._relay(talker, vocoder, events, text=False)))
                relays.append(asyncio.create_task(self._relay(vocoder, None, events, text=False, audio=True)))
            pending = len(relays)
            while pending:
                item = await events.get()
                if item is None:
                    pending -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
            done = thinker.done
            yield Finished(
                finish_reason=done.finish_reason if done else "stop",
                prompt_tokens=done.usage.prompt_tokens if done else int(prompt.input_ids.numel()),
                completion_tokens=done.usage.completion_tokens if done else 0,
            )
        except StageCallError as exc:
            raise stage_error(exc) from exc
        finally:
            for task in relays:
                task.cancel()
            for stream in streams:
                await stream.cancel()

    async def _encode(self, rid: str, prompt: PromptInputs, deadline: float, streams: list[StageStream]) -> dict[str, torch.Tensor]:
        """Run the encoder when the prompt has audio or images; return what the thinker needs."""
        tensors: dict[str, torch.Tensor] = {}
        if prompt.input_features is not None and prompt.feature_attention_mask is not None:
            tensors["input_features"] = prompt.input_features
            tensors["feature_attention_mask"] = prompt.feature_attention_mask
        if prompt.pixel_values is not None and prompt.image_grid_thw is not None:
            tensors["pixel_values"] = prompt.pixel_values
            tensors["image_grid_thw"] = prompt.image_grid_thw
        if not tensors:
            return {}
        encoder = await self._client("encoder").open(rid, None, {}, deadline)
        streams.append(encoder)
        await encoder.send(StageChunk(tensors=tensors, final=True))
        out: dict[str, torch.Tensor] = {}
        async for chunk in encoder:
            out.update(chunk.tensors)
        if prompt.image_grid_thw is not None:
            out["image_grid_thw"] = prompt.image_grid_thw
        return out

    async def _relay(
        self, source: StageStream, sink: StageStream | None, events: asyncio.Queue, *, text: bool, audio: bool = False
    ) -> None:
        """Read `source`; client-visible parts go to `events`; tensors go on to `sink`."""
        try:
            async for chunk in source:
                if text and chunk.text:
                    events.put_nowait(TextDelta(chunk.text))
                if audio and "pcm" in chunk.tensors and chunk.tensors["pcm"].numel():
                    pcm = chunk.tensors["pcm"].to(torch.float32).numpy()
                    events.put_nowait(AudioDelta(pcm=pcm, sample_rate=self.sample_rate))
                if sink is None:
                    continue
                # without async_chunk the sink was opened with whole_input: it buffers until the final chunk
                await sink.send(StageChunk(tensors=chunk.tensors, final=chunk.final))
            events.put_nowait(None)
        except asyncio.CancelledError:
            raise
        except StageCallError as exc:
            events.put_nowait(stage_error(exc))
        except Exception as exc:  # a relay bug must fail the request, not hang it
            log.exception("relay %s -> %s failed", source.stage, sink.stage if sink else "client")
            events.put_nowait(PipelineError(f"gateway relay failed: {exc}", http_status=500, grpc_code=13, kind="internal_error"))

