"""ThinkerTask: one request in the thinker stage — prefill, then one decode per engine step.

Data flow: feed(final chunk: input_ids + encoder outputs) -> step 1: prefill, sample token 0 ->
each later step: if the pending token is final (a stop id, or max tokens) emit its text and finish;
otherwise decode it (-> its embedding for the talker + logits) and sample the next. Each output chunk
carries the text delta, `token_ids` (1,), and, when the request wants audio, `token_embeds` (1, H) for
the talker (the first chunk also carries the TalkerPrompt). The last chunk is final=True: for the
talker it means "the text ended" (the final token is never spoken, as in `generate`).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from omnimesh.engine.task import StageTask
from omnimesh.models.qwen3_omni.edges import require, talker_prompt_to_tensors
from omnimesh.models.qwen3_omni.sampling import Sampler, SamplingParams
from omnimesh.models.qwen3_omni.thinker import Qwen3OmniThinker, ThinkerState
from omnimesh.transport.frames import StageChunk
from services.llm.detokenizer import Detokenizer

EDGE = "gateway -> thinker"


class ThinkerTask(StageTask):
    def __init__(self, request_id: str, thinker: Qwen3OmniThinker, tokenizer: object, params: SamplingParams,
                 *, talker_inputs: bool, max_model_len: int):
        super().__init__(request_id)
        self.thinker = thinker
        self.sampler = Sampler(params)
        self.detok = Detokenizer(tokenizer)
        self.talker_inputs = talker_inputs
        self.max_model_len = max_model_len
        self.inputs: dict[str, torch.Tensor] | None = None
        self.state: ThinkerState | None = None
        self.pending: int | None = None  # sampled, not yet fed back
        self.first_chunk_extra: dict[str, torch.Tensor] = {}

    def close(self) -> None:
        if self.state is not None:
            self.thinker.release(self.state)
            self.state = None

    def feed(self, chunk: StageChunk) -> None:
        if self.inputs is not None:
            raise ValueError(f"{EDGE}: the thinker takes its whole prompt in one chunk")
        if not chunk.final:
            raise ValueError(f"{EDGE}: send the prompt as one final chunk")
        ids = require(chunk.tensors, "input_ids", EDGE).view(-1).long()
        if ids.numel() == 0:
            raise ValueError(f"{EDGE}: input_ids is empty")
        if ids.numel() >= self.max_model_len:
            raise ValueError(f"prompt has {ids.numel()} tokens; the thinker's max_model_len is {self.max_model_len}")
        vocab = self.thinker.config.get_text_config().vocab_size
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"{EDGE}: input_ids must be in [0, {vocab}), got [{int(ids.min())}, {int(ids.max())}]")
        self.inputs = chunk.tensors

    def ready(self) -> bool:
        return self.inputs is not None and not self.finished

    def step(self) -> list[StageChunk]:
        if self.state is None:
            return self._prefill()
        return [self._advance(self.state)]

    def _prefill(self) -> list[StageChunk]:
        t = self.inputs
        if t is None:
            raise RuntimeError("prefill before the prompt arrived")  # ready() prevents this
        deep = t.get("deepstack_embeds")
        logits, state, prompt = self.thinker.prefill(
            t["input_ids"].view(-1).long(),
            audio_embeds=t.get("audio_embeds"),
            image_embeds=t.get("image_embeds"),
            deepstack=list(deep.unbind(0)) if deep is not None and deep.numel() else None,
            image_grid_thw=t.get("image_grid_thw"),
            audio_feature_lengths=t.get("audio_feature_lengths"),
        )
        self.state = state
        self.prompt_tokens = state.seq_len
        # a prompt this long leaves only so much room in the model's context
        room = self.max_model_len - state.seq_len
        if room < self.sampler.params.max_tokens:
            self.sampler = Sampler(replace(self.sampler.params, max_tokens=room), self.sampler.generator)
        self.pending = self.sampler.sample(logits, state.history())
        self.completion_tokens = 1
        if self.talker_inputs:
            self.first_chunk_extra = talker_prompt_to_tensors(prompt)
        return [self._advance(state)]

    def _advance(self, state: ThinkerState) -> StageChunk:
        """Emit the pending token; feed it back and sample the next unless it ends the request."""
        token = self.pending
        if token is None:
            raise RuntimeError("no sampled token to advance")
        tensors: dict[str, torch.Tensor] = {"token_ids": torch.tensor([token], dtype=torch.long)}
        tensors.update(self.first_chunk_extra)
        self.first_chunk_extra = {}
        stop = self.sampler.is_stop(token)
        at_max = self.completion_tokens >= self.sampler.params.max_tokens
        if stop or at_max:
            text = (self.detok.push(token) if not stop else "") + self.detok.finish()
            self.finished = True
            self.finish_reason = "stop" if stop else "length"
            return StageChunk(tensors=tensors, text=text)
        text = self.detok.push(token)
        logits, embed = self.thinker.decode(state, token)
        if self.talker_inputs:
            tensors["token_embeds"] = embed.view(1, -1)  # (1, H)
        self.pending = self.sampler.sample(logits, state.history())
        self.completion_tokens += 1
        return StageChunk(tensors=tensors, text=text)
