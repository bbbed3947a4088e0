"""The `transformers` reference for end-to-end parity: `Qwen3OmniMoeForConditionalGeneration.generate`
on the same folder, same chat template and processor, greedy thinker and talker, same speaker."""

from __future__ import annotations

import base64
import io
import math
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from gateway.events import ChatMessage, ChatRequest, TextPart
from gateway.media import decode_image, wav_to_audio_part
from gateway.prompt import PromptBuilder


def sine_wav(seconds: float = 1.0, rate: int = 16000, freq: float = 440.0) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    pcm = (0.3 * np.sin(2 * math.pi * freq * t) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def png_bytes(size: int = 64, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def mp4_bytes(n_frames: int = 12, rate: int = 6, width: int = 80, height: int = 48, seed: int = 0,
              sound: bool = False) -> bytes:
    """A small MP4 (MPEG-4 Part 2) clip of moving color gradients: 2 s at 6 fps -> 4 sampled frames at 2 fps;
    with `sound`, a stereo AAC soundtrack at 44.1 kHz (a rising tone on the left, noise on the right)."""
    import av

    rng = np.random.default_rng(seed)
    base = rng.integers(0, 200, 3)
    y, x = np.mgrid[0:height, 0:width]
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        audio = out.add_stream("aac", rate=44100, layout="stereo") if sound else None  # all before any packet
        for i in range(n_frames):
            rgb = np.stack([(base[c] + x * (c + 1) + y * 2 + i * 9) % 256 for c in range(3)], axis=-1)
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb.astype(np.uint8), format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
        if audio is not None:
            _soundtrack(out, audio, n_frames / rate, rng)
    return buf.getvalue()


def _soundtrack(out, stream, seconds: float, rng: np.random.Generator) -> None:  # type: ignore[no-untyped-def]
    import av

    rate = stream.rate
    t = np.arange(int(seconds * rate)) / rate
    left = 0.3 * np.sin(2 * math.pi * (300 + 200 * t) * t)
    right = 0.05 * rng.standard_normal(t.size)
    pcm = np.stack([left, right]).astype(np.float32)  # (2, n) planar
    for start in range(0, t.size, 1024):
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm[:, start:start + 1024]), format="fltp",
                                           layout="stereo")
        frame.sample_rate, frame.pts = rate, start
        for packet in stream.encode(frame):
            out.mux(packet)
    for packet in stream.encode():
        out.mux(packet)


def openai_content(text: str, wav: bytes | None, png: bytes | None, mp4: bytes | None = None) -> list[dict]:
    parts: list[dict] = []
    if wav is not None:
        parts.append({"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}})
    if png is not None:
        parts.append({"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}})
    if mp4 is not None:
        parts.append({"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(mp4).decode()}})
    parts.append({"type": "text", "text": text})
    return parts


def chat_request(text: str, wav: bytes | None, png: bytes | None, *, max_tokens: int, talker_max: int,
                 voice: str = "ethan", modalities: tuple[str, ...] = ("text", "audio"),
                 mp4: bytes | None = None, model_dir: Path | None = None,
                 use_audio_in_video: bool = False) -> ChatRequest:
    """The same request as `openai_content` builds, in the gateway's in-process form."""
    from gateway.events import SamplingOverrides

    parts: list = []
    if wav is not None:
        parts.append(wav_to_audio_part(wav, max_seconds=600, param="audio"))
    if png is not None:
        parts.append(decode_image(png, max_pixels=4096 * 4096, param="image"))
    if mp4 is not None:  # sampled as the gateway samples it for this model folder
        from gateway.input_limits import InputLimits
        from gateway.media_video import decode_video
        from omnimesh.models.qwen3_omni.video_processor import VideoFrameProcessor

        assert model_dir is not None, "a video request needs the model folder (its video sampling)"
        sampling = VideoFrameProcessor.from_pretrained(model_dir).sampling
        parts.append(decode_video(mp4, sampling=sampling, limits=InputLimits(), param="video",
                                  with_audio=use_audio_in_video))
    parts.append(TextPart(text))
    return ChatRequest(
        request_id="ref", model="tiny", messages=(ChatMessage("user", tuple(parts)),), modalities=modalities,
        voice=voice, sampling=SamplingOverrides(temperature=0.0, max_tokens=max_tokens),
        stage_params={"talker": SamplingOverrides(temperature=0.0, max_tokens=talker_max)},
    )


@dataclass
class Reference:
    text: str
    token_ids: list[int]
    audio: np.ndarray  # (samples,) float32


class ReferenceModel:
    def __init__(self, model_dir: Path):
        from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

        self.model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(model_dir).eval()
        # transformers bug (MODELS.md): with audio AND an image the talker needs the thinker's audio config
        self.model.talker.config.audio_config = self.model.thinker.config.audio_config
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.prompts = PromptBuilder(model_dir, max_model_len=4096)

    @torch.no_grad()
    def generate(self, req: ChatRequest, *, max_tokens: int, talker_max: int, speaker: str = "Ethan",
                 audio: bool = True, **generate_kwargs: object) -> Reference:
        """`generate_kwargs` go to `generate` as they are (e.g. `thinker_logits_processor=...`)."""
        p = self.prompts(req)
        kwargs: dict = dict(generate_kwargs)
        if p.input_features is not None:
            kwargs["input_features"] = p.input_features
            kwargs["feature_attention_mask"] = p.feature_attention_mask
        if p.pixel_values is not None:
            kwargs["pixel_values"] = p.pixel_values
            kwargs["image_grid_thw"] = p.image_grid_thw
        if p.pixel_values_videos is not None:
            kwargs.update(pixel_values_videos=p.pixel_values_videos, video_grid_thw=p.video_grid_thw,
                          video_second_per_grid=p.video_second_per_grid, use_audio_in_video=p.use_audio_in_video)
        ids = p.input_ids.view(1, -1)
        out = self.model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), speaker=speaker, return_audio=audio,
            thinker_max_new_tokens=max_tokens, thinker_eos_token_id=self.model.config.im_end_token_id,
            thinker_do_sample=False, talker_do_sample=False, talker_max_new_tokens=talker_max, **kwargs,
        )
        if audio:
            seq, wav = out
            wav_np = wav.reshape(-1).float().numpy()
        else:
            seq = out if isinstance(out, torch.Tensor) else out.sequences
            wav_np = np.zeros(0, dtype=np.float32)
        gen = seq[0, ids.shape[1]:].tolist()
        return Reference(self.tokenizer.decode(gen, skip_special_tokens=True), gen, wav_np)

    @torch.no_grad()
    def prompt_logprobs(self, req: ChatRequest) -> tuple[list[int], torch.Tensor]:
        """The prompt's ids and log_softmax of the thinker's logits at each row but the last (row i predicts
        prompt token i + 1), (n - 1, V): vLLM's prompt_logprobs."""
        p = self.prompts(req)
        kwargs = _media(p)
        ids = p.input_ids.view(1, -1)
        logits = self.model.thinker(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs).logits
        return ids[0].tolist(), torch.log_softmax(logits[0, :-1].float(), dim=-1)

    @torch.no_grad()
    def text_logprobs(self, req: ChatRequest, *, max_tokens: int) -> tuple[list[int], torch.Tensor]:
        """Greedy text-only `generate` -> (the generated ids, EOS included when it stopped there;
        log_softmax of the thinker's raw logits at each step, (n, V))."""
        p = self.prompts(req)
        kwargs = _media(p)
        ids = p.input_ids.view(1, -1)
        out = self.model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), return_audio=False, thinker_max_new_tokens=max_tokens,
            thinker_eos_token_id=self.model.config.im_end_token_id, thinker_do_sample=False,
            thinker_output_logits=True, thinker_return_dict_in_generate=True, **kwargs)
        logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)  # (n, V)
        return out.sequences[0, ids.shape[1]:].tolist(), logprobs


def _media(p) -> dict:  # type: ignore[no-untyped-def]
    """A prompt's audio and image inputs as the thinker's forward / generate take them."""
    kwargs: dict = {}
    if p.input_features is not None:
        kwargs.update(input_features=p.input_features, feature_attention_mask=p.feature_attention_mask)
    if p.pixel_values is not None:
        kwargs.update(pixel_values=p.pixel_values, image_grid_thw=p.image_grid_thw)
    return kwargs
