"""Video file bytes -> the sampled RGB frames of a `VideoPart`, and audio files that are not WAV -> an
`AudioPart` (PyAV, i.e. FFmpeg's demuxers and decoders).

Data flow: file bytes (MP4, WebM, MKV, MOV, AVI, ... any container and codec this FFmpeg build reads) ->
`av.open` on a BytesIO -> the first video stream (cover art excluded) -> its frame count
(`stream.frames`, else one demux-only pass that counts its packets) and native frame rate
(`average_rate`, else `guessed_rate`) -> the limits, checked before any decoding (duration =
frames / rate against `InputLimits.max_video_seconds`, width * height against `max_image_pixels`) ->
`VideoSampling.indices(frames, rate)` -> the sampled frames' pixels against `max_video_pixels` -> `admit`
(the memory the decode will hold, which the gateway's media budget grants; gateway/video_process.py) -> one
decoding pass (bounded by `video_decode_timeout_s`) that converts only those frames to RGB, into one array
allocated at the first of them, and stops after the last -> `VideoPart(frames (T, H, W, 3) uint8,
fps=sampling.fps)`. A long video
never sits in memory as RGB: the frames not sampled are decoded and dropped. A stream that ends before
its declared count, or at a packet the decoder rejects (a truncated upload), keeps the sampled frames
decoded until then (logged); one without any is refused.

The soundtrack is read only when the request asks for it (`with_audio`, vLLM-Omni's
`mm_processor_kwargs: {"use_audio_in_video": true}`): `decode_soundtrack` decodes the first audio stream
as float samples at its own rate, which `samples_to_audio_part` mixes to mono and resamples to 16 kHz
exactly like a WAV part; a video without an audio stream is then refused. `decode_audio_file` does the same
for an audio file in any format this FFmpeg reads (MP3, FLAC, Ogg Vorbis / Opus, M4A / AAC, WebM, ...):
OpenAI's `input_audio` with format "mp3", vLLM's `audio_url`, the transcription upload.
Every refusal is a `PipelineError` (400, or 413 for a limit) naming the request field and saying what to
send instead; no PyAV / FFmpeg exception leaves this module. CPU-bound and native: the gateway runs it in a
child process of its own (gateway/video_process.py), never on the event loop.
"""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import av
import av.error
import numpy as np

from gateway.events import AudioPart, PipelineError, VideoPart
from gateway.input_limits import InputLimits
from gateway.media import invalid_request, samples_to_audio_part, too_large

if TYPE_CHECKING:
    from av.container import InputContainer
    from av.video.frame import VideoFrame
    from av.video.stream import VideoStream

    from omnimesh.models.qwen3_omni.video_sampling import VideoSampling

# what PyAV raises on bytes it cannot read: FFmpeg's errors (InvalidDataError is also a ValueError) and
# the ValueErrors of its own checks
_AV_ERRORS: tuple[type[Exception], ...] = (av.error.FFmpegError, ValueError)
_FORMATS_HINT = "MP4, WebM, MKV, MOV, AVI, ..."
_AUDIO_HINT = "WAV, MP3, FLAC, Ogg, M4A, WebM, ..."
log = logging.getLogger(__name__)

Admit = Callable[[int], None]  # told a decode's working memory (bytes) before it starts; may wait for it
FRAME_COPIES = 2  # the sampled frames as RGB: the decoder's array, and the gateway's copy it is sent into
MIN_AUDIO_BYTES_PER_S = 750  # 6 kbit/s, Opus's lowest rate for speech: a duration bound for files that declare none
AUDIO_COPIES = 3  # the decoded samples (float32 at their own rate and channels), then their mono mix and resampling


class DecodeTimeout(PipelineError):
    """`video_decode_timeout_s` passed while decoding: a 400 like any refusal, counted apart by the gateway
    (gateway/video_process.py)."""

    def __init__(self, message: str, param: str) -> None:
        e = invalid_request(message, param)
        super().__init__(e.message, http_status=e.http_status, grpc_code=e.grpc_code, kind=e.kind, param=param)


def decode_video(data: bytes, *, sampling: VideoSampling, limits: InputLimits, param: str,
                 with_audio: bool = False, admit: Admit | None = None) -> VideoPart:
    """Video file bytes -> `VideoPart` of the frames `sampling` keeps (see the module docstring), with its
    soundtrack when `with_audio`. `admit` is told the memory the decode will take (its frames twice: here and
    the gateway's copy; the soundtrack's working memory) before anything is decoded, and may wait; and the new
    total if the soundtrack outgrows what its header said."""
    frames_cost = 0
    try:
        with _open(data, param) as container:
            stream = _video_stream(container, param)
            native_fps = _native_fps(stream, param)
            _check_frame_size(stream.codec_context.width, stream.codec_context.height, limits.max_image_pixels,
                              param)
            total = stream.frames if stream.frames > 0 else _count_packets(data, param)
            if total < 1:
                raise invalid_request(f"{param}: the video stream has no frames; send a video with at least one "
                                      "frame", param)
            seconds = total / native_fps
            if seconds > limits.max_video_seconds:
                raise too_large(f"{param}: video is {seconds:.1f} s long ({total} frames at {native_fps:g} fps); "
                                f"the limit is {limits.max_video_seconds:g} s", param)
            indices = sampling.indices(total, native_fps)
            width, height = stream.codec_context.width, stream.codec_context.height
            _check_budget(len(indices), width, height, limits, param)
            if admit is not None:
                pixels = len(indices) * (width * height or min(limits.max_image_pixels, limits.max_video_pixels))
                sound = _audio_cost(container, len(data), limits.max_audio_seconds) if with_audio else 0
                admit(FRAME_COPIES * 3 * pixels + sound)
                frames_cost = FRAME_COPIES * 3 * pixels
            frames = _decode_sampled(container, stream, indices, limits, param,
                                     (width, height) if width * height else None)  # (T, H, W, 3)
    except PipelineError:
        raise
    except _AV_ERRORS as e:
        raise invalid_request(f"{param}: could not decode the video, the file is corrupt or truncated "
                              f"({_reason(e)}); send an intact video file ({_FORMATS_HINT})", param) from None
    # a soundtrack longer than its header said asks for the decode's new total: the frames and its grown buffer
    grown = (lambda sound_total: admit(frames_cost + sound_total)) if admit is not None else None
    audio = decode_soundtrack(data, max_seconds=limits.max_audio_seconds, param=param,
                              grown=grown) if with_audio else None
    return VideoPart(frames=frames, fps=float(sampling.fps), audio=audio)


def decode_soundtrack(data: bytes, *, max_seconds: float, param: str, grown: Admit | None = None) -> AudioPart:
    """The first audio stream of a video file -> 16 kHz mono `AudioPart` (400 when there is none). Its memory
    was asked for with the frames'; `grown` is told the soundtrack's new total if it outgrows that."""
    return _first_audio_stream(data, max_seconds, param, in_video=True, admit=grown, asked=True)


def decode_audio_file(data: bytes, *, sampling: VideoSampling | None = None, limits: InputLimits, param: str,
                      with_audio: bool = False, admit: Admit | None = None) -> AudioPart:
    """An audio file (MP3, FLAC, Ogg, M4A, WebM, ... or a WAV FFmpeg reads) -> 16 kHz mono `AudioPart`, at most
    `limits.max_audio_seconds` long (413 beyond). The signature is `decode_video`'s, so the same child-process
    runner takes it (gateway/video_process.py); `sampling` and `with_audio` mean nothing here. `admit` is told
    the decode's working memory (from the stream's duration, rate and channels) before it decodes, and its new
    total each time a stream longer than it declared outgrows that."""
    return _first_audio_stream(data, limits.max_audio_seconds, param, in_video=False, admit=admit)


def _audio_cost(container: InputContainer, size: int, max_seconds: float) -> int:
    """The working memory of decoding the first audio stream (0 without one) of a file of `size` bytes: its
    samples at their own rate and channels as float32, AUDIO_COPIES times, for `_expected_seconds`."""
    if not container.streams.audio:
        return 0
    context = container.streams.audio[0].codec_context
    if context is None:  # no decoder for it: `_first_audio_stream` refuses the file before decoding anything
        return 0
    rate, channels = context.sample_rate or 48_000, context.channels or 2
    return int(AUDIO_COPIES * 4 * _expected_seconds(container, size, max_seconds) * rate * channels)


def _expected_seconds(container: InputContainer, size: int, max_seconds: float) -> float:
    """The first audio stream's duration as its header says (the container's), at most `max_seconds` (decoding
    stops there). A file that declares none (a live-recorded WebM, as browsers make) is taken to be as long as
    its `size` bytes last at MIN_AUDIO_BYTES_PER_S; a longer one grows its buffer as it decodes."""
    stream = container.streams.audio[0]
    if stream.duration and stream.time_base:
        seconds = float(stream.duration * stream.time_base)
    elif container.duration:
        seconds = container.duration / av.time_base
    else:
        seconds = size / MIN_AUDIO_BYTES_PER_S
    return min(seconds, max_seconds)


def _first_audio_stream(data: bytes, max_seconds: float, param: str, *, in_video: bool,
                        admit: Admit | None = None, asked: bool = False) -> AudioPart:
    """The first audio stream's samples; `admit` is told the decode's memory before it starts (unless the caller
    `asked` for it already) and its new total whenever the stream outgrows what its header said."""
    what = "the video's audio" if in_video else "the audio"
    empty = "the video's audio track" if in_video else "the audio"
    try:
        with _open(data, param, "video" if in_video else "audio") as container:
            if not container.streams.audio:
                if not in_video:
                    raise invalid_request(f"{param}: the file holds no audio stream; send an audio file "
                                          f"({_AUDIO_HINT})", param)
                raise invalid_request(f"{param}: the video has no audio track, so use_audio_in_video cannot hear "
                                      "it; leave use_audio_in_video off for this request", param)
            if container.streams.audio[0].codec_context is None:  # PyAV found no decoder for its codec id
                raise invalid_request(f"{param}: this server has no decoder for the codec of {what} in this "
                                      f"{container.format.name} file; send it as 16-bit PCM WAV, FLAC, MP3 or "
                                      "Opus", param)
            if admit is not None and not asked:
                admit(_audio_cost(container, len(data), max_seconds))
            # planar float32 at the first frame's rate and layout (the resampler keeps them for the stream)
            resampler = av.AudioResampler(format="fltp")
            samples: np.ndarray | None = None  # (channels, capacity) float32, sized by the declared duration
            rate, n = 0, 0
            for frame in container.decode(container.streams.audio[0]):
                for out in resampler.resample(frame):
                    block = out.to_ndarray()  # (channels, k)
                    if samples is None:
                        rate = out.sample_rate
                        expected = _expected_seconds(container, len(data), max_seconds)
                        samples = np.empty((block.shape[0], int(expected * rate) + block.shape[1]), np.float32)
                    if admit is not None and (grown := _capacity(samples, n, block.shape[1])) > samples.shape[1]:
                        # longer than its header said: the decode's new total, waited for before it is taken
                        admit(int(AUDIO_COPIES * 4 * samples.shape[0] * grown))
                    samples = _append(samples, n, block)
                    n += block.shape[1]
                    if n / rate > max_seconds:
                        raise too_large(f"{param}: {what} is longer than {max_seconds:g} s, the audio limit", param)
    except PipelineError:
        raise
    except _AV_ERRORS as e:
        if not in_video:
            raise invalid_request(f"{param}: could not decode the audio, the file is corrupt or truncated "
                                  f"({_reason(e)}); send an intact audio file ({_AUDIO_HINT})", param) from None
        raise invalid_request(f"{param}: could not decode the video's audio track ({_reason(e)}); send an "
                              "intact video file, or its audio as an input_audio part", param) from None
    if samples is None or n == 0:
        raise invalid_request(f"{param}: {empty} holds no samples" + (
            "; leave use_audio_in_video off for this request" if in_video else ""), param)
    return samples_to_audio_part(samples[:, :n].T, rate, param=param)  # (frames, channels), a view


def _capacity(samples: np.ndarray, n: int, k: int) -> int:
    """The sample buffer's length once `k` more samples follow the first `n`: its own, or half as long again
    (at least long enough) when the stream is longer than it declared."""
    return samples.shape[1] if n + k <= samples.shape[1] else max(n + k, samples.shape[1] * 3 // 2)


def _append(samples: np.ndarray, n: int, block: np.ndarray) -> np.ndarray:
    """`block` (channels, k) written after the first `n` samples, in a buffer grown to `_capacity`."""
    if block.shape[0] != samples.shape[0]:
        raise ValueError(f"the stream changed from {samples.shape[0]} to {block.shape[0]} channels")
    if n + block.shape[1] > samples.shape[1]:
        grown = np.empty((samples.shape[0], _capacity(samples, n, block.shape[1])), np.float32)
        grown[:, :n] = samples[:, :n]
        samples = grown
    samples[:, n:n + block.shape[1]] = block
    return samples


def _reason(e: Exception) -> str:
    """FFmpeg's own words (its errors' str() also names a '<none>' file: nothing the client sent)."""
    return str(getattr(e, "strerror", None) or e)


def _open(data: bytes, param: str, what: str = "video") -> InputContainer:
    try:
        return av.open(io.BytesIO(data), mode="r")
    except _AV_ERRORS as e:
        hint = _FORMATS_HINT if what == "video" else _AUDIO_HINT
        raise invalid_request(f"{param}: could not read the {what}: {len(data)} bytes in no container format "
                              f"this server reads ({_reason(e)}); send {'a' if what == 'video' else 'an'} {what} "
                              f"file ({hint})", param) from None


def _video_stream(container: InputContainer, param: str) -> VideoStream:
    """The first video stream that is not an attached picture (cover art); a still image is refused."""
    fmt = container.format.name
    if fmt.endswith("_pipe") or fmt == "image2":  # png_pipe, jpeg_pipe, webp_pipe, ...: one still image
        raise invalid_request(f"{param}: this is a still image ({fmt.removesuffix('_pipe')}), not a video; send it "
                              "as an image part", param)
    for stream in container.streams.video:
        if stream.disposition & av.stream.Disposition.attached_pic:
            continue
        if stream.codec_context is None:  # PyAV found no decoder for the stream's codec id
            raise invalid_request(f"{param}: this server has no decoder for the codec of the video stream in this "
                                  f"{fmt} file; re-encode it (e.g. H.264, VP9 or AV1)", param)
        stream.thread_type = "AUTO"  # frame + slice threads: decoding is the costly part
        return stream
    kinds = ", ".join(sorted({str(s.type) for s in container.streams})) or "none"
    raise invalid_request(f"{param}: the file ({fmt}) has no video stream (streams: {kinds}); send a "
                          "video file, or audio as an audio part", param)


def _native_fps(stream: VideoStream, param: str) -> float:
    rate = stream.average_rate or stream.guessed_rate  # Fraction | None; 0/1 counts as unknown
    if rate is None or not float(rate) > 0:
        raise invalid_request(f"{param}: the video stream's frame rate is unknown, so its frames cannot be "
                              "sampled in time; re-encode it with a constant frame rate (e.g. MP4 / H.264)", param)
    return float(rate)


def _check_frame_size(width: int, height: int, max_pixels: int, param: str) -> None:
    if width * height > max_pixels:
        raise too_large(f"{param}: video frames are {width}x{height} = {width * height} pixels; the limit is "
                        f"{max_pixels}", param)


def _check_budget(n_frames: int, width: int, height: int, limits: InputLimits, param: str) -> None:
    """The sampled frames as RGB must fit `max_video_pixels` (what decoding would hold in memory)."""
    if n_frames * width * height > limits.max_video_pixels:
        raise too_large(f"{param}: the video's {n_frames} sampled frames of {width}x{height} are "
                        f"{n_frames * width * height} pixels; the limit is {limits.max_video_pixels}: send a "
                        "shorter or smaller video", param)


def _count_packets(data: bytes, param: str) -> int:
    """The video stream's frame count where the container does not store it (WebM, MKV, ...): its packets,
    counted in a demux-only pass over a second container (nothing is decoded)."""
    with _open(data, param) as container:
        stream = _video_stream(container, param)
        return sum(1 for packet in container.demux(stream) if packet.size > 0)  # the last is an empty flush


def _frames(container: InputContainer, stream: VideoStream, param: str) -> Iterator[VideoFrame]:
    """The stream's frames in presentation order. A packet the decoder rejects ends them as the end of the
    file would: a truncated upload keeps the frames before the cut (the caller refuses a video without any)."""
    decoded = container.decode(stream)
    while True:
        try:
            frame = next(decoded)
        except StopIteration:
            return
        except _AV_ERRORS as e:
            log.warning("%s: video decoding stopped at a corrupt packet (%s)", param, _reason(e))
            return
        yield frame


def _decode_sampled(container: InputContainer, stream: VideoStream, indices: list[int], limits: InputLimits,
                    param: str, header: tuple[int, int] | None = None) -> np.ndarray:
    """Decode up to the last of `indices` (frames in presentation order), converting only those to RGB
    -> (T, H, W, 3) uint8 at the first kept frame's size (a later size change is scaled to it), or at the
    `header`'s (width, height) when that frame is larger than the stream declared: the memory admitted for
    the decode was the header's. A stream that ends early (fewer frames than counted, or a corrupt packet)
    keeps the sampled frames it has."""
    wanted, last = frozenset(indices), indices[-1]
    out: np.ndarray | None = None  # (T, H, W, 3) uint8 at the first kept frame's size, filled in place
    kept = 0
    deadline = time.monotonic() + limits.video_decode_timeout_s
    for i, frame in enumerate(_frames(container, stream, param)):
        if time.monotonic() > deadline:
            raise DecodeTimeout(f"{param}: decoding the video took longer than {limits.video_decode_timeout_s:g} "
                                f"s (after {i} of the {last + 1} frames it must decode); send a shorter or "
                                "smaller video", param)
        if i in wanted:
            _check_frame_size(frame.width, frame.height, limits.max_image_pixels, param)  # the header may differ
            if out is None:  # every kept frame takes this size
                width, height = frame.width, frame.height
                if header is not None and width * height > header[0] * header[1]:
                    width, height = header
                _check_budget(len(indices), width, height, limits, param)
                out = np.empty((len(indices), height, width, 3), np.uint8)
            out[kept] = frame.to_ndarray(format="rgb24", width=out.shape[2], height=out.shape[1])
            kept += 1
        if i >= last:
            break
    if out is None:
        raise invalid_request(f"{param}: no frame of the video could be decoded; send an intact video file "
                              f"({_FORMATS_HINT})", param)
    if kept < len(indices):
        log.warning("%s: the video ended after fewer frames than it declared; %d of %d sampled frames kept",
                    param, kept, len(indices))
        return out[:kept]  # the frames it has (a view: the child sends only these and exits)
    return out
