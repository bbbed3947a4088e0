"""Batched BigVGAN for Qwen2.5-Omni's token2wav: several mels in one call, each row the samples of its solo decode.

Role: transformers' `Qwen2_5OmniToken2WavBigVGANModel` maps a mel (B, 80, T) to samples (prod(upsample_rates) =
240 per frame). Right-padding mels of different lengths to one T changes each shorter row near its end: alone, every
position-mixing op sees its own boundary padding there (zeros for the "same" nn.Conv1d and the nn.ConvTranspose1d,
the last value repeated in the anti-aliasing Up/DownSample1d); padded, it sees the neighbour frames. `_forward_padded`
walks the same modules in the same order as transformers' forwards (BigVGAN, AMPBlock, AntiAliasedActivation1d)
and, before each position-mixing module, overwrites every row's positions past its valid length with what its solo
run would pad there (everything between is pointwise), so each row equals its solo decode to float rounding (the
convolutions may sum in another order for another batch size). Nothing is registered on the module and nothing
global is touched: two threads may decode on the same module at once.

Data flow:
    decode_mels(bigvgan, [mel (80, L_b) or (1, 80, L_b)]) -> [waveform (240 L_b,) float32 on CPU]
        one request: the module's own forward (bit-identical to it)
        several: right-pad to (B, 80, T_max) -> _forward_padded(bigvgan, x, lengths) -> (B, 240 T_max) -> crop each row
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch


@torch.no_grad()
def decode_mels(bigvgan: Any, mels: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each mel (mel_dim, L_b) or (1, mel_dim, L_b) on the module's device -> its waveform (spf * L_b,) float32 on
    CPU, spf = prod(upsample_rates); an empty mel gives an empty waveform."""
    mels = [mel.reshape(mel.shape[-2], mel.shape[-1]) for mel in mels]
    out: list[torch.Tensor] = [torch.zeros(0) for _ in mels]
    live = [i for i, mel in enumerate(mels) if mel.shape[-1] > 0]
    if len(live) == 1:
        out[live[0]] = bigvgan(mels[live[0]].unsqueeze(0)).reshape(-1).float().cpu()
    elif live:
        lengths = [mels[i].shape[-1] for i in live]
        x = mels[live[0]].new_zeros(len(live), mels[live[0]].shape[0], max(lengths))
        for row, i in enumerate(live):
            x[row, :, : lengths[row]] = mels[i]
        wave = _forward_padded(bigvgan, x, lengths).float().cpu()
        spf = math.prod(bigvgan.config.upsample_rates)
        for row, i in enumerate(live):
            out[i] = wave[row, : spf * lengths[row]].clone()
    return out


def _forward_padded(bigvgan: Any, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """transformers' BigVGAN forward on right-padded mels x (B, mel_dim, T_max), row b valid for lengths[b] frames,
    with the solo boundary restored before every position-mixing module -> (B, spf * T_max) (past spf * L_b: junk)."""
    t_max = x.shape[-1]
    full = min(lengths) == t_max
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def masks(t_cur: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(valid (B, 1, T) bool, index (B, 1, T) of the row's last valid position past its end) for length t_cur."""
        if t_cur not in cache:
            assert t_cur % t_max == 0, f"length {t_cur} at a module is not a multiple of the mel's {t_max}"
            valid = torch.tensor([n * t_cur // t_max for n in lengths], device=x.device).view(-1, 1, 1)
            pos = torch.arange(t_cur, device=x.device).view(1, 1, -1)
            cache[t_cur] = (pos < valid, torch.minimum(pos, valid - 1))
        return cache[t_cur]

    def zeros(h: torch.Tensor) -> torch.Tensor:  # nn.Conv1d / nn.ConvTranspose1d pad with zeros
        return h if full else h.masked_fill(~masks(h.shape[-1])[0], 0.0)

    def replicate(h: torch.Tensor) -> torch.Tensor:  # Up/DownSample1d pad with the last value, per channel
        return h if full else h.gather(-1, masks(h.shape[-1])[1].expand(h.shape[0], h.shape[1], -1))

    def act(module: Any, h: torch.Tensor) -> torch.Tensor:  # Qwen2_5OmniAntiAliasedActivation1d.forward
        return module.downsample(replicate(module.act(module.upsample(replicate(h)))))

    def conv(module: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        return module(zeros(h))

    def amp_block(block: Any, h: torch.Tensor) -> torch.Tensor:  # Qwen2_5OmniAMPBlock.forward
        acts1, acts2 = block.activations[::2], block.activations[1::2]
        for conv1, conv2, act1, act2 in zip(block.convs1, block.convs2, acts1, acts2):
            residual = h
            h = conv(conv2, act(act2, conv(conv1, act(act1, h))))
            h = residual + h
        return h

    h = conv(bigvgan.conv_pre, bigvgan.process_mel_spectrogram(x))
    n_res = bigvgan.num_residual_blocks
    for layer in range(bigvgan.num_upsample_layers):
        h = conv(bigvgan.ups[layer][0], h)
        residual_output = sum(amp_block(bigvgan.resblocks[layer * n_res + k], h) for k in range(n_res))
        h = residual_output / n_res
    h = conv(bigvgan.conv_post, act(bigvgan.activation_post, h))
    return torch.clamp(h, min=-1.0, max=1.0)[:, 0]
