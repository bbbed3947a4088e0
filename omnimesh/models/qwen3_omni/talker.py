"""The talker stage of Qwen3-Omni, step-wise and request-safe, fed text incrementally.

Role: turns the thinker's prompt + generated text into codec code groups for ONE request, exactly as
`Qwen3OmniMoeForConditionalGeneration.generate` does, but with text arriving token by token. Holds only
`talker` (`model`, `text_projection`, `hidden_projection`, `codec_head`, `code_predictor`).

Data flow:
    start(TalkerPrompt, speaker, first_text_embed) -> TalkerState with the prefill built (not yet run):
        [user turns: text_projection(text embeds) | hidden_projection(media hidden)]            (U rows)
        [im_start, assistant, \\n, 4 x tts_pad, tts_bos, first text] text rows
          + [0, 0, 0, nothink, think_bos, think_eos, speaker, codec_pad, codec_bos] codec rows   (9 rows)
    push_text(state, token_embed (H,))   the thinker's embedding of each later generated token
    finish_text(state)                   the thinker sampled its final token (EOS or max-tokens): that token
                                         is never spoken; `tts_eos` is appended instead (what `generate` does)
    step(state) -> (num_code_groups,) | None
        first call: the prefill, samples codec token c0, emits nothing
        call g+1 (g = 0, 1, ...): code predictor on c_g -> residual codes r1..r_{G-1}; emits [c_g, r1..];
                                  then one talker token: sum of the group's embeddings + text entry g -> c_{g+1}
    state.finished after codec EOS or max tokens; the final token gets no group (as in `generate`).

Look-ahead (any config): with generated text tokens t_0 .. t_{n-1} (t_{n-1} final), text entry g is
text_projection(embed(t_{g+1})) for g < n-2, `tts_eos` for g = n-2, and `tts_pad` beyond. Talker decode
step g (the step that emits code group g) therefore needs t_{g+1} decoded by the thinker, or the thinker
finished: the talker trails the thinker by one text token, and `can_step` says when it may run.
Fed token by token or all at once the numbers are identical (each text row is projected on its own);
`generate` projects the assistant rows in one GEMM, which rounds ~3e-8 differently (codes still equal).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch
from torch import nn
from transformers import DynamicCache
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeConfig

from omnimesh.models.qwen3_omni.decoder import run_code_predictor
from omnimesh.models.qwen3_omni.lm_backend import HFBackend, LMBackend
from omnimesh.models.qwen3_omni.mrope import MropeSpec, decode_positions, decode_positions_batch, prompt_positions
from omnimesh.models.qwen3_omni.sampling import (
    Sampler,
    SamplingParams,
    code_predictor_sampling_params,
    greedy_batch,
    talker_sampling_params,
)
from omnimesh.models.qwen3_omni.thinker import ASSISTANT_PREFIX, TalkerPrompt, last_assistant_start


@dataclass
class TalkerState:
    """One request's talker state; owned by the caller, never shared."""

    sampler: Sampler
    predictor_sampler: Sampler
    handle: Any  # the backend's handle for this request's KV cache
    prefill_embeds: torch.Tensor | None  # (1, P, H) until the first step runs it
    prefill_positions: torch.Tensor | None  # (4, 1, P)
    rope_delta: int
    tts_eos: torch.Tensor  # (H,) projected
    tts_pad: torch.Tensor  # (H,) projected
    seq_len: int = 0  # tokens in the KV cache
    text: list[torch.Tensor] = field(default_factory=list)  # projected text entries, entry g used at step g
    text_done: bool = False
    codes: list[int] = field(default_factory=list)  # sampled codec tokens c0, c1, ... (first code group)
    # the same codes in a buffer written once per code (`history`): the penalty reads a view, not a new tensor
    code_buffer: torch.Tensor = field(default_factory=lambda: torch.empty(64, dtype=torch.long))
    last_hidden: torch.Tensor | None = None  # (1, 1, H) final hidden of the latest talker token
    steps_done: int = 0  # talker decode steps run (= code groups emitted)
    finished: bool = False


class Qwen3OmniTalker:
    """Step-wise talker over an already-loaded `Qwen3OmniMoeTalkerForConditionalGeneration`.

    `config` is the whole `Qwen3OmniMoeConfig` (cheap to load anywhere): the talker needs the chat/tts ids
    and the audio tower's `n_window`, which its own config lacks.
    """

    default_speaker = "ethan"  # `generate` speaks as "Ethan" unless told otherwise

    def __init__(self, talker: nn.Module, config: Qwen3OmniMoeConfig, backend: LMBackend | None = None,
                 predictor: Any = None) -> None:
        """`talker` supplies the small per-step modules (text/hidden projections, codec embedding, and the code
        predictor unless `predictor` is given); the decoder stack + codec head run in `backend` (default:
        transformers' own, in-process). `predictor(prefix (1, 2, H), params) -> (codes, codec_sum)` runs the
        code predictor elsewhere (a `ShardedBackend.predict` over the stage's ranks)."""
        self.predictor = predictor
        self.talker: Any = talker
        self.backend: LMBackend = backend if backend is not None else HFBackend(self.talker.model, self.talker.codec_head)
        self.config = config
        tk: Any = config.talker_config
        self.num_code_groups = int(tk.num_code_groups)
        self.speakers: dict[str, int] = {k.lower(): int(v) for k, v in tk.speaker_id.items()}
        self.media_ids = (int(tk.audio_token_id), int(tk.image_token_id), int(tk.video_token_id))
        self.codec_prefix = (
            int(tk.codec_nothink_id), int(tk.codec_think_bos_id), int(tk.codec_think_eos_id),
        )
        self.codec_suffix = (int(tk.codec_pad_id), int(tk.codec_bos_id))
        self.mrope = MropeSpec.for_talker(config)

    @property
    def dtype(self) -> torch.dtype:
        """What the talker computes in (its projections' dtype): the thinker's tensors are cast to it."""
        return next(self.talker.text_projection.parameters()).dtype

    @torch.no_grad()
    def start(
        self,
        prompt: TalkerPrompt,
        speaker: str,
        first_text_embed: torch.Tensor,
        params: SamplingParams | None = None,
        generator: torch.Generator | None = None,
    ) -> TalkerState:
        """Build the talker prefill exactly as `generate`; `first_text_embed` (H,) is generated token 0's.

        `params` defaults to `generate`'s talker settings (sampled, 4096 tokens). The code predictor follows
        `params`' greedy/sampled choice and draws from the same generator, in `generate`'s order; pass
        `generator` to share one stream with other samplers of the request (else seeded by `params.seed`).
        """
        speaker_id = self.speakers.get(speaker.lower())
        if speaker_id is None:
            raise ValueError(f"unknown speaker {speaker!r}; valid speakers: {sorted(self.speakers)}")
        params = params if params is not None else talker_sampling_params(self.config)
        ids = prompt.input_ids.view(-1)  # (L,)
        cfg = self.config
        if last_assistant_start(ids, cfg) != ids.numel() - ASSISTANT_PREFIX:
            raise ValueError(
                "the prompt must end with the assistant start `<|im_start|>assistant\\n` "
                f"(ids {cfg.im_start_token_id}, {cfg.assistant_token_id}, newline); the talker speaks the text "
                "generated right after it"
            )
        proj_text = self.talker.text_projection
        user_embeds, user_ids = self._user_part(prompt, ids)  # (U, H), (U,)
        tts_bos, tts_eos, tts_pad = proj_text(prompt.tts_embeds).unbind(0)  # 3 x (H,)
        assistant = proj_text(
            torch.cat([prompt.prompt_embeds[-ASSISTANT_PREFIX:], first_text_embed.view(1, -1)], dim=0)
        )  # (4, H)
        text_rows = torch.cat(
            [assistant[:3], tts_pad.expand(4, -1), tts_bos.view(1, -1), assistant[3:4]], dim=0
        )  # (9, H)
        codec_ids = torch.tensor([*self.codec_prefix, speaker_id, *self.codec_suffix], dtype=torch.long)  # (6,)
        codec_rows = torch.cat(
            [text_rows.new_zeros(3, text_rows.shape[-1]), self.talker.get_input_embeddings()(codec_ids)], dim=0
        )  # (9, H)
        embeds = torch.cat([user_embeds, text_rows + codec_rows], dim=0).unsqueeze(0)  # (1, P, H)
        talker_ids = torch.cat([user_ids, torch.full((9,), int(cfg.tts_pad_token_id), dtype=torch.long)])  # (P,)
        # use_audio_in_video stays False here even when the thinker's prompt interleaves a video's soundtrack:
        # transformers' generate never passes it to the talker (only the grids and seconds), and the talker's
        # positions follow that reference
        positions, rope_delta = prompt_positions(
            talker_ids, self.mrope, prompt.image_grid_thw, prompt.audio_feature_lengths,
            prompt.video_grid_thw, prompt.video_second_per_grid,
        )  # (4, 1, P)
        sampler = Sampler(params, generator)
        return TalkerState(
            sampler=sampler,
            predictor_sampler=Sampler(code_predictor_sampling_params(params), sampler.generator),
            handle=self.backend.open(),
            prefill_embeds=embeds, prefill_positions=positions, rope_delta=rope_delta,
            tts_eos=tts_eos, tts_pad=tts_pad,
        )

    @torch.no_grad()
    def push_text(self, state: TalkerState, token_embed: torch.Tensor) -> None:
        """Append the thinker's embedding (H,) of the next generated (non-final) token."""
        if state.text_done:
            raise ValueError("push_text after finish_text: the thinker's text already ended")
        state.text.append(self.talker.text_projection(token_embed.view(1, -1))[0])  # (H,)

    def finish_text(self, state: TalkerState) -> None:
        """The thinker sampled its final token (EOS or max tokens); it is not spoken, `tts_eos` ends the text."""
        if state.text_done:
            raise ValueError("finish_text called twice")
        state.text.append(state.tts_eos)
        state.text_done = True

    def release(self, state: TalkerState) -> None:
        """The request ended: free its KV cache wherever the backend keeps it."""
        self.backend.close(state.handle)

    def can_step(self, state: TalkerState) -> bool:
        """Whether `step` can run now: the prefill is pending, or text entry g for the next decode is known."""
        if state.finished:
            return False
        if state.prefill_embeds is not None:
            return True
        return state.steps_done < len(state.text) or state.text_done

    @torch.no_grad()
    def step(self, state: TalkerState) -> torch.Tensor | None:
        """One talker step; returns the code group (G,) int64 of the previous codec token, or None."""
        if not self.can_step(state):
            raise ValueError(
                "talker step not possible: " + ("the request finished" if state.finished else
                f"text entry {state.steps_done} is not known yet (push_text or finish_text first)")
            )
        if state.prefill_embeds is not None and state.prefill_positions is not None:
            self._forward_and_sample(state, state.prefill_embeds, state.prefill_positions)
            state.prefill_embeds = state.prefill_positions = None
            return None
        code = state.codes[-1]
        residuals, codec_sum = self._predict_residuals(state, code)  # G-1 ints, (1, 1, H)
        g = state.steps_done
        text = state.text[g] if g < len(state.text) else state.tts_pad  # (H,)
        inputs = codec_sum + text.view(1, 1, -1)  # (1, 1, H)
        state.steps_done += 1
        self._forward_and_sample(state, inputs, decode_positions(state.seq_len, state.rope_delta))
        return torch.tensor([code, *residuals], dtype=torch.long)  # (G,)

    def _forward_and_sample(self, state: TalkerState, inputs: torch.Tensor, positions: torch.Tensor) -> None:
        out = self.backend.forward(state.handle, inputs, positions)
        state.seq_len += inputs.shape[1]
        self.sample_next(state, out.logits, out.last_hidden)

    # --- the batched stage path: the talker's decoder runs in the stage's LMEngine, the code predictor in
    # --- one call for all requests of a step (services/llm/talker_batcher.py drives these)

    def prefill_input(self, state: TalkerState) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefill rows (P, H) and positions (4, P); the state then counts them as fed."""
        return take_prefill(state)

    def needs_predict(self, state: TalkerState) -> bool:
        """The prefill ran and c_g is sampled: the code predictor can run once text entry g is known."""
        return state.prefill_embeds is None and bool(state.codes) and self.can_step(state)

    def predict_prefixes(self, states: list[TalkerState]) -> tuple[torch.Tensor, list[SamplingParams]]:
        """The code predictor's input (B, 2, H) = per request [last hidden, embedding of c_g] (one embedding
        call for the batch) and each request's sampling (a fresh seed from its stream when sampling, drawn in
        `_predict_residuals`' order)."""
        if any(s.last_hidden is None for s in states):
            raise ValueError("code predictor before the talker prefill ran")
        codes = torch.tensor([[s.codes[-1]] for s in states], dtype=torch.long)  # (B, 1)
        first = self.talker.get_input_embeddings()(codes)  # (B, 1, H)
        params = []
        for state in states:
            p = state.predictor_sampler.params
            if not p.greedy:
                p = replace(p, seed=int(torch.randint(0, 2**62, (1,), generator=state.sampler.generator)))
            params.append(p)
        hidden = torch.cat([cast(torch.Tensor, s.last_hidden) for s in states])  # (B, 1, H)
        return torch.cat([hidden, first], dim=1), params

    def after_predict(self, states: list[TalkerState], residuals: list[list[int]], codec_sums: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The code predictor ran for B requests: -> (code groups (B, G), next decoder inputs (B, H) = each
        group's summed embedding + its text entry, their positions (4, B)), made in one op each (row b is what
        request b alone gives, element for element)."""
        texts, groups = [], []
        positions = decode_positions_batch([s.seq_len for s in states], [s.rope_delta for s in states])  # (4, B)
        for state, codes in zip(states, residuals):
            g = state.steps_done
            texts.append(state.text[g] if g < len(state.text) else state.tts_pad)  # (H,)
            state.steps_done += 1
            state.seq_len += 1
            groups.append((state.codes[-1], *codes))
        rows = codec_sums.view(len(states), -1) + torch.stack(texts)  # (B, H)
        return torch.tensor(groups, dtype=torch.long), rows, positions  # (B, G), (B, H), (4, B)

    def sample_next(self, state: TalkerState, logits: torch.Tensor, last_hidden: torch.Tensor) -> None:
        """The decoder's output for the latest input: sample the next codec token (c0 of the next group)."""
        state.last_hidden = last_hidden  # (1, 1, H)
        self._took(state, state.sampler.sample(logits, history(state)))  # generated codec tokens only

    def sample_next_batch(self, states: list[TalkerState], logits: torch.Tensor, last_hidden: list[torch.Tensor]) -> bool:
        """`sample_next` for B requests of one step, logits (B, V), when they are greedy alike (`greedy_batch`:
        one go, the same tokens). False (nothing changed) when they are not: sample them one by one."""
        tokens = greedy_batch([s.sampler for s in states], logits, [history(s) for s in states])
        if tokens is None:
            return False
        for state, token, hidden in zip(states, tokens, last_hidden):
            state.last_hidden = hidden  # (1, 1, H)
            self._took(state, token)
        return True

    def final_group(self, state: TalkerState) -> torch.Tensor | None:
        """None: the final codec token (EOS or the max-tokens one) gets no group, as in `generate`."""
        return None

    def _took(self, state: TalkerState, token: int) -> None:
        n = len(state.codes)
        if n == state.code_buffer.numel():  # doubled when full: amortised O(1) per code
            state.code_buffer = torch.cat([state.code_buffer, torch.empty_like(state.code_buffer)])
        state.code_buffer[n] = token
        state.codes.append(token)
        if state.sampler.is_stop(token) or len(state.codes) >= state.sampler.params.max_tokens:
            state.finished = True

    def _user_part(self, prompt: TalkerPrompt, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """User-turn rows of the talker prefill: (U, H) embeddings and (U,) ids, as `generate` selects them."""
        cfg = self.config
        length = ids.numel()
        pos = torch.arange(length)  # (L,)
        im_start = torch.where(ids == cfg.im_start_token_id, pos, pos.new_full((), -1))  # (L,)
        previous = torch.cummax(im_start, dim=0).values.clamp_min(0)  # (L,)
        user_mask = ids[(previous + 1).clamp_max(length - 1)] == cfg.user_token_id  # (L,)
        mm = torch.zeros(length, dtype=torch.bool)
        for media_id in self.media_ids:
            mm |= ids == media_id  # (L,)
        if int(mm.sum()) != prompt.multimodal_hidden.shape[0]:
            raise ValueError(
                f"TalkerPrompt has {prompt.multimodal_hidden.shape[0]} multimodal hidden rows but its ids hold "
                f"{int(mm.sum())} media placeholders"
            )
        hidden_size = self.talker.text_projection.linear_fc2.out_features
        full = prompt.prompt_embeds.new_empty(length, hidden_size)  # (L, H)
        # Project exactly the row sets `generate` projects (all media rows, all other rows), so the GEMMs match.
        if mm.any():
            full[mm] = self.talker.hidden_projection(prompt.multimodal_hidden)  # (n_mm, H)
        full[~mm] = self.talker.text_projection(prompt.prompt_embeds[~mm])  # (L - n_mm, H)
        return full[user_mask], ids[user_mask]

    def _predict_residuals(self, state: TalkerState, code: int) -> tuple[list[int], torch.Tensor]:
        """Code predictor for codec token `code`: residual codes r1..r_{G-1} and the summed group embedding."""
        if self.predictor is not None:
            if state.last_hidden is None:
                raise ValueError("code predictor before the talker prefill ran")
            first = self.talker.get_input_embeddings()(torch.tensor([[code]], dtype=torch.long))  # (1, 1, H)
            params = state.predictor_sampler.params
            if not params.greedy:  # a seed per step from the request's own stream: reproducible with its seed
                seed = int(torch.randint(0, 2**62, (1,), generator=state.sampler.generator))
                params = replace(params, seed=seed)
            return self.predictor(torch.cat([state.last_hidden, first], dim=1), params)
        predictor = self.talker.code_predictor
        model = predictor.model
        first = self.talker.get_input_embeddings()(torch.tensor([[code]], dtype=torch.long))  # (1, 1, H)
        cache = DynamicCache(config=model.config)
        if state.last_hidden is None:
            raise ValueError("code predictor before the talker prefill ran")
        hidden = run_code_predictor(
            model, torch.cat([state.last_hidden, first], dim=1), torch.arange(2).view(1, 2), cache
        )  # (1, 2, H)
        embeds = [first]
        residuals: list[int] = []
        for j in range(self.num_code_groups - 1):
            if j > 0:
                embeds.append(model.codec_embedding[j - 1](torch.tensor([[residuals[-1]]], dtype=torch.long)))
                hidden = run_code_predictor(model, embeds[-1], torch.tensor([[1 + j]]), cache)  # (1, 1, H)
            logits = predictor.lm_head[j](hidden)[0, -1]  # (V_cp,)
            residuals.append(state.predictor_sampler.sample(logits))
        last = model.codec_embedding[self.num_code_groups - 2](torch.tensor([[residuals[-1]]], dtype=torch.long))
        embeds.append(last)  # (1, 1, H)
        return residuals, torch.cat(embeds, dim=1).sum(1, keepdim=True)  # (1, 1, H)


def take_prefill(state: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A talker state's prefill rows (P, H) and positions (4, P), taken once (both families' states): the state
    then counts them as fed."""
    if state.prefill_embeds is None or state.prefill_positions is None:
        raise ValueError("the talker prefill was already taken")
    embeds, positions = state.prefill_embeds[0], state.prefill_positions[:, 0]
    state.prefill_embeds = state.prefill_positions = None
    state.seq_len = embeds.shape[0]
    return embeds, positions


def history(state: TalkerState) -> torch.Tensor:
    """The request's generated codes (n,): a view of its buffer (a tensor built from the list each step cost
    O(codes) per request per step)."""
    return state.code_buffer[:len(state.codes)]
