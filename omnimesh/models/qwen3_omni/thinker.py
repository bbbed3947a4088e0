"""The thinker stage of Qwen3-Omni (and of Qwen2.5-Omni), step-wise and request-safe: prefill once, then one
token per decode.

Qwen2.5-Omni differs here in facts read from its config (`Qwen2_5OmniConfig`): its audio token count
formula, its M-RoPE index (mrope.py), no deepstack features, and what its talker reads (`reply_rows`): the
final-norm hidden (`accept_hidden_layer` = the layer count) of EVERY prompt row plus its layer-0 embedding with
the media rows' embeddings zeroed (`talker_prompt`), then for each generated token j but the last the row
r_j = its embedding + its final hidden (`reply_row`: known one step after j is sampled, when j has run).

Role: runs the thinker LLM for ONE request with an explicit `ThinkerState` (its own KV cache and rope
delta; the module's `rope_deltas` attribute is never touched), and produces what the talker stage needs.

Data flow (the caller samples with `sampling.Sampler`, history = `state.history()`); a thinker stage's
batched engine uses `prepare` / `token_input` / `talker_prompt` and runs the decoder itself (lm_engine.py):
    prefill(input_ids (L,), audio_embeds, image_embeds, deepstack, image_grid_thw, audio_feature_lengths,
            video_embeds, video_deepstack, video_grid_thw, video_second_per_grid)
        embed -> masked_scatter media at the placeholder ids -> M-RoPE positions (mrope.py) -> layers
        (deepstack features go to the image AND video rows, in prompt order, as transformers joins them)
        -> (logits (V,) for generated token 0, ThinkerState, TalkerPrompt)
    decode(state, token_id) -> (logits (V,) for the next token, token_embed (H,) of `token_id`)

Text for the talker: the talker consumes the thinker's layer-0 embedding of every generated token except
the last one (EOS or the max-tokens token, which `generate` never feeds back). `decode(state, tok)` returns
exactly that embedding for `tok`, so the first generated token's embedding (the talker's
`first_text_embed`) is the `token_embed` of the FIRST decode call, and every later decode's `token_embed`
is pushed to the talker. When the sampled token is final, do not decode it: call `talker.finish_text`.
If generated token 0 is already final there is no text to speak (`generate` itself crashes there with a
size mismatch): skip the talker and return empty audio.

Numbers: decode logits equal `generate`'s bit for bit. The prefill applies `lm_head` to the last position
only; `generate` applies it to all L positions, and that larger GEMM rounds differently (~1e-7 on the
logits). Paying L x vocab for bit-equality is not worth it on the real model (152K vocab).

`TalkerPrompt` is the stage boundary: a small dataclass of named tensors, serialised as tensor frames.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeConfig
from transformers import Qwen2_5OmniConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

from omnimesh.models.qwen3_omni.lm_backend import HFBackend, LMBackend
from omnimesh.models.qwen3_omni.mrope import MropeSpec, decode_positions, prompt_positions


ASSISTANT_PREFIX = 3  # im_start, assistant, "\n": the rows of an assistant turn's start the talker's prefill takes


def last_assistant_start(ids: torch.Tensor, config: Qwen3OmniMoeConfig) -> int | None:
    """Where the last `<|im_start|>assistant` of the prompt ids (L,) begins (None: there is none)."""
    starts = torch.nonzero((ids[:-1] == config.im_start_token_id) & (ids[1:] == config.assistant_token_id)).flatten()
    return int(starts[-1]) if starts.numel() else None


@dataclass
class TalkerPrompt:
    """What the talker needs from the prompt (thinker -> talker, once per request)."""

    input_ids: torch.Tensor  # (L,) int64 prompt ids
    prompt_embeds: torch.Tensor  # (L, H) thinker layer-0 embeddings after the media merge
    multimodal_hidden: torch.Tensor  # (n_mm, H) thinker hidden at `accept_hidden_layer`, media positions only
    tts_embeds: torch.Tensor  # (3, H) thinker embeddings of tts_bos, tts_eos, tts_pad (in that order)
    image_grid_thw: torch.Tensor | None = None  # (n_images, 3) int64
    audio_feature_lengths: torch.Tensor | None = None  # (n_audios,) int64 valid mel frames per audio
    video_grid_thw: torch.Tensor | None = None  # (n_videos, 3) int64
    video_second_per_grid: torch.Tensor | None = None  # (n_videos,) float32 seconds per temporal patch
    # Qwen2.5-Omni only: generated token 0's id (1,) (its talker positions its prompt with it) and whether the
    # prompt interleaves a video's soundtrack (its talker's M-RoPE index reads that; Qwen3-Omni's does not)
    first_token: torch.Tensor | None = None
    use_audio_in_video: bool = False


@dataclass
class PreparedPrompt:
    """A prompt ready for the decoder: embedded with its media merged in, positioned."""

    ids: torch.Tensor  # (L,) int64
    embeds: torch.Tensor  # (L, H) layer-0 inputs
    positions: torch.Tensor  # (4, L) M-RoPE rows
    rope_delta: int
    visual: torch.Tensor | None  # (L,) bool image and video rows (deepstack targets)
    deepstack: torch.Tensor | None  # (k, n_visual_rows, H), rows in prompt order
    mm_mask: torch.Tensor  # (L,) bool media rows (their hidden at accept_hidden_layer goes to the talker)
    image_grid_thw: torch.Tensor | None = None
    audio_feature_lengths: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    video_second_per_grid: torch.Tensor | None = None
    use_audio_in_video: bool = False


@dataclass
class ThinkerState:
    """One request's thinker state; owned by the caller, never shared."""

    handle: Any  # the backend's handle for this request's KV cache
    rope_delta: int  # M-RoPE position of cache slot i is i + rope_delta
    token_ids: list[int] = field(default_factory=list)  # prompt + every token fed so far

    @property
    def seq_len(self) -> int:
        return len(self.token_ids)

    def history(self) -> torch.Tensor:
        """Ids the thinker's repetition penalty looks at (prompt + generated, as `generate` with input_ids)."""
        return torch.tensor(self.token_ids, dtype=torch.long)  # (n,)


class Qwen3OmniThinker:
    """Step-wise thinker: the embedding table here, the decoder stack + lm_head behind an `LMBackend`.

    `Qwen3OmniThinker(embed_tokens, backend, config)`; `Qwen3OmniThinker.from_hf(thinker, config)` wraps a
    whole transformers `Qwen3OmniMoeThinkerForConditionalGeneration` (the in-process reference), and a
    thinker stage builds a `ShardedBackend` over its pp x tp ranks (see stage_loading.py).
    """

    qwen2_5 = False  # a Qwen2.5-Omni config (set in __init__)
    reply_rows = False  # its talker reads rows r_j, not the tokens' embeddings (Qwen2.5-Omni with a talker)

    def __init__(self, embed_tokens: nn.Module, backend: LMBackend, config: Qwen3OmniMoeConfig | Qwen2_5OmniConfig
                 ) -> None:
        self.embed_tokens = embed_tokens
        self.backend = backend
        self.config = config
        tc: Any = config.thinker_config
        self.audio_token_id = int(tc.audio_token_id)
        self.image_token_id = int(tc.image_token_id)
        self.video_token_id = int(tc.video_token_id)
        self.audio_n_window = int(tc.audio_config.n_window)
        # the layer whose hidden the talker reads; None where no talker is fed (nothing to capture)
        self.accept_hidden_layer: int | None = None
        self.tts_ids: tuple[int, int, int] | None = None
        # the chat turns' token ids (im_start_token_id, im_end_token_id, assistant_token_id): Qwen3-Omni's config
        # names them; Qwen2.5-Omni's does not, `set_turn_tokens` reads them off its tokenizer
        self.turns: Any = None if isinstance(config, Qwen2_5OmniConfig) else config
        if isinstance(config, Qwen2_5OmniConfig):
            self.qwen2_5 = True
            self.deepstack_layers = 0
            self.mrope = MropeSpec.for_thinker(config)
            if config.enable_audio_output:  # its talker reads the final hidden of every prompt row
                self.accept_hidden_layer = int(tc.text_config.num_hidden_layers)
                self.reply_rows = True
        else:
            self.qwen2_5 = False
            tk: Any = config.talker_config
            self.deepstack_layers = len(tc.vision_config.deepstack_visual_indexes)
            if config.enable_audio_output:  # a thinker-only checkpoint feeds no talker
                self.accept_hidden_layer = int(tk.accept_hidden_layer)
            self.tts_ids = (int(config.tts_bos_token_id), int(config.tts_eos_token_id), int(config.tts_pad_token_id))
            self.mrope = MropeSpec.for_thinker(config)
        n_layers = int(tc.text_config.num_hidden_layers)
        if self.accept_hidden_layer is not None and not 0 <= self.accept_hidden_layer <= n_layers:
            raise ValueError(
                f"talker_config.accept_hidden_layer={self.accept_hidden_layer} is outside 0..{n_layers} "
                f"(the thinker has {n_layers} layers)"
            )

    @classmethod
    def from_hf(cls, thinker: nn.Module, config: Qwen3OmniMoeConfig) -> Qwen3OmniThinker:
        """Over a whole transformers thinker, run in this process (the reference path)."""
        text_model: Any = thinker.model.language_model  # type: ignore[union-attr]
        return cls(text_model.embed_tokens, HFBackend(text_model, thinker.lm_head), config)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)  # (..., H)

    def audio_tokens(self, feature_lengths: torch.Tensor) -> torch.Tensor:
        """Audio placeholder rows per audio of `feature_lengths` (n,) valid mel frames, by the family's formula."""
        if self.qwen2_5:  # Qwen2.5-Omni: a stride-2 conv, then a stride-2 average pool
            return (((feature_lengths - 1) // 2 + 1) - 2) // 2 + 1
        return _get_feat_extract_output_lengths(feature_lengths, self.audio_n_window)

    def release(self, state: ThinkerState) -> None:
        """The request ended: free its KV cache wherever the backend keeps it."""
        self.backend.close(state.handle)

    @torch.no_grad()
    def prepare(
        self,
        input_ids: torch.Tensor,
        audio_embeds: torch.Tensor | None = None,
        image_embeds: torch.Tensor | None = None,
        deepstack: list[torch.Tensor] | None = None,
        image_grid_thw: torch.Tensor | None = None,
        audio_feature_lengths: torch.Tensor | None = None,
        video_embeds: torch.Tensor | None = None,
        video_deepstack: list[torch.Tensor] | None = None,
        video_grid_thw: torch.Tensor | None = None,
        video_second_per_grid: torch.Tensor | None = None,
        use_audio_in_video: bool = False,
    ) -> PreparedPrompt:
        """Check the media, embed the prompt and merge the media in, and compute its M-RoPE positions.
        `use_audio_in_video`: the prompt interleaves each video's soundtrack with its frames (the audio
        embeddings hold those soundtracks in prompt order, like any audio)."""
        ids = input_ids.view(-1).long()  # (L,)
        self._check_media(ids, audio_embeds, audio_feature_lengths)
        self._check_visual(ids, "image", image_embeds, deepstack, image_grid_thw)
        self._check_visual(ids, "video", video_embeds, video_deepstack, video_grid_thw)
        if video_embeds is not None and video_grid_thw is not None and (
                video_second_per_grid is None or video_second_per_grid.numel() != video_grid_thw.shape[0]):
            raise ValueError("video_embeds need video_second_per_grid (n_videos,): seconds per temporal patch")
        embeds = self._embed(ids).unsqueeze(0)  # (1, L, H)
        rows = {"audio": ids == self.audio_token_id, "image": ids == self.image_token_id,
                "video": ids == self.video_token_id}  # (L,) each
        for kind, media in (("audio", audio_embeds), ("image", image_embeds), ("video", video_embeds)):
            if media is not None:
                embeds = embeds.masked_scatter(rows[kind].view(1, -1, 1).expand_as(embeds), media.to(embeds.dtype))
        visual = joint = None
        if image_embeds is not None or video_embeds is not None:
            visual = rows["image"] | rows["video"]  # (L,)
            joint = self._joint_deepstack(visual, rows, image_embeds, deepstack, video_embeds, video_deepstack)
        video_seconds = None if video_second_per_grid is None else video_second_per_grid.view(-1).float()
        positions, rope_delta = prompt_positions(ids, self.mrope, image_grid_thw, audio_feature_lengths,
                                                 video_grid_thw, video_seconds, use_audio_in_video)
        mm_mask = rows["audio"] | rows["image"] | rows["video"]  # (L,)
        return PreparedPrompt(
            ids=ids, embeds=embeds[0], positions=positions[:, 0], rope_delta=rope_delta, visual=visual,
            deepstack=joint, mm_mask=mm_mask, image_grid_thw=image_grid_thw,
            audio_feature_lengths=None if audio_feature_lengths is None else audio_feature_lengths.view(-1),
            video_grid_thw=None if video_embeds is None else video_grid_thw,
            video_second_per_grid=None if video_embeds is None else video_seconds,
            use_audio_in_video=use_audio_in_video)

    @staticmethod
    def _joint_deepstack(visual: torch.Tensor, rows: dict[str, torch.Tensor], image_embeds: torch.Tensor | None,
                         deepstack: list[torch.Tensor] | None, video_embeds: torch.Tensor | None,
                         video_deepstack: list[torch.Tensor] | None) -> torch.Tensor | None:
        """The deepstack features of every visual row in prompt order (k, n_visual_rows, H), as transformers
        joins image and video features; None when the model has no deepstack layers."""
        if video_embeds is None:
            return torch.stack(deepstack) if deepstack else None
        if image_embeds is None:
            return torch.stack(video_deepstack) if video_deepstack else None
        if not deepstack or not video_deepstack:
            return None
        joint = video_deepstack[0].new_zeros(len(deepstack), int(visual.sum()), video_deepstack[0].shape[-1])
        joint[:, rows["image"][visual]] = torch.stack(deepstack).to(joint.dtype)
        joint[:, rows["video"][visual]] = torch.stack(video_deepstack)
        return joint

    def set_turn_tokens(self, tokenizer: Any) -> None:
        """Qwen2.5-Omni: the ids of `<|im_start|>`, `<|im_end|>` and `assistant` from the tokenizer (its config does not
        name them); without all three as single tokens a continued assistant message is not spoken."""
        if self.turns is not None:
            return
        start, end = (tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>"))
        assistant = tokenizer.encode("assistant", add_special_tokens=False)
        if len(assistant) == 1 and None not in (start, end) and tokenizer.unk_token_id not in (start, end):
            self.turns = SimpleNamespace(im_start_token_id=start, im_end_token_id=end, assistant_token_id=assistant[0])

    def assistant_lead(self, ids: torch.Tensor) -> int:
        """How many rows end the prompt `ids` (L,) after its last `<|im_start|>assistant\\n` while that turn
        is open (no `<|im_end|>` or turn start after them): an assistant message the client began (vLLM's continue_final_message), which the
        talker speaks before the generated text, as if the thinker had written it. 0 for a prompt that ends
        with the assistant start (or has none: the talker refuses that)."""
        ids = ids.view(-1)
        cfg: Any = self.turns
        if cfg is None:
            return 0
        start = last_assistant_start(ids, cfg)
        if start is None:
            return 0
        begin = start + ASSISTANT_PREFIX
        tail = ids[begin:]
        if tail.numel() == 0 or bool(((tail == cfg.im_start_token_id) | (tail == cfg.im_end_token_id)).any()):
            return 0
        return ids.numel() - begin

    def talker_prompt(self, prompt: PreparedPrompt, multimodal_hidden: torch.Tensor, lead: int = 0) -> TalkerPrompt:
        """What the talker needs, once `multimodal_hidden` (n_mm, H) — the hidden at `accept_hidden_layer` of
        the prompt's media rows — is known. `lead` (`assistant_lead`): the prompt's last rows are an assistant
        message being continued; the talker's prompt stops before them (the caller sends their embeddings as the
        first text to speak; Qwen2.5-Omni: their rows, `lead_rows`, and the first of their ids is `first_token`)."""
        if self.reply_rows:  # Qwen2.5-Omni: final hidden (L, H) of every row + embeddings, media rows' zeroed
            rows = self.prompt_rows(prompt, multimodal_hidden)
            end = prompt.ids.numel() - lead
            return TalkerPrompt(
                input_ids=prompt.ids[:end].clone(), prompt_embeds=rows[:end], multimodal_hidden=rows[:0],
                tts_embeds=rows[:0], first_token=prompt.ids[end:end + 1].clone() if lead else None,
                image_grid_thw=prompt.image_grid_thw, audio_feature_lengths=prompt.audio_feature_lengths,
                video_grid_thw=prompt.video_grid_thw, video_second_per_grid=prompt.video_second_per_grid,
                use_audio_in_video=prompt.use_audio_in_video)
        end = prompt.ids.numel() - lead
        return TalkerPrompt(
            input_ids=prompt.ids[:end].clone(),
            prompt_embeds=prompt.embeds[:end].clone(),  # (L - lead, H)
            multimodal_hidden=multimodal_hidden.clone(),  # (n_mm, H)
            tts_embeds=self._embed(torch.tensor(self._tts_ids(), dtype=torch.long)),  # (3, H)
            image_grid_thw=None if prompt.image_grid_thw is None else prompt.image_grid_thw.clone(),
            audio_feature_lengths=None if prompt.audio_feature_lengths is None else prompt.audio_feature_lengths.clone(),
            video_grid_thw=None if prompt.video_grid_thw is None else prompt.video_grid_thw.clone(),
            video_second_per_grid=None if prompt.video_second_per_grid is None else prompt.video_second_per_grid.clone(),
        )

    @staticmethod
    def prompt_rows(prompt: PreparedPrompt, hidden: torch.Tensor) -> torch.Tensor:
        """Qwen2.5-Omni's talker rows of the prompt (L, H): each row's final hidden + its embedding, the media
        rows' embeddings zeroed (as `generate` builds them)."""
        return hidden + prompt.embeds.masked_fill(prompt.mm_mask.view(-1, 1), 0.0)

    def lead_rows(self, prompt: PreparedPrompt, hidden: torch.Tensor, lead: int) -> torch.Tensor:
        """What the talker speaks first for a continued assistant message's `lead` rows (lead, H): their
        embeddings (Qwen3-Omni), or their rows r as if the thinker had generated them (Qwen2.5-Omni)."""
        end = prompt.ids.numel() - lead
        if self.reply_rows:
            return self.prompt_rows(prompt, hidden)[end:]
        return prompt.embeds[end:]

    def capture_rows(self, prompt: PreparedPrompt) -> torch.Tensor | None:
        """The prompt rows whose hidden at `accept_hidden_layer` the talker reads: the media rows (Qwen3-Omni; None
        without media), every row (Qwen2.5-Omni)."""
        if self.reply_rows:
            return torch.ones_like(prompt.mm_mask)
        return prompt.mm_mask if bool(prompt.mm_mask.any()) else None

    @staticmethod
    def reply_row(token_embed: torch.Tensor, last_hidden: torch.Tensor) -> torch.Tensor:
        """Qwen2.5-Omni's talker row r_j (1, H) of a generated token: its embedding + its final-norm hidden."""
        return token_embed.view(1, -1) + last_hidden.reshape(1, -1)

    def _tts_ids(self) -> tuple[int, int, int]:
        if self.tts_ids is None:
            raise ValueError("this thinker feeds no talker (a thinker-only or Qwen2.5-Omni checkpoint)")
        return self.tts_ids

    @torch.no_grad()
    def token_input(self, token_id: int, seq_len: int, rope_delta: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A generated token as the next input row: its embedding (H,) and its positions (4, 1) at `seq_len`."""
        embed = self._embed(torch.tensor([token_id], dtype=torch.long))[0]  # (H,)
        return embed, decode_positions(seq_len, rope_delta)[:, 0]  # (H,), (4, 1)

    @torch.no_grad()
    def prefill(
        self,
        input_ids: torch.Tensor,
        audio_embeds: torch.Tensor | None = None,
        image_embeds: torch.Tensor | None = None,
        deepstack: list[torch.Tensor] | None = None,
        image_grid_thw: torch.Tensor | None = None,
        audio_feature_lengths: torch.Tensor | None = None,
        **video: Any,
    ) -> tuple[torch.Tensor, ThinkerState, TalkerPrompt]:
        """Run the prompt; returns (logits (V,) of generated token 0, state, talker prompt). `video`: the
        video_* keywords of `prepare`."""
        prompt = self.prepare(input_ids, audio_embeds, image_embeds, deepstack, image_grid_thw, audio_feature_lengths,
                              **video)
        handle = self.backend.open()
        out = self.backend.forward(
            handle, prompt.embeds.unsqueeze(0), prompt.positions.unsqueeze(1),
            visual_pos_mask=None if prompt.visual is None else prompt.visual.view(1, -1),
            deepstack=None if prompt.deepstack is None else list(prompt.deepstack.unbind(0)),
            capture_layer=self.accept_hidden_layer,
        )
        # `captured` is always set: the layer index was checked in __init__
        if out.captured is None:
            raise RuntimeError("the backend returned no captured hidden for accept_hidden_layer")
        state = ThinkerState(handle=handle, rope_delta=prompt.rope_delta, token_ids=prompt.ids.tolist())
        return out.logits, state, self.talker_prompt(prompt, out.captured[0][prompt.mm_mask])

    @torch.no_grad()
    def decode(self, state: ThinkerState, token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed one sampled token; returns (logits (V,) of the next token, token_embed (H,) of `token_id`)."""
        embed = self._embed(torch.tensor([[token_id]], dtype=torch.long))  # (1, 1, H)
        positions = decode_positions(state.seq_len, state.rope_delta)  # (4, 1, 1)
        out = self.backend.forward(state.handle, embed, positions)
        state.token_ids.append(int(token_id))
        return out.logits, embed[0, 0]  # (V,), (H,)

    def _check_media(self, ids: torch.Tensor, audio_embeds: torch.Tensor | None,
                     audio_feature_lengths: torch.Tensor | None) -> None:
        n_audio = int((ids == self.audio_token_id).sum())
        got_audio = 0 if audio_embeds is None else audio_embeds.shape[0]
        if n_audio != got_audio:
            raise ValueError(f"prompt has {n_audio} audio placeholder ids but {got_audio} audio embeddings were given")
        if audio_embeds is not None:
            if audio_feature_lengths is None:
                raise ValueError("audio_embeds given without audio_feature_lengths (valid mel frames per audio)")
            expected = int(self.audio_tokens(audio_feature_lengths.view(-1)).sum())
            if expected != n_audio:
                raise ValueError(
                    f"audio_feature_lengths {audio_feature_lengths.tolist()} give {expected} audio tokens, "
                    f"the prompt has {n_audio} audio placeholders"
                )

    def _check_visual(self, ids: torch.Tensor, kind: str, embeds: torch.Tensor | None,
                      deepstack: list[torch.Tensor] | None, grid_thw: torch.Tensor | None) -> None:
        """Image (`kind="image"`) or video embeddings against their placeholders, grid and deepstack."""
        token = self.image_token_id if kind == "image" else self.video_token_id
        grid_name, deep_name = f"{kind}_grid_thw", "deepstack" if kind == "image" else "video_deepstack"
        n_rows = int((ids == token).sum())
        got = 0 if embeds is None else embeds.shape[0]
        if n_rows != got:
            raise ValueError(f"prompt has {n_rows} {kind} placeholder ids but {got} {kind} embeddings were given")
        if embeds is None:
            if deepstack:
                raise ValueError(f"{deep_name} features given without {kind}_embeds")
            return
        if grid_thw is None:
            raise ValueError(f"{kind}_embeds given without {grid_name} (n_{kind}s, 3)")
        merge = self.mrope.spatial_merge_size**2
        if int(grid_thw.prod(-1).sum()) // merge != n_rows:
            raise ValueError(
                f"{grid_name} {grid_thw.tolist()} gives {int(grid_thw.prod(-1).sum()) // merge} "
                f"{kind} tokens, the prompt has {n_rows} {kind} placeholders"
            )
        n_deep = self.deepstack_layers
        if len(deepstack or []) != n_deep:
            raise ValueError(f"expected {n_deep} {deep_name} feature tensors (one per deepstack layer), got "
                             f"{len(deepstack or [])}; pass what Qwen3OmniEncoder.encode_image returns")
        for i, feat in enumerate(deepstack or []):
            if feat.shape != embeds.shape:
                raise ValueError(f"{deep_name}[{i}] has shape {tuple(feat.shape)}, expected {tuple(embeds.shape)}")
