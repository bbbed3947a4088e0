"""ThinkerBatcher: the thinker stage's continuous batching — every ready request in one step per call.

Data flow (`step_batch`, on the engine loop's compute thread): a request seen for the first time has its
prompt prepared (`ThinkerTask.prompt_run`; bad media, or any error there, fail that request alone) and
queued in the `LMEngine`; then one `LMEngine.step` runs the scheduled rows of all ready requests (decodes + prefill
chunks) as one batched forward over the stage's pp x tp ranks; each request that got logits samples its
next token (`ThinkerTask.on_output`), whose row is queued for the next step. Requests the scheduler left
out this step (budget, seats, KV blocks) are simply not in the result: they stay ready.

First outputs in one call (`first_output_rounds`, default 1 here; the stage's config sets 8): when every
request of the step got a token this round and still waits for its first outputs (its eager tokens,
`ThinkerTask.urgent`), the call runs the next rounds itself, up to that many in all, instead of returning
to the engine loop between them; their chunks leave together at the end (the servicer merges them into one
message). The tokens are those of round-by-round steps. That includes the prefill's round: a request whose
talker's first window reads 6 tokens gets all 6 from its prefill's call, so the talker receives them in one
message and runs its prefill and its first window in one call too (a text-only request has 1 eager token:
its first token leaves at once).
"""

from __future__ import annotations

from omnimesh.engine.task import StageTask
from omnimesh.models.qwen3_omni.lm_engine import LMEngine
from omnimesh.transport.frames import StageChunk
from services.llm.thinker_task import ThinkerTask


class ThinkerBatcher:
    def __init__(self, engine: LMEngine, first_output_rounds: int = 1):
        if first_output_rounds < 1:
            raise ValueError(f"first_output_rounds must be >= 1, got {first_output_rounds}")
        self.engine = engine
        self.first_output_rounds = first_output_rounds

    def stats(self) -> dict[str, float]:
        return self.engine.stats()

    def step_batch(self, tasks: list[StageTask]) -> dict[str, list[StageChunk] | BaseException]:
        """-> each request's chunks (or its failure), by request id; the engine knows tasks by `key`."""
        out: dict[str, list[StageChunk] | BaseException] = {}
        ready: dict[str, ThinkerTask] = {}  # by task key
        for task in tasks:
            if not isinstance(task, ThinkerTask):
                raise TypeError(f"the thinker batcher got a {type(task).__name__}")
            if not self.engine.has(task.key):
                try:
                    run = task.prompt_run()
                except Exception as exc:  # bad media (ValueError: a 400), or a bug in preparing this prompt:
                    out[task.request_id] = exc  # it ends this request alone, never the batch's others
                    continue
                self.engine.feed(task.key, run)
                task.on_close.append(self.engine.remove)
            ready[task.key] = task
        for _ in range(self.first_output_rounds):
            results = self.engine.step(list(ready))
            for key, result in results.items():
                task = ready[key]
                rid = task.request_id
                try:
                    chunks, next_run = task.on_output(result)
                except Exception as exc:  # this request's sampling / detokenizing failed: it alone ends
                    out[rid] = exc
                    continue
                if next_run is not None:
                    self.engine.feed(key, next_run)
                done = out.get(rid)
                out[rid] = done + chunks if isinstance(done, list) else chunks
            if not self._another_round(ready, results, out):
                break
        return out

    @staticmethod
    def _another_round(ready: dict[str, ThinkerTask], results: dict, out: dict) -> bool:
        """Every request of the step ran this round, got a token (a prefill's last chunk included) and still
        waits for its first outputs: the next round can run in this call."""
        return len(results) == len(ready) and all(
            isinstance(out.get(task.request_id), list) and results[key].logits is not None and not task.finished
            and task.urgent() for key, task in ready.items())
