"""Qwen2.5-Omni's token2wav DiT over several requests at once, each getting the mel it gets alone.

Role: the mel half of `token2wav.Qwen2_5OmniToken2Wav.decode`. transformers' `Qwen2_5OmniToken2WavDiTModel.sample`
integrates a flow from Gaussian noise to a mel (RK4, 10 steps, classifier-free guidance), calling the DiT ~40
times on [guided rows | null rows]. `sample_mels` runs that loop for B requests of different lengths in one
batch, with transformers' own modules (time and code embeddings, input projection, final norm and
projection) called in transformers' order around the decoder layers, which run on the stage's pp x tp ranks
(`layers`: `dit_shard.DiTBackend` over `parallel_dit.ParallelDiT`, our rank model, equal to transformers'
layers), and three differences that keep each request's result its own:
- the noise of each request comes from a generator of its own (its seed), drawn at its own length, so a
  request's mel depends on its seed alone (not on torch's global generator nor on what else runs);
- rows are right-padded to the longest request; the decoder layers' attention masks (transformers'
  `-look_backward <= block_diff <= look_ahead`, computed block-locally: `dit_attention.window_mask`, built
  by each rank from the rows' frame counts) are per row, so that a real frame never attends a padded one
  and a padded frame attends only itself (no all-masked row, no NaN); every other op is per position, so
  padding changes nothing but float rounding (~1e-7);
- the speaker encoder (ECAPA over the speaker's reference mel, and over zeros for the null rows) depends
  on the speaker only: `encode_voice` runs it once per speaker, on the [reference | zeros] pair transformers
  runs each call, and every call reuses it.
One request alone equals transformers' `sample` under the same noise to float rounding (its attention is
block-local: O(T) where transformers' is O(T^2); the keys each frame attends are the same).
Everything that does not change across the ~40 calls (code embeddings, conditioning; on the ranks the rotary
table and masks) is built once per batch.

Data flow:
    per request: codes (n_b,), voice (cond (1, enc_emb_dim), encoded (2, enc_dim)), generator
      -> noise (1, 2 n_b, mel_dim) from its generator -> right-padded batch x (B, T, mel_dim)
    per RK4 evaluation: input projection of [x | x] -> layers(hidden (2B, T, H), time embedding, frames)
      -> norm_out, proj_out -> [guided | null] -> guided + (guided - null) * guidance
    -> per request its mel (mel_dim, 2 n_b)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

Layers = Callable[[torch.Tensor, torch.Tensor, Sequence[int]], torch.Tensor]  # (x, time_embedding, frames) -> x


@torch.no_grad()
def encode_voice(dit: Any, reference_mel: torch.Tensor) -> torch.Tensor:
    """The speaker encoder over [reference mel | zeros] (what transformers runs on every DiT call of a
    request): (2, enc_dim), row 0 for the guided rows, row 1 for the null rows."""
    return dit.input_embed.spk_encoder(torch.cat([reference_mel, torch.zeros_like(reference_mel)], dim=0))


@torch.no_grad()
def sample_mels(dit: Any, layers: Layers, codes: list[torch.Tensor], conditions: list[torch.Tensor],
                encoded: list[torch.Tensor], generators: list[torch.Generator], num_steps: int = 10,
                guidance_scale: float = 0.5, sway_coefficient: float | None = -1.0) -> list[torch.Tensor]:
    """codes[b] (n_b,) int64, conditions[b] (1, enc_emb_dim) (the speaker's `cond`), encoded[b] (2, enc_dim)
    (`encode_voice`) -> mels[b] (mel_dim, n_b * repeats), as transformers' `sample` gives each alone with
    its noise drawn from generators[b]. `dit`: transformers' DiT for everything but its decoder layers, which
    `layers` runs (the stage's `DiTBackend`: our rank model over its pp x tp ranks, each building the rotary
    table and the per-row masks from the frame counts). (transformers skips the null rows when guidance_scale < 1e-5; here
    they always run, and a zero scale leaves the guided rows.)"""
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver

    device, dtype = codes[0].device, conditions[0].dtype
    frames = [int(c.numel()) * dit.repeats for c in codes]
    if max(frames) > dit.config.max_position_embeddings:
        raise ValueError(f"{max(frames) // dit.repeats} codes make {max(frames)} mel frames, more than the DiT's "
                         f"max_position_embeddings {dit.config.max_position_embeddings}")
    total, batch = max(frames), len(codes)
    noise = torch.zeros(batch, total, dit.mel_dim, dtype=dtype, device=device)
    padded_codes = torch.zeros(batch, total // dit.repeats, dtype=torch.long, device=device)
    for b, (c, n) in enumerate(zip(codes, frames)):
        noise[b, :n] = torch.randn([1, n, dit.mel_dim], dtype=dtype, device=device, generator=generators[b])[0]
        padded_codes[b, :c.numel()] = c
    # what no RK4 evaluation changes: [guided | null] conditioning, code embeddings
    speaker = torch.cat(conditions).unsqueeze(1).repeat(1, total, 1)
    speaker = torch.cat([speaker, torch.zeros_like(speaker)])
    voices = torch.cat([torch.stack([e[0] for e in encoded]), torch.stack([e[1] for e in encoded])])
    code_embed = torch.cat([dit.text_embed(padded_codes, drop_code=False), dit.text_embed(padded_codes, drop_code=True)])
    fixed = (voices.unsqueeze(1).repeat(1, total, 1), code_embed, speaker)

    def velocity(time_step: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        time_embedding = dit.time_embed(time_step.repeat(2 * batch))
        x = dit.input_embed.proj(torch.cat((torch.cat([hidden, hidden]),) + fixed, dim=-1))
        x = layers(x, time_embedding, frames + frames)  # the decoder layers, on the stage's ranks
        guided, null = torch.chunk(dit.proj_out(dit.norm_out(x, time_embedding)), 2, dim=0)
        return guided + (guided - null) * guidance_scale

    times = torch.linspace(0, 1, num_steps, device=device, dtype=dtype)
    if sway_coefficient is not None:
        times += sway_coefficient * (torch.cos(torch.pi / 2 * times) - 1 + times)
    final = RungeKutta4ODESolver(function=velocity, initial_value=noise).integrate(times)[-1]
    return [final[b, :n].transpose(0, 1) for b, n in enumerate(frames)]
