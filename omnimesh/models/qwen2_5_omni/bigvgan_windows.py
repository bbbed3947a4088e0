"""BigVGAN over bounded windows: a long mel decodes in pieces, each with the context its receptive field needs.

Role: token2wav's BigVGAN decodes a whole utterance at once, and its working memory grows with the utterance's
length (the tiny model: +159 MiB for 1,000 codes, +368 MiB for 2,000, in one call; the real one's channels
are 24 times wider), times the rows of a batched (CUDA) call. BigVGAN is convolutional: an output sample
depends on the mel frames within `reach_frames` of it and nothing farther (`reach_frames` bounds it from the
modules' kernels, strides and paddings). So a mel longer than `window` frames decodes in pieces of `window`
frames, each read with `reach_frames` frames of context on either side (fewer at the utterance's ends, which
are its real ends), and each piece keeps only its own samples: the samples equal the whole decode's to float
rounding, while a call's memory is bounded by `window` (+ context) frames per row and `call_frames` frames
per batched call, whatever the utterance's length. A mel of at most `window` frames decodes whole, as before.

Data flow:
    decode_windowed(bigvgan, mels [(mel_dim, L_b)], batched)
        -> pieces (mel b, read [a, z), keep [s, e)) of every mel -> calls: one piece each (CPU) or groups of
           at most `call_frames` padded frames (CUDA: `bigvgan_batch.decode_mels`, each row exact)
        -> each piece's kept samples [spf (s - a), spf (e - a)) -> per mel, its pieces joined (spf L_b,)
"""

from __future__ import annotations

import math
from typing import Any

import torch

from omnimesh.models.qwen2_5_omni.bigvgan_batch import decode_mels

WINDOW_FRAMES = 1000  # 10 s of audio per piece (100 mel frames a second)
CALL_FRAMES = 8192  # the most frames (rows x the longest piece) one batched call decodes


def reach_frames(bigvgan: Any) -> int:
    """Mel frames either side of an output sample beyond which no frame changes it (a bound): the sum, along
    transformers' BigVGAN forward, of each position-mixing module's reach in its input's samples, over the
    samples per mel frame there (the parallel residual blocks of a layer: the widest)."""

    def conv(module: Any) -> int:  # nn.Conv1d: [i - pad, i - pad + dilation (kernel - 1)]
        pad, span = int(module.padding[0]), int(module.dilation[0]) * (int(module.kernel_size[0]) - 1)
        return max(pad, span - pad)

    def act(module: Any) -> int:  # anti-aliased activation: x2 up (transposed filter), snake, /2 down (filter)
        up, down = module.upsample, module.downsample
        return (math.ceil(up.kernel_size / up.ratio)
                + math.ceil(max(down.pad_left, down.kernel_size - 1 - down.pad_left) / up.ratio))

    def amp(block: Any) -> int:
        return sum(act(a1) + conv(c1) + act(a2) + conv(c2) for c1, c2, a1, a2 in
                   zip(block.convs1, block.convs2, block.activations[::2], block.activations[1::2]))

    reach, rate = float(conv(bigvgan.conv_pre)), 1  # rate: samples per mel frame here
    n_res = bigvgan.num_residual_blocks
    for layer in range(bigvgan.num_upsample_layers):
        up = bigvgan.ups[layer][0]  # nn.ConvTranspose1d: output j reads inputs (j + pad - kernel, j + pad] / stride
        kernel, stride, pad = int(up.kernel_size[0]), int(up.stride[0]), int(up.padding[0])
        reach += math.ceil(max(kernel - pad, pad) / stride) / rate
        rate *= stride
        reach += max(amp(bigvgan.resblocks[layer * n_res + k]) for k in range(n_res)) / rate
    reach += (act(bigvgan.activation_post) + conv(bigvgan.conv_post)) / rate
    return math.ceil(reach)


def pieces(length: int, window: int, context: int) -> list[tuple[int, int, int, int]]:
    """(read from, read to, keep from, keep to) frames of each piece of a `length`-frame mel."""
    if length <= window:
        return [(0, length, 0, length)]
    return [(max(0, s - context), min(length, s + window + context), s, min(length, s + window))
            for s in range(0, length, window)]


@torch.no_grad()
def decode_windowed(bigvgan: Any, mels: list[torch.Tensor], batched: bool, window: int = WINDOW_FRAMES,
                    call_frames: int = CALL_FRAMES, context: int | None = None) -> list[torch.Tensor]:
    """Each mel (mel_dim, L_b) -> its waveform (spf L_b,) float32 on CPU, decoded in pieces of `window` frames
    (+ `context`, `reach_frames` by default, either side): one piece a call, or, `batched`, as many pieces as
    fit `call_frames` (rows x the longest) in one padded call."""
    context = reach_frames(bigvgan) if context is None else context
    spf = math.prod(bigvgan.config.upsample_rates)
    todo = [(b, *piece) for b, mel in enumerate(mels) for piece in pieces(mel.shape[-1], window, context)]
    parts: list[list[torch.Tensor]] = [[] for _ in mels]
    while todo:
        group = [todo.pop(0)]
        while batched and todo and (len(group) + 1) * max(z - a for _, a, z, _, _ in group + todo[:1]) <= call_frames:
            group.append(todo.pop(0))
        waves = decode_mels(bigvgan, [mels[b][..., a:z] for b, a, z, _, _ in group])
        for (b, a, _, s, e), wave in zip(group, waves):
            parts[b].append(wave[spf * (s - a): spf * (e - a)])
    return [p[0] if len(p) == 1 else torch.cat(p) for p in parts]
