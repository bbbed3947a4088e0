"""The talker stage service (services/llm, role talker): loads the talker (+ code predictor on Qwen3-Omni; one
codec stream on Qwen2.5-Omni) and opens a TalkerTask per request; sampling defaults are the ones `generate`
uses for the talker of the model's family.

Run: `omnimesh stage talker --model DIR --port 50053`. Options: `speaker`; `chunk_schedule` (code groups per
output chunk, a code_windows schedule such as 5,25; default 1: the gateway sets the vocoder's decode
windows, see TalkerTask), or `first_chunk_codes` / `chunk_codes` for a schedule of those two.
"""

from __future__ import annotations

from pathlib import Path

import grpc

from omnimesh.config.serve_args import ServeArgs
from omnimesh.engine.task import StageRequestError
from omnimesh.models.qwen3_omni.code_windows import parse_windows
from omnimesh.models.qwen2_5_omni import talker as qwen2_5_talker
from omnimesh.models.qwen3_omni.sampling import talker_sampling_params
from omnimesh.models.qwen3_omni.stage_loading import LMLayout, load_talker
from omnimesh.models.qwen3_omni.talker import Qwen3OmniTalker
from omnimesh.server.stage_failure import StageFailure
from omnimesh.models.qwen3_omni.lm_engine import LMEngine
from omnimesh.stage_registry import lm_engine, lm_layout, resolve_dtype
from omnimesh.v1 import stage_pb2
from services.llm.sampling import SeedStream, merge_sampling, operator_defaults
from services.llm.talker_batcher import TalkerBatcher
from services.llm.talker_task import TalkerTask
from services.options import count_option, priority_option

class TalkerHandler:
    name = "talker"

    def __init__(self, talker: Qwen3OmniTalker | qwen2_5_talker.Qwen2_5OmniTalker, model_name: str, layout: LMLayout, failure: StageFailure,
                 engine: LMEngine | None = None, max_model_len: int = 0, first_output_rounds: int = 1):
        """`engine` None: a handler that only validates requests (tests); the stage always has one.
        `first_output_rounds`: see TalkerBatcher."""
        self.layout = layout
        self.max_model_len = max_model_len
        qwen2_5 = isinstance(talker, qwen2_5_talker.Qwen2_5OmniTalker)
        self.batcher = None
        if engine is not None:  # Qwen2.5-Omni's one codec stream has no code predictor to call
            predict = None if qwen2_5 else talker.backend.predict_batch  # type: ignore[attr-defined]
            self.batcher = TalkerBatcher(talker, engine, predict, first_output_rounds)
        self.family = "qwen2.5-omni" if qwen2_5 else "qwen3-omni"
        self.failure = failure
        # one request per pipeline rank at a time; in one process on CPU a second slot where a step of first
        # outputs starts at once beside a bulk step, which pauses for it (EngineLoop `preempt`, StepGate)
        self.preempt = layout.in_process_cpu
        self.max_inflight_steps = 2 if self.preempt else layout.pp
        self.talker = talker
        self.defaults = (qwen2_5_talker.talker_sampling_params(talker.config) if qwen2_5  # type: ignore[arg-type]
                         else talker_sampling_params(talker.config))  # type: ignore[arg-type]
        self.seeds = SeedStream(None, self.name)  # --seed (build_handler)
        self.model_name = model_name
        # the default voice first: the one `generate` speaks with unless told otherwise
        self.speakers = sorted(talker.speakers, key=lambda name: (name != talker.default_speaker, name))

    def info(self) -> stage_pb2.StageInfo:
        return stage_pb2.StageInfo(stage=self.name, model=self.model_name, family=self.family,
                                   pipeline_parallel_size=self.layout.pp, tensor_parallel_size=self.layout.tp,
                                   device="cuda" if self.layout.backend == "nccl" else "cpu", speakers=self.speakers)

    def open(self, msg: stage_pb2.Open) -> TalkerTask:
        if self.failure.message is not None:
            raise StageRequestError(grpc.StatusCode.UNAVAILABLE, f"talker: {self.failure.message}")
        params = self.seeds.fill(merge_sampling(self.defaults, msg.sampling if msg.HasField("sampling") else None,
                                                text=False))
        speaker = msg.options.get("speaker") or self.speakers[0]
        if "chunk_schedule" in msg.options:
            chunks = parse_windows(msg.options["chunk_schedule"], "option chunk_schedule")
        else:
            chunk = count_option(msg, "chunk_codes", 1)
            chunks = (count_option(msg, "first_chunk_codes", chunk), chunk)
        task = TalkerTask(msg.request_id, self.talker, speaker, params, max_model_len=self.max_model_len,
                          batcher=self.batcher, chunks=chunks)
        task.priority = priority_option(msg, self.batcher.engine.scheduler.policy if self.batcher else "fcfs")
        if self.batcher is not None:
            self.batcher.engine.admit(task)  # RESOURCE_EXHAUSTED when --max-waiting-requests already wait
        return task


def build_handler(model_dir: Path, args: ServeArgs) -> TalkerHandler:
    failure = StageFailure()
    layout = lm_layout(args, "talker", failure, model_dir)
    talker = load_talker(model_dir, resolve_dtype(args), layout)
    # the talker's own context (prompt rows + codec tokens): its model limit, not the thinker's --max-model-len
    tk = talker.config.talker_config
    max_len = int((getattr(tk, "text_config", None) or tk).max_position_embeddings)  # Qwen2.5: its own config
    engine = lm_engine(talker.backend, "talker", args, max_len)
    cfg = args.stage_configs()["talker"]
    handler = TalkerHandler(talker, args.model_name(model_dir), layout, failure, engine, max_len,
                            cfg.effective_first_output_rounds("talker"))
    handler.defaults = operator_defaults(handler.defaults, cfg.default_sampling_params, "talker")
    handler.seeds = SeedStream(args.seed, "talker")
    return handler
