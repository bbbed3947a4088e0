"""TalkerBatcher: the talker stage's continuous batching — code predictor and decoder, each once per step.

Data flow (`step_batch`, on the engine loop's compute thread), over the ready requests:
  1. a request with nothing to speak (its thinker's first token was final) finishes with no audio;
  2. a started request's prefill rows are queued in the stage's `LMEngine` (once);
  3. every request whose codec token c_g is sampled and whose text entry g is known joins ONE code-predictor
     call (B requests, `ShardedBackend.predict_batch`): its group [c_g, r1..] goes to the task's outgoing
     codes (sent once its chunk is whole) and the group's embedding sum + text entry g is queued as its next
     decoder input;
  4. ONE `LMEngine.step` runs the scheduled decoder rows of all requests; each request that got logits
     samples its next codec token (greedy requests alike in one go: `Qwen3OmniTalker.sample_next_batch`);
     codec EOS or max tokens ends it: the last token gets no group, and the codes still held go out with
     the request's last chunk.
First outputs in one call (`first_output_rounds`, default 1 here; the stage's config sets 8): while every
request of the step still waits for its first chunk of codes (`TalkerTask.urgent`) and has the text its next
group reads, the call runs steps 3-4 again itself, up to that many rounds in all, instead of returning to the
engine loop between them: a new request's first window of codes comes out of one call once its text is in.
The codes are those of round-by-round steps.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from omnimesh.engine.task import StageTask
from omnimesh.models.qwen3_omni.lm_engine import InputRun, LMEngine
from omnimesh.models.qwen3_omni.talker import TalkerState
from omnimesh.transport.frames import StageChunk
from services.llm.talker_task import TalkerTask


class TalkerBatcher:
    def __init__(self, talker: Any, engine: LMEngine, predict_batch: Any, first_output_rounds: int = 1):
        """`talker`: a `Qwen3OmniTalker`, or a `Qwen2_5OmniTalker` with `predict_batch` None (one codec stream: its
        `next_inputs` makes the decoder rows where the code predictor would run);
        `predict_batch(prefix (B, 2, H), params tuple) -> [(codes, codec_sum (1, 1, H))]`;
        `first_output_rounds`: see the module doc."""
        if first_output_rounds < 1:
            raise ValueError(f"first_output_rounds must be >= 1, got {first_output_rounds}")
        self.talker = talker
        self.engine = engine
        self.predict_batch = predict_batch
        self.first_output_rounds = first_output_rounds

    def stats(self) -> dict[str, float]:
        return self.engine.stats()

    def step_batch(self, tasks: list[StageTask]) -> dict[str, list[StageChunk] | BaseException]:
        out: dict[str, list[StageChunk] | BaseException] = {}
        for _ in range(self.first_output_rounds):
            live = self._round(tasks, out)
            if not self._another_round(live, out):
                break
            tasks = list(live.values())
        return out

    def _another_round(self, live: dict[str, TalkerTask], out: dict[str, list[StageChunk] | BaseException]) -> bool:
        """Every request of the step still waits for its first chunk, got its codec token this round and has
        the text its next code group reads: the next round can run in this call."""
        return bool(live) and all(
            isinstance(out.get(task.request_id), list) and task.urgent() and not task.finished and not task.awaiting
            and task.state is not None and self.talker.needs_predict(task.state) for task in live.values())

    def _round(self, tasks: list[StageTask], out: dict[str, list[StageChunk] | BaseException]) -> dict[str, TalkerTask]:
        """One model round over `tasks` (prefills queued, one code-predictor call, one decoder step, sampling),
        its chunks added to `out`; -> the requests that took part (not finished before it), by task key."""
        live: dict[str, TalkerTask] = {}
        predict: list[TalkerTask] = []
        for task in tasks:
            if not isinstance(task, TalkerTask):
                raise TypeError(f"the talker batcher got a {type(task).__name__}")
            state = task.state
            if state is None:  # the thinker spoke nothing
                task.finished = True
                out.setdefault(task.request_id, [])
                continue
            if not task.queued:
                try:
                    embeds, positions = self.talker.prefill_input(state)
                except Exception as exc:  # a bug in this request's prompt ends it alone, never the batch's others
                    out[task.request_id] = exc
                    continue
                self.engine.feed(task.key, InputRun(embeds, positions))
                task.queued = task.awaiting = True
                task.on_close.append(self.engine.remove)
            elif not task.awaiting and self.talker.needs_predict(state):
                predict.append(task)
            live[task.key] = task  # the engine knows tasks by key, not request id (BatchedTask)
        if predict:
            self._predict(predict, out)
        sampled: list[tuple[TalkerTask, Any]] = []
        for key, result in self.engine.step([key for key, t in live.items() if t.awaiting]).items():
            out.setdefault(live[key].request_id, [])
            if result.logits is not None:
                sampled.append((live[key], result))
        self._sample(sampled, out)
        return live

    def _sample(self, sampled: list[tuple[TalkerTask, Any]], out: dict[str, list[StageChunk] | BaseException]) -> None:
        """Each request that got logits samples its next codec token: all in one go when they can
        (`sample_next_batch`), else one by one, so a request whose sampling fails ends alone."""
        if not sampled:
            return
        states = [t.state for t, _ in sampled]
        try:
            batched = all(s is not None for s in states) and self.talker.sample_next_batch(
                cast("list[TalkerState]", states), torch.stack([r.logits for _, r in sampled]),
                [r.last_hidden for _, r in sampled])
        except Exception:  # nothing was taken: each request tries alone below, and a failure ends it alone
            batched = False
        done = [t for t, _ in sampled] if batched else []
        if not batched:
            for task, result in sampled:
                try:
                    assert task.state is not None
                    self.talker.sample_next(task.state, result.logits, result.last_hidden)
                    done.append(task)
                except Exception as exc:  # this request's sampling failed: it alone ends
                    out[task.request_id] = exc
        for task in done:
            task.awaiting = False
            task.finish_counts()
            chunks = out[task.request_id]
            if task.finished and isinstance(chunks, list):
                final = self.talker.final_group(task.state)  # Qwen2.5-Omni at max tokens: its last code
                if final is not None:
                    chunks.extend(task.add_group(final))
                chunks.extend(task.flush())

    def _predict(self, tasks: list[TalkerTask], out: dict[str, list[StageChunk] | BaseException]) -> None:
        states = [cast(TalkerState, t.state) for t in tasks]
        if self.predict_batch is None:  # one codec stream: c_g is the group, no predictor call
            groups, rows, positions = self.talker.next_inputs(states)
        else:
            prefix, params = self.talker.predict_prefixes(states)  # (B, 2, H)
            results = self.predict_batch(prefix, tuple(params))
            sums = torch.cat([codec_sum for _, codec_sum in results])  # (B, 1, H)
            groups, rows, positions = self.talker.after_predict(states, [codes for codes, _ in results], sums)
        for b, task in enumerate(tasks):
            self.engine.feed(task.key, InputRun(rows[b:b + 1], positions[:, b:b + 1]))  # (1, H), (4, 1)
            task.awaiting = True
            task.completion_tokens = len(states[b].codes)
            chunks = out.setdefault(task.request_id, [])
            if isinstance(chunks, list):
                chunks.extend(task.add_group(groups[b]))
