"""A compressed audio file written as the answer's samples come, so the client hears it before the answer ends.

`/v1/audio/speech` answers in mp3 by default, as OpenAI's does, and OpenAI streams it; a file encoded only at
the end would make the whole answer's latency the time to the first byte. MP3, AAC in ADTS and Opus in Ogg are
written front to back (no header carries the length), so the bytes FFmpeg's muxer writes after each delta can
go out at once. WAV and FLAC name their length in a header written first: those stay whole files at the end
(`gateway/audio_encoding.compressed_bytes` / `wav_bytes`).

The muxer writes into a sink that is not seekable: MP3's Xing/LAME header keeps no frame count (players
read the stream as they would a radio stream), Ogg pages are cut every 100 ms instead of every second. The
encoder re-cuts samples into its own frames, so how the deltas split the answer does not change the packets
(mp3 and aac bytes are the same for any split; Ogg's random stream serial differs per file, its audio not).

Data flow: the answer's float32 deltas -> `AudioFileStream.push` -> the file's next bytes (maybe none yet) ->
... -> `finish` -> the encoder's and muxer's last bytes.
"""

from __future__ import annotations

import threading
from typing import Any, cast

import numpy as np

from gateway.audio_encoding import codec_rate, compressed_format, float_to_pcm16

STREAMED_FORMATS = ("mp3", "aac", "opus")  # written front to back: streamable as they are encoded
_OGG_PAGE_US = "100000"  # an Ogg page every 100 ms of audio (FFmpeg's default waits a whole second)


class _Sink:
    """A write-only, non-seekable file for PyAV: it keeps what the muxer writes until `take`."""

    def __init__(self) -> None:
        self._chunks: list[bytes] = []

    def write(self, data: Any) -> int:
        self._chunks.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out, self._chunks = b"".join(self._chunks), []
        return out


class AudioFileStream:
    """One answer's `fmt` file (mp3, aac, opus), encoded delta by delta."""

    def __init__(self, fmt: str, sample_rate: int) -> None:
        import av
        from av.audio.stream import AudioStream

        if fmt not in STREAMED_FORMATS:
            raise ValueError(f"{fmt} is not written front to back; streamed formats: {', '.join(STREAMED_FORMATS)}")
        if sample_rate <= 0:
            raise ValueError(f"sample_rate must be positive, got {sample_rate}")
        container, codec = compressed_format(fmt)
        self.sample_rate, self.samples = sample_rate, 0
        self._sink = _Sink()
        self._out = av.open(self._sink, mode="w", format=container,
                            options={"page_duration": _OGG_PAGE_US} if container == "ogg" else {})
        self._stream = cast(AudioStream, self._out.add_stream(codec, rate=codec_rate(codec, sample_rate),
                                                              layout="mono"))
        self._closed = False
        self._lock = threading.Lock()  # push / finish run in worker threads; close may come from the event loop

    def push(self, waveform: np.ndarray) -> bytes:
        """Samples (float32 at `sample_rate`) -> the file's bytes that are ready now (b"" while the encoder
        fills its first frame)."""
        pcm = float_to_pcm16(np.ravel(waveform)).reshape(1, -1)
        with self._lock:
            if self._closed:
                raise RuntimeError("the audio file is closed")
            if pcm.size:
                self._encode(pcm)
            return self._sink.take()

    def finish(self) -> bytes:
        """The rest of the file. An answer with no audio at all becomes 20 ms of silence (these formats have no
        valid empty file), as the whole-file encoder does."""
        with self._lock:
            if self._closed:
                return b""
            if not self.samples:
                self._encode(np.zeros((1, max(1, self.sample_rate // 50)), np.int16))
            for packet in self._stream.encode(None):
                self._out.mux(packet)
            self._closed = True
            self._out.close()
            return self._sink.take()

    def close(self) -> None:
        """Drop an unfinished file (the client went away): the muxer's resources are freed, after a push still
        running in its thread (at most one encoder frame's work)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._out.close()

    def _encode(self, pcm: np.ndarray) -> None:
        import av

        frame = av.AudioFrame.from_ndarray(pcm, format="s16", layout="mono")
        frame.sample_rate, frame.pts = self.sample_rate, self.samples
        self.samples += pcm.shape[1]
        for packet in self._stream.encode(frame):
            self._out.mux(packet)
