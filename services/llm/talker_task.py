"""TalkerTask: one request in the talker stage — speaks the thinker's text as codec code groups.

`talker` is a `Qwen3OmniTalker`, or a `Qwen2_5OmniTalker` (one codec stream: groups of one code; its
`token_embeds` rows are the thinker's r_j, see qwen2_5_omni/talker.py); both take the same calls here.

Data flow: thinker chunks arrive (async: one per thinker token; whole: all at once). The first carries the
TalkerPrompt and the first spoken token's embedding -> `talker.start`; later `token_embeds` ->
`push_text`; the final chunk -> `finish_text`. The `TalkerBatcher` then steps it in continuous batches:
the prefill rows go to the stage's `LMEngine`; each time the engine returns logits, the next codec token
c_g is sampled; once text entry g is known the code predictor (one call for all requests of a step) gives
the residual codes, the group [c_g, r1..] joins the request's outgoing codes and the group's summed
embedding + text entry g becomes the next decoder input. A thinker that spoke nothing gives no audio.

Output chunking (`chunks`, a code_windows schedule: groups per chunk, the last entry repeating; default 1 =
every group at once): the gateway sets it to the vocoder's decode windows, which cannot start before a
window is whole anyway, so the codes of a window travel as one `codes` (num_code_groups, n) chunk instead
of n messages through the gateway, with no later audio. The last chunk carries what is left when the
request ends.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from omnimesh.engine.task import BatchedTask
from omnimesh.models.qwen3_omni.code_windows import window_size
from omnimesh.models.qwen3_omni.edges import talker_prompt_from_tensors
from omnimesh.models.qwen3_omni.sampling import Sampler, SamplingParams
from omnimesh.models.qwen3_omni.talker import TalkerState
from omnimesh.models.qwen3_omni.thinker import TalkerPrompt
from omnimesh.transport.frames import StageChunk

EDGE = "thinker -> talker"
EMBEDDINGS = ("prompt_embeds", "multimodal_hidden", "tts_embeds", "token_embeds")  # what the projections read


def in_dtype(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The thinker's embeddings and hidden states in the talker's dtype: a thinker serving in another dtype
    (bf16 on a GPU, a float32 talker on a CPU host) would otherwise meet the projections with mixed dtypes. The
    other tensors (ids, grid sizes, seconds per grid) keep theirs; nothing is copied when the dtypes agree."""
    if all(tensors[k].dtype == dtype for k in EMBEDDINGS if k in tensors):
        return tensors
    return {k: v.to(dtype) if k in EMBEDDINGS else v for k, v in tensors.items()}


class TalkerTask(BatchedTask):
    def __init__(self, request_id: str, talker: Any, speaker: str, params: SamplingParams,
                 *, max_model_len: int = 0, batcher: object = None, chunks: tuple[int, ...] = (1,)):
        super().__init__(request_id, batcher)
        if speaker.lower() not in talker.speakers:
            raise ValueError(f"unknown speaker {speaker!r}; valid speakers: {', '.join(sorted(talker.speakers))}")
        self.talker = talker
        self.dtype = talker.dtype  # what the thinker's tensors are cast to, read once per request
        self.speaker = speaker
        self.params = params
        self.max_model_len = max_model_len  # 0: no cap beyond max_tokens
        self.prompt: TalkerPrompt | None = None
        self.state: TalkerState | None = None
        self.text_ended = False
        self.queued = False  # the prefill went to the engine
        self.awaiting = False  # an input row is in the engine: wait for its logits before predicting again
        if not chunks or min(chunks) < 1:
            raise ValueError(f"codes per chunk must be >= 1, got {chunks}")
        self.chunks = chunks
        self.held: list[torch.Tensor] = []  # code groups (G, 1) not sent yet
        self.sent_chunks = 0

    def feed(self, chunk: StageChunk) -> None:
        if self.text_ended:
            raise ValueError(f"{EDGE}: chunk {chunk.seq} after the final chunk")
        tensors = in_dtype(chunk.tensors, self.dtype)
        if self.prompt is None:
            self.prompt = talker_prompt_from_tensors(tensors)
            self.prompt_tokens = int(self.prompt.input_ids.numel())
        embeds = tensors.get("token_embeds")
        for row in embeds.unbind(0) if embeds is not None else ():
            if self.state is None:
                self._start(row)
            else:
                self.talker.push_text(self.state, row)
        if chunk.final:
            self.text_ended = True
            if self.state is not None:
                self.talker.finish_text(self.state)

    def _start(self, first_text_embed) -> None:  # noqa: ANN001 - (H,) tensor
        assert self.prompt is not None
        state = self.talker.start(self.prompt, self.speaker, first_text_embed, self.params)
        if self.max_model_len and state.prefill_embeds is not None:
            room = self.max_model_len - state.prefill_embeds.shape[1]
            if room < 1:
                raise ValueError(f"the talker prompt has {state.prefill_embeds.shape[1]} rows; the talker's "
                                 f"max_model_len is {self.max_model_len}")
            p = state.sampler.params
            if room < p.max_tokens:  # the codes must fit the talker's context (min_tokens with them)
                state.sampler = Sampler(replace(p, max_tokens=room, min_tokens=min(p.min_tokens, room)),
                                        state.sampler.generator)
        self.state = state

    def add_group(self, group: torch.Tensor) -> list[StageChunk]:
        """A new code group (G,): the chunk to send once the current chunk is whole, else nothing yet."""
        self.held.append(group.view(-1, 1))
        size = window_size(self.sent_chunks, self.chunks)
        return self.flush() if len(self.held) >= size else []

    def flush(self) -> list[StageChunk]:
        """The held groups as one `codes` (G, n) chunk (none when nothing is held)."""
        if not self.held:
            return []
        codes = torch.cat(self.held, dim=1) if len(self.held) > 1 else self.held[0]
        self.sent_chunks += 1
        self.held = []
        return [StageChunk(tensors={"codes": codes})]

    def close(self) -> None:
        super().close()
        self.held = []
        self.prompt = self.state = None  # the thinker's tensors may be slots of its shm arena: free them now

    def urgent(self) -> bool:
        """Until its first chunk of codes leaves (the vocoder's first window)."""
        return self.sent_chunks == 0

    def ready(self) -> bool:
        if self.state is None:
            return self.text_ended  # nothing to speak: finish on the next pass
        if self.state.finished:
            return False
        return not self.queued or self.awaiting or self.talker.needs_predict(self.state)

    def finish_counts(self) -> None:
        state = self.state
        if state is None:
            return
        self.completion_tokens = len(state.codes)
        self.finished = state.finished
        if self.finished:
            self.finish_reason = "stop" if state.sampler.is_stop(state.codes[-1]) else "length"
