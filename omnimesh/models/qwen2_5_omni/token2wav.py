"""Qwen2.5-Omni's token2wav: codec ids -> 24 kHz waveform, several requests per call, each reproducible by seed.

Role: the vocoder half of Qwen2.5-Omni's speech. transformers' `Qwen2_5OmniToken2WavModel` runs a DiT that turns the
codes (50 a second, each repeated twice: 100 mel frames a second) into a mel spectrogram by integrating a flow from
Gaussian noise (RK4, 10 steps, classifier-free guidance 0.5), conditioned on the speaker's embedding and reference mel
from `spk_dict.pt`; BigVGAN turns the mel into samples (240 per mel frame: 480 per code). transformers' `sample` draws
that noise from torch's global generator and decodes one request per call; here (`dit_batch.sample_mels`,
`bigvgan_batch.decode_mels`) the noise of each request comes from a generator of its own, seeded, and several requests
of any lengths and speakers decode in one batched DiT loop and (on CUDA) batched BigVGAN calls: a request's audio
depends on its codes, speaker and seed alone, not on what ran before or beside it (alone or in a batch: equal to
transformers' under the same seed to float rounding; the DiT attends block-locally, `dit_attention`, where transformers
masks a full (T, T) attention). BigVGAN decodes pieces of at most 10 s of audio (with the context its receptive field
needs: `bigvgan_windows`), so its memory does not grow with an utterance's length; on CPU one piece a call: batched it
decodes no faster there (measured on the tiny model, 1 thread, 8 requests of 12-30 codes: 43 ms a request batched, 37
alone; its convolutions are compute-bound and the padding is waste), while the DiT's ~40 small calls halve (28 -> 15 ms
a request). Two calls may run at once on two threads (nothing global is touched; the modules are only read). The DiT's
decoder layers run on the stage's pp x tp ranks (`dit_shard.DiTBackend`; in-process for pp = tp = 1); this process keeps
the rest: the DiT's embeddings, speaker encoder, input and output projections, the RK4 loop, and BigVGAN.

Data flow:
    load_speakers(model_dir) -> {name (lower case): {"bos_token", "cond" (1, enc_emb_dim), "ref_mel" (1, T, 80)}}
    Qwen2_5OmniToken2Wav(module, speakers, layers).decode([Utterance(codes (n_b,) int64, speaker, seed), ...])
        -> sample_mels (per request noise (1, 2 n_b, 80) from its seed -> 10 RK4 steps of the guided DiT over
           the right-padded batch) -> mels (80, 2 n_b) -> BigVGAN in pieces of <= 10 s (+ context) each
           (`bigvgan_windows`; CUDA: batched, exact per row; CPU: one piece a call) -> waveforms (480 n_b,)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omnimesh.models.qwen2_5_omni.bigvgan_windows import WINDOW_FRAMES, decode_windowed, reach_frames
from omnimesh.models.qwen2_5_omni.dit_batch import Layers, encode_voice, sample_mels
from omnimesh.models.qwen2_5_omni.dit_shard import DiTBackend, DiTShardSpec

SAMPLES_PER_CODE = 480  # 2 mel frames per code x 240 samples per mel frame (BigVGAN's upsampling)
SAMPLE_RATE = 24000


@dataclass(frozen=True)
class Utterance:
    """One request's whole code stream and how to voice it."""

    codes: torch.Tensor  # (n,) int64
    speaker: str
    seed: int


def load_speakers(model_dir: Path) -> dict[str, dict[str, Any]]:
    """The checkpoint's `spk_dict.pt` (what `from_pretrained` loads), keyed by lower-cased speaker name."""
    path = Path(model_dir) / "spk_dict.pt"
    if not path.is_file():
        raise ValueError(f"{model_dir} has no spk_dict.pt: a Qwen2.5-Omni checkpoint ships its speakers there")
    speakers = torch.load(path, weights_only=True)
    return {str(name).lower(): dict(value) for name, value in speakers.items()}


class Qwen2_5OmniToken2Wav:
    """transformers' Token2Wav module (without the DiT's decoder layers: `layers` runs them) with the
    checkpoint's speakers; request-safe (no state kept between calls)."""

    def __init__(self, module: Any, speakers: dict[str, dict[str, Any]], layers: Layers, num_steps: int = 10,
                 guidance_scale: float = 0.5, sway_coefficient: float = -1.0) -> None:
        self.module = module.float().eval()  # transformers runs it in float32 whatever the checkpoint's dtype
        self.layers = layers
        self.speakers = speakers
        self.num_steps, self.guidance_scale, self.sway_coefficient = num_steps, guidance_scale, sway_coefficient
        self.device = next(self.module.parameters()).device  # the stage's; the samples come back to the host
        dit = self.module.code2wav_dit_model
        # BigVGAN decodes pieces of at most this many mel frames (+ its reach either side): bounded memory
        self.bigvgan_window, self.bigvgan_context = WINDOW_FRAMES, reach_frames(self.module.code2wav_bigvgan_model)
        # per speaker, on the device: its conditioning vector and its speaker encoding (constant per speaker)
        self.voices = {name: (voice["cond"].float().to(self.device),
                              encode_voice(dit, voice["ref_mel"].float().to(self.device)))
                       for name, voice in speakers.items()}

    def check_speaker(self, speaker: str) -> None:
        if speaker.lower() not in self.voices:
            raise ValueError(f"unknown speaker {speaker!r}; valid speakers: {sorted(self.voices)}")

    @torch.no_grad()
    def decode(self, utterances: list[Utterance]) -> list[torch.Tensor]:
        """Each utterance's waveform (480 n_b,) float32 on the host, decoded together."""
        for u in utterances:
            self.check_speaker(u.speaker)
        out: list[torch.Tensor | None] = [torch.zeros(0) if u.codes.numel() == 0 else None for u in utterances]
        todo = [(i, u) for i, u in enumerate(utterances) if out[i] is None]
        if todo:
            voices = [self.voices[u.speaker.lower()] for _, u in todo]
            mels = sample_mels(self.module.code2wav_dit_model, self.layers,
                               [u.codes.reshape(-1).long().to(self.device) for _, u in todo],
                               [v[0] for v in voices], [v[1] for v in voices],
                               [torch.Generator(device=self.device).manual_seed(u.seed) for _, u in todo],
                               self.num_steps, self.guidance_scale, self.sway_coefficient)
            waves = decode_windowed(self.module.code2wav_bigvgan_model, mels, self.device.type == "cuda",
                                    self.bigvgan_window, context=self.bigvgan_context)
            for (i, _), wave in zip(todo, waves):
                out[i] = wave
        return [w for w in out if w is not None]

    def __call__(self, codes: torch.Tensor, speaker: str, seed: int) -> torch.Tensor:
        """codes (n,) -> waveform (480 n,) float32, the noise drawn from `seed`."""
        return self.decode([Utterance(codes, speaker, seed)])[0]


def _without_dit_layers(config: Any) -> Any:
    """token2wav without the DiT's decoder layers (they live in the DiT shards)."""
    from torch import nn
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavModel

    module = Qwen2_5OmniToken2WavModel(config)
    module.code2wav_dit_model.transformer_blocks = nn.ModuleList()
    return module


def load_token2wav(model_dir: Path, device: str | torch.device = "cpu", pp: int = 1, tp: int = 1,
                   partition: tuple[int, ...] | None = None, **executor_args: Any) -> Qwen2_5OmniToken2Wav:
    """Only `token2wav.*` of the checkpoint and its speakers, float32 (transformers runs it so), failing on a
    missing key: this process keeps everything but the DiT's decoder layers, on `device`; those are split over
    pp x tp ranks (`executor_args`: the stage layout's, see `start_program`; pp = tp = 1: in this process, on
    `device`), each rank loading only its own."""
    from omnimesh.models.loader import build_submodule

    module = build_submodule(Path(model_dir), config_path="token2wav_config", factory=_without_dit_layers,
                             prefix="token2wav.", dtype=torch.float32)
    if pp * tp == 1 and torch.device(device).type == "cuda":
        executor_args = {**executor_args, "backend": "nccl", "devices": (str(device),)}
    layers = DiTBackend.build(DiTShardSpec(Path(model_dir), torch.float32, partition), pp, tp, **executor_args)
    return Qwen2_5OmniToken2Wav(module.to(device), load_speakers(model_dir), layers)
