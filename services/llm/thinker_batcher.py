"""ThinkerBatcher: the thinker stage's continuous batching — every ready request in one step per call.

Data flow (`step_batch`, on the engine loop's compute thread): a request seen for the first time has its
prompt prepared (`ThinkerTask.prompt_run`; bad media fail that request alone) and queued in the
`LMEngine`; then one `LMEngine.step` runs the scheduled rows of all ready requests (decodes + prefill
chunks) as one batched forward over the stage's pp x tp ranks; each request that got logits samples its
next token (`ThinkerTask.on_output`), whose row is queued for the next step. Requests the scheduler left
out this step (budget, seats, KV blocks) are simply not in the result: they stay ready.
"""

from __future__ import annotations

from omnimesh.engine.task import StageTask
from omnimesh.models.qwen3_omni.lm_engine import LMEngine
from omnimesh.transport.frames import StageChunk
from services.llm.thinker_task import ThinkerTask


class ThinkerBatcher:
    def __init__(self, engine: LMEngine):
        self.engine = engine

    def stats(self) -> dict[str, float]:
        return self.engine.stats()

    def step_batch(self, tasks: list[StageTask]) -> dict[str, list[StageChunk] | BaseException]:
        out: dict[str, list[StageChunk] | BaseException] = {}
        ready: dict[str, ThinkerTask] = {}
        for task in tasks:
            if not isinstance(task, ThinkerTask):
                raise TypeError(f"the thinker batcher got a {type(task).__name__}")
            if not self.engine.has(task.request_id):
                try:
                    run = task.prompt_run()
                except ValueError as exc:
                    out[task.request_id] = exc
                    continue
                self.engine.feed(task.request_id, run)
                task.on_close.append(self.engine.remove)
            ready[task.request_id] = task
        for rid, result in self.engine.step(list(ready)).items():
            task = ready[rid]
            try:
                chunks, next_run = task.on_output(result)
            except Exception as exc:  # this request's sampling / detokenizing failed: it alone ends
                out[rid] = exc
                continue
            if next_run is not None:
                self.engine.feed(rid, next_run)
            out[rid] = chunks
        return out
