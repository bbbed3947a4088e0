"""What a media decode in a child process (gateway/video_process.py) costs the gateway in memory, and how it waits
for it in the media budget (gateway/media_budget.py): the child asks for its frames twice (its array and the
gateway's) and the soundtrack's working memory before decoding anything; the gateway reads the frames straight
into their array (a 316 MB decode held them twice in the gateway and three times in the child before); decodes
that do not fit beside the others wait in line, and a caller that leaves withdraws its wait."""

from __future__ import annotations

import asyncio
import multiprocessing
import time
import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest
import video_decoders

pytest.importorskip("av", reason="PyAV (the av package) decodes video; pip install av")

from gateway import media_video, video_process  # noqa: E402
from gateway.events import PipelineError  # noqa: E402
from gateway.input_limits import InputLimits  # noqa: E402
from gateway.media import MediaLoader  # noqa: E402
from gateway.media_budget import MediaBudget  # noqa: E402
from omnimesh.models.qwen3_omni.video_sampling import VideoSampling  # noqa: E402
from test_media_video import make_video  # noqa: E402

SAMPLING = VideoSampling()
THREE_SECONDS = media_video.AUDIO_COPIES * 4 * 2 * 44_100 * 3  # the working memory of 3 s of 44.1 kHz stereo


def _in_child(data: bytes, asked: list[int], **kw: object):  # type: ignore[no-untyped-def]
    def admit(cost: int):  # type: ignore[no-untyped-def]
        asked.append(cost)
        return lambda: asked.append(-cost)

    return video_process.decode_in_child(data, sampling=SAMPLING, limits=InputLimits(), param="v", admit=admit, **kw)


def test_the_child_asks_for_its_frames_twice_and_its_soundtrack_before_decoding() -> None:
    asked: list[int] = []
    part = _in_child(make_video(12, 4), asked)
    assert asked == [media_video.FRAME_COPIES * part.frames.nbytes, -media_video.FRAME_COPIES * part.frames.nbytes]
    asked.clear()
    part = _in_child(make_video(12, 4, tone_hz=440.0), asked, with_audio=True)  # 3 s of 44.1 kHz stereo
    sound = asked[0] - media_video.FRAME_COPIES * part.frames.nbytes
    assert 0.95 * THREE_SECONDS < sound < 1.07 * THREE_SECONDS
    assert asked[1] == -asked[0]


def test_an_audio_file_asks_for_its_samples_at_their_own_rate_and_channels() -> None:
    asked: list[int] = []
    part = video_process.decode_in_child(make_video(12, 4, tone_hz=440.0), sampling=None, limits=InputLimits(),
                                         param="a", kind="audio",
                                         admit=lambda cost: asked.append(cost) or (lambda: asked.append(-cost)))
    assert part.sample_rate == 16_000 and len(asked) == 2 and asked[1] == -asked[0]
    assert 0.95 * THREE_SECONDS < asked[0] < 1.07 * THREE_SECONDS


def test_the_gateway_holds_the_frames_once_while_they_arrive() -> None:
    """The frames come as raw bytes read into their array: no pickled copy beside it (2x before)."""
    video_process.start_forkserver()
    data = make_video(12, 2, w=640, h=480)
    tracemalloc.start()
    try:
        part = video_process.decode_in_child(data, sampling=SAMPLING, limits=InputLimits(), param="v")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert part.frames.shape == (12, 480, 640, 3) and part.frames.nbytes > 10_000_000
    assert peak < 1.25 * part.frames.nbytes, (peak, part.frames.nbytes)
    assert np.array_equal(part.frames, media_video.decode_video(data, sampling=SAMPLING, limits=InputLimits(),
                                                                param="v").frames)


def _traced_peak(fn):  # type: ignore[no-untyped-def]
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_decoders_fill_one_array() -> None:
    """The sampled frames go into one array as they are decoded (a list of frames stacked at the end held them
    twice: the child's peak rose by 2.3x the frames, now 1.5x with the decoder's own buffers); an audio file's
    samples into one buffer sized by its declared length (its decoded frames, their concatenation and a
    contiguous copy held them three times before the mono mix)."""
    ours, theirs = multiprocessing.Pipe()
    child = video_process._CONTEXT.Process(target=video_decoders.peak_growth,
                                           args=(theirs, make_video(12, 2, w=1920, h=1080), make_video(4, 2)))
    child.start()
    try:
        assert ours.poll(60.0), "the child did not answer"
        frames, growth = ours.recv()
    finally:
        child.join(10.0)
    if growth is None:
        pytest.skip("this kernel cannot reset a process's peak resident size (/proc/self/clear_refs)")
    assert frames == 12 * 1920 * 1080 * 3 and growth < 1.9 * frames, (growth / frames)  # 1.47 now, 2.30 before
    sound = make_video(12, 1, tone_hz=440.0)  # 12 s of 44.1 kHz stereo
    part, peak = _traced_peak(lambda: media_video.decode_audio_file(sound, limits=InputLimits(), param="a"))
    samples = 12 * 44_100 * 2 * 4  # float32 at their own rate and channels
    assert abs(part.waveform.size - 12 * 16_000) < 16_000 and peak < 2.8 * samples, (peak, samples)


def _slow_loader(monkeypatch: pytest.MonkeyPatch, budget: MediaBudget) -> MediaLoader:
    """A loader whose child decoder asks for 600 bytes, then holds them 0.4 s before decoding."""
    real = video_process.decode_in_child
    monkeypatch.setattr(video_process, "decode_in_child",
                        lambda data, **kw: real(data, decoder=video_decoders.admitted_then_slow, **kw))
    return MediaLoader(InputLimits(), budget=budget)


async def _until(condition, what: str, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def test_decodes_that_do_not_fit_together_wait_in_line(monkeypatch: pytest.MonkeyPatch) -> None:
    budget = MediaBudget(1000)
    loader = _slow_loader(monkeypatch, budget)
    data = make_video(4, 4)
    both = asyncio.gather(loader.video_from_bytes(data, "a"), loader.video_from_bytes(data, "b"))
    await _until(lambda: budget.used == 600 and len(budget._waiting) == 1, "one decode granted, one in line")
    first, second = await both
    assert first.frames.shape == second.frames.shape == (4, 48, 64, 3)
    await _until(lambda: budget.used == 0, "both grants given back")
    assert not budget._waiting


async def test_a_caller_that_leaves_withdraws_its_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    budget = MediaBudget(1000)
    loader = _slow_loader(monkeypatch, budget)
    before = video_process.METRICS.counts["cancelled"]
    async with budget.hold(1000):  # another request's build holds it all
        decode = asyncio.ensure_future(loader.video_from_bytes(make_video(4, 4), "v"))
        await _until(lambda: len(budget._waiting) == 1, "the decode in line")
        decode.cancel()
        await _until(lambda: not budget._waiting, "the wait withdrawn")
        await _until(lambda: video_process.METRICS.counts["cancelled"] == before + 1, "the decode counted")
        await _until(lambda: not multiprocessing.active_children(), "the child gone")
    assert budget.used == 0
    with pytest.raises(asyncio.CancelledError):
        await decode


async def test_a_decode_larger_than_the_budget_runs_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    budget = MediaBudget(100)  # the decoder asks for 600
    part = await _slow_loader(monkeypatch, budget).video_from_bytes(make_video(4, 4), "v")
    assert part.frames.shape[0] == 4
    await _until(lambda: budget.used == 0, "the grant given back")


def _frame(width: int, height: int) -> SimpleNamespace:
    return SimpleNamespace(width=width, height=height,
                           to_ndarray=lambda format, width, height: np.zeros((height, width, 3), np.uint8))


@pytest.mark.parametrize(("header", "first", "kept"), [
    ((16, 16), (64, 64), (16, 16)),  # larger than declared: the header's size, which is what was admitted
    ((16, 16), (8, 8), (8, 8)),  # smaller: its own (every later frame is scaled to it)
    (None, (64, 64), (64, 64)),  # no size declared: admitted at the limits, its own
])
def test_frames_never_take_more_than_the_header_admitted(monkeypatch: pytest.MonkeyPatch, header, first,
                                                           kept) -> None:  # type: ignore[no-untyped-def]
    frames = [_frame(*first), _frame(64, 64), _frame(4, 4)]
    monkeypatch.setattr(media_video, "_frames", lambda container, stream, param: iter(frames))
    out = media_video._decode_sampled(None, None, [0, 1, 2], InputLimits(), "v", header)  # type: ignore[arg-type]
    assert out.shape == (3, kept[1], kept[0], 3)


def test_a_stream_shorter_than_declared_keeps_what_it_has(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(media_video, "_frames", lambda container, stream, param: iter([_frame(8, 8)]))
    out = media_video._decode_sampled(None, None, [0, 2, 4], InputLimits(), "v", (8, 8))  # type: ignore[arg-type]
    assert out.shape == (1, 8, 8, 3)
    monkeypatch.setattr(media_video, "_frames", lambda container, stream, param: iter([]))
    with pytest.raises(PipelineError, match="no frame of the video could be decoded"):
        media_video._decode_sampled(None, None, [0, 2], InputLimits(), "v", (8, 8))  # type: ignore[arg-type]


def _live_webm(seconds: int) -> bytes:
    """Mono Opus in a WebM written as a live recording (a browser's MediaRecorder): no duration in its header."""
    import io

    import av

    out = io.BytesIO()
    with av.open(out, "w", format="webm", options={"live": "1"}) as c:
        stream = c.add_stream("libopus", rate=48_000, layout="mono")
        for k in range(seconds):
            frame = av.AudioFrame.from_ndarray((0.3 * np.sin(np.arange(48_000) / 7 + k)).astype(np.float32)[None],
                                               format="flt", layout="mono")
            frame.sample_rate, frame.pts = 48_000, k * 48_000
            for packet in stream.encode(frame):
                c.mux(packet)
        for packet in stream.encode():
            c.mux(packet)
    return out.getvalue()


def test_a_file_without_a_declared_duration_asks_by_its_size() -> None:
    """A live-recorded WebM says nothing of its length: it is taken to last its bytes at 6 kbit/s (Opus's
    lowest for speech), not the whole max_audio_seconds (600 s of 48 kHz: 345 MB asked for a 5-second clip)."""
    data = _live_webm(5)
    asked: list[int] = []
    part = video_process.decode_in_child(data, sampling=None, limits=InputLimits(), param="a", kind="audio",
                                         admit=lambda cost: asked.append(cost) or (lambda: None))
    assert abs(part.waveform.size - 5 * 16_000) < 1_600
    expected_s = len(data) / media_video.MIN_AUDIO_BYTES_PER_S
    assert 5 < expected_s < 600 and asked == [int(media_video.AUDIO_COPIES * 4 * expected_s * 48_000)]


def test_an_audio_file_longer_than_its_header_says_asks_again_for_its_new_total() -> None:
    """A file whose header says 1 s but holds 5: each time its buffer must grow, the child asks for the decode's
    new total (AUDIO_COPIES x the grown buffer) before taking it, and the gateway gives back what it held before
    it waits for that, so no decode waits while holding a reservation; everything is given back at the end."""
    data = _live_webm(5)
    events: list[tuple[str, int]] = []

    def admit(cost: int):  # type: ignore[no-untyped-def]
        events.append(("admit", cost))
        return lambda: events.append(("release", cost))

    part = video_process.decode_in_child(data, sampling=None, limits=InputLimits(), param="a", kind="audio",
                                         admit=admit, decoder=video_decoders.understated_audio)
    assert abs(part.waveform.size - 5 * 16_000) < 1_600
    asked = [cost for what, cost in events if what == "admit"]
    one_second = int(media_video.AUDIO_COPIES * 4 * 1.0 * 48_000)
    assert asked[0] == one_second and len(asked) >= 4 and asked == sorted(asked)
    assert asked[-1] >= media_video.AUDIO_COPIES * 4 * 5 * 48_000  # at least the samples it came to hold
    assert events == [e for cost in asked for e in (("admit", cost), ("release", cost))]


def test_a_soundtrack_longer_than_its_header_says_asks_again_with_the_frames() -> None:
    """use_audio_in_video: the first ask holds the frames and 1 s of sound; each later one the frames and the
    grown sound buffer, each after the last was given back."""
    data = make_video(12, 1, tone_hz=440.0)  # 12 s of 44.1 kHz stereo
    events: list[tuple[str, int]] = []

    def admit(cost: int):  # type: ignore[no-untyped-def]
        events.append(("admit", cost))
        return lambda: events.append(("release", cost))

    part = video_process.decode_in_child(data, sampling=SAMPLING, limits=InputLimits(), param="v", admit=admit,
                                         decoder=video_decoders.understated_soundtrack)
    assert part.audio is not None and abs(part.audio.waveform.size - 12 * 16_000) < 1_600
    asked = [cost for what, cost in events if what == "admit"]
    frames = media_video.FRAME_COPIES * part.frames.size
    assert asked[0] == frames + int(media_video.AUDIO_COPIES * 4 * 1.0 * 44_100 * 2)
    assert len(asked) >= 4 and asked == sorted(asked)
    assert asked[-1] - frames >= media_video.AUDIO_COPIES * 4 * 12 * 44_100 * 2
    assert events == [e for cost in asked for e in (("admit", cost), ("release", cost))]


async def test_an_audio_file_that_outgrows_its_header_waits_in_the_budget_again(monkeypatch: pytest.MonkeyPatch
                                                                                   ) -> None:
    """Through the loader and the media budget: the decode's later asks wait in line (here behind another
    request's build, which holds all but the first ask), and all of it is given back at the end."""
    real = video_process.decode_in_child
    monkeypatch.setattr(video_process, "decode_in_child",
                        lambda data, **kw: real(data, decoder=video_decoders.understated_audio, **kw))
    budget = MediaBudget(int(media_video.AUDIO_COPIES * 4 * 1.0 * 48_000) + 1000)  # the first ask fits, no more
    loader = MediaLoader(InputLimits(), budget=budget)
    async with budget.hold(1000):  # another request's, granted first
        decode = asyncio.ensure_future(loader.audio_from_file(_live_webm(5), "a"))
        await _until(lambda: len(budget._waiting) == 1 and budget.used == 1000, "a larger ask waiting in line")
    part = await asyncio.wait_for(decode, 30)
    assert abs(part.waveform.size - 5 * 16_000) < 1_600
    await _until(lambda: budget.used == 0, "every grant given back")
    assert not budget._waiting and budget.waits[-1] >= 5  # grants: the other build, the first ask, 3+ more


def test_the_sample_buffer_grows_past_what_the_header_said() -> None:
    samples = np.arange(8, dtype=np.float32).reshape(2, 4)
    grown = media_video._append(samples, 4, np.full((2, 3), -1, np.float32))  # 7 samples in a buffer of 4
    assert grown.shape == (2, 7) and np.array_equal(grown[:, :4], samples) and (grown[:, 4:] == -1).all()
    again = media_video._append(np.zeros((2, 40), np.float32), 7, np.ones((2, 3), np.float32))  # fits: in place
    assert again.shape == (2, 40) and again[:, 7:10].sum() == 6
    with pytest.raises(ValueError, match="changed from 2 to 1 channels"):
        media_video._append(grown, 7, np.ones((1, 3), np.float32))


def test_frames_that_stop_coming_are_given_up_at_the_deadline() -> None:
    """The raw frame bytes are read under the decode's deadline: a child that stops sending halfway (stopped, not
    dead: no end of file) cannot hold the gateway's thread."""
    ours, theirs = multiprocessing.Pipe()
    frames = np.arange(2 * 4 * 4 * 3, dtype=np.uint8).reshape(2, 4, 4, 3)
    video_process._send_frames(theirs, frames)
    part = video_process._receive_frames(ours, time.monotonic() + 5.0, frames.shape, 2.0, None)
    assert part is not None and np.array_equal(part.frames, frames) and part.fps == 2.0
    video_process._send_frames(theirs, frames[:1])  # half of what the header will say
    started = time.monotonic()
    assert video_process._receive_frames(ours, started + 0.2, frames.shape, 2.0, None) is None
    assert 0.15 < time.monotonic() - started < 2.0
    theirs.close()
    with pytest.raises(EOFError, match="ended after 0 of 96 bytes"):
        video_process._receive_frames(ours, time.monotonic() + 5.0, frames.shape, 2.0, None)


def test_a_child_waiting_for_memory_ends_when_the_gateway_goes() -> None:
    """A child blocked in its ask for memory (`_ask_to_decode`) whose gateway end closes exits (SystemExit), not
    a decoder bug logged and answered to nobody."""
    import threading

    ours, theirs = multiprocessing.Pipe()
    ended: list[BaseException] = []

    def child() -> None:
        try:
            video_process._ask_to_decode(theirs, 1234)
        except BaseException as e:  # noqa: BLE001  # what the child's process would end with
            ended.append(e)

    asker = threading.Thread(target=child)
    asker.start()
    assert ours.poll(10.0) and ours.recv() == ("admit", 1234)
    ours.close()  # the gateway is gone before it answered "go"
    asker.join(10.0)
    assert not asker.is_alive() and len(ended) == 1 and isinstance(ended[0], SystemExit)


async def test_decodes_waiting_for_memory_never_take_the_thread_a_build_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A build holds its share of the budget while it waits for a thread of the loop's default pool to run in
    (as StagePipeline builds a prompt). Decodes wait for their memory in a thread as well; in that pool they
    took every thread while the build that would give the memory back never ran (12 videos at once with a
    150 MiB budget hung a gateway that ordered its line by arrival). Here the pool has one thread, a decode
    waits in line, and an older request's build is granted first: it must still run, and the decode after it."""
    from concurrent.futures import ThreadPoolExecutor

    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(max_workers=1))  # this test's loop only
    budget = MediaBudget(1000)
    loader = _slow_loader(monkeypatch, budget)

    async def build() -> None:
        granted = await budget.acquire(1000, arrived=0.0)  # an older request's
        try:
            await asyncio.to_thread(time.sleep, 0.05)
        finally:
            budget.release(granted)

    async with budget.hold(1000):  # another build holds it all
        decode = asyncio.ensure_future(loader.video_from_bytes(make_video(4, 4), "v"))
        await _until(lambda: len(budget._waiting) == 1, "the decode in line")
        built = asyncio.ensure_future(build())
        await _until(lambda: len(budget._waiting) == 2, "the build in line before it")
    await asyncio.wait_for(built, 20)
    assert (await asyncio.wait_for(decode, 20)).frames.shape[0] == 4
    await _until(lambda: budget.used == 0, "every grant given back")


def test_a_thread_waiting_for_memory_ends_when_the_loop_stops() -> None:
    """The gateway's loop stops while a decode's thread waits for its memory: the thread is told (CancelledError)
    within LOOP_CHECK_S instead of waiting for ever (which would hold the interpreter's exit)."""
    import concurrent.futures
    import threading

    from gateway import media_budget

    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    budget = MediaBudget(100)
    asyncio.run_coroutine_threadsafe(budget.acquire(100), loop).result(5)  # it is all taken
    admission = asyncio.run_coroutine_threadsafe(_admission(budget, loop), loop).result(5)
    outcome: list[BaseException] = []

    def wait() -> None:
        try:
            admission(60)
        except BaseException as e:  # noqa: BLE001
            outcome.append(e)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    deadline = time.monotonic() + 5
    while not budget._waiting:
        assert time.monotonic() < deadline, "the wait never reached the line"
        time.sleep(0.01)
    loop.call_soon_threadsafe(loop.stop)
    runner.join(5)
    started = time.monotonic()
    waiter.join(media_budget.LOOP_CHECK_S + 5)
    assert not waiter.is_alive() and time.monotonic() - started < media_budget.LOOP_CHECK_S + 2
    assert len(outcome) == 1 and isinstance(outcome[0], concurrent.futures.CancelledError)
    loop.close()


async def _admission(budget: MediaBudget, loop: asyncio.AbstractEventLoop):  # type: ignore[no-untyped-def]
    from gateway.media_budget import ThreadAdmission

    return ThreadAdmission(budget, loop)
