"""Qwen2.5-Omni's token2wav: codec ids -> 24 kHz waveform, per request, reproducible by seed.

Role: the vocoder half of Qwen2.5-Omni's speech. transformers' `Qwen2_5OmniToken2WavModel` runs a DiT that turns
the codes (50 a second, each repeated twice: 100 mel frames a second) into a mel spectrogram by integrating a
flow from Gaussian noise (RK4, 10 steps, classifier-free guidance 0.5), conditioned on the speaker's embedding
and reference mel from `spk_dict.pt`; BigVGAN turns the mel into samples (240 per mel frame: 480 per code).
transformers' `sample` draws that noise from torch's global generator; `sample_mel` here is the same loop
(transformers' DiT forward and RK4 solver, its guidance and time schedule) with the noise drawn from a
generator of the request's own, seeded: a request's audio depends on its seed alone, not on what ran before it,
and two requests can decode at once on two threads (nothing global is touched).

Data flow:
    load_speakers(model_dir) -> {name (lower case): {"bos_token", "cond" (1, enc_emb_dim), "ref_mel" (1, T, 80)}}
    Qwen2_5OmniToken2Wav(module, speakers)(codes (n,) int64, speaker, seed)
        -> sample_mel (noise (1, 2n, 80) from `seed` -> 10 RK4 steps of the guided DiT) -> mel (1, 80, 2n)
        -> BigVGAN -> waveform (480 n,) float32
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

SAMPLES_PER_CODE = 480  # 2 mel frames per code x 240 samples per mel frame (BigVGAN's upsampling)
SAMPLE_RATE = 24000


def load_speakers(model_dir: Path) -> dict[str, dict[str, Any]]:
    """The checkpoint's `spk_dict.pt` (what `from_pretrained` loads), keyed by lower-cased speaker name."""
    path = Path(model_dir) / "spk_dict.pt"
    if not path.is_file():
        raise ValueError(f"{model_dir} has no spk_dict.pt: a Qwen2.5-Omni checkpoint ships its speakers there")
    speakers = torch.load(path, weights_only=True)
    return {str(name).lower(): dict(value) for name, value in speakers.items()}


class Qwen2_5OmniToken2Wav:
    """transformers' Token2Wav module with the checkpoint's speakers; request-safe (no state kept between calls)."""

    def __init__(self, module: Any, speakers: dict[str, dict[str, Any]], num_steps: int = 10,
                 guidance_scale: float = 0.5, sway_coefficient: float = -1.0) -> None:
        self.module = module.float().eval()  # transformers runs it in float32 whatever the checkpoint's dtype
        self.speakers = speakers
        self.num_steps, self.guidance_scale, self.sway_coefficient = num_steps, guidance_scale, sway_coefficient

    @torch.no_grad()
    def __call__(self, codes: torch.Tensor, speaker: str, seed: int) -> torch.Tensor:
        """codes (n,) -> waveform (480 n,) float32, the noise drawn from `seed`."""
        voice = self.speakers.get(speaker.lower())
        if voice is None:
            raise ValueError(f"unknown speaker {speaker!r}; valid speakers: {sorted(self.speakers)}")
        device = next(self.module.parameters()).device  # the stage's device; the samples come back to the host
        codes = codes.view(1, -1).long().to(device)
        if codes.shape[1] == 0:
            return torch.zeros(0)
        generator = torch.Generator(device=device).manual_seed(seed)
        mel = sample_mel(self.module.code2wav_dit_model, voice["cond"].float().to(device),
                         voice["ref_mel"].float().to(device), codes, generator, self.num_steps,
                         self.guidance_scale, self.sway_coefficient)
        return self.module.code2wav_bigvgan_model(mel).reshape(-1).float().cpu()


@torch.no_grad()
def sample_mel(dit: Any, conditioning: torch.Tensor, reference_mel: torch.Tensor, codes: torch.Tensor,
               generator: torch.Generator, num_steps: int = 10, guidance_scale: float = 0.5,
               sway_coefficient: float | None = -1.0) -> torch.Tensor:
    """transformers' `Qwen2_5OmniToken2WavDiTModel.sample`, its noise drawn from `generator`: codes (B, n),
    conditioning (B, enc_emb_dim), reference_mel (B, T, mel_dim) -> mel (B, mel_dim, n * repeats)."""
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver

    duration = codes.shape[1] * dit.repeats
    if duration > dit.config.max_position_embeddings:
        raise ValueError(f"{codes.shape[1]} codes make {duration} mel frames, more than the DiT's "
                         f"max_position_embeddings {dit.config.max_position_embeddings}")
    noise = torch.randn([reference_mel.shape[0], duration, dit.mel_dim], dtype=reference_mel.dtype,
                        device=codes.device, generator=generator)
    speaker = conditioning.unsqueeze(1).repeat(1, duration, 1)

    def velocity(time_step: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        if guidance_scale < 1e-5:
            return dit(hidden_states=hidden, speaker_embedding=speaker, condition_vector=reference_mel,
                       quantized_code=codes, time_step=time_step, drop_audio_conditioning=False, drop_code=False,
                       apply_cfg=False)
        out = dit(hidden_states=hidden, quantized_code=codes, speaker_embedding=speaker,
                  condition_vector=reference_mel, time_step=time_step, apply_cfg=True)
        guided, null = torch.chunk(out, 2, dim=0)
        return guided + (guided - null) * guidance_scale

    times = torch.linspace(0, 1, num_steps, device=codes.device, dtype=speaker.dtype)
    if sway_coefficient is not None:
        times += sway_coefficient * (torch.cos(torch.pi / 2 * times) - 1 + times)
    trajectory = RungeKutta4ODESolver(function=velocity, initial_value=noise).integrate(times)
    return trajectory[-1].permute(0, 2, 1)  # (B, mel_dim, frames)


def load_token2wav(model_dir: Path, device: str | torch.device = "cpu") -> Qwen2_5OmniToken2Wav:
    """Only `token2wav.*` of the checkpoint (DiT + BigVGAN, float32, on `device`) and its speakers; fails on a
    missing key."""
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavModel

    from omnimesh.models.loader import build_submodule

    module = build_submodule(Path(model_dir), config_path="token2wav_config", factory=Qwen2_5OmniToken2WavModel,
                             prefix="token2wav.", dtype=torch.float32)
    return Qwen2_5OmniToken2Wav(module.to(device), load_speakers(model_dir))
