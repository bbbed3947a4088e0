"""The gateway's media build budget (gateway/media_budget.py, `InputLimits.media_build_memory`): a request's
estimate by its media (none for text), grants in the order the requests arrived (a small request does not
overtake a waiting large one, nor a newer request's decode an older one's build; the fronts mark each request's
arrival), a request larger than the budget runs alone, a waiter that leaves gives its place or its grant back;
through `StagePipeline.run`, audio prompts are built one at a time when two do not fit together while text
prompts build beside them."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from PIL import Image

from gateway.events import (
    AudioPart,
    ChatMessage,
    ChatRequest,
    ImagePart,
    PipelineError,
    SamplingOverrides,
    TextPart,
    VideoPart,
)
from gateway.media_budget import (
    AUDIO_BYTES_PER_SAMPLE,
    IMAGE_BYTES_PER_PIXEL,
    RELEASE_AFTER_BYTES,
    MediaBudget,
    build_cost,
)
from gateway.pipeline import StagePipeline


def _chat(*parts: object) -> ChatRequest:
    return ChatRequest(request_id=f"r{time.monotonic_ns()}", model="m", sampling=SamplingOverrides(),
                       modalities=("text",), messages=(ChatMessage("user", tuple(parts)),))  # type: ignore[arg-type]


def test_the_estimate_counts_each_kind_of_media() -> None:
    assert build_cost(_chat(TextPart("a long text " * 1000))) == 0
    second_16k, second_48k = AudioPart(np.zeros(16_000, np.float32), 16_000), AudioPart(np.zeros(48_000, np.float32),
                                                                                         48_000)
    assert build_cost(_chat(second_16k)) == build_cost(_chat(second_48k)) == 16_000 * AUDIO_BYTES_PER_SAMPLE
    image = ImagePart(Image.new("RGB", (640, 480)))
    assert build_cost(_chat(image, second_16k)) == 640 * 480 * IMAGE_BYTES_PER_PIXEL + 16_000 * AUDIO_BYTES_PER_SAMPLE
    video = VideoPart(np.zeros((4, 32, 48, 3), np.uint8), 2.0)
    assert build_cost(_chat(video)) == 4 * 32 * 48
    with_sound = VideoPart(video.frames, 2.0, audio=second_16k)
    assert build_cost(_chat(with_sound)) == 4 * 32 * 48 + 16_000 * AUDIO_BYTES_PER_SAMPLE


async def test_grants_go_in_arrival_order_and_a_large_request_runs_alone() -> None:
    budget, order = MediaBudget(100), []

    async def run(name: str, cost: int, release: asyncio.Event) -> None:
        async with budget.hold(cost):
            order.append(name)
            await release.wait()

    a, b, c, big = (asyncio.Event() for _ in range(4))
    tasks = [asyncio.create_task(run("a", 60, a))]
    await asyncio.sleep(0)
    tasks.append(asyncio.create_task(run("b", 60, b)))  # does not fit beside a: waits
    await asyncio.sleep(0)
    tasks.append(asyncio.create_task(run("c", 10, c)))  # would fit, but b came first
    tasks.append(asyncio.create_task(run("text", 0, asyncio.Event())))  # no media: never waits
    await asyncio.sleep(0.01)
    assert order == ["a", "text"] and budget.used == 60
    a.set()
    await asyncio.sleep(0.01)
    assert order == ["a", "text", "b", "c"] and budget.used == 70
    tasks.append(asyncio.create_task(run("big", 10**9, big)))  # more than the budget: waits for it all, then alone
    await asyncio.sleep(0.01)
    assert order[-1] == "c"
    b.set(), c.set()
    await asyncio.sleep(0.01)
    assert order[-1] == "big" and budget.used == 100
    big.set()
    tasks[3].cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert budget.used == 0


async def test_a_waiter_that_leaves_gives_its_place_or_its_grant_back() -> None:
    budget = MediaBudget(100)
    async with budget.hold(80):
        waiting = asyncio.create_task(budget.hold(50).__aenter__())
        await asyncio.sleep(0.01)
        waiting.cancel()  # left while waiting: out of the queue
        await asyncio.gather(waiting, return_exceptions=True)
        assert not budget._waiting and budget.used == 80
        granted_late = asyncio.create_task(budget.hold(50).__aenter__())
        await asyncio.sleep(0.01)
    # the 80 went back and the waiter got its 50 in the same moment; it is cancelled before it could run
    granted_late.cancel()
    await asyncio.gather(granted_late, return_exceptions=True)
    assert budget.used == 0 and not budget._waiting
    with pytest.raises(ValueError, match="must be positive"):
        MediaBudget(0)


async def test_the_pipeline_builds_audio_prompts_within_the_budget_and_text_beside_them() -> None:
    """Two prompts of 10 s of audio need more than the budget together: the second build starts only after the
    first returned; a text prompt sent meanwhile builds at once."""
    building, peak, lock, texts = [0], [0], threading.Lock(), []

    def prepare(request: ChatRequest):
        has_audio = any(isinstance(p, AudioPart) for m in request.messages for p in m.content)
        with lock:
            building[0] += has_audio
            peak[0] = max(peak[0], building[0])
            if not has_audio:
                texts.append(building[0])  # how many audio builds ran while this one did
        time.sleep(0.3 if has_audio else 0.0)
        with lock:
            building[0] -= has_audio
        raise PipelineError("prepared", http_status=400, grpc_code=3, kind="invalid_request_error")

    pipe = StagePipeline({"thinker": []}, prepare, served_models=("m",))
    ten_s = AudioPart(np.zeros(160_000, np.float32), 16_000)
    pipe.media_budget = MediaBudget(int(1.5 * build_cost(_chat(ten_s))))

    async def one(request: ChatRequest) -> str:
        try:
            async for _ in pipe.run(request):
                pass
        except PipelineError as e:
            return e.message
        return "no error"

    first = asyncio.create_task(one(_chat(ten_s)))
    second = asyncio.create_task(one(_chat(ten_s)))
    await asyncio.sleep(0.1)
    assert await one(_chat(TextPart("hi"))) == "prepared" and texts == [1]  # beside the first audio build
    assert await asyncio.gather(first, second) == ["prepared", "prepared"]
    assert peak[0] == 1 and pipe.media_budget.used == 0


async def test_the_free_pages_go_back_once_the_budget_is_idle_after_a_large_build(monkeypatch) -> None:
    """tcmalloc keeps what a build freed: after a large one, once no build holds the budget, the allocator hands
    its free pages back (once for overlapping builds; never after small ones, which free too little to matter)."""
    from omnimesh import allocator

    calls: list[str] = []
    monkeypatch.setattr(allocator, "release_free_memory", lambda: calls.append("released") or "tcmalloc")
    budget = MediaBudget(2**31)
    async with budget.hold(RELEASE_AFTER_BYTES // 2):
        pass
    assert budget.releasing is None and calls == []  # a small build
    async with budget.hold(RELEASE_AFTER_BYTES):
        async with budget.hold(RELEASE_AFTER_BYTES):
            pass
        assert budget.releasing is None  # another large build still holds the budget
    assert budget.releasing is not None and await budget.releasing == "tcmalloc"
    assert calls == ["released"]


async def test_a_refused_build_leaves_nothing_behind_without_a_collection() -> None:
    """A prompt refused after its features were built (too long for max_model_len) must free them when the error
    has been answered, by reference counting alone: the gateway's start-up heap is frozen, so full collections
    are rare, and a cycle through the request's frame (the exception it kept, whose traceback holds that frame)
    kept each refused 10-minute clip's 30 MB of features: a burst of them kept gigabytes."""
    import gc
    import weakref

    class Features:  # stands for the processor's BatchFeature
        pass

    alive: list[weakref.ref] = []

    def prepare(request: ChatRequest):
        features = Features()
        alive.append(weakref.ref(features))
        raise PipelineError("the prompt is 7680 tokens, but ...", http_status=400, grpc_code=3,
                            kind="invalid_request_error")

    async def refused() -> str:
        try:
            async for _ in pipe.run(_chat(AudioPart(np.zeros(16_000, np.float32), 16_000))):
                pass
        except PipelineError as e:
            return e.message
        return "answered"

    pipe = StagePipeline({"thinker": []}, prepare, served_models=("m",))
    pipe.media_budget = MediaBudget(2**30)
    gc.disable()
    try:
        assert (await refused()).startswith("the prompt is 7680 tokens")
        await asyncio.sleep(0.05)  # the worker thread's future hands its result over in a callback of the loop's
        assert len(alive) == 1 and alive[0]() is None
    finally:
        gc.enable()


async def test_the_budget_is_on_the_gateways_metrics() -> None:
    """omnimesh:media_budget_*: its limit, what is held, how many wait, and how long each grant waited."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from gateway.rest import create_app
    from gateway_harness import RestServer, ScriptedPipeline

    pipeline = ScriptedPipeline()
    pipeline.media_budget = MediaBudget(100)  # type: ignore[assignment]

    def scrape() -> dict[str, float]:
        text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
        return {s.name: s.value for f in text_string_to_metric_families(text) if f.name.startswith("omnimesh:media_b")
                for s in f.samples if "le" not in s.labels or s.labels["le"] == "0.01"}

    with RestServer(create_app(pipeline, served_model_names=("tiny-omni",))) as server:
        async with pipeline.media_budget.hold(80):
            waiting = asyncio.ensure_future(pipeline.media_budget.acquire(50))
            await asyncio.sleep(0.05)
            now = await asyncio.to_thread(scrape)
            assert (now["omnimesh:media_budget_limit_bytes"], now["omnimesh:media_budget_used_bytes"],
                    now["omnimesh:media_budget_waiting"]) == (100, 80, 1)
        pipeline.media_budget.release(await waiting)
        after = await asyncio.to_thread(scrape)
    assert (after["omnimesh:media_budget_used_bytes"], after["omnimesh:media_budget_waiting"]) == (0, 0)
    assert after["omnimesh:media_budget_wait_seconds_count"] == 2  # the 80 at once, the 50 after its wait
    assert after["omnimesh:media_budget_wait_seconds_bucket"] == 1  # within 10 ms: the first only
    assert after["omnimesh:media_budget_wait_seconds_sum"] >= 0.05


async def test_a_thread_admission_cancelled_as_it_is_granted_gives_the_bytes_back() -> None:
    """`ThreadAdmission` (a decode's worker thread waiting on the loop): cancelled in the same moment its wait is
    granted, the grant goes back to the budget (the thread sees CancelledError and releases nothing); cancelled
    after the thread has its grant, the thread keeps it until it releases; cancelled before it asked, the thread
    never waits. (The thread's concurrent.futures.CancelledError reaches an awaiting coroutine as asyncio's.)"""
    from gateway.media_budget import ThreadAdmission

    budget = MediaBudget(100)
    loop = asyncio.get_running_loop()
    async with budget.hold(100):
        admission = ThreadAdmission(budget, loop)
        thread = asyncio.ensure_future(asyncio.to_thread(admission, 60))
        await asyncio.sleep(0.05)
        assert len(budget._waiting) == 1
    admission.cancel()  # the 100 went back and granted the 60 in this same step; the cancel comes before it ran
    with pytest.raises(asyncio.CancelledError):
        await thread
    assert budget.used == 0 and not budget._waiting

    admission = ThreadAdmission(budget, loop)
    release = await asyncio.to_thread(admission, 60)
    admission.cancel()  # too late: the thread has it
    assert budget.used == 60
    release()
    await asyncio.sleep(0)
    assert budget.used == 0

    admission = ThreadAdmission(budget, loop)
    admission.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.to_thread(admission, 60)
    assert budget.used == 0


async def test_a_requests_build_goes_before_the_decodes_of_requests_that_came_after_it() -> None:
    """The line is ordered by request: request 1's build (it arrived at 1.0) is granted before the decodes of
    requests 2 and 3, which were in line before it; a wait of the same request keeps its own order."""
    budget = MediaBudget(100)
    granted: list[str] = []

    async def wait(name: str, cost: int, arrived: float) -> int:
        got = await budget.acquire(cost, arrived)
        granted.append(name)
        return got

    async with budget.hold(100):
        decodes = [asyncio.create_task(wait(f"decode {i}", 60, float(i))) for i in (2, 3)]
        await asyncio.sleep(0.01)
        build = asyncio.create_task(wait("build 1", 60, 1.0))
        second = asyncio.create_task(wait("second build 1", 30, 1.0))  # the same request: behind its first
        await asyncio.sleep(0.01)
        assert [w[0] for w in budget._waiting] == [1.0, 1.0, 2.0, 3.0] and not granted
    await asyncio.sleep(0.01)
    assert granted == ["build 1", "second build 1"]  # 90: decode 2 (60) does not fit beside them
    budget.release(await build)
    await asyncio.sleep(0.01)
    assert granted[2:] == ["decode 2"]  # 90 again: decode 3 waits for it
    budget.release(await second)
    budget.release(await decodes[0])
    budget.release(await decodes[1])
    assert granted[3:] == ["decode 3"] and budget.used == 0 and not budget._waiting


async def test_a_request_keeps_its_place_through_its_tasks_and_its_decode_threads() -> None:
    """`mark_arrival` in a request's task: the tasks it starts and its decode's `ThreadAdmission` (in a worker
    thread) wait at that place; an older request that asks later still goes first, and work no front marked
    waits by the moment it asked."""
    from gateway.media_budget import ThreadAdmission, arrival, mark_arrival

    budget, loop, order = MediaBudget(100), asyncio.get_running_loop(), []
    older_marked, newer_asks = asyncio.Event(), asyncio.Event()

    async def older() -> None:
        mark_arrival()
        older_marked.set()
        await newer_asks.wait()
        await asyncio.sleep(0.01)

        async def build() -> None:  # a task of its own, as a choice's run is
            async with budget.hold(60):
                order.append("older build")

        await asyncio.create_task(build())

    async def newer() -> None:
        await older_marked.wait()
        await asyncio.sleep(0.01)
        mark_arrival()
        admit = ThreadAdmission(budget, loop)  # made in the request's task, as MediaLoader makes it
        newer_asks.set()
        release = await asyncio.to_thread(admit, 60)
        order.append("newer decode")
        release()

    async with budget.hold(100):
        tasks = [asyncio.create_task(older()), asyncio.create_task(newer())]
        await asyncio.sleep(0.1)
        assert len(budget._waiting) == 2 and budget._waiting[0][0] < budget._waiting[1][0]
    await asyncio.gather(*tasks)
    assert order == ["older build", "newer decode"]
    first = arrival()
    await asyncio.sleep(0.01)
    assert arrival() > first  # unmarked: each asks at its own moment


def test_the_fronts_mark_each_requests_arrival() -> None:
    """REST chat (both runs of n=2 in one place) and gRPC Generate: the pipeline runs inside the request's mark,
    so its builds keep the request's place in line however late they ask."""
    from gateway_harness import GrpcServer, RestServer, ScriptedPipeline, default_script

    from gateway.media_budget import arrival
    from gateway.rest import create_app
    from omnimesh.v1 import omni_pb2, omni_pb2_grpc

    pipeline = ScriptedPipeline()
    seen: list[tuple[float, float]] = []

    def script(request: ChatRequest) -> list:
        first = arrival()
        time.sleep(0.02)
        seen.append((first, arrival()))
        return default_script(request)

    pipeline.script = script
    body = {"model": "tiny-omni", "n": 2, "modalities": ["text"], "messages": [{"role": "user", "content": "hi"}]}
    with RestServer(create_app(pipeline, served_model_names=("tiny-omni",))) as server:
        import httpx

        assert httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=10).status_code == 200
    assert len(seen) == 2 and seen[0][0] == seen[0][1] == seen[1][0] == seen[1][1]
    seen.clear()
    grpc_server = GrpcServer(pipeline).start()
    try:
        import grpc

        with grpc.insecure_channel(f"127.0.0.1:{grpc_server.port}") as ch:
            request = omni_pb2.GenerateRequest(model="tiny-omni", modalities=["text"], messages=[
                omni_pb2.ChatMessage(role="user", content=[omni_pb2.ContentPart(text="hi")])])
            list(omni_pb2_grpc.OmniStub(ch).Generate(request, timeout=10))
    finally:
        grpc_server.stop()
    assert len(seen) == 1 and seen[0][0] == seen[0][1]
