"""The `transformers` reference for Qwen2.5-Omni: text, codes and waveform of one greedy request.

Thinker: `Qwen2_5OmniThinkerForConditionalGeneration.generate` (greedy, stopping at the tiny model's end ids).
Talker: transformers' `Qwen2_5OmniTalkerForConditionalGeneration` stepped greedily from the rows `generate` builds
out of the thinker's output, WITH the attention mask `generate` means to give it. transformers 5.23's `generate`
no longer hands the talker that mask (a regression of its generation refactor, see huggingface/transformers#47186),
and the talker's forward keys two things on it: adding the codec pad / bos embeddings to its prompt's last two
rows, and its M-RoPE index; without it the prompt lacks both and its positions are plain 0..P-1
(tests/models/test_qwen2_5_talker.py pins that). The talker's settings are `generate`'s, greedy: repetition
penalty 1.05 over its input ids, codec bos suppressed, stop at codec pad or end; at max tokens every code is kept.
Token2wav: transformers' module after `torch.manual_seed(seed)` (the noise its DiT starts from).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache
from transformers.generation.logits_process import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
)

from gateway.events import ChatRequest
from gateway.prompt import PromptBuilder
from omnimesh.models.qwen2_5_omni.talker import Qwen2_5OmniTalker
from omnimesh.models.qwen2_5_omni.tiny_config import CODEC_IDS, SPECIAL_TOKENS

THINKER_EOS = [SPECIAL_TOKENS["<|im_end|>"], SPECIAL_TOKENS["<|endoftext|>"]]
TALKER_STOPS = (CODEC_IDS["tts_codec_pad_token_id"], CODEC_IDS["tts_codec_end_token_id"])


@dataclass
class ThinkerOutput:
    text: str
    generated: list[int]  # token ids, the end id included when it stopped there
    logprobs: list[float]  # each generated token's log-probability under the raw logits
    prompt_rows: torch.Tensor  # (L, E): what the thinker stage sends the talker for the prompt
    replies: list[torch.Tensor]  # r_0 .. r_{n-2}, each (E,)


def media_kwargs(p: Any, image_prefix: str = "") -> dict[str, Any]:
    """A prompt's media as the thinker's `generate` takes them (`image_prefix` "thinker_" for the whole model's)."""
    kwargs: dict[str, Any] = {}
    if p.input_features is not None:
        kwargs.update(input_features=p.input_features, feature_attention_mask=p.feature_attention_mask)
    if p.pixel_values is not None:
        kwargs.update({f"{image_prefix}pixel_values": p.pixel_values, "image_grid_thw": p.image_grid_thw})
    if p.pixel_values_videos is not None:
        kwargs.update(pixel_values_videos=p.pixel_values_videos, video_grid_thw=p.video_grid_thw,
                      video_second_per_grid=p.video_second_per_grid, use_audio_in_video=p.use_audio_in_video)
    return kwargs


class Qwen2_5Reference:
    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration

        self.model_dir = model_dir
        self.model = Qwen2_5OmniForConditionalGeneration.from_pretrained(model_dir).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.prompts = PromptBuilder(model_dir, max_model_len=4096)
        self.talker = Qwen2_5OmniTalker.from_hf(self.model)

    @torch.no_grad()
    def thinker(self, p: Any, max_tokens: int) -> ThinkerOutput:
        ids = p.input_ids.view(1, -1)
        out = self.model.thinker.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
            eos_token_id=THINKER_EOS, output_hidden_states=True, output_logits=True, return_dict_in_generate=True,
            **media_kwargs(p))
        generated = out.sequences[0, ids.shape[1]:].tolist()
        logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)  # (n, V)
        hs = out.hidden_states
        prompt_rows = self.talker.prompt_rows(p.input_ids.view(-1), hs[0][0][0], hs[0][-1][0])
        replies = [hs[k][-1][0, -1] + hs[k][0][0, -1] for k in range(1, len(generated))]
        return ThinkerOutput(self.tokenizer.decode(generated, skip_special_tokens=True), generated,
                             [float(logprobs[i, t]) for i, t in enumerate(generated)], prompt_rows, replies)

    @torch.no_grad()
    def codes(self, p: Any, thinker: ThinkerOutput, speaker: str, max_tokens: int,
              logits: list[torch.Tensor] | None = None) -> list[int]:
        """transformers' talker stepped greedily with its mask (see the module docstring); `logits` collects each
        step's raw logits (V,)."""
        hf, talker = self.model.talker, self.talker
        hf.rope_deltas = None  # module state of a previous run
        bos_id, bos_row = talker.text_rows.speakers[speaker.lower()]
        ids = p.input_ids.view(-1)
        replies = thinker.replies
        embeds = torch.cat([thinker.prompt_rows, bos_row.view(1, -1), replies[0].view(1, -1)]).unsqueeze(0).clone()
        reply = torch.stack([*replies[1:], talker.text_rows.text_end, talker.text_rows.text_pad]).unsqueeze(0)
        text_ids = torch.cat([ids, torch.tensor([bos_id, thinker.generated[0]])]).view(1, -1)
        history = torch.tensor([[talker.codec_mask] * ids.numel() + [talker.codec_pad, talker.codec_bos]])
        processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.05),
                                          SuppressTokensLogitsProcessor([talker.codec_bos])])
        cache = DynamicCache(config=hf.config)
        mask = torch.ones_like(text_ids)
        media: dict[str, Any] = {"use_audio_in_video": bool(p.use_audio_in_video)}
        for name in ("image_grid_thw", "video_grid_thw", "video_second_per_grid"):
            if getattr(p, name) is not None:
                media[name] = getattr(p, name)
        if p.feature_attention_mask is not None:
            media["audio_feature_lengths"] = p.feature_attention_mask.sum(-1)
        out = hf(inputs_embeds=embeds, attention_mask=mask, input_text_ids=text_ids, thinker_reply_part=reply,
                 past_key_values=cache, use_cache=True, **media)
        codes: list[int] = []
        while len(codes) < max_tokens:
            if logits is not None:
                logits.append(out.logits[0, -1].clone())
            token = int(processors(history, out.logits[:, -1]).argmax(-1))
            history = torch.cat([history, torch.tensor([[token]])], dim=1)
            if token in TALKER_STOPS:
                break
            codes.append(token)
            mask = torch.cat([mask, torch.ones(1, 1, dtype=mask.dtype)], dim=1)
            out = hf(input_ids=torch.tensor([[token]]), attention_mask=mask,
                     thinker_reply_part=out.thinker_reply_part, past_key_values=cache, use_cache=True)
        return codes

    @torch.no_grad()
    def waveform(self, codes: list[int], speaker: str, seed: int) -> torch.Tensor:
        """transformers' token2wav on the codes, its noise drawn after `torch.manual_seed(seed)` (no codes: no
        samples; transformers' token2wav takes no empty stream)."""
        if not codes:
            return torch.zeros(0)
        voice = next(v for k, v in self.model.speaker_map.items() if k.lower() == speaker.lower())
        torch.manual_seed(seed)
        wav = self.model.token2wav(torch.tensor([codes]), conditioning=voice["cond"].float(),
                                   reference_mel=voice["ref_mel"].float())
        return wav.reshape(-1).float()

    def speech(self, req: ChatRequest, *, max_tokens: int, talker_max: int, speaker: str, seed: int
               ) -> tuple[ThinkerOutput, list[int], torch.Tensor]:
        """Text, codes and waveform of one request (greedy thinker and talker)."""
        p = self.prompts(req)
        thinker = self.thinker(p, max_tokens)
        codes = self.codes(p, thinker, speaker, talker_max)
        return thinker, codes, self.waveform(codes, speaker, seed)
