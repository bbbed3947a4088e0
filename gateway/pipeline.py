"""StagePipeline: chains encoder -> thinker -> talker -> vocoder for one request over the Stage RPC.

Data flow for `run(request)`:
  prepare (chat template + processor, in a thread) -> encoder (only with audio/images) -> thinker;
  thinker chunks: text deltas go to the client, tensors go on to the talker; talker chunks (codes) go
  on to the vocoder; vocoder chunks (pcm) go to the client. With `async_chunk` every chunk is forwarded
  the moment it arrives, so the talker and vocoder start before the thinker finishes; without it each
  stage gets its whole input in one final chunk. Text-only requests stop at the thinker.
Three relay coroutines run concurrently and feed one event queue (deltas of one kind that queued up while
the front end was busy leave it joined: `merge_ready`); the first failure cancels the rest
and every open stage stream, and is raised as a `PipelineError` with the HTTP status / gRPC code the
front ends answer with (a stage that is down: 503 / UNAVAILABLE).

The gateway stays on the control path: stage-to-stage tensors pass through as the producer wrote them
(`parts()` -> `send_part`), never decoded here. `connect()` picks each producer's output transport from
both ends' Info (`choose_transport`): between co-located stages the frames are shared-memory (or CUDA
IPC) references, so only headers cross the gateway; across hosts they are inline pieces. A request that
fails or is cancelled tells every producer that used shared memory to take back the frames nobody
claimed (`StageClient.release`). `received_bytes` / `tensor_bytes` / `inline_bytes` count, per stage,
what the gateway read off the wire, the tensor bytes those frames described, and how many of them came
inline (0 on a shared-memory edge).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import cast

import grpc
import numpy as np
import torch

from gateway.events import AudioDelta, ChatRequest, Event, Finished, PipelineError, TextDelta
from gateway.prompt import PromptInputs
from gateway.request_log import RequestLog
from gateway.stage_sampling import talker_sampling, thinker_sampling
from omnimesh.models.qwen3_omni.code_windows import windows_text
from omnimesh.transport.chunk_codec import ChunkEncoder
from omnimesh.transport.frames import StageChunk
from omnimesh.transport.stage_client import StageCallError, StageClient, StageStream
from omnimesh.queue_runs import take_run
from omnimesh.transport.transport import choose_transport
from omnimesh.v1 import stage_pb2

log = logging.getLogger(__name__)

_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
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
        request_log: RequestLog | None = None,
    ):
        missing = {"thinker"} - set(stages)
        if missing:
            raise ValueError(f"the gateway needs at least a thinker stage; missing: {sorted(missing)}")
        self.stages = stages
        self.prepare = prepare
        self.served_models = served_models
        self.async_chunk = async_chunk
        self.request_timeout_s = request_timeout_s
        self.request_log = request_log  # --enable-log-requests
        self.voices: tuple[str, ...] = ()
        self.default_voice = ""
        self.sample_rate = 24000
        self.talker_options: dict[str, str] = {}  # the talker's output chunks = the vocoder's decode windows
        self.eager_tokens = 1  # thinker tokens sent one by one before --stream-interval applies
        self.output_transport: dict[str, str] = {name: "grpc" for name in stages}
        self.received_bytes: dict[str, int] = dict.fromkeys(stages, 0)
        self.tensor_bytes: dict[str, int] = dict.fromkeys(stages, 0)
        self.inline_bytes: dict[str, int] = dict.fromkeys(stages, 0)
        self._background: set[asyncio.Task] = set()
        self._in_flight: set[str] = set()  # request ids running here: each names its state in every stage

    async def connect(self, timeout_s: float = 60.0) -> None:
        """Read each stage's Info (voices, sample rate), waiting up to `timeout_s` for them to come up."""
        deadline = time.monotonic() + timeout_s
        infos: dict[str, stage_pb2.StageInfo] = {}
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
            if name == "vocoder" and info.window_codes > 0:
                # the vocoder decodes nothing before a window is whole: the talker sends each window's codes as
                # one chunk instead of one message per code group, and no audio comes later for it
                windows = tuple(info.window_schedule) or (info.first_window_codes or info.window_codes,
                                                          info.window_codes)
                self.talker_options = {"chunk_schedule": windows_text(windows)}
                # the talker's first window of codes reads the thinker's first `first` + 1 tokens: those leave
                # the thinker one by one whatever its --stream-interval, so the first audio never waits
                self.eager_tokens = windows[0] + 1
            infos[name] = info
        self._choose_transports(infos)

    def _choose_transports(self, infos: dict[str, stage_pb2.StageInfo]) -> None:
        """Each producer's output transport, from its own setting and both ends' host ids."""
        own_host = self.stages["thinker"].transport.host_id
        for producer, consumer in EDGES:
            info = infos.get(producer)
            if info is None:
                continue
            if consumer == "gateway":
                consumer_host = own_host
            elif consumer in infos:
                consumer_host = infos[consumer].host_id
            else:
                continue  # no consumer stage: this stage's tensors go nowhere
            try:
                mode = choose_transport(producer, info.transport or "grpc", info.host_id, info.device, consumer,
                                        consumer_host)
            except ValueError as exc:
                raise RuntimeError(str(exc)) from exc
            self.output_transport[producer] = mode
            log.info("edge %s -> %s: %s", producer, consumer, mode)

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
        rid = request.request_id
        if rid in self._in_flight:
            # a second request under one id would share the first one's state in the stages, and its failure
            # would hand back the first one's frames (`_release`): refused before it touches a stage
            raise PipelineError(
                f"request_id {rid!r} is already in flight on this gateway; give each request its own id",
                http_status=409, grpc_code=grpc.StatusCode.ALREADY_EXISTS.value[0], kind="conflict_error",
                param="request_id",
            )
        self._in_flight.add(rid)
        started, done, error = time.monotonic(), None, None
        try:
            async with contextlib.aclosing(self._run(request, want_audio, voice)) as events:
                async for event in events:  # closing `run` closes this: the stages hear of the cancel at once
                    if isinstance(event, Finished):
                        done = event
                    yield event
        except (GeneratorExit, asyncio.CancelledError):
            raise  # the client went away: logged as cancelled
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._in_flight.discard(rid)
            if self.request_log is not None:
                self.request_log.finished(rid, time.monotonic() - started, done, error)

    async def _run(self, request: ChatRequest, want_audio: bool, voice: str) -> AsyncGenerator[Event, None]:
        prompt = await asyncio.to_thread(self.prepare, request)
        if self.request_log is not None:
            self.request_log.received(request, int(prompt.input_ids.numel()))
        rid = request.request_id
        deadline = time.time() + self.request_timeout_s
        streams: list[StageStream] = []
        events: asyncio.Queue = asyncio.Queue()
        relays: list[asyncio.Task] = []
        ok = False
        try:
            features = await self._encode(rid, prompt, deadline, streams)
            out = self.output_transport
            thinker = await self._client("thinker").open(
                rid, thinker_sampling(request),
                {"talker_inputs": "1" if want_audio else "0", "eager_tokens": str(self.eager_tokens if want_audio else 1)},
                deadline,
                transport=out["thinker"] if want_audio else "grpc",
            )
            streams.append(thinker)
            await self._send_prompt(thinker, prompt, features)
            talker = vocoder = None
            if want_audio:
                whole = not self.async_chunk
                talker = await self._client("talker").open(
                    rid, talker_sampling(request), {"speaker": voice, **self.talker_options}, deadline, whole_input=whole,
                    transport=out["talker"],
                )
                streams.append(talker)
                vocoder = await self._client("vocoder").open(rid, None, {}, deadline, whole_input=whole,
                                                             transport=out["vocoder"])
                streams.append(vocoder)
            relays.append(asyncio.create_task(self._relay(thinker, talker, events, text=True)))
            if talker is not None and vocoder is not None:
                relays.append(asyncio.create_task(self._relay(talker, vocoder, events, text=False)))
                relays.append(asyncio.create_task(self._relay(vocoder, None, events, text=False, audio=True)))
            pending = len(relays)
            held: list[Event | BaseException | None] = []  # taken off the queue while merging, handled next
            while pending:
                item = held.pop() if held else await events.get()
                if item is None:
                    pending -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    if not events.empty():
                        item, held = merge_ready(item, events)
                    yield item
            done = thinker.done
            yield Finished(
                finish_reason=done.finish_reason if done else "stop",
                prompt_tokens=done.usage.prompt_tokens if done else int(prompt.input_ids.numel()),
                completion_tokens=done.usage.completion_tokens if done else 0,
            )
            ok = True
        except StageCallError as exc:
            raise stage_error(exc) from exc
        except PipelineError as exc:
            if exc.grpc_code == grpc.StatusCode.ALREADY_EXISTS.value[0]:
                ok = True  # the id is another gateway's request in that stage: its frames are not ours to release
            raise
        finally:
            for task in relays:
                task.cancel()
            for stream in streams:
                await stream.cancel()
                self.received_bytes[stream.stage] += stream.received_bytes
                self.tensor_bytes[stream.stage] += stream.tensor_bytes
                self.inline_bytes[stream.stage] += stream.inline_bytes
            if not ok:
                self._release(rid, [s.stage for s in streams])

    def _release(self, rid: str, stages: list[str]) -> None:
        """A failed or cancelled request: producers that used shared memory take back its unclaimed frames
        (in the background: this runs while the request's own task may be cancelled)."""
        for name in stages:
            if self.output_transport.get(name, "grpc") == "grpc":
                continue
            task = asyncio.get_running_loop().create_task(self._release_one(name, rid))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _release_one(self, name: str, rid: str) -> None:
        try:
            await self.stages[name].release(rid)
        except StageCallError as exc:  # the stage's own deadline sweep frees them later
            log.warning("release of request %s at %s failed: %s", rid, name, exc.message)

    async def _send_prompt(self, thinker: StageStream, prompt: PromptInputs, features: list[stage_pb2.Chunk]) -> None:
        """The thinker's one input chunk: the prompt ids (inline) + the encoder's output parts as they came."""
        names = {f.name for part in features for f in part.tensors}
        tensors = {"input_ids": prompt.input_ids}
        if prompt.image_grid_thw is not None and "image_grid_thw" not in names:
            tensors["image_grid_thw"] = prompt.image_grid_thw
        if not features:
            await thinker.send(StageChunk(tensors=tensors, final=True))
            return
        parts = ChunkEncoder("grpc", request_id=thinker.request_id).parts(StageChunk(tensors=tensors))
        for part in features:
            relayed = stage_pb2.Chunk(tensors=part.tensors)
            parts.append(relayed)
        for part in parts:
            part.more, part.final = True, False
        parts[-1].more, parts[-1].final = False, True
        for part in parts:
            await thinker.send_part(part)

    async def _encode(self, rid: str, prompt: PromptInputs, deadline: float, streams: list[StageStream]) -> list[stage_pb2.Chunk]:
        """Run the encoder when the prompt has audio or images -> its output parts (passed on unread)."""
        tensors: dict[str, torch.Tensor] = {}
        if prompt.input_features is not None and prompt.feature_attention_mask is not None:
            tensors["input_features"] = prompt.input_features
            tensors["feature_attention_mask"] = prompt.feature_attention_mask
        if prompt.pixel_values is not None and prompt.image_grid_thw is not None:
            tensors["pixel_values"] = prompt.pixel_values
            tensors["image_grid_thw"] = prompt.image_grid_thw
        if not tensors:
            return []
        encoder = await self._client("encoder").open(rid, None, {}, deadline, transport=self.output_transport["encoder"])
        streams.append(encoder)
        await encoder.send(StageChunk(tensors=tensors, final=True))
        return [part async for part in encoder.parts()]

    async def _relay(
        self, source: StageStream, sink: StageStream | None, events: asyncio.Queue, *, text: bool, audio: bool = False
    ) -> None:
        """Read `source` part by part: client-visible parts go to `events`; tensors go on to `sink` unread."""
        try:
            async for part in source.parts():
                if text and part.text:
                    events.put_nowait(TextDelta(part.text))
                    part.text = ""
                if audio:
                    chunk = source.assemble(part)
                    if chunk is not None and "pcm" in chunk.tensors and chunk.tensors["pcm"].numel():
                        pcm = chunk.tensors["pcm"].to(torch.float32).numpy()
                        events.put_nowait(AudioDelta(pcm=pcm, sample_rate=self.sample_rate))
                if sink is not None:
                    # without async_chunk the sink was opened with whole_input: it buffers until the final chunk
                    await sink.send_part(part)
            events.put_nowait(None)
        except asyncio.CancelledError:
            raise
        except StageCallError as exc:
            events.put_nowait(stage_error(exc))
        except Exception as exc:  # a relay bug must fail the request, not hang it
            log.exception("relay %s -> %s failed", source.stage, sink.stage if sink else "client")
            events.put_nowait(PipelineError(f"gateway relay failed: {exc}", http_status=500, grpc_code=13, kind="internal_error"))


def merge_ready(item: Event, events: asyncio.Queue) -> tuple[Event, list[Event | BaseException | None]]:
    """`item` joined with the deltas of its kind queued right behind it (texts concatenated, pcm of one
    rate concatenated) -> (the delta, [the next other queue item, which may be a relay's None] or []). The
    front end then writes one message where it would write several, when it has fallen behind; nothing
    waits for it."""
    if not isinstance(item, (TextDelta, AudioDelta)):
        return item, []
    same, rest = take_run(item, events, _same_kind)
    return _joined(same), rest


def _same_kind(first: TextDelta | AudioDelta, nxt: object) -> bool:
    return type(nxt) is type(first) and (not isinstance(first, AudioDelta)
                                         or cast(AudioDelta, nxt).sample_rate == first.sample_rate)


def _joined(deltas: list[TextDelta | AudioDelta]) -> Event:
    if len(deltas) == 1:
        return deltas[0]
    if isinstance(deltas[0], TextDelta):
        return TextDelta("".join(d.text for d in deltas if isinstance(d, TextDelta)))
    pcm = [d.pcm for d in deltas if isinstance(d, AudioDelta)]
    return AudioDelta(pcm=np.concatenate(pcm), sample_rate=deltas[0].sample_rate)


# producer -> consumer of every stage edge (the vocoder's pcm is read by the gateway itself)
EDGES = (("encoder", "thinker"), ("thinker", "talker"), ("talker", "vocoder"), ("vocoder", "gateway"))
