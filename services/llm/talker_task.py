"""TalkerTask: one request in the talker stage — speaks the thinker's text as codec code groups.

Data flow: thinker chunks arrive (async: one per thinker token; whole: all at once). The first carries
the TalkerPrompt and the first spoken token's embedding -> `talker.start`; later `token_embeds` ->
`push_text`; the final chunk -> `finish_text`. Each engine step runs one talker step (which includes the
code predictor) when its text entry is known (`can_step`); a finished code group goes out as
`codes` (num_code_groups, 1). A thinker that spoke nothing (its first token was final) gives no audio.
"""

from __future__ import annotations

from omnimesh.engine.task import StageTask
from omnimesh.models.qwen3_omni.edges import talker_prompt_from_tensors
from omnimesh.models.qwen3_omni.sampling import SamplingParams
from omnimesh.models.qwen3_omni.talker import Qwen3OmniTalker, TalkerState
from omnimesh.models.qwen3_omni.thinker import TalkerPrompt
from omnimesh.transport.frames import StageChunk

EDGE = "thinker -> talker"


class TalkerTask(StageTask):
    def __init__(self, request_id: str, talker: Qwen3OmniTalker, speaker: str, params: SamplingParams):
        super().__init__(request_id)
        if speaker.lower() not in talker.speakers:
            raise ValueError(f"unknown speaker {speaker!r}; valid speakers: {', '.join(sorted(talker.speakers))}")
        self.talker = talker
        self.speaker = speaker
        self.params = params
        self.prompt: TalkerPrompt | None = None
        self.state: TalkerState | None = None
        self.text_ended = False

    def close(self) -> None:
        if self.state is not None:
            self.talker.release(self.state)
            self.state = None

    def feed(self, chunk: StageChunk) -> None:
        if self.text_ended:
            raise ValueError(f"{EDGE}: chunk {chunk.seq} after the final chunk")
        if self.prompt is None:
            self.prompt = talker_prompt_from_tensors(chunk.tensors)
            self.prompt_tokens = int(self.prompt.input_ids.numel())
        embeds = chunk.tensors.get("token_embeds")
        for row in embeds.unbind(0) if embeds is not None else ():
            if self.state is None:
                self.state = self.talker.start(self.prompt, self.speaker, row, self.params)
            else:
                self.talker.push_text(self.state, row)
        if chunk.final:
            self.text_ended = True
            if self.state is not None:
                self.talker.finish_text(self.state)

    def ready(self) -> bool:
        if self.state is None:
            return self.text_ended  # nothing to speak: finish on the next pass
        return self.talker.can_step(self.state)

    def step(self) -> list[StageChunk]:
        if self.state is None:
            self.finished = True
            return []
        group = self.talker.step(self.state)
        self.finished = self.state.finished
        self.completion_tokens = len(self.state.codes)
        if self.finished:
            self.finish_reason = "length" if not self.state.sampler.is_stop(self.state.codes[-1]) else "stop"
        if group is None:
            return []
        return [StageChunk(tensors={"codes": group.view(-1, 1)})]  # (G, 1)
