"""The talker of Qwen2.5-Omni, step-wise and request-safe, fed the thinker's rows as they are made.

Role: turns the thinker's prompt and generated text into codec ids for ONE request (one stream, 50 codes a
second of speech), exactly as `Qwen2_5OmniForConditionalGeneration.generate` does, but with the text arriving
token by token. Holds `talker.thinker_to_talker_proj` and `talker.model.embed_tokens` (the codec table, in the
thinker's width); the decoder + codec head run behind an `LMBackend` (transformers' modules in-process, or the
stage's pp x tp ranks: `ParallelTextModel` runs this dense Qwen2 LM as it runs the thinker's).

What comes from the thinker, all in the thinker's embedding width E:
    prompt rows (L, E): final-norm hidden + layer-0 embedding at every prompt position, the media rows'
        embeddings zeroed (their hidden kept), as `generate` builds them
    reply row r_j (E,): the same sum at generated token j, for j = 0 .. n-2 (the final token n-1 is never fed
        back to the thinker, so it has no hidden)
    `TextRows`: the thinker's embeddings of each speaker's bos token, of tts_text_end and of tts_text_pad (the
        talker stage reads those rows of the thinker's table, never the whole table)

Data flow (the edge's `TalkerPrompt` carries the prompt ids, the prompt rows as `prompt_embeds`, generated token
0's id as `first_token` and the media grids; thinker.py builds it):
    start(TalkerPrompt, speaker, r_0) -> Talker25State, prefill built (not run):
        [prompt rows; bos(speaker); r_0] (L + 2, E), + codec_pad's and codec_bos's embeddings on the last two,
        -> thinker_to_talker_proj -> (L + 2, H); positions: the M-RoPE index of [prompt ids, the speaker's bos
        id, generated token 0] (transformers' own for Qwen2.5-Omni, mrope.py)
    push_text(state, r_j) for j = 1, 2, ...;  finish_text(state): the thinker's final token came: tts_text_end
        is the next text entry, tts_text_pad every one after it
    step(state) -> (1,) codec id | None: the first call runs the prefill and samples c_0 (emits nothing); call
        g + 1 feeds proj(codec_embed(c_g) + text entry g), samples c_{g+1} and emits c_g. Text entry g is
        r_{g+1}: decode step g needs the thinker to have fed generated token g + 1 (`can_step`).
    The request ends at the first stop id (codec pad or codec end, never emitted) or max tokens.
The talker stage's batcher (services/llm/talker_batcher.py) drives the same state through `prefill_input`,
`needs_predict` (here: the next decode's text entry is known), `next_inputs` (B requests' decode rows at once;
the place Qwen3-Omni's code predictor runs) and `sample_next` / `sample_next_batch`.
Sampling: `generate`'s talker defaults (`talker_sampling_params`); the repetition penalty reads the talker's
whole input ids, its prompt's codec mask / pad / bos ids included, as `generate` passes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from transformers import Qwen2_5OmniConfig

from omnimesh.models.qwen3_omni.lm_backend import HFBackend, LMBackend
from omnimesh.models.qwen3_omni.mrope import MropeSpec, decode_positions_batch, prompt_positions
from omnimesh.models.qwen3_omni.sampling import Sampler, SamplingParams, greedy_batch
from omnimesh.models.qwen3_omni.talker import take_prefill
from omnimesh.models.qwen3_omni.thinker import TalkerPrompt

DEFAULT_SPEAKER = "chelsie"  # `generate`'s default voice


def talker_sampling_params(config: Qwen2_5OmniConfig, do_sample: bool = True, max_tokens: int = 4096,
                           seed: int | None = None, temperature: float = 0.9, top_k: int = 40, top_p: float = 0.8,
                           repetition_penalty: float = 1.05) -> SamplingParams:
    """`generate`'s talker defaults: sampled, T 0.9, top-k 40, top-p 0.8, penalty 1.05; it stops at the codec
    pad or end id (`talker_eos_token_id`) and never picks the codec bos. Nor, unlike `generate`, any other id
    token2wav cannot voice (at or above its DiT's `num_embeds`: the codec's control ids besides the stops), which
    would end `generate` in an index error and the request here in the vocoder's refusal."""
    tk: Any = config.talker_config
    vocab = int(tk.vocab_size)
    stops = (int(tk.tts_codec_pad_token_id), int(tk.tts_codec_end_token_id))
    dit = getattr(getattr(config, "token2wav_config", None), "dit_config", None)
    voiced = int(dit.num_embeds) if dit is not None else vocab
    unvoiced = tuple(i for i in range(voiced, vocab) if i not in stops)
    return SamplingParams(
        temperature=temperature if do_sample else 0.0, top_p=top_p, top_k=top_k, seed=seed, max_tokens=max_tokens,
        repetition_penalty=repetition_penalty, stop_token_ids=stops,
        suppress_tokens=tuple(sorted({int(tk.tts_codec_start_token_id), *unvoiced})), vocab_size=vocab,
    )


@dataclass(frozen=True)
class TextRows:
    """The rows of the thinker's embedding table the talker reads: per speaker (lower-cased name) its bos id and
    row, and the rows of tts_text_end and tts_text_pad, each (E,)."""

    speakers: dict[str, tuple[int, torch.Tensor]]
    text_end: torch.Tensor
    text_pad: torch.Tensor


@dataclass
class Talker25State:
    """One request's talker state; owned by the caller, never shared."""

    sampler: Sampler
    handle: Any  # the backend's handle for this request's KV cache
    prefill_embeds: torch.Tensor | None  # (1, P, H) until the first step runs it
    prefill_positions: torch.Tensor | None  # (4, 1, P)
    rope_delta: int
    ids: torch.Tensor  # the talker's input ids so far (its prompt's codec ids, then its codes): the penalty's history
    n_ids: int
    seq_len: int = 0  # tokens in the KV cache
    text: list[torch.Tensor] = field(default_factory=list)  # text entries (E,), entry g used at decode step g
    text_done: bool = False
    codes: list[int] = field(default_factory=list)  # sampled codec ids c_0, c_1, ...
    steps_done: int = 0
    finished: bool = False


class Qwen2_5OmniTalker:
    """Step-wise Qwen2.5-Omni talker: projection and codec table here, decoder + codec head behind `backend`."""

    default_speaker = DEFAULT_SPEAKER
    num_code_groups = 1  # one codec stream (Qwen3-Omni's talker emits groups of 16)

    def __init__(self, proj: nn.Module, codec_embed: nn.Module, backend: LMBackend, config: Qwen2_5OmniConfig,
                 text_rows: TextRows) -> None:
        self.proj = proj
        self.codec_embed = codec_embed
        self.backend = backend
        self.config = config
        self.text_rows = text_rows
        tk: Any = config.talker_config
        self.codec_mask, self.codec_pad, self.codec_bos = (
            int(tk.tts_codec_mask_token_id), int(tk.tts_codec_pad_token_id), int(tk.tts_codec_start_token_id))
        tc: Any = config.thinker_config
        self.media_ids = (int(tc.audio_token_id), int(tc.image_token_id), int(tc.video_token_id))
        self.mrope = MropeSpec.for_talker(config)

    @property
    def speakers(self) -> list[str]:
        return sorted(self.text_rows.speakers)

    @property
    def dtype(self) -> torch.dtype:
        """What the talker computes in (its projection's dtype): the thinker's tensors are cast to it."""
        return next(self.proj.parameters()).dtype

    @classmethod
    def from_hf(cls, model: Any) -> Qwen2_5OmniTalker:
        """Over a whole transformers `Qwen2_5OmniForConditionalGeneration` with its speakers loaded (the reference
        path: its talker's modules run in this process)."""
        talker, table = model.talker, model.thinker.get_input_embeddings()
        tk: Any = model.config.talker_config

        def row(token: int) -> torch.Tensor:
            return table(torch.tensor([token]))[0].detach()

        speakers = {name.lower(): (int(p["bos_token"]), row(int(p["bos_token"]))) for name, p in model.speaker_map.items()}
        rows = TextRows(speakers, row(int(tk.tts_text_end_token_id)), row(int(tk.tts_text_pad_token_id)))
        return cls(talker.thinker_to_talker_proj, talker.model.embed_tokens,
                   HFBackend(talker.model, talker.codec_head), model.config, rows)

    def prompt_rows(self, ids: torch.Tensor, embeds: torch.Tensor, last_hidden: torch.Tensor) -> torch.Tensor:
        """What the thinker sends for its prompt: final hidden (L, E) + layer-0 embeddings (L, E), the media rows'
        embeddings zeroed, as `generate` builds them."""
        media = torch.zeros_like(ids, dtype=torch.bool)
        for media_id in self.media_ids:
            media |= ids == media_id
        return last_hidden + embeds.masked_fill(media.view(-1, 1), 0.0)  # (L, E)

    @torch.no_grad()
    def start(self, prompt: TalkerPrompt, speaker: str, first_reply: torch.Tensor, params: SamplingParams | None = None,
              generator: torch.Generator | None = None) -> Talker25State:
        """Build the prefill exactly as `generate`; `first_reply` (E,) is r_0, generated token 0's row (its id is
        the prompt's `first_token`)."""
        voice = self.text_rows.speakers.get(speaker.lower())
        if voice is None:
            raise ValueError(f"unknown speaker {speaker!r}; valid speakers: {self.speakers}")
        if prompt.first_token is None:
            raise ValueError("thinker -> talker: the prompt has no first_token (generated token 0's id)")
        ids, prompt_rows, first_token = prompt.input_ids.view(-1).long(), prompt.prompt_embeds, int(prompt.first_token)
        if prompt_rows.shape[0] != ids.numel():
            raise ValueError(f"{prompt_rows.shape[0]} prompt rows for {ids.numel()} prompt ids")
        seconds = prompt.video_second_per_grid
        bos_id, bos_row = voice
        rows = torch.cat([prompt_rows, bos_row.view(1, -1), first_reply.view(1, -1)])  # (L + 2, E)
        codec = self.codec_embed(torch.tensor([self.codec_pad, self.codec_bos]))  # (2, E)
        rows = torch.cat([rows[:-2], rows[-2:] + codec])  # generate adds them in place to the last two rows
        text_ids = torch.cat([ids, torch.tensor([bos_id, first_token])])  # (L + 2,)
        positions, rope_delta = prompt_positions(
            text_ids, self.mrope, prompt.image_grid_thw, prompt.audio_feature_lengths, prompt.video_grid_thw,
            None if seconds is None else seconds.view(-1).float(), prompt.use_audio_in_video)
        params = params if params is not None else talker_sampling_params(self.config)
        history = torch.empty(ids.numel() + 2 + 64, dtype=torch.long)
        history[:ids.numel()] = self.codec_mask
        history[ids.numel():ids.numel() + 2] = torch.tensor([self.codec_pad, self.codec_bos])
        return Talker25State(sampler=Sampler(params, generator), handle=self.backend.open(),
                             prefill_embeds=self.proj(rows).unsqueeze(0), prefill_positions=positions,
                             rope_delta=rope_delta, ids=history, n_ids=ids.numel() + 2)

    def push_text(self, state: Talker25State, reply_row: torch.Tensor) -> None:
        """Append r_j (E,) for the next generated (non-final) token j >= 1."""
        if state.text_done:
            raise ValueError("push_text after finish_text: the thinker's text already ended")
        state.text.append(reply_row.view(-1))

    def finish_text(self, state: Talker25State) -> None:
        """The thinker sampled its final token: tts_text_end is the next entry, tts_text_pad every later one."""
        if state.text_done:
            raise ValueError("finish_text called twice")
        state.text.append(self.text_rows.text_end)
        state.text_done = True

    def release(self, state: Talker25State) -> None:
        self.backend.close(state.handle)

    def can_step(self, state: Talker25State) -> bool:
        """The prefill is pending, or text entry g of the next decode is known (or past the text's end)."""
        if state.finished:
            return False
        return state.prefill_embeds is not None or state.steps_done < len(state.text) or state.text_done

    @torch.no_grad()
    def step(self, state: Talker25State) -> torch.Tensor | None:
        """One talker step in this process (the stage's batcher makes the same calls for many requests): the
        prefill (returns None), else one decode that returns the previous code (1,)."""
        if not self.can_step(state):
            raise ValueError("talker step not possible: " + (
                "the request finished" if state.finished else
                f"text entry {state.steps_done} is not known yet (push_text or finish_text first)"))
        if state.prefill_embeds is not None:
            embeds, positions = take_prefill(state)  # (P, H), (4, P)
            out = self.backend.forward(state.handle, embeds.unsqueeze(0), positions.unsqueeze(1))
            self.sample_next(state, out.logits)
            return None
        codes, rows, positions = self.next_inputs([state])  # (1, 1), (1, H), (4, 1)
        out = self.backend.forward(state.handle, rows.unsqueeze(0), positions.unsqueeze(1))
        self.sample_next(state, out.logits)
        return codes[0]

    # --- the batched stage path (services/llm/talker_batcher.py)

    def prefill_input(self, state: Talker25State) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefill rows (P, H) and positions (4, P); the state then counts them as fed."""
        return take_prefill(state)

    def needs_predict(self, state: Talker25State) -> bool:
        """The prefill ran, c_g is sampled and the next decode's text entry is known: `next_inputs` can run."""
        return state.prefill_embeds is None and bool(state.codes) and self.can_step(state)

    @torch.no_grad()
    def next_inputs(self, states: Sequence[Talker25State]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """B requests' next decodes: (codes (B, 1) of c_g, decoder rows (B, H), positions (4, B)); each row is what
        `step` feeds for its request."""
        codes = torch.tensor([[s.codes[-1]] for s in states], dtype=torch.long)  # (B, 1)
        texts = [s.text[s.steps_done] if s.steps_done < len(s.text) else self.text_rows.text_pad for s in states]
        rows = self.proj(self.codec_embed(codes[:, 0]) + torch.stack(texts))  # (B, H)
        positions = decode_positions_batch([s.seq_len for s in states], [s.rope_delta for s in states])  # (4, B)
        for state in states:
            state.steps_done += 1
            state.seq_len += 1
        return codes, rows, positions

    def sample_next_batch(self, states: Sequence[Talker25State], logits: torch.Tensor, last_hidden: Any = None) -> bool:
        """`sample_next` for B greedy requests in one go (`greedy_batch`); False (nothing taken) when they are not."""
        tokens = greedy_batch([s.sampler for s in states], logits, [s.ids[:s.n_ids] for s in states])
        if tokens is None:
            return False
        for state, token in zip(states, tokens):
            self._took(state, token)
        return True

    def sample_next(self, state: Talker25State, logits: torch.Tensor, last_hidden: Any = None) -> None:
        """The decoder's logits (V,) for the latest input: sample the next codec id (`last_hidden` unused: no code
        predictor reads it here)."""
        self._took(state, state.sampler.sample(logits, state.ids[:state.n_ids]))

    def final_group(self, state: Talker25State) -> torch.Tensor | None:
        """A request that ended at max tokens speaks its last code too (`generate` hands token2wav every code up to
        the first stop id); one that ended at a stop id has nothing more."""
        if not state.finished or not state.codes or state.sampler.is_stop(state.codes[-1]):
            return None
        return torch.tensor([state.codes[-1]], dtype=torch.long)

    def _took(self, state: Talker25State, token: int) -> None:
        if state.n_ids == state.ids.numel():  # doubled when full: amortised O(1) per code
            state.ids = torch.cat([state.ids, torch.empty_like(state.ids)])
        state.ids[state.n_ids] = token
        state.n_ids += 1
        state.codes.append(token)
        if state.sampler.is_stop(token) or len(state.codes) >= state.sampler.params.max_tokens:
            state.finished = True


def thinker_rows(model_dir: Path, tokens: Sequence[int], dtype: torch.dtype, width: int) -> dict[int, torch.Tensor]:
    """Rows of the checkpoint's thinker embedding table (`thinker.model.embed_tokens.weight`), read one by one
    (never the whole table: 152064 x 3584 on the real model) -> {token: (width,)}; random rows under
    --load-format dummy."""
    from omnimesh.models.loader import checkpoint_files, dummy_weights, fill_dummy

    key = "thinker.model.embed_tokens.weight"
    if dummy_weights():
        rows = {int(t): torch.empty(width, dtype=dtype) for t in tokens}
        for t, row in rows.items():
            fill_dummy(row, f"{key}[{t}]")
        return rows
    files = checkpoint_files(Path(model_dir))
    if key not in files:
        raise ValueError(f"{model_dir} has no {key}: the talker reads the speakers' and text markers' rows from it")
    with safe_open(str(files[key]), framework="pt") as f:
        table = f.get_slice(key)
        return {int(t): table[int(t):int(t) + 1][0].to(dtype) for t in tokens}


def load_qwen2_5_talker(model_dir: Path, dtype: torch.dtype, backend: LMBackend) -> Qwen2_5OmniTalker:
    """The talker stage's parts: the projection and codec table (checked loads of `talker.thinker_to_talker_proj.*`
    and `talker.model.embed_tokens.*`), the speakers (spk_dict.pt) and their thinker rows; the decoder is
    `backend` (the stage's pp x tp ranks)."""
    from omnimesh.models.loader import build_submodule
    from omnimesh.models.qwen2_5_omni.token2wav import load_speakers
    from omnimesh.models.model_config import load_config

    config = load_config(model_dir)
    tk: Any = config.talker_config
    proj = build_submodule(model_dir, config_path="talker_config", prefix="talker.thinker_to_talker_proj.",
                           factory=lambda c: nn.Linear(c.embedding_size, c.hidden_size), dtype=dtype)
    codec = build_submodule(model_dir, config_path="talker_config", prefix="talker.model.embed_tokens.",
                            factory=lambda c: nn.Embedding(c.vocab_size, c.embedding_size), dtype=dtype)
    speakers = {name: int(p["bos_token"]) for name, p in load_speakers(model_dir).items()}
    end, pad = int(tk.tts_text_end_token_id), int(tk.tts_text_pad_token_id)
    rows = thinker_rows(model_dir, [*speakers.values(), end, pad], dtype, int(tk.embedding_size))
    text = TextRows({name: (bos, rows[bos]) for name, bos in speakers.items()}, rows[end], rows[pad])
    return Qwen2_5OmniTalker(proj, codec, backend, config, text)
