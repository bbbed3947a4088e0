"""code2wav's conv stack (upsample + decoder) run as a stream: each call takes only the NEW pre-transformer
frames of each request and returns only its new samples, equal to one-piece decoding.

Role: the vocoder's per-window compute. Every conv after the pre-transformer is causal, so a stream needs, per
conv, only the few inputs it reads from before the window — kept as that request's state (`ConvState`),
instead of re-running the stack over frames of earlier windows:
  * `CausalConvNet` (stride 1): pads `padding` zeros on the left. Streamed: conv over [state | new inputs]
    without padding; the state starts as those zeros and then holds the last `padding` inputs.
  * `CausalTransConvNet` with kernel = stride (the upsample blocks): each output reads one input. No state.
  * `CausalTransConvNet` with kernel = 2 x stride r (the decoder blocks): trims r outputs on each side, so
    output m reads inputs floor(m / r) and floor(m / r) + 1 and the last r outputs of a window wait for
    the next input. Streamed: [last input | new inputs] through the module gives exactly the new outputs
    that are final (L x r for L inputs); a request's first call has no last input, so it runs with a zero
    one and drops its first r outputs (what the module trims). This is where n codes give n x 1920 - 555
    samples: the held-back samples come out with the next window.
  * `ConvNeXtBlock`, `Code2WavDecoderResidualUnit`, `Code2WavDecoderBlock`: their forward, with the convs
    streamed; `SnakeBeta` (its exp(alpha), 1/exp(beta) made once; the rest one fused kernel, see
    snake_kernel), LayerNorm and the linears are per sample.
Cost: a window of n codes runs the stack on n frames, the same work as decoding everything at once.

Batching: rows are right-padded to the longest; every op is causal, so no kept sample reads a padded one;
each row's state is read and kept at its own length. Data flow (`run_stream`): frames per row (n_b, H) ->
(B, H, T) -> ops (states read and replaced per row) -> clamp -> per row its new samples (k_b,).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeCausalConvNet,
    Qwen3OmniMoeCausalTransConvNet,
    Qwen3OmniMoeCode2WavDecoderBlock,
    Qwen3OmniMoeCode2WavDecoderResidualUnit,
    Qwen3OmniMoeConvNeXtBlock,
    Qwen3OmniMoeSnakeBeta,
)

from omnimesh.engine.step_gate import checkpoint
from omnimesh.models.qwen3_omni.snake_kernel import snake


class ConvState:
    """One request's conv states: per streamed conv (keyed by the module's id), the inputs it still reads."""

    def __init__(self) -> None:
        self.kept: dict[int, torch.Tensor] = {}  # (C, padding) or (C, 1) per op
        self.started = False  # a first call has run (the trans convs hold their last input)


def check_stack(code2wav: Any) -> None:
    """Raise ValueError if the conv stack has a module the stream cannot run exactly."""
    for module in (*[b for blocks in code2wav.upsample for b in blocks], *code2wav.decoder):
        _check(module)


def _check(module: Any) -> None:
    if isinstance(module, Qwen3OmniMoeCausalConvNet):
        if module.stride != 1:
            raise ValueError(f"strided causal conv (stride {module.stride}) is not supported by the streamer")
    elif isinstance(module, Qwen3OmniMoeCausalTransConvNet):
        kernel, stride = module.conv.kernel_size[0], module.conv.stride[0]
        if kernel not in (stride, 2 * stride) or module.left_pad != kernel - stride or module.right_pad != kernel - stride:
            raise ValueError(f"trans conv kernel {kernel} / stride {stride} is not supported by the streamer")
    elif isinstance(module, Qwen3OmniMoeConvNeXtBlock):
        _check(module.dwconv)
    elif isinstance(module, Qwen3OmniMoeCode2WavDecoderResidualUnit):
        for name in ("act1", "conv1", "act2", "conv2"):
            _check(getattr(module, name))
    elif isinstance(module, Qwen3OmniMoeCode2WavDecoderBlock):
        for inner in module.block:
            _check(inner)
    elif not isinstance(module, Qwen3OmniMoeSnakeBeta):
        raise ValueError(f"{type(module).__name__} in the code2wav conv stack is not supported by the streamer")


class _Batch:
    """One call over B rows: their states and each row's valid length at the current op."""

    def __init__(self, states: Sequence[ConvState], lengths: list[int]) -> None:
        self.states = states
        self.lengths = lengths

    def module(self, m: Any, x: torch.Tensor) -> torch.Tensor:
        if isinstance(m, Qwen3OmniMoeCausalConvNet):
            return self.causal(m, x)
        if isinstance(m, Qwen3OmniMoeCausalTransConvNet):
            return self.trans(m, x)
        if isinstance(m, Qwen3OmniMoeConvNeXtBlock):  # transformers' forward, dwconv streamed
            h = self.causal(m.dwconv, x).permute(0, 2, 1)
            h = m.gamma * m.pwconv2(m.act(m.pwconv1(m.norm(h))))
            return x + h.permute(0, 2, 1)
        if isinstance(m, Qwen3OmniMoeCode2WavDecoderResidualUnit):
            return x + self.causal(m.conv2, _snake(m.act2, self.causal(m.conv1, _snake(m.act1, x))))
        if isinstance(m, Qwen3OmniMoeCode2WavDecoderBlock):
            for inner in m.block:
                x = self.module(inner, x)
            return x
        return _snake(m, x)

    def causal(self, op: Qwen3OmniMoeCausalConvNet, x: torch.Tensor) -> torch.Tensor:
        """x (B, C, T) -> (B, C_out, T); each row's state becomes its last `padding` inputs."""
        pad = op.padding
        if pad == 0:
            return op.conv(x)
        key = id(op)
        zeros = x.new_zeros(x.shape[1], pad)
        kept = torch.stack([s.kept.get(key, zeros) for s in self.states])  # (B, C, pad)
        full = torch.cat([kept, x], dim=2)  # (B, C, pad + T)
        for s, row, n in zip(self.states, full, self.lengths):
            s.kept[key] = row[:, n: n + pad].clone()  # its last `pad` valid inputs (state included)
        return op.conv(full)

    def trans(self, op: Qwen3OmniMoeCausalTransConvNet, x: torch.Tensor) -> torch.Tensor:
        """x (B, C, T) -> (B, C_out, T x r): each row's new final outputs, left-aligned."""
        stride = op.conv.stride[0]
        if op.conv.kernel_size[0] == stride:  # one input per output: nothing to keep
            self.lengths = [n * stride for n in self.lengths]
            return op(x)
        key = id(op)
        zeros = x.new_zeros(x.shape[1], 1)
        last = torch.stack([s.kept.get(key, zeros) for s in self.states])  # (B, C, 1)
        for s, row, n in zip(self.states, x, self.lengths):
            s.kept[key] = row[:, n - 1: n].clone()
        y = op(torch.cat([last, x], dim=2))  # (B, C_out, T x r): output m reads inputs m // r, m // r + 1
        first = [b for b, s in enumerate(self.states) if not s.started]
        for b in first:  # no input before the first: the module trims these r outputs
            y[b, :, :-stride] = y[b, :, stride:].clone()
        self.lengths = [n * stride - (stride if not s.started else 0) for s, n in zip(self.states, self.lengths)]
        return y


_SNAKE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _snake(m: Qwen3OmniMoeSnakeBeta, x: torch.Tensor) -> torch.Tensor:
    """SnakeBeta, x + 1/b * sin^2(x a), with exp(alpha) and 1 / (exp(beta) + eps) made once per module
    (transformers' forward makes them every call: 8 of its 12 ops; the same ops give the same values).
    Remade when a parameter is replaced or changed in place through autograd-visible ops."""
    key = (m.alpha.data_ptr(), m.alpha._version, m.beta.data_ptr(), m.beta._version)
    cached = _SNAKE.get(m)
    if cached is None or cached[0] != key:
        with torch.no_grad():
            alpha = torch.exp(m.alpha.unsqueeze(0).unsqueeze(-1))  # (1, C, 1)
            inv_beta = 1.0 / (torch.exp(m.beta.unsqueeze(0).unsqueeze(-1)) + m.no_div_by_zero)  # (1, C, 1)
        cached = _SNAKE[m] = (key, alpha, inv_beta)
    return snake(x, cached[1], cached[2])  # the compiled kernel in a vocoder stage on CPU (snake_kernel)


def run_stream(code2wav: Any, frames: Sequence[torch.Tensor], states: Sequence[ConvState]) -> list[torch.Tensor]:
    """The conv stack over each row's new frames (n_b, H), n_b >= 1 -> per row its new samples (k_b,)
    (n_b x samples per code, 555 fewer on a request's first call). Updates every row's state."""
    lengths = [f.shape[0] for f in frames]
    if min(lengths) < 1:
        raise ValueError("every row needs at least one new frame")
    T = max(lengths)
    x = torch.stack([F.pad(f, (0, 0, 0, T - f.shape[0])) for f in frames]).permute(0, 2, 1)  # (B, H, T)
    batch = _Batch(states, lengths)
    for blocks in code2wav.upsample:
        for block in blocks:
            checkpoint()
            x = batch.module(block, x)
    for block in code2wav.decoder:
        checkpoint()
        x = batch.module(block, x)
    wav = x.clamp(min=-1, max=1)[:, 0]  # (B, samples)
    for s in states:
        s.started = True
    return [wav[b, :n] for b, n in enumerate(batch.lengths)]
