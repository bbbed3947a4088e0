"""Streaming Qwen3-Omni vocoder (code2wav) whose output equals one-piece decoding.

Role: the vocoder stage. Codec code groups arrive a few at a time; audio must leave as soon as it is final,
and the concatenation of everything emitted must equal `code2wav(all_codes)` (same length, n * 1920 - 555
samples for n codes on the tiny and real configs, values within float noise).

Why that is possible (read off `Qwen3OmniMoeCode2Wav.forward`):
  * the pre-transformer is causal with a sliding window of 72 per layer (receptive field layers x 71 codes:
    142 tiny, 568 on the real 8-layer config). It runs incrementally on a per-request KV cache, so that
    long left context costs nothing to keep, instead of being recomputed every window;
  * every conv after it is causal, so it runs as a stream too (`streaming_convs`): each conv keeps the few
    inputs it reads from before the window, and a window runs the stack on its own new frames only — the
    same work as decoding everything at once. The decoder blocks' trans convs read one input ahead, which
    is why n codes yield only n * 1920 - 555 samples: the last 555 samples of code n need code n+1. They
    come out with the next window; output already produced never changes.

Data flow (one request):
    feed(codes (Q, n)) -> pending; once >= `window` codes are pending:
        embed (n, H) -> pre_transformer(cache, positions seen..seen+n) -> frames (n, H)
        -> streamed upsample + decoder (conv states kept) -> emit new samples (k,)
    flush() -> decodes what is pending; afterwards total emitted == n_total * 1920 - 555.

Batching (the vocoder stage's continuous batching): `decode_windows` decodes the next codes of MANY
streamers in one pre-transformer call and one conv-stack call. Each streamer `prepare`s its codes (its own
embedding, cheap), the frames are right-padded to the longest row, and each row's output is cropped back
to its own length. That is exact: the pre-transformer masks per row (see parallel_code2wav_transformer),
and every conv is causal with each row's state read and kept at its own length (see streaming_convs). A
lone streamer is a batch of one: the same code either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from omnimesh.models.qwen3_omni.streaming_convs import ConvState, check_stack, run_stream


class Code2WavStreamer:
    """Streams ONE request's codes through `Qwen3OmniMoeCode2Wav`; emitted audio == one-piece decode."""

    def __init__(self, code2wav: nn.Module, window: int = 1, transformer: Any = None) -> None:
        """`transformer`: where the pre-transformer runs (a `Code2WavTransformerBackend`, our pp x tp
        ranks, batched over requests); default: `code2wav.pre_transformer` in this process with a
        transformers KV cache (one call per request even in a batch)."""
        if window < 1:
            raise ValueError(f"window must be >= 1 code, got {window}")
        c2w: Any = code2wav
        check_stack(c2w)
        self.code2wav = c2w
        self.window = window
        self.samples_per_code = int(c2w.total_upsample)
        self.num_quantizers = int(c2w.config.num_quantizers)
        self.transformer = transformer
        self._handle = transformer.open() if transformer is not None else None
        self._cache = DynamicCache(config=c2w.pre_transformer.config) if transformer is None else None
        self.convs = ConvState()  # what each conv still reads from earlier windows
        self._seen = 0  # codes through the pre-transformer
        self._emitted = 0  # samples emitted so far
        self._pending: list[torch.Tensor] = []  # (Q, n) code blocks not yet decoded

    @property
    def emitted_samples(self) -> int:
        return self._emitted

    def feed(self, codes: torch.Tensor) -> torch.Tensor:
        """Queue codes (Q, n); decode once >= `window` are pending. Returns the new final samples (k,)."""
        self._check(codes)
        self._pending.append(codes.long())
        if sum(c.shape[1] for c in self._pending) < self.window:
            return torch.zeros(0, device=self.code2wav.code_offset.device)  # beside the decoded pieces
        return self._decode_pending()

    def flush(self) -> torch.Tensor:
        """Decode whatever is pending (end of request). Returns the remaining samples (k,)."""
        return self._decode_pending()

    def _check(self, codes: torch.Tensor) -> None:
        if codes.dim() != 2 or codes.shape[0] != self.num_quantizers:
            raise ValueError(f"codes must be (num_quantizers={self.num_quantizers}, n), got {tuple(codes.shape)}")

    def _decode_pending(self) -> torch.Tensor:
        codes = torch.cat(self._pending, dim=1) if self._pending else torch.zeros(self.num_quantizers, 0)
        self._pending = []
        if codes.shape[1] == 0:
            return torch.zeros(0, device=self.code2wav.code_offset.device)
        return decode_windows([self.prepare(codes)])[0]

    @torch.no_grad()
    def prepare(self, codes: torch.Tensor) -> Window:
        """This request's part of a decode step: embed its next n >= 1 codes (Q, n) -> a `Window` for
        `decode_windows`. Raises (for this request alone) on bad codes or a closed streamer."""
        self._check(codes)
        if codes.shape[1] == 0:
            raise ValueError("a window needs at least one code")
        if self.transformer is not None and self._handle is None:
            raise ValueError("this streamer is closed (its pre-transformer cache was freed)")
        c2w = self.code2wav
        codes = codes.long().to(c2w.code_offset.device)  # the stack's device (a CUDA stage: rank 0's GPU)
        x = c2w.code_embedding(codes.unsqueeze(0) + c2w.code_offset).mean(1)[0]  # (n, H)
        return Window(self, x)

    def _run_local(self, x: torch.Tensor) -> torch.Tensor:
        """transformers' pre-transformer on this request's KV cache: x (n, H) -> frames (n, H)."""
        n = x.shape[0]
        positions = torch.arange(self._seen, self._seen + n, device=x.device).view(1, n)  # (1, n)
        return self.code2wav.pre_transformer(
            inputs_embeds=x.unsqueeze(0), position_ids=positions, past_key_values=self._cache, use_cache=True
        ).last_hidden_state[0]  # (n, H)

    def close(self) -> None:
        """Free the request's pre-transformer cache (on every rank when the transformer is split)."""
        if self.transformer is not None and self._handle is not None:
            self.transformer.close(self._handle)
            self._handle = None


@dataclass(frozen=True)
class Window:
    """One streamer's next codes, embedded: x (n, H)."""

    streamer: Code2WavStreamer
    x: torch.Tensor


@torch.no_grad()
def decode_windows(windows: Sequence[Window]) -> list[torch.Tensor]:
    """Decode the windows of several streamers (one each, same code2wav and transformer) in ONE
    pre-transformer call and ONE conv-stack call; returns each streamer's new samples (k_b,), in order."""
    if not windows:
        return []
    streamers = [w.streamer for w in windows]
    first = streamers[0]
    if any(s.code2wav is not first.code2wav or s.transformer is not first.transformer for s in streamers):
        raise ValueError("a batch must share one code2wav and one pre-transformer")
    if len({id(s) for s in streamers}) != len(streamers):
        raise ValueError("a streamer may decode one window per batch")
    new = _pre_transformer(first, windows)  # per row (n_b, H)
    wavs = run_convs(first.code2wav, new, [s.convs for s in streamers])  # per row (k_b,)
    for s, wav in zip(streamers, wavs):
        s._emitted += wav.shape[0]
    return wavs


def _pre_transformer(first: Code2WavStreamer, windows: Sequence[Window]) -> list[torch.Tensor]:
    """Every window's new frames (n_b, H): one call on the backend for the whole batch, right-padded."""
    lengths = [w.x.shape[0] for w in windows]
    if first.transformer is None:
        out = [w.streamer._run_local(w.x) for w in windows]
    else:
        T = max(lengths)
        x = torch.stack([F.pad(w.x, (0, 0, 0, T - w.x.shape[0])) for w in windows])  # (B, T, H)
        positions = torch.stack([torch.arange(w.streamer._seen, w.streamer._seen + T) for w in windows])  # (B, T)
        hidden = first.transformer.forward([w.streamer._handle for w in windows], x, positions, lengths)  # (B, T, H)
        out = [hidden[b, :n].to(x.device) for b, n in enumerate(lengths)]  # split ranks answer on the host
    for w, n in zip(windows, lengths):
        w.streamer._seen += n
    return out


CPU_CONV_ROWS = 4  # measured on CPU (tiny model, 1 thread, 25-code windows, compiled SnakeBeta): 1 row 0.62 ms/code, 2 rows 0.48, 4 rows 0.45, 8 rows 0.55


def run_convs(code2wav: Any, frames: Sequence[torch.Tensor], states: Sequence[ConvState]) -> list[torch.Tensor]:
    """The streamed upsample + decoder over B rows of new frames (n_b, H) -> per row its new samples (k_b,)
    (see streaming_convs). On CPU the rows go through in groups of `CPU_CONV_ROWS`: the stack upsamples
    1920x, and wider batches fall out of cache (8 rows are slower per code than 4); on CUDA all rows at once."""
    if frames and frames[0].device.type == "cpu" and len(frames) > CPU_CONV_ROWS:
        order = sorted(range(len(frames)), key=lambda i: frames[i].shape[0])  # similar lengths pad least
        out: list[torch.Tensor | None] = [None] * len(frames)
        for at in range(0, len(order), CPU_CONV_ROWS):
            group = order[at:at + CPU_CONV_ROWS]
            for i, wav in zip(group, run_stream(code2wav, [frames[i] for i in group], [states[i] for i in group])):
                out[i] = wav
        return [w for w in out if w is not None]
    return run_stream(code2wav, frames, states)


def stream_decode(code2wav: nn.Module, codes: torch.Tensor, window: int) -> list[torch.Tensor]:
    """Decode codes (Q, n) as a stream that emits every `window` codes; returns the emitted pieces."""
    streamer = Code2WavStreamer(code2wav, window=window)
    pieces = [streamer.feed(codes[:, i : i + window]) for i in range(0, codes.shape[1], window)]
    pieces.append(streamer.flush())
    return pieces
