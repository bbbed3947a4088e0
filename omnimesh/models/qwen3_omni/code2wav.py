"""Streaming Qwen3-Omni vocoder (code2wav) whose output equals one-piece decoding.

Role: the vocoder stage. Codec code groups arrive a few at a time; audio must leave as soon as it is final,
and the concatenation of everything emitted must equal `code2wav(all_codes)` (same length, n * 1920 - 555
samples for n codes on the tiny and real configs, values within float noise).

Why that is possible (read off `Qwen3OmniMoeCode2Wav.forward`):
  * the pre-transformer is causal with a sliding window of 72 per layer (receptive field layers x 71 codes:
    142 tiny, 568 on the real 8-layer config). It runs incrementally on a per-request KV cache, so that
    long left context costs nothing to keep, instead of being recomputed every window;
  * every conv after it is causal: a `CausalConvNet` sees `padding` samples back, and a
    `CausalTransConvNet` (kernel 2r, stride r, r trimmed each side) makes output m from inputs
    floor(m/r) and floor(m/r) + 1. That one-input look-ahead is why n codes yield only n * 1920 - 555
    samples (each block drops r of its outputs, later upsampled: 555 = 8*(5*4*3) + 5*(4*3) + 4*3 + 3): the
    last 555 samples of code n need code n+1. Output already produced never changes later, so the streamer
    holds back exactly those 555 samples (they come out with the next window) and never revises anything;
  * so each window re-runs only the conv stack, over the pre-transformer frames of the new codes plus the
    frames it needs on the left: `left_context` frames before the frame holding the first unemitted sample
    (the conv stack's receptive field, derived from the modules by `conv_left_context`: 10 for this
    architecture, whatever its widths; that frame is the previous window's last, so 11 frames are kept).
    Cost: a window of w codes runs the convs on w + 11 frames.

Data flow (one request):
    feed(codes (Q, n)) -> pending; once >= `window` codes are pending:
        embed (n, H) -> pre_transformer(cache, positions seen..seen+n) -> frames (n, H)
        [kept left-context frames | new frames] -> upsample + decoder -> emit new samples (k,)
    flush() -> decodes what is pending; afterwards total emitted == n_total * 1920 - 555.

Batching (the vocoder stage's continuous batching): `decode_windows` decodes the next codes of MANY
streamers in one pre-transformer call and one conv-stack call. Each streamer `prepare`s its codes (its own
embedding, cheap), the frames are right-padded to the longest row, and each row's output is cropped back
to its own length. That is exact: the pre-transformer masks per row (see parallel_code2wav_transformer),
and every conv is causal with the trans convs' look-ahead already trimmed (output m of a trans conv reads
inputs <= floor(m / r), and the trim drops every output that would read past the last input), so no
sample a row keeps reads a padded frame. A lone streamer is a batch of one: the same code either way.
"""

from __future__ import annotations

import weakref

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeCausalConvNet,
    Qwen3OmniMoeCausalTransConvNet,
    Qwen3OmniMoeCode2WavDecoderBlock,
    Qwen3OmniMoeCode2WavDecoderResidualUnit,
    Qwen3OmniMoeConvNeXtBlock,
)


def _conv_ops(code2wav: Any) -> list[Any]:
    """The modules after the pre-transformer, in forward order (blocks flattened one level)."""
    ops: list[Any] = []
    for blocks in code2wav.upsample:
        ops.extend(blocks)
    for block in code2wav.decoder:
        ops.extend(block.block if isinstance(block, Qwen3OmniMoeCode2WavDecoderBlock) else [block])
    return ops


def _first_input_needed(op: Any, first_output: int) -> int:
    """Smallest input index `op` reads to compute its outputs from `first_output` on."""
    if isinstance(op, Qwen3OmniMoeCausalConvNet):
        if op.stride != 1:
            raise ValueError(f"strided causal conv (stride {op.stride}) is not supported by the streamer")
        return first_output - op.padding
    if isinstance(op, Qwen3OmniMoeCausalTransConvNet):
        kernel, stride = op.conv.kernel_size[0], op.conv.stride[0]
        # output m is full-length index m + left_pad, made from inputs i with i*s <= j <= i*s + k - 1
        return -((-(first_output + op.left_pad - kernel + 1)) // stride)  # ceil division
    if isinstance(op, Qwen3OmniMoeConvNeXtBlock):
        return _first_input_needed(op.dwconv, first_output)
    if isinstance(op, Qwen3OmniMoeCode2WavDecoderResidualUnit):
        return _first_input_needed(op.conv1, _first_input_needed(op.conv2, first_output))
    return first_output  # pointwise (SnakeBeta)


def _first_frame_needed(code2wav: Any, first_sample: int) -> int:
    """Smallest pre-transformer frame the conv stack reads to produce samples from `first_sample` on."""
    index = first_sample
    for op in reversed(_conv_ops(code2wav)):
        index = _first_input_needed(op, index)
    return index


_LEFT_CONTEXT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def conv_left_context(code2wav: Any) -> int:
    """Frames before the frame of the first unemitted sample that the conv stack must re-read (exact bound).
    Computed once per module (it walks the whole conv stack for every sample offset of a code)."""
    cached = _LEFT_CONTEXT.get(code2wav)
    if cached is None:
        cached = _LEFT_CONTEXT[code2wav] = _conv_left_context(code2wav)
    return cached


def _conv_left_context(code2wav: Any) -> int:
    per_code = int(code2wav.total_upsample)
    base = 1000 * per_code  # far from the sequence start, so only the receptive field matters
    return max(base // per_code - _first_frame_needed(code2wav, base + offset) for offset in range(per_code))


class Code2WavStreamer:
    """Streams ONE request's codes through `Qwen3OmniMoeCode2Wav`; emitted audio == one-piece decode."""

    def __init__(self, code2wav: nn.Module, left_context: int | None = None, window: int = 1,
                 transformer: Any = None) -> None:
        """`transformer`: where the pre-transformer runs (a `Code2WavTransformerBackend`, our pp x tp
        ranks, batched over requests); default: `code2wav.pre_transformer` in this process with a
        transformers KV cache (one call per request even in a batch)."""
        if window < 1:
            raise ValueError(f"window must be >= 1 code, got {window}")
        c2w: Any = code2wav
        needed = conv_left_context(c2w)
        if left_context is not None and left_context < 0:
            raise ValueError(f"left_context must be >= 0 frames, got {left_context} (exact needs {needed})")
        self.code2wav = c2w
        self.left_context = needed if left_context is None else left_context
        self.window = window
        self.samples_per_code = int(c2w.total_upsample)
        self.num_quantizers = int(c2w.config.num_quantizers)
        self.transformer = transformer
        self._handle = transformer.open() if transformer is not None else None
        self._cache = DynamicCache(config=c2w.pre_transformer.config) if transformer is None else None
        self._frames: torch.Tensor | None = None  # (F, H) kept pre-transformer output
        self._frames_start = 0  # global index of self._frames[0]
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
            return torch.zeros(0)
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
            return torch.zeros(0)
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
        x = c2w.code_embedding(codes.long().unsqueeze(0) + c2w.code_offset).mean(1)[0]  # (n, H)
        return Window(self, x)

    def _run_local(self, x: torch.Tensor) -> torch.Tensor:
        """transformers' pre-transformer on this request's KV cache: x (n, H) -> frames (n, H)."""
        n = x.shape[0]
        positions = torch.arange(self._seen, self._seen + n).view(1, n)  # (1, n)
        return self.code2wav.pre_transformer(
            inputs_embeds=x.unsqueeze(0), position_ids=positions, past_key_values=self._cache, use_cache=True
        ).last_hidden_state[0]  # (n, H)

    def _advance(self, frames: torch.Tensor, wav: torch.Tensor) -> torch.Tensor:
        """After a decode over frames (F, H) (kept + new) that gave wav (F * samples_per_code - tail,):
        the new samples (k,); keeps the left-context frames the next window needs."""
        offset = self._emitted - self._frames_start * self.samples_per_code
        out = wav[offset:]  # (k,)
        self._emitted += out.shape[0]
        keep_from = max(self._emitted // self.samples_per_code - self.left_context, self._frames_start)
        self._frames = frames[keep_from - self._frames_start :]  # (F', H)
        self._frames_start = keep_from
        return out

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
    frames = [f if s._frames is None else torch.cat([s._frames.to(f.dtype), f]) for s, f in zip(streamers, new)]
    wavs = run_convs(first.code2wav, frames)  # per row (F_b * samples_per_code - tail,)
    return [s._advance(f, w) for s, f, w in zip(streamers, frames, wavs)]


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
        out = [hidden[b, :n] for b, n in enumerate(lengths)]
    for w, n in zip(windows, lengths):
        w.streamer._seen += n
    return out


CPU_CONV_ROWS = 2  # measured on CPU (tiny model, 1 thread): 2 rows 34 ms/window, 4 rows 54, 8 rows 66, 16 rows 79


def run_convs(code2wav: Any, frames: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Upsample + decoder over B rows of frames (F_b, H), right-padded -> per row its waveform
    (F_b * samples_per_code - tail,), cropped back (exact: see the module docstring). On CPU the rows go
    through in groups of `CPU_CONV_ROWS`: the stack upsamples 1920x, and wider batches fall out of cache
    (a window costs more in a batch of 8 than alone); on CUDA all rows go in one call."""
    if frames and frames[0].device.type == "cpu" and len(frames) > CPU_CONV_ROWS:
        order = sorted(range(len(frames)), key=lambda i: frames[i].shape[0])  # similar lengths pad least
        out: list[torch.Tensor | None] = [None] * len(frames)
        for at in range(0, len(order), CPU_CONV_ROWS):
            group = order[at:at + CPU_CONV_ROWS]
            for i, wav in zip(group, _run_convs(code2wav, [frames[i] for i in group])):
                out[i] = wav
        return [w for w in out if w is not None]
    return _run_convs(code2wav, frames)


def _run_convs(code2wav: Any, frames: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    lengths = [f.shape[0] for f in frames]
    F_max = max(lengths)
    batch = torch.stack([F.pad(f, (0, 0, 0, F_max - f.shape[0])) for f in frames])  # (B, F, H)
    hidden = batch.permute(0, 2, 1)  # (B, H, F)
    for blocks in code2wav.upsample:
        for block in blocks:
            hidden = block(hidden)
    for block in code2wav.decoder:
        hidden = block(hidden)
    wav = hidden.clamp(min=-1, max=1).reshape(len(frames), -1)  # (B, F * samples_per_code - tail)
    tail = F_max * int(code2wav.total_upsample) - wav.shape[1]
    return [wav[b, : n * int(code2wav.total_upsample) - tail] for b, n in enumerate(lengths)]


def stream_decode(
    code2wav: nn.Module, codes: torch.Tensor, window: int, left_context: int | None = None
) -> list[torch.Tensor]:
    """Decode codes (Q, n) as a stream that emits every `window` codes; returns the emitted pieces."""
    streamer = Code2WavStreamer(code2wav, left_context=left_context, window=window)
    pieces = [streamer.feed(codes[:, i : i + window]) for i in range(0, codes.shape[1], window)]
    pieces.append(streamer.flush())
    return pieces
