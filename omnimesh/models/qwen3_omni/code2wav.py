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
        embed (1, n, H) -> pre_transformer(cache, positions seen..seen+n) -> frames (1, n, H)
        [kept left-context frames | new frames] -> upsample + decoder -> emit new samples (k,)
    flush() -> decodes what is pending; afterwards total emitted == n_total * 1920 - 555.
"""

from __future__ import annotations

from typing import Any

import torch
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


def conv_left_context(code2wav: Any) -> int:
    """Frames before the frame of the first unemitted sample that the conv stack must re-read (exact bound)."""
    per_code = int(code2wav.total_upsample)
    base = 1000 * per_code  # far from the sequence start, so only the receptive field matters
    return max(base // per_code - _first_frame_needed(code2wav, base + offset) for offset in range(per_code))


class Code2WavStreamer:
    """Streams ONE request's codes through `Qwen3OmniMoeCode2Wav`; emitted audio == one-piece decode."""

    def __init__(self, code2wav: nn.Module, left_context: int | None = None, window: int = 1,
                 transformer: Any = None) -> None:
        """`transformer`: where the pre-transformer runs (a `Code2WavTransformerBackend`, our pp x tp
        ranks); default: `code2wav.pre_transformer` in this process with a transformers KV cache."""
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
        self._frames = torch.zeros(1, 0, c2w.config.hidden_size)  # (1, F, H) kept pre-transformer output
        self._frames_start = 0  # global index of self._frames[:, 0]
        self._seen = 0  # codes through the pre-transformer
        self._emitted = 0  # samples emitted so far
        self._pending: list[torch.Tensor] = []  # (Q, n) code blocks not yet decoded

    @property
    def emitted_samples(self) -> int:
        return self._emitted

    def feed(self, codes: torch.Tensor) -> torch.Tensor:
        """Queue codes (Q, n); decode once >= `window` are pending. Returns the new final samples (k,)."""
        if codes.dim() != 2 or codes.shape[0] != self.num_quantizers:
            raise ValueError(f"codes must be (num_quantizers={self.num_quantizers}, n), got {tuple(codes.shape)}")
        self._pending.append(codes.long())
        if sum(c.shape[1] for c in self._pending) < self.window:
            return torch.zeros(0)
        return self._decode_pending()

    def flush(self) -> torch.Tensor:
        """Decode whatever is pending (end of request). Returns the remaining samples (k,)."""
        return self._decode_pending()

    @torch.no_grad()
    def _decode_pending(self) -> torch.Tensor:
        if not self._pending or sum(c.shape[1] for c in self._pending) == 0:
            self._pending = []
            return torch.zeros(0)
        codes = torch.cat(self._pending, dim=1).unsqueeze(0)  # (1, Q, n)
        self._pending = []
        new_frames = self._run_transformer(codes)  # (1, n, H)
        frames = torch.cat([self._frames, new_frames], dim=1)  # (1, F + n, H)
        wav = self._run_convs(frames)  # (samples,)
        offset = self._emitted - self._frames_start * self.samples_per_code
        out = wav[offset:]  # (k,)
        self._emitted += out.shape[0]
        keep_from = max(self._emitted // self.samples_per_code - self.left_context, self._frames_start)
        self._frames = frames[:, keep_from - self._frames_start :]  # (1, F', H)
        self._frames_start = keep_from
        return out

    def _run_transformer(self, codes: torch.Tensor) -> torch.Tensor:
        """Pre-transformer on new codes (1, Q, n) with the request's KV cache -> frames (1, n, H)."""
        c2w = self.code2wav
        hidden = c2w.code_embedding(codes + c2w.code_offset).mean(1)  # (1, n, H)
        n = hidden.shape[1]
        positions = torch.arange(self._seen, self._seen + n).view(1, n)  # (1, n)
        if self.transformer is not None:
            out = self.transformer.forward(self._handle, hidden, positions)  # (1, n, H)
        else:
            out = c2w.pre_transformer(
                inputs_embeds=hidden, position_ids=positions, past_key_values=self._cache, use_cache=True
            ).last_hidden_state  # (1, n, H)
        self._seen += n
        return out

    def close(self) -> None:
        """Free the request's pre-transformer cache (on every rank when the transformer is split)."""
        if self.transformer is not None and self._handle is not None:
            self.transformer.close(self._handle)
            self._handle = None

    def _run_convs(self, frames: torch.Tensor) -> torch.Tensor:
        """Upsample + decoder over frames (1, F, H) -> waveform (F * samples_per_code - tail,)."""
        hidden = frames.permute(0, 2, 1)  # (1, H, F)
        for blocks in self.code2wav.upsample:
            for block in blocks:
                hidden = block(hidden)
        for block in self.code2wav.decoder:
            hidden = block(hidden)
        return hidden.clamp(min=-1, max=1).view(-1)  # (samples,)


def stream_decode(
    code2wav: nn.Module, codes: torch.Tensor, window: int, left_context: int | None = None
) -> list[torch.Tensor]:
    """Decode codes (Q, n) as a stream that emits every `window` codes; returns the emitted pieces."""
    streamer = Code2WavStreamer(code2wav, left_context=left_context, window=window)
    pieces = [streamer.feed(codes[:, i : i + window]) for i in range(0, codes.shape[1], window)]
    pieces.append(streamer.flush())
    return pieces
