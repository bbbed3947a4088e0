"""The thinker stage service (services/llm, role thinker): loads the language model + lm_head and the
tokenizer, and opens a ThinkerTask per request with the model's own sampling defaults under the
caller's overrides; the engine admits it or refuses it at once (`LMEngine.admit`: --max-waiting-requests).

Run: `omnimesh stage thinker --model DIR --port 50052`. `--stream-interval N` (vLLM's): tokens per output chunk
after the first `eager_tokens` (request option, default 1; the gateway sets what the talker's first audio
needs), see ThinkerTask.
"""

from __future__ import annotations

import logging
from pathlib import Path

import grpc
from transformers import GenerationConfig

from omnimesh.config.serve_args import ServeArgs
from omnimesh.engine.task import StageRequestError
from omnimesh.models.qwen3_omni.sampling import thinker_sampling_params
from omnimesh.models.qwen3_omni.processor import load_tokenizer
from omnimesh.models.qwen3_omni.stage_loading import LMLayout, load_thinker
from omnimesh.models.qwen3_omni.thinker import Qwen3OmniThinker
from omnimesh.server.stage_failure import StageFailure
from omnimesh.models.qwen3_omni.lm_engine import LMEngine
from omnimesh.stage_registry import lm_engine, lm_layout, resolve_dtype
from omnimesh.v1 import stage_pb2
from services.llm.sampling import SeedStream, bad_word_texts, merge_sampling, operator_defaults
from services.llm.thinker_batcher import ThinkerBatcher
from services.llm.thinker_task import ThinkerTask, merge_token_chunks
from services.llm.token_logprobs import TokenBytes
from services.llm.structured_output import AFTER_OPTION as STRUCTURED_AFTER_OPTION
from services.llm.structured_output import OPTION as STRUCTURED_OPTION
from services.llm.structured_output import Grammars
from services.options import count_option, priority_option

log = logging.getLogger(__name__)


class ThinkerHandler:
    name = "thinker"

    def __init__(self, thinker: Qwen3OmniThinker, tokenizer: object, generation_config: GenerationConfig | None,
                 model_name: str, max_model_len: int, layout: LMLayout, failure: StageFailure,
                 engine: LMEngine | None = None, stream_interval: int = 1, first_output_rounds: int = 1):
        """`engine` None: a handler that only validates requests (tests); the stage always has one.
        `first_output_rounds`: see ThinkerBatcher."""
        self.layout = layout
        self.batcher = ThinkerBatcher(engine, first_output_rounds) if engine is not None else None
        self.failure = failure
        # one request per pipeline rank at a time; in one process on CPU a second slot where a step of first
        # outputs starts at once beside a bulk step, which pauses for it (EngineLoop `preempt`, StepGate)
        self.preempt = layout.in_process_cpu
        self.max_inflight_steps = 2 if self.preempt else layout.pp
        self.thinker = thinker
        self.tokenizer = tokenizer
        self.token_bytes = TokenBytes(tokenizer)  # token id -> bytes, for logprobs (cached across requests)
        self.defaults = thinker_sampling_params(thinker.config, generation_config)
        self.seeds = SeedStream(None, self.name)  # --seed (build_handler)
        self.logprobs_mode = "raw_logprobs"  # --logprobs-mode (build_handler)
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.stream_interval = stream_interval
        vocab = int(thinker.config.get_text_config().vocab_size)
        self.grammars = Grammars(tokenizer, vocab, self.defaults.stop_token_ids)  # structured outputs

    def info(self) -> stage_pb2.StageInfo:
        return stage_pb2.StageInfo(stage=self.name, model=self.model_name,
                                   family="qwen2.5-omni" if self.thinker.qwen2_5 else "qwen3-omni",
                                   pipeline_parallel_size=self.layout.pp, tensor_parallel_size=self.layout.tp,
                                   device="cuda" if self.layout.backend == "nccl" else "cpu",
                                   prefix_caching=self.batcher is not None and self.batcher.engine.allocator.prefix_caching)

    # chunks waiting together in a request's output queue go out as one (see stage_servicer)
    merge_outputs = staticmethod(merge_token_chunks)

    def open(self, msg: stage_pb2.Open) -> ThinkerTask:
        if self.failure.message is not None:
            raise StageRequestError(grpc.StatusCode.UNAVAILABLE, f"thinker: {self.failure.message}")
        if msg.options.get("talker_inputs") == "1" and self.thinker.accept_hidden_layer is None:
            raise StageRequestError(grpc.StatusCode.INVALID_ARGUMENT, "thinker: talker_inputs asked of a thinker that "
                                    "feeds no talker (a thinker-only checkpoint, enable_audio_output false, or a "
                                    "Qwen2.5-Omni checkpoint, whose speech is not served yet)")
        params = self.seeds.fill(merge_sampling(self.defaults, msg.sampling if msg.HasField("sampling") else None))
        task = ThinkerTask(msg.request_id, self.thinker, self.tokenizer, params,
                           talker_inputs=msg.options.get("talker_inputs") == "1", max_model_len=self.max_model_len,
                           batcher=self.batcher, stream_interval=self.stream_interval,
                           eager_tokens=count_option(msg, "eager_tokens", 1, "tokens"), token_bytes=self.token_bytes,
                           prefix_caching=self.batcher is not None and self.batcher.engine.allocator.prefix_caching,
                           logprobs_mode=self.logprobs_mode)
        task.priority = priority_option(msg, self.batcher.engine.scheduler.policy if self.batcher else "fcfs")
        task.requested_stops = frozenset(int(i) for i in msg.sampling.stop_token_ids)
        task.own_stops = frozenset(self.defaults.stop_token_ids)
        # compiled with the prompt, on the compute thread (a big schema takes a while: not on the event loop)
        task.structured, task.grammars = msg.options.get(STRUCTURED_OPTION), self.grammars
        task.structured_after = msg.options.get(STRUCTURED_AFTER_OPTION) or None
        task.bad_words = bad_word_texts(msg.sampling.bad_words)  # vLLM's: tokenized with the prompt, as above
        if self.batcher is not None:
            self.batcher.engine.admit(task)  # RESOURCE_EXHAUSTED when --max-waiting-requests already wait
        return task


def generation_config(model_dir: Path, source: str) -> GenerationConfig | None:
    """--generation-config: the model folder's generation_config.json ("auto"; None when it has none), vLLM's
    neutral defaults with the model's end ids ("vllm"), or another folder's (an error when it has none)."""
    if source in ("auto", "vllm"):
        try:
            gen = GenerationConfig.from_pretrained(model_dir, local_files_only=True)
        except OSError:
            gen = None
        if source == "auto":
            return gen
        return GenerationConfig(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0,
                                eos_token_id=gen.eos_token_id if gen is not None else None)
    try:
        gen = GenerationConfig.from_pretrained(source, local_files_only=True)
    except OSError as exc:
        raise ValueError(f"--generation-config {source!r}: not auto, vllm or a folder with a readable "
                         f"generation_config.json ({exc})") from None
    log.info("thinker: default sampling from %s/generation_config.json (--generation-config)", source)
    return gen


def build_handler(model_dir: Path, args: ServeArgs) -> ThinkerHandler:
    failure = StageFailure()
    layout = lm_layout(args, "thinker", failure, model_dir)
    thinker = load_thinker(model_dir, resolve_dtype(args), layout)
    tokenizer = load_tokenizer(args.tokenizer or model_dir)
    vocab = int(thinker.config.get_text_config().vocab_size)
    if len(tokenizer) > vocab:
        raise ValueError(f"the tokenizer in {args.tokenizer or model_dir} has {len(tokenizer)} tokens, more than the "
                         f"thinker's vocabulary of {vocab}: it is not this model's (--tokenizer)")
    thinker.set_turn_tokens(tokenizer)  # Qwen2.5-Omni: where a continued assistant message starts
    gen = generation_config(model_dir, args.generation_config)
    limit = int(thinker.config.get_text_config().max_position_embeddings)
    cfg = args.stage_configs()["thinker"]
    max_len = cfg.max_model_len or limit
    if max_len > limit:
        raise ValueError(f"--max-model-len {max_len} exceeds the model's max_position_embeddings {limit}")
    engine = lm_engine(thinker.backend, "thinker", args, max_len, capture_layer=thinker.accept_hidden_layer)
    handler = ThinkerHandler(thinker, tokenizer, gen, args.model_name(model_dir), max_len, layout, failure, engine,
                             stream_interval=args.stream_interval,
                             first_output_rounds=cfg.effective_first_output_rounds("thinker"))
    handler.defaults = operator_defaults(handler.defaults, cfg.default_sampling_params, "thinker")
    handler.seeds = SeedStream(args.seed, "thinker")
    handler.logprobs_mode = args.logprobs_mode
    return handler
