"""StagePipeline: chains encoder -> thinker -> talker -> vocoder for one request over the Stage RPC.

Data flow for `run(request)`:
  prepare (chat template + processor, in a thread) -> one replica of each stage the request needs
  (`StageMesh.plan`, gateway/stage_mesh.py) -> encoder (only with audio/images) -> thinker;
  thinker chunks: text deltas go to the client, tensors go on to the talker; talker chunks (codes) go
  on to the vocoder; vocoder chunks (pcm) go to the client. With `async_chunk` every chunk is forwarded
  the moment it arrives, so the talker and vocoder start before the thinker finishes; without it each
  stage gets its whole input in one final chunk. Text-only requests stop at the thinker.
Three relay coroutines run concurrently and feed one event queue (deltas of one kind that queued up while
the front end was busy leave it joined: `merge_ready`); the first failure cancels the rest
and every open stage stream, and is raised as a `PipelineError` with the HTTP status / gRPC code the
front ends answer with (a stage that is down: 503 / UNAVAILABLE). A replica that is unreachable or full
(UNAVAILABLE / RESOURCE_EXHAUSTED) before the client got anything has the request run again on another
replica of its stage (`_attempts`); after that the error reaches the client.

The gateway stays on the control path: stage-to-stage tensors pass through as the producer wrote them
(`parts()` -> `send_part`), never decoded here. Each producer replica's output transport comes from both
ends' Info (`StageMesh.mode`): between co-located replicas the frames are shared-memory (or CUDA IPC)
references, so only headers cross the gateway; across hosts they are inline pieces. A request that
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
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import cast

import grpc
import numpy as np
import torch

from gateway.events import AudioDelta, ChatRequest, Event, Finished, PipelineError, TextDelta
from gateway.media_budget import MediaBudget, build_cost
from gateway.openai_schema import audio_unavailable
from gateway.prompt import PromptBuilder, PromptInputs
from gateway.replicas import RETRY_CODES, Lease, Replica
from gateway.run_span import RunSpan
from gateway.spoken_calls import call_token, no_call_token, spoken_with_calls
from gateway.stage_mesh import REPLICA_GRACE_S, StageMesh
from gateway.request_log import RequestLog
from gateway.stage_sampling import talker_sampling, thinker_sampling
from omnimesh.transport.chunk_codec import ChunkEncoder
from omnimesh.transport.frames import StageChunk
from omnimesh.transport.stage_client import StageCallError, StageClient, StageStream
from omnimesh.queue_runs import take_run
from omnimesh.v1 import stage_pb2
from services.llm.structured_output import AFTER_OPTION as STRUCTURED_AFTER_OPTION
from services.llm.structured_output import OPTION as STRUCTURED_OPTION
from services.llm.structured_output import option_value

log = logging.getLogger(__name__)
PREFIX_KEY_TOKENS = 256  # a prompt's start that picks its thinker replica when they cache prefixes (a conversation's
# system turn and first question: the same on every later turn)

_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


def stage_error(exc: StageCallError, timeout_s: float = 0.0) -> PipelineError:
    """A stage's failure as the client's error; a deadline says which limit it was (`timeout_s`, the gateway's
    --request-timeout)."""
    status, kind = _HTTP.get(exc.code, (500, "internal_error"))
    message = exc.message
    if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED and timeout_s:
        message += f" (the gateway's --request-timeout is {timeout_s:g} s)"
    return PipelineError(message, http_status=status, grpc_code=exc.code.value[0], kind=kind, stage=exc.stage)


@dataclass(slots=True)
class _Leg:
    """One stage's part in one attempt at a request: its stream, the replica it runs on, its output transport."""

    stream: StageStream
    replica: Replica
    transport: str


class StagePipeline:
    def __init__(
        self,
        stages: Mapping[str, StageClient | Sequence[StageClient]],
        prepare: Callable[[ChatRequest], PromptInputs],
        *,
        served_models: tuple[str, ...],
        async_chunk: bool = True,
        request_timeout_s: float = 600.0,
        request_log: RequestLog | None = None,
        no_audio: str | None = None,
    ):
        missing = {"thinker"} - set(stages)
        if missing:
            raise ValueError(f"the gateway needs at least a thinker stage; missing: {sorted(missing)}")
        self.mesh = StageMesh(stages)
        self.stages = self.mesh.stages
        self.prepare = prepare
        self.served_models = served_models
        self.async_chunk = async_chunk
        self.request_timeout_s = request_timeout_s
        self.request_log = request_log  # --enable-log-requests
        self.media_budget: MediaBudget | None = None  # builds' and decodes' working memory (None: unbounded)
        if no_audio is None and not {"talker", "vocoder"} <= set(stages):
            no_audio = "this gateway was given no talker / vocoder stage (--stages)"
        self.no_audio = no_audio  # why this gateway speaks no audio (a thinker-only model, ...); None: it does
        self.output_transport = self.mesh.output_transport  # each stage's, for /metrics
        self.received_bytes: dict[str, int] = dict.fromkeys(stages, 0)
        self.tensor_bytes: dict[str, int] = dict.fromkeys(stages, 0)
        self.inline_bytes: dict[str, int] = dict.fromkeys(stages, 0)
        self._in_flight: set[str] = set()  # request ids running here: each names its state in every stage
        # ids of ended requests whose frames the stages are still taking back (`_release`): a new request under
        # one of them would have its own frames taken back too, so the id stays taken until that is done
        self._releasing: dict[str, int] = {}

    @property
    def voices(self) -> tuple[str, ...]:
        return self.mesh.voices

    @property
    def default_voice(self) -> str:
        return self.mesh.default_voice

    @property
    def sample_rate(self) -> int:
        return self.mesh.sample_rate

    async def connect(self, timeout_s: float = 60.0, late_grace_s: float = REPLICA_GRACE_S) -> None:
        """Find the stages (StageMesh.connect): bounded wait for a replica of each."""
        await self.mesh.connect(timeout_s, late_grace_s)

    async def health(self) -> dict[str, bool]:
        return await self.mesh.health()

    async def health_detail(self) -> dict[str, dict[str, bool]]:
        return await self.mesh.health_detail()

    async def close(self) -> None:
        await self.mesh.close()

    def run(self, request: ChatRequest) -> AsyncIterator[Event]:
        """The request's events; a spoken one with tools keeps its calls out of the speech (gateway/spoken_calls.py)."""
        if request.spoken_calls and "audio" in request.modalities:  # its calls part builds from its media again:
            # they stay (gateway/media_release.py)
            return spoken_with_calls(self._run_request, replace(request, media=None), self._call_token(request.model))
        return self._run_request(request)

    def _call_token(self, model: str) -> int:
        tokenizer = getattr(getattr(self.prepare, "processor", None), "tokenizer", None)
        token = call_token(tokenizer) if tokenizer is not None else None
        if token is None:
            raise no_call_token(model)
        return token

    async def _run_request(self, request: ChatRequest) -> AsyncIterator[Event]:
        want_audio = "audio" in request.modalities
        voice = (request.voice or self.mesh.default_voice).lower()
        if want_audio and self.no_audio is not None:
            raise audio_unavailable(self.no_audio)
        if want_audio and voice not in self.voices:
            raise PipelineError(
                f"unknown voice {request.voice!r}; available: {', '.join(self.voices)}",
                http_status=400, grpc_code=grpc.StatusCode.INVALID_ARGUMENT.value[0], kind="invalid_request_error", param="audio.voice",
            )
        rid = request.request_id
        if rid in self._in_flight or rid in self._releasing:
            # a second request under one id would share the first one's state in the stages, and its failure
            # would hand back the first one's frames (`_release`): refused before it touches a stage
            raise PipelineError(
                f"request_id {rid!r} is already in flight on this gateway; give each request its own id",
                http_status=409, grpc_code=grpc.StatusCode.ALREADY_EXISTS.value[0], kind="conflict_error",
                param="request_id",
            )
        self._in_flight.add(rid)
        started, done, error = time.monotonic(), None, None
        span = RunSpan.start(request)  # tracing on: this run's span, the stages' spans under it
        output = self.request_log.output() if self.request_log is not None else None  # --enable-log-outputs
        try:
            try:
                built = _HeldPrompt(await self._built(request))
            finally:
                if request.media is not None:  # this run will not build again: its media may go
                    request.media.built()
            if self.request_log is not None:
                self.request_log.received(request, built.tokens)
            trace = span.headers() if span is not None else {}
            async with contextlib.aclosing(self._attempts(request, built, want_audio, voice, trace)) as events:
                async for event in events:  # closing `run` closes this: the stages hear of the cancel at once
                    if isinstance(event, Finished):
                        done = event
                    if span is not None:
                        span.saw(event)
                    if output is not None:
                        output.saw(event)
                    yield event
        except (GeneratorExit, asyncio.CancelledError):
            raise  # the client went away: logged as cancelled
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._in_flight.discard(rid)
            if span is not None:
                span.end(done, error)
            if self.request_log is not None:
                self.request_log.finished(rid, time.monotonic() - started, done, error, output)
            # this frame holding the exception whose traceback holds this frame is a cycle that only a full
            # collection frees (rare here: the start-up heap is frozen), and with it the request's prompt: a
            # refused 10-minute clip kept its 30 MB of features, and a burst of them kept gigabytes
            error = None

    async def _built(self, request: ChatRequest) -> PromptInputs:
        """The request's prompt, built in its share of the media budget: here, or once for all of its request's
        choices (gateway/shared_build.py)."""
        async def build() -> PromptInputs:
            async with self.building(request):
                return await asyncio.to_thread(self._prepared, request, self.hashes_media())

        shared = request.shared_build
        if shared is None or not shared.serves(request):
            return await build()
        return await shared.get(build)

    def building(self, request: ChatRequest) -> contextlib.AbstractAsyncContextManager[None]:
        """Around a build of `request`'s prompt: its share of the media budget (nothing to wait for without media)."""
        if self.media_budget is None:
            return contextlib.nullcontext()
        return self.media_budget.hold(build_cost(request))

    def hashes_media(self) -> bool:
        """Does a thinker replica cache prefixes, or an encoder replica its outputs (both key media items by the
        gateway's digests)? True until a stage's replicas answered Info (the safe side), and when the mesh has
        no thinker of its own to ask."""
        def keyed(stage: str, absent: bool) -> bool:
            replicas = self.stages.get(stage)
            if replicas is None:
                return absent
            known = replicas.known()
            return not known or any(r.info is not None and r.info.prefix_caching for r in known)

        return keyed("thinker", absent=True) or keyed("encoder", absent=False)

    def _prepared(self, request: ChatRequest, hash_media: bool) -> PromptInputs:
        if isinstance(self.prepare, PromptBuilder):
            return self.prepare.build(request, hash_media=hash_media)
        return self.prepare(request)

    async def _attempts(self, request: ChatRequest, built: _HeldPrompt, want_audio: bool,
                        voice: str, trace: Mapping[str, str]) -> AsyncGenerator[Event, None]:
        """Run the request on one replica of each stage; when a replica is unreachable or full
        (UNAVAILABLE / RESOURCE_EXHAUSTED) before the client got anything, run it again on another one of
        that stage (under a new id in the stages: `ID#1`, ...) — once per replica, at most. The prompt is let
        go at the first event: no attempt can follow it."""
        tried: dict[str, set[int]] = {}
        attempt = 0
        while True:
            plan = self.mesh.plan(bool(_encoder_inputs(built.prompt)), want_audio, tried, _content_keys(built.prompt))
            sent = ok = False
            try:
                sid = request.request_id if attempt == 0 else f"{request.request_id}#{attempt}"
                async with contextlib.aclosing(self._run(request, sid, built, want_audio, voice, plan,
                                                         trace)) as events:
                    async for event in events:
                        if not sent:
                            built.let_go()
                        sent = True
                        ok = isinstance(event, Finished)  # the front end may stop reading here
                        yield event
                return
            except PipelineError as exc:
                lease = plan.get(exc.stage) if exc.stage is not None else None
                if lease is None or exc.grpc_code not in RETRY_CODES:
                    raise
                rs = self.stages[lease.replica.stage]
                rs.mark_down(lease.replica, exc.message)
                tried.setdefault(rs.stage, set()).add(lease.replica.index)
                if sent or len(tried[rs.stage]) >= len(rs.known()):
                    raise
                log.warning("request %s: %s; running it again on another %s replica", request.request_id,
                            exc.message, rs.stage)
                attempt += 1
            finally:
                for lease in plan.values():
                    lease.done(ok)

    async def _run(self, request: ChatRequest, rid: str, built: _HeldPrompt, want_audio: bool, voice: str,
                   plan: dict[str, Lease], trace: Mapping[str, str]) -> AsyncGenerator[Event, None]:
        """One attempt on the planned replicas; `trace`: the run span's context, sent with every stage call.
        Neither the prompt nor the encoder's output stays referenced here once the thinker has them."""
        deadline = time.time() + self.request_timeout_s if self.request_timeout_s else 0.0  # 0: none
        legs: list[_Leg] = []
        events: asyncio.Queue = asyncio.Queue()
        relays: list[asyncio.Task] = []
        ok = False
        try:
            features = await self._encode(rid, built.prompt, deadline, plan, legs, trace)
            thinker_replica = plan["thinker"].replica
            out = self.mesh.mode(thinker_replica, plan["talker"].replica.host, "talker") if want_audio else "grpc"
            thinker = await thinker_replica.client.open(
                rid, thinker_sampling(request),
                {"talker_inputs": "1" if want_audio else "0",
                 "eager_tokens": str(self.mesh.eager_tokens if want_audio else 1), **_priority(request),
                 **_structured(request)},
                deadline, transport=out, metadata=trace,
            )
            legs.append(_Leg(thinker, thinker_replica, out))
            await self._send_prompt(thinker, built.prompt, features)
            del features  # the thinker has them: a long video's embeddings need not last as long as its answer
            talker = vocoder = None
            if want_audio:
                whole = not self.async_chunk
                replica = plan["talker"].replica
                out = self.mesh.mode(replica, plan["vocoder"].replica.host, "vocoder")
                talker = await replica.client.open(
                    rid, talker_sampling(request), {"speaker": voice, **self.mesh.talker_options, **_priority(request)},
                    deadline,
                    whole_input=whole,
                    transport=out,
                    metadata=trace,
                )
                legs.append(_Leg(talker, replica, out))
                replica = plan["vocoder"].replica
                out = self.mesh.mode(replica, self.mesh.host_id, "gateway")
                vocoder = await replica.client.open(rid, None, _vocoder_options(request, voice), deadline,
                                                    whole_input=whole, transport=out, metadata=trace)
                legs.append(_Leg(vocoder, replica, out))
            relays.append(asyncio.create_task(self._relay(thinker, talker, events, text=True,
                                                          prompt_tokens=built.tokens)))
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
            ok = True  # every stage said done: a consumer that stops at Finished has nothing left to hand back
            yield Finished(
                finish_reason=done.finish_reason if done else "stop",
                prompt_tokens=done.usage.prompt_tokens if done else built.tokens,
                completion_tokens=done.usage.completion_tokens if done else 0,
                cached_tokens=done.usage.cached_tokens if done else 0,
                stop_reason=_stop_reason(done),
            )
        except StageCallError as exc:
            raise stage_error(exc, self.request_timeout_s) from exc
        except PipelineError as exc:
            if exc.grpc_code == grpc.StatusCode.ALREADY_EXISTS.value[0]:
                ok = True  # the id is another gateway's request in that stage: its frames are not ours to release
            raise
        finally:
            for task in relays:
                task.cancel()
            for leg in legs:
                await leg.stream.cancel()
                self.received_bytes[leg.stream.stage] += leg.stream.received_bytes
                self.tensor_bytes[leg.stream.stage] += leg.stream.tensor_bytes
                self.inline_bytes[leg.stream.stage] += leg.stream.inline_bytes
            if not ok:
                self._release(request.request_id, rid, legs)

    def _release(self, owner: str, rid: str, legs: list[_Leg]) -> None:
        """A failed or cancelled request (`owner`, the client's id; `rid`, the attempt's id in the stages):
        producers that used shared memory take back its unclaimed frames (in the background: this runs while
        the request's own task may be cancelled)."""
        for leg in legs:
            if leg.transport != "grpc":
                self._releasing[owner] = self._releasing.get(owner, 0) + 1
                self.mesh.spawn(self._release_one(owner, leg.replica, rid))

    async def _release_one(self, owner: str, replica: Replica, rid: str) -> None:
        try:
            await replica.client.release(rid)
        except StageCallError as exc:  # the stage's own deadline sweep frees them later
            log.warning("release of request %s at %s failed: %s", rid, replica.label, exc.message)
        finally:
            if (left := self._releasing[owner] - 1) > 0:
                self._releasing[owner] = left
            else:
                del self._releasing[owner]

    async def _send_prompt(self, thinker: StageStream, prompt: PromptInputs, features: list[stage_pb2.Chunk]) -> None:
        """The thinker's one input chunk: the prompt ids (inline) + the encoder's output parts as they came."""
        names = {f.name for part in features for f in part.tensors}
        tensors = {"input_ids": prompt.input_ids}
        if prompt.image_grid_thw is not None and "image_grid_thw" not in names:
            tensors["image_grid_thw"] = prompt.image_grid_thw
        if prompt.video_grid_thw is not None and prompt.video_second_per_grid is not None:
            tensors["video_grid_thw"] = prompt.video_grid_thw
            tensors["video_second_per_grid"] = prompt.video_second_per_grid
        if prompt.use_audio_in_video:
            tensors["use_audio_in_video"] = torch.ones(1, dtype=torch.int64)
        tensors.update(prompt.media_hashes)  # the prefix cache's names for the media rows
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

    async def _encode(self, rid: str, prompt: PromptInputs, deadline: float, plan: dict[str, Lease],
                      legs: list[_Leg], trace: Mapping[str, str]) -> list[stage_pb2.Chunk]:
        """Run the encoder when the prompt has audio or images -> its output parts (passed on unread)."""
        tensors = _encoder_inputs(prompt)
        if not tensors:
            return []
        replica = plan["encoder"].replica
        out = self.mesh.mode(replica, plan["thinker"].replica.host, "thinker")
        encoder = await replica.client.open(rid, None, {}, deadline, transport=out, metadata=trace)
        legs.append(_Leg(encoder, replica, out))
        await encoder.send(StageChunk(tensors=tensors, final=True))
        return [part async for part in encoder.parts()]

    async def _relay(
        self, source: StageStream, sink: StageStream | None, events: asyncio.Queue, *, text: bool, audio: bool = False,
        prompt_tokens: int = 0,
    ) -> None:
        """Read `source` part by part: client-visible parts go to `events`; tensors go on to `sink` unread. The
        thinker's text deltas carry the tokens generated so far (its parts' `token_ids` frames, counted from
        their shapes without reading them)."""
        generated = 0
        try:
            async for part in source.parts():
                if text:
                    generated += sum(int(f.shape[0]) for f in part.tensors
                                     if f.name == "token_ids" and f.piece_offset == 0 and len(f.shape) == 1)
                if text and (part.text or part.logprobs or part.prompt_logprobs):
                    events.put_nowait(TextDelta(part.text, tuple(part.logprobs), (prompt_tokens, generated),
                                                tuple(part.prompt_logprobs)))
                    part.text = ""
                    del part.logprobs[:]  # the client's, like the text: the talker never reads them
                    del part.prompt_logprobs[:]
                if audio:
                    self._audio_out(source, part, events)
                if sink is not None:
                    # without async_chunk the sink was opened with whole_input: it buffers until the final chunk
                    await sink.send_part(part)
            events.put_nowait(None)
        except asyncio.CancelledError:
            raise
        except StageCallError as exc:
            events.put_nowait(stage_error(exc, self.request_timeout_s))
        except Exception as exc:  # a relay bug must fail the request, not hang it
            log.exception("relay %s -> %s failed", source.stage, sink.stage if sink else "client")
            events.put_nowait(PipelineError(f"gateway relay failed: {exc}", http_status=500, grpc_code=13, kind="internal_error"))


    def _audio_out(self, source: StageStream, part: stage_pb2.Chunk, events: asyncio.Queue) -> None:
        """The vocoder's pcm of a whole chunk, copied out to the client's events. A function of its own, so the
        chunk, whose tensor maps the vocoder's shm slot, is gone when it returns: held in the relay's frame it
        kept the slot taken while the relay waited for the next part, and after a cancel for as long as the
        cancelled task's traceback lived (a slot stayed MAPPED after clients hung up); the client's unread
        audio holds the copy, never the vocoder's arena."""
        chunk = source.assemble(part)
        if chunk is not None and "pcm" in chunk.tensors and chunk.tensors["pcm"].numel():
            pcm = chunk.tensors["pcm"].to(torch.float32, copy=True).numpy()
            events.put_nowait(AudioDelta(pcm=pcm, sample_rate=self.mesh.sample_rate))


def _stop_reason(done: stage_pb2.Done | None) -> str | int | None:
    """The thinker's Done's stop string or stop token id (vLLM's stop_reason), None when it names neither."""
    which = done.WhichOneof("stop_reason") if done is not None else None
    return None if which is None else getattr(done, which)


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
        texts = [d for d in deltas if isinstance(d, TextDelta)]
        return TextDelta("".join(d.text for d in texts), tuple(e for d in texts for e in d.logprobs), texts[-1].usage,
                         tuple(e for d in texts for e in d.prompt_logprobs))
    pcm = [d.pcm for d in deltas if isinstance(d, AudioDelta)]
    return AudioDelta(pcm=np.concatenate(pcm), sample_rate=deltas[0].sample_rate)


class _HeldPrompt:
    """A request's built prompt while an attempt may still need it. A failed attempt is run again only before
    the client got anything (`_attempts`), so at its first event the prompt is let go: its media tensors
    (audio features, image and video patches: a minute of 720p video is ~0.9 GB of float32 patches at
    Qwen3-Omni's sizes) are freed while the answer streams, not kept as long as the request lasts."""

    __slots__ = ("_prompt", "tokens")

    def __init__(self, prompt: PromptInputs) -> None:
        self._prompt: PromptInputs | None = prompt
        self.tokens = int(prompt.input_ids.numel())

    @property
    def prompt(self) -> PromptInputs:
        if self._prompt is None:
            raise RuntimeError("the prompt was let go at the request's first event; no attempt may follow it")
        return self._prompt

    def let_go(self) -> None:
        self._prompt = None


def _encoder_inputs(prompt: PromptInputs) -> dict[str, torch.Tensor]:
    """What the encoder reads from a prompt; empty when it has no audio, images or video."""
    tensors: dict[str, torch.Tensor] = {}
    if prompt.input_features is not None and prompt.feature_attention_mask is not None:
        tensors["input_features"] = prompt.input_features
        tensors["feature_attention_mask"] = prompt.feature_attention_mask
    if prompt.pixel_values is not None and prompt.image_grid_thw is not None:
        tensors["pixel_values"] = prompt.pixel_values
        tensors["image_grid_thw"] = prompt.image_grid_thw
    if prompt.pixel_values_videos is not None and prompt.video_grid_thw is not None:
        tensors["pixel_values_videos"] = prompt.pixel_values_videos
        tensors["video_grid_thw"] = prompt.video_grid_thw
    if tensors:
        tensors.update(prompt.media_hashes)  # the encoder cache's keys (it hashes the inputs itself without them)
    return tensors



def _content_keys(prompt: PromptInputs) -> dict[str, bytes]:
    """What a request's work is keyed by in the stages that cache it, for picking their replicas: the thinker's
    prompt start (its prefix cache's blocks) and the encoder's first media item (its cache's entries)."""
    keys = {"thinker": prompt.input_ids[:PREFIX_KEY_TOKENS].numpy().tobytes()}
    digests = [d for name in sorted(prompt.media_hashes) for d in prompt.media_hashes[name].tolist()]
    if digests:
        keys["encoder"] = str(digests[0]).encode()
    return keys


def _structured(request: ChatRequest) -> dict[str, str]:
    """The thinker's `structured_output` option (services/llm/structured_output.py), when the request has one,
    and where it starts: after the reasoning's end marker (--reasoning-parser), when the answer reasons first."""
    if request.structured is None:
        return {}
    after = {} if request.reasoning_end is None else {STRUCTURED_AFTER_OPTION: request.reasoning_end}
    return {STRUCTURED_OPTION: option_value(*request.structured), **after}


def _vocoder_options(request: ChatRequest, voice: str) -> dict[str, str]:
    """The voice, and the request's seed: a vocoder that conditions on the speaker and draws noise (Qwen2.5-Omni's
    token2wav) reads them; Qwen3-Omni's code2wav reads neither."""
    seed = request.sampling.seed
    return {"speaker": voice, **({"seed": str(seed)} if seed is not None else {})}


def _priority(request: ChatRequest) -> dict[str, str]:
    """The thinker's and talker's `priority` option (none for the default 0: any stage takes that)."""
    return {"priority": str(request.priority)} if request.priority else {}
