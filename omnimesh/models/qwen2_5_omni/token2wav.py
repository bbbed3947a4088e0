"""Qwen2.5-Omni's token2wav: codec ids -> 24 kHz waveform, per request, reproducible by seed.

Role: the vocoder half of Qwen2.5-Omni's speech. transformers' `Qwen2_5OmniToken2WavModel` runs a DiT that turns
the codes (50 a second, each repeated twice: 100 mel frames a second) into a mel spectrogram by integrating a
flow from Gaussian noise (RK4, 10 steps, classifier-free guidance 0.5), conditioned on the speaker's embedding
and reference mel from `spk_dict.pt`; BigVGAN turns the mel into samples (240 per mel frame: 480 per code).
The noise is drawn from torch's global generator inside transformers; here each call draws it under its own
seed (the global generator forked and restored around the call), so a request's audio depends on its seed
alone, not on what ran before it in the process.

Data flow:
    load_speakers(model_dir) -> {name (lower case): {"bos_token", "cond" (1, enc_emb_dim), "ref_mel" (1, T, 80)}}
    Qwen2_5OmniToken2Wav(module, speakers)(codes (n,) int64, speaker, seed) -> waveform (480 n,) float32
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
        self.options = {"num_steps": num_steps, "guidance_scale": guidance_scale, "sway_coefficient": sway_coefficient}

    @torch.no_grad()
    def __call__(self, codes: torch.Tensor, speaker: str, seed: int) -> torch.Tensor:
        """codes (n,) -> waveform (480 n,) float32, the noise drawn from `seed`."""
        voice = self.speakers.get(speaker.lower())
        if voice is None:
            raise ValueError(f"unknown speaker {speaker!r}; valid speakers: {sorted(self.speakers)}")
        codes = codes.view(1, -1).long()
        if codes.shape[1] == 0:
            return torch.zeros(0)
        devices = [codes.device] if codes.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            wav = self.module(codes, conditioning=voice["cond"].float(), reference_mel=voice["ref_mel"].float(),
                              **self.options)
        return wav.reshape(-1).float()


def load_token2wav(model_dir: Path) -> Qwen2_5OmniToken2Wav:
    """Only `token2wav.*` of the checkpoint (DiT + BigVGAN, float32) and its speakers; fails on a missing key."""
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavModel

    from omnimesh.models.loader import build_submodule

    module = build_submodule(Path(model_dir), config_path="token2wav_config", factory=Qwen2_5OmniToken2WavModel,
                             prefix="token2wav.", dtype=torch.float32)
    return Qwen2_5OmniToken2Wav(module, load_speakers(model_dir))
