"""ThinkerTask: one request in the thinker stage — its prompt, sampler, text state; stepped in batches.

Data flow: feed(final chunk: input_ids + encoder outputs) -> the `ThinkerBatcher` prepares the prompt
(embedded, media merged, positioned) and hands it to the stage's `LMEngine`, which prefills it (in chunks
when long) within continuous batches. Each time the engine returns logits for the request, `on_output`
samples one token and returns its chunk: the text delta, `token_ids` (1,), and, when the request wants
audio, `token_embeds` (1, H) for the talker (the first chunk also carries the TalkerPrompt); a token that
does not end the request is fed back as the next input row. Qwen2.5-Omni's talker reads other rows
(`Qwen3OmniThinker.reply_rows`): its prompt is every prompt row's final hidden + embedding, the first chunk
also carries `first_token`, and each later chunk's `token_embeds` is the row r_j of the token before (its
embedding + the final hidden the engine returned with this step's logits), the final chunk's included.
The final token (a stop id, a stop string, or max tokens) is never spoken: its chunk has no `token_embeds`
(Qwen2.5-Omni: only the row of the token before it) and ends the stream (final=True).
A prompt that continues an assistant message (vLLM's continue_final_message; `Qwen3OmniThinker.assistant_lead`)
gives the talker a prompt that stops at that message's `<|im_start|>assistant\n`, and the first token's chunk
carries the message's own rows before the token's: the talker speaks the whole message, as if generated.
Streaming (`stream_interval`, the stage's --stream-interval; `eager_tokens`, a request option): the first
`eager_tokens` tokens and the last leave at once, the others every `stream_interval` tokens as one chunk
(texts joined, `token_ids` (k,) and `token_embeds` (k, H) stacked): fewer messages through the gateway.
Chunks the stage's writer has not sent yet when the next one comes are merged the same way
(`ThinkerHandler.merge_outputs`, see stage_servicer), so under load the stream coalesces by itself.
`logprobs` (a sampling parameter): each token's chunk also carries its log-probability entry
(services/llm/token_logprobs.py; not for a stop id, which adds no text), merged along with the text.
`prompt_logprobs` (vLLM's): the prompt run carries each row's next prompt token as its target; the engine
scores them as it prefills (lm_shard.score_rows) and the first token's chunk carries every prompt token's
entry from the second on, with its rank (such a request skips the prefix cache: skipped rows have no scores).
`min_tokens`: the sampler picks no stop id before that many tokens, and a stop string counts only when it
completes in the token that reaches min_tokens or a later one (`StopStrings.push(armed=...)`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from omnimesh.engine.task import BatchedTask
from omnimesh.models.qwen3_omni.edges import flag, require_ids, talker_prompt_to_tensors
from omnimesh.models.qwen3_omni.lm_engine import InputRun, RunOutput
from omnimesh.models.qwen3_omni.sampling import Sampler, SamplingParams
from omnimesh.models.qwen3_omni.thinker import PreparedPrompt, Qwen3OmniThinker
from omnimesh.transport.frames import StageChunk
from services.llm.detokenizer import Detokenizer, StopStrings
from services.llm.prefix_keys import prompt_prefix_keys
from services.llm.sampling import bad_word_ids
from services.llm.structured_output import Constraint, Grammars
from omnimesh.v1 import stage_pb2
from services.llm.token_logprobs import TokenBytes, prompt_logprobs, token_logprob

EDGE = "gateway -> thinker"
MERGED = ("token_ids", "token_embeds")  # what several tokens' chunks stack into one (along dim 0)


class ThinkerTask(BatchedTask):
    def __init__(self, request_id: str, thinker: Qwen3OmniThinker, tokenizer: object, params: SamplingParams,
                 *, talker_inputs: bool, max_model_len: int, batcher: object = None, stream_interval: int = 1,
                 eager_tokens: int = 1, token_bytes: TokenBytes | None = None, prefix_caching: bool = False,
                 logprobs_mode: str = "raw_logprobs"):
        super().__init__(request_id, batcher)
        self.thinker = thinker
        self.sampler = Sampler(params)
        self.logprobs_mode = logprobs_mode  # --logprobs-mode (token_logprobs.LOGPROBS_MODES)
        self.sampler.keep_processed = logprobs_mode.startswith("processed") and params.logprobs is not None
        self.detok = Detokenizer(tokenizer, params.skip_special_tokens)
        self.token_bytes = token_bytes or TokenBytes(tokenizer)  # for logprobs: one per handler, cached
        self.stops = StopStrings(params.stop, include_stop=params.include_stop_str_in_output)
        self.talker_inputs = talker_inputs
        self.max_model_len = max_model_len
        self.prefix_caching = prefix_caching  # its engine caches prefixes: its prompt run names its rows' keys
        self.inputs: dict[str, torch.Tensor] | None = None
        self.prompt: PreparedPrompt | None = None
        self.token_ids: list[int] = []  # prompt + generated tokens (what the repetition penalty sees)
        self._history = torch.empty(0, dtype=torch.long)  # the same ids in a buffer of max_model_len (`history`)
        self.captured: list[torch.Tensor] = []  # hidden at accept_hidden_layer of the prompt's media rows
        self._fed_embed: torch.Tensor | None = None  # Qwen2.5-Omni: the embedding of the token fed last (for r_j)
        if stream_interval < 1 or eager_tokens < 1:
            raise ValueError(f"stream_interval and eager_tokens must be >= 1, got {stream_interval}, {eager_tokens}")
        self.stream_interval = stream_interval
        self.eager_tokens = eager_tokens
        self.held: list[StageChunk] = []  # one chunk per token not sent yet (see `_send`)
        self.structured: str | None = None  # the structured_output option (services/llm/structured_output.py)
        self.grammars: Grammars | None = None  # the stage's compiler for it (its handler's)
        self.structured_after: str | None = None  # the grammar waits until the text has passed this (reasoning)
        self._reasoned = ""  # the text so far, while it waits (only as much as can hold the marker)
        self.constraint: Constraint | None = None  # ... compiled by `prompt_run`
        self.bad_words: tuple[str, ...] = ()  # vLLM's bad_words as texts (`bad_word_texts`), tokenized there too
        self.prompt_scores: list[stage_pb2.TokenLogprob] = []  # prompt_logprobs: the prefill's, until the first token
        self.requested_stops: frozenset[int] = frozenset()  # the request's stop_token_ids (stop_reason names them)
        self.own_stops: frozenset[int] = frozenset()  # the model's own stop ids (they leave stop_reason unset)

    def feed(self, chunk: StageChunk) -> None:
        if self.inputs is not None:
            raise ValueError(f"{EDGE}: the thinker takes its whole prompt in one chunk")
        if not chunk.final:
            raise ValueError(f"{EDGE}: send the prompt as one final chunk")
        ids = require_ids(chunk.tensors, "input_ids", EDGE)
        if ids.dim() not in (1, 2) or (ids.dim() == 2 and ids.shape[0] != 1):
            raise ValueError(f"{EDGE}: input_ids must be one sequence, (n,) or (1, n), got {tuple(ids.shape)}")
        ids = ids.view(-1)
        if ids.numel() == 0:
            raise ValueError(f"{EDGE}: input_ids is empty")
        if ids.numel() >= self.max_model_len:
            raise ValueError(f"prompt has {ids.numel()} tokens; the thinker's max_model_len is {self.max_model_len} "
                             f"(prompt + at least one generated token must fit)")
        vocab = self.thinker.config.get_text_config().vocab_size
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"{EDGE}: input_ids must be in [0, {vocab}), got [{int(ids.min())}, {int(ids.max())}]")
        self.inputs = chunk.tensors

    def ready(self) -> bool:
        return self.inputs is not None and not self.finished

    def urgent(self) -> bool:
        """Until its first `eager_tokens` tokens: the gateway sets them to what the talker's first codes need
        (1 for a text-only request: its first token)."""
        return self.completion_tokens < self.eager_tokens

    def close(self) -> None:
        super().close()
        self.inputs = self.prompt = None  # the encoder's tensors may be slots of its shm arena: free them now
        self._history = torch.empty(0, dtype=torch.long)
        self.captured = []

    def prompt_run(self) -> InputRun:
        """Prepare the prompt (raises ValueError for media that do not match it): the first input run."""
        t = self.inputs
        if t is None:
            raise RuntimeError("prefill before the prompt arrived")  # ready() prevents this
        prompt = self.thinker.prepare(
            t["input_ids"].view(-1).long(),
            audio_embeds=t.get("audio_embeds"),
            image_embeds=t.get("image_embeds"),
            deepstack=_layers(t.get("deepstack_embeds")),
            image_grid_thw=t.get("image_grid_thw"),
            audio_feature_lengths=t.get("audio_feature_lengths"),
            video_embeds=t.get("video_embeds"),
            video_deepstack=_layers(t.get("video_deepstack_embeds")),
            video_grid_thw=t.get("video_grid_thw"),
            video_second_per_grid=t.get("video_second_per_grid"),
            use_audio_in_video=flag(t, "use_audio_in_video"),
        )
        if self.structured is not None and self.constraint is None:
            if self.grammars is None:
                raise RuntimeError("a structured output without the stage's grammar compiler")
            self.constraint = self.grammars.constraint(self.structured)  # ValueError: this request fails
        self.prompt = prompt
        self.token_ids = prompt.ids.tolist()
        self.prompt_tokens = len(self.token_ids)
        self._history = torch.empty(max(self.max_model_len, self.prompt_tokens + 1), dtype=torch.long)
        self._history[:self.prompt_tokens] = prompt.ids.view(-1)
        room = self.max_model_len - self.prompt_tokens  # a long prompt leaves only so much room
        p, changes = self.sampler.params, dict[str, Any]()
        if room < p.max_tokens:  # and min_tokens with it: no request can ask for more than fits
            changes.update(max_tokens=room, min_tokens=min(p.min_tokens, room))
        if self.bad_words:  # vLLM's bad_words, tokenized here on the compute thread
            changes["bad_words_ids"], self.bad_words = bad_word_ids(self.detok.tokenizer, self.bad_words), ()
        if changes:  # the sampler built once more, keeping its generator
            self.sampler = Sampler(replace(p, **changes), self.sampler.generator)
        capture = self.thinker.capture_rows(prompt) if self.talker_inputs else None
        keys = targets = None
        k = self.sampler.params.prompt_logprobs
        if k is not None:  # each row scored against the prompt token after it (the last row: the first sample)
            targets = torch.cat([prompt.ids.view(-1)[1:].long(), torch.tensor([-1])])
        elif self.prefix_caching:
            # token ids and positions, media rows by their items' digests (prefix_keys.py); Qwen2.5-Omni's speech
            # keys every row as captured: its talker reads every prompt row's hidden, which its blocks then keep
            # (not with prompt logprobs: rows the cache served would have no scores, as vLLM skips the cache)
            hashes = {name: t.get(name) for name in ("audio_hashes", "image_hashes", "video_hashes")}
            keys = prompt_prefix_keys(self.thinker, prompt, hashes, captured=capture is not None,
                                      all_captured=capture is not None and self.thinker.reply_rows)
        return InputRun(prompt.embeds, prompt.positions, prompt.visual, prompt.deepstack, capture, prefix_keys=keys,
                        targets=targets, score_k=k or 0)

    def on_output(self, out: RunOutput) -> tuple[list[StageChunk], InputRun | None]:
        """The engine ran some of this request's rows: sample when it returned logits. Returns the chunks to
        emit and the next input row (None when the request ended or no token was sampled)."""
        if out.captured is not None:
            self.captured.append(out.captured)
        if out.scores is not None:
            self.prompt_scores.extend(prompt_logprobs(out.scores, self.token_bytes))
        self.cached_tokens = out.cached_tokens
        if out.logits is None:
            return [], None  # a prefill chunk (or a recompute after preemption): no token yet
        prompt = self.prompt
        if prompt is None:
            raise RuntimeError("logits before the prompt was prepared")
        tensors: dict[str, torch.Tensor] = {}
        spoken: list[torch.Tensor] = []  # this chunk's rows of text for the talker
        first = self.completion_tokens == 0
        if first and self.talker_inputs:
            hidden = torch.cat(self.captured) if self.captured else prompt.embeds.new_zeros(0, prompt.embeds.shape[1])
            lead = self.thinker.assistant_lead(prompt.ids)  # a continued assistant message: spoken first
            tensors.update(talker_prompt_to_tensors(self.thinker.talker_prompt(prompt, hidden, lead)))
            if lead:
                spoken.append(self.thinker.lead_rows(prompt, hidden, lead))  # (lead, H)
            self.captured = []
        elif self.talker_inputs and self.thinker.reply_rows and self._fed_embed is not None:
            spoken.append(self.thinker.reply_row(self._fed_embed, out.last_hidden))  # the previous token's r_j
        grammar = self.constraint if self.structured_after is None else None  # none yet while it reasons
        grammar_done = grammar is not None and grammar.complete
        if grammar is None:
            token = self.sampler.sample(out.logits, self.history)
        elif grammar_done:  # the grammar takes nothing more: the answer ends here
            token = grammar.stop_id
        else:
            token = self.sampler.sample(grammar.allowed_logits(out.logits), self.history)
            grammar.accept(token)
        self.completion_tokens += 1
        tensors["token_ids"] = torch.tensor([token], dtype=torch.long)
        if first and self.talker_inputs and self.thinker.reply_rows and "first_token" not in tensors:
            tensors["first_token"] = tensors["token_ids"]  # Qwen2.5-Omni's talker positions its prompt with it
            # (a continued message's: its first token, already in the prompt's tensors)
        stop = grammar_done or self.sampler.is_stop(token)
        at_max = self.completion_tokens >= self.sampler.params.max_tokens
        k = self.sampler.params.logprobs
        logprobs = []
        if k is not None and not stop:
            scores = self.sampler.processed if self.sampler.processed is not None else out.logits
            logprobs = [token_logprob(scores, token, k, self.token_bytes, self.logprobs_mode.endswith("logprobs"))]
        raw = "" if stop else self.detok.push(token)
        if stop or at_max:
            raw += self.detok.finish()
        if self.structured_after is not None:  # reasoning: does the answer (and its grammar) start now?
            self._reasoned += raw
            if self.structured_after in self._reasoned:
                self.structured_after, self._reasoned = None, ""
            else:
                self._reasoned = self._reasoned[-len(self.structured_after):]
        text, stop_str = self.stops.push(raw, armed=self.completion_tokens >= self.sampler.params.min_tokens)
        scored, self.prompt_scores = self.prompt_scores, []  # all of them by the first token: on its chunk
        if stop or at_max or stop_str:
            if not stop_str:
                text += self.stops.finish()  # release held-back text (never after a stop-string match)
            self.finished = True
            self.finish_reason = "stop" if (stop or stop_str) else "length"
            if stop_str:
                self.stop_reason = self.stops.matched
            elif stop and not grammar_done and token in self.requested_stops and token not in self.own_stops:
                self.stop_reason = token  # vLLM's: a request's stop id (the model's own EOS says nothing)
            if spoken:
                tensors["token_embeds"] = torch.cat(spoken) if len(spoken) > 1 else spoken[0]
            return self._send(StageChunk(tensors=tensors, text=text, logprobs=logprobs, prompt_logprobs=scored)), None
        embed, positions = self.thinker.token_input(token, len(self.token_ids), prompt.rope_delta)
        self._history[len(self.token_ids)] = token
        self.token_ids.append(token)
        if self.talker_inputs and self.thinker.reply_rows:  # its row r_j leaves with the next token's chunk
            self._fed_embed = embed
            if spoken:
                tensors["token_embeds"] = spoken[0]  # (1, H)
        elif self.talker_inputs:
            spoken.append(embed.view(1, -1))
            tensors["token_embeds"] = torch.cat(spoken) if len(spoken) > 1 else spoken[0]  # (k, H)
        return (self._send(StageChunk(tensors=tensors, text=text, logprobs=logprobs, prompt_logprobs=scored)),
                InputRun(embed.view(1, -1), positions))

    @property
    def history(self) -> torch.Tensor:
        """The prompt and generated ids (n,): a view of a buffer written once per token, so a step costs the same
        however long the prompt (a tensor built from the list each step cost O(prompt) per request)."""
        return self._history[:len(self.token_ids)]

    def _send(self, chunk: StageChunk) -> list[StageChunk]:
        """This token's chunk goes out now (the first `eager_tokens` tokens, the last one, every
        `stream_interval`-th) together with the tokens held before it, as ONE chunk: texts joined,
        `token_ids` (k,) and `token_embeds` (k, H) stacked; else it is held."""
        self.held.append(chunk)
        if not (self.finished or self.completion_tokens <= self.eager_tokens
                or len(self.held) >= self.stream_interval):
            return []
        held, self.held = self.held, []
        return [merge_token_chunks(held)]


def merge_token_chunks(chunks: list[StageChunk]) -> StageChunk:
    """Consecutive token chunks of one request as ONE chunk: texts and logprobs joined, `token_ids` (k,) and
    `token_embeds` (k, H) stacked, any other tensor (the talker prompt, on the stream's first chunk) kept,
    final if the last one is. What the talker and the gateway read from it is what they read from the
    chunks one by one; two chunks carrying the same other tensor cannot merge (ValueError)."""
    if len(chunks) == 1:
        return chunks[0]
    tensors: dict[str, torch.Tensor] = {}
    stacked: dict[str, list[torch.Tensor]] = {name: [] for name in MERGED}
    for chunk in chunks:
        for name, tensor in chunk.tensors.items():
            if name in stacked:
                stacked[name].append(tensor)
            elif name in tensors:
                raise ValueError(f"two chunks both carry {name!r}: they cannot merge")
            else:
                tensors[name] = tensor
    tensors.update({name: torch.cat(parts) for name, parts in stacked.items() if parts})
    return StageChunk(tensors=tensors, text="".join(c.text for c in chunks), final=chunks[-1].final,
                      logprobs=[entry for c in chunks for entry in c.logprobs],
                      prompt_logprobs=[entry for c in chunks for entry in c.prompt_logprobs])


def _layers(deep: torch.Tensor | None) -> list[torch.Tensor] | None:
    """A stacked deepstack tensor (k, n, H) from the encoder edge -> its k layers (None when empty)."""
    return list(deep.unbind(0)) if deep is not None and deep.numel() else None
