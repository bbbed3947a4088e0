"""Memory plan: do each stage's weights and KV cache fit its devices? Worked out before anything loads.

Role: the SPEC's rule of thumb "a model that does not fit in pp x tp x memory x utilization -> an error that
says how much is missing and which pp / tp would fit", and its failure mode "OOM at load". `omnimesh plan`
prints `MemoryPlan.report()` and starts nothing; `omnimesh serve` (and `omnimesh stage`, for its own stage)
refuses on CUDA when the plan does not fit, and on CPU only prints advice. What a stage's engine would refuse
at start-up whatever the memory (`refusals`: a KV cache given a size that cannot hold one max-length sequence, a
--max-model-len beyond the thinker's max_position_embeddings) stops the start on any device, before anything
loads.

Data flow:
    model.safetensors[.index.json] headers (shapes and dtypes; no tensor is read)
      -> per stage (STAGE_PARTS): the checkpoint prefixes it loads, split over its pp x tp ranks or kept
         whole on rank 0 (the driver: the thinker's embedding table, the talker's projections and codec
         embedding, code2wav's / token2wav's convolutions), in bytes of the serving dtype (`resolve_dtype`:
         bf16 on CUDA, fp32 on CPU; Qwen2.5-Omni's token2wav always fp32; integer tensors keep their size)
      -> per rank: the heaviest pipeline rank's numbered layers + the stage's other split tensors, / tp;
         rank 0 adds the driver's part; the thinker and talker add their KV cache:
         2 x layers/pp x kv_heads/tp x head_dim x dtype bytes per token (the text config), and at least one
         max-length sequence (the thinker's max_model_len, else max_position_embeddings; the talker's own
         max_position_embeddings), as the engine refuses to start when its cache cannot hold one
      -> per device (CUDA: the stage's `devices`, else 0..pp*tp/num_nodes-1, so stages without `devices` all
         share GPU 0; each device's memory from torch or --device-memory) the stage's budget is memory x its
         gpu_memory_utilization; on CPU all ranks share the host's RAM (the KV pools counted at their
         kv_cache_memory, 4 GiB per rank by default)
      -> fits / how much is missing per rank, the smallest pp x tp that fits (`check_layout`'s tp values,
         tp before pp), and devices whose stages claim more than the whole device between them.

What is an estimate (a plan that fits can still run out of memory at load; one that does not fit would):
  - tp splits a stage's share evenly (the norms and biases every tp rank keeps whole are small);
  - a stage's split tensors outside its numbered layers (final norm, heads, tower stems and mergers) are all
    counted on its heaviest pipeline rank, though they sit on its first or last one;
  - activations (the engine's profiled step, the towers' and the vocoder's working memory), the CUDA
    context (~0.5 GiB per process), the code predictor's per-request caches and other processes on the
    device are NOT counted: keep headroom below gpu_memory_utilization;
  - on CUDA an LM stage without kv_cache_memory counts one max-length sequence of KV, the least it starts
    with (it then takes whatever its utilization leaves); with kv_cache_memory, that pool;
  - the encoder's rank 0 counts its cache at full capacity (--encoder-cache-memory), which it reaches only
    as it fills.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from omnimesh.config.serve_args import ServeArgs
from omnimesh.config.stage_config import StageConfig, fmt_bytes, parse_size

LM_STAGES = ("thinker", "talker")
PLANNED_DEVICES = 8  # CUDA devices per host when planning on a host that has none (`--num-devices` overrides)
# each process's own memory before any weight (an idle tiny vocoder stage: ~280 MiB anonymous, its shared-memory
# arena besides), so a CPU start of more processes than the host can hold is refused before it spawns them
PROCESS_FLOOR_BYTES = 250 * 2**20
# bytes per element of the safetensors dtypes; floats (F*, BF16) are converted to the serving dtype
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_LAYER = re.compile(r"^(.*?\.(?:layers|blocks|transformer_blocks))\.(\d+)\.")


@dataclass(frozen=True)
class StageParts:
    """Where a stage's weights sit in the checkpoint (stage_loading.py and the rank programs' checkpoint plans)."""

    split: tuple[str, ...]  # prefixes loaded by the stage's pp x tp ranks
    driver: tuple[str, ...] = ()  # prefixes kept whole on rank 0 (the stage's server process)
    driver_except: tuple[str, ...] = ()  # ... but not these (they are in `split`)
    stacks: tuple[str, ...] = ()  # `<prefix>.N.` numbered layers split over pp; the first is the main stack
    tied: tuple[str, str] | None = None  # (head prefix, embedding key a tied head loads when the head is absent)
    float32: bool = False  # kept in float32 whatever the serving dtype (Qwen2.5-Omni's token2wav)


_ENCODER = StageParts(split=("thinker.audio_tower.", "thinker.visual."),
                      stacks=("thinker.audio_tower.layers", "thinker.visual.blocks"))
_THINKER = StageParts(split=("thinker.model.layers.", "thinker.model.norm.", "thinker.lm_head."),
                      driver=("thinker.model.embed_tokens.",), stacks=("thinker.model.layers",),
                      tied=("thinker.lm_head.", "thinker.model.embed_tokens.weight"))
STAGE_PARTS: dict[str, dict[str, StageParts]] = {
    "qwen3-omni": {
        "encoder": _ENCODER,
        "thinker": _THINKER,
        "talker": StageParts(
            split=("talker.model.layers.", "talker.model.norm.", "talker.codec_head.", "talker.code_predictor."),
            driver=("talker.text_projection.", "talker.hidden_projection.", "talker.model.codec_embedding.",
                    "talker.model.norm."),
            stacks=("talker.model.layers", "talker.code_predictor.model.layers"),
            tied=("talker.codec_head.", "talker.model.codec_embedding.weight")),
        "vocoder": StageParts(split=("code2wav.pre_transformer.layers.", "code2wav.pre_transformer.norm."),
                              driver=("code2wav.",), driver_except=("code2wav.pre_transformer.layers.",),
                              stacks=("code2wav.pre_transformer.layers",)),
    },
    "qwen2.5-omni": {
        "encoder": _ENCODER,
        "thinker": _THINKER,
        "talker": StageParts(split=("talker.model.layers.", "talker.model.norm.", "talker.codec_head."),
                             driver=("talker.thinker_to_talker_proj.", "talker.model.embed_tokens."),
                             stacks=("talker.model.layers",),
                             tied=("talker.codec_head.", "talker.model.embed_tokens.weight")),
        "vocoder": StageParts(split=("token2wav.code2wav_dit_model.transformer_blocks.",), driver=("token2wav.",),
                              driver_except=("token2wav.code2wav_dit_model.transformer_blocks.",),
                              stacks=("token2wav.code2wav_dit_model.transformer_blocks",), float32=True),
    },
}


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # safetensors dtype, e.g. "BF16"
    numel: int

    def nbytes(self, float_bytes: int) -> int:
        is_float = self.dtype == "BF16" or self.dtype.startswith("F")
        return self.numel * (float_bytes if is_float else DTYPE_BYTES.get(self.dtype, 4))


def read_checkpoint(model_dir: Path) -> dict[str, TensorInfo]:
    """Every tensor of the folder's safetensors checkpoint: its dtype and element count, from the files'
    headers only (8 bytes of header length, then the JSON header)."""
    from omnimesh.models.loader import checkpoint_files, safetensors_header

    out: dict[str, TensorInfo] = {}
    for path in sorted(set(checkpoint_files(Path(model_dir)).values())):
        for key, entry in safetensors_header(path).items():
            out[key] = TensorInfo(entry["dtype"], math.prod(entry["shape"]))
    return out


def shape_checkpoint(model_dir: Path) -> dict[str, TensorInfo]:
    """What the folder's checkpoint would hold, from its config alone (--load-format dummy: there may be no
    weight files): the whole model built on the meta device (no memory), its state dict under the checkpoint's
    own key names (`transformers`' reverse of its load-time renaming: per-expert tensors, `thinker.audio_tower.`)."""
    import torch
    from transformers import Qwen2_5OmniForConditionalGeneration, Qwen3OmniMoeForConditionalGeneration
    from transformers.core_model_loading import revert_weight_conversion

    from omnimesh.models.model_config import is_qwen2_5, load_config

    config = load_config(model_dir)
    cls: Any = Qwen2_5OmniForConditionalGeneration if is_qwen2_5(config) else Qwen3OmniMoeForConditionalGeneration
    with torch.device("meta"):
        model = cls(config)
    def kind(t: torch.Tensor) -> str:  # floats take the serving dtype's size anyway
        return "F32" if t.is_floating_point() else "BOOL" if t.dtype == torch.bool else f"I{8 * t.element_size()}"

    return {key: TensorInfo(kind(t), t.numel()) for key, t in revert_weight_conversion(model, model.state_dict()).items()}


@contextlib.contextmanager
def _quiet_partitions() -> Iterator[None]:
    """`partition_layers` warns about uneven splits; the plan tries many layouts, so not here."""
    log = logging.getLogger("omnimesh.parallel.partition")
    disabled, log.disabled = log.disabled, True
    try:
        yield
    finally:
        log.disabled = disabled


def _ranges(layers: int, pp: int, partition: tuple[int, ...] | None) -> list[tuple[int, int]]:
    from omnimesh.parallel.partition import partition_layers

    with _quiet_partitions():
        return partition_layers(layers, pp, list(partition) if partition is not None else None)


@dataclass(frozen=True)
class StageWeights:
    """A stage's weights in the serving dtype: what rank 0 keeps whole, and what its ranks split."""

    driver: int  # bytes kept whole on rank 0
    split: int  # bytes split over the pp x tp ranks, all together
    layers: tuple[tuple[int, ...], ...]  # per stack (the main one first), the bytes of each numbered layer

    def per_rank(self, pp: int, tp: int, partition: tuple[int, ...] | None = None) -> int:
        """The heaviest rank's share (an estimate: see the module docstring)."""
        other = self.split - sum(sum(stack) for stack in self.layers)
        heaviest = 0
        for p in range(pp):
            rank = 0
            for i, stack in enumerate(self.layers):
                if stack:
                    start, end = _ranges(len(stack), pp, partition if i == 0 else None)[p]
                    rank += sum(stack[start:end])
            heaviest = max(heaviest, rank)
        return -(-(heaviest + other) // tp)


def stage_weights(tensors: dict[str, TensorInfo], parts: StageParts, float_bytes: int) -> StageWeights:
    """Sum the checkpoint's tensors under the stage's prefixes (`float_bytes`: the serving dtype's size)."""
    size = 4 if parts.float32 else float_bytes
    split = driver = 0
    layers: list[dict[int, int]] = [{} for _ in parts.stacks]
    for key, info in tensors.items():
        n = info.nbytes(size)
        if key.startswith(parts.driver) and not key.startswith(parts.driver_except):
            driver += n
        if key.startswith(parts.split):
            split += n
            m = _LAYER.match(key)
            if m is not None and m.group(1) in parts.stacks:
                stack = layers[parts.stacks.index(m.group(1))]
                stack[int(m.group(2))] = stack.get(int(m.group(2)), 0) + n
    if parts.tied is not None and not any(k.startswith(parts.tied[0]) for k in tensors) and parts.tied[1] in tensors:
        split += tensors[parts.tied[1]].nbytes(size)  # a tied head: the ranks load the embedding as their head
    return StageWeights(driver, split, tuple(tuple(s.get(i, 0) for i in range(max(s, default=-1) + 1))
                                             for s in layers))


@dataclass(frozen=True)
class KVShape:
    """A thinker's / talker's KV cache: per token, per rank, from its text config."""

    config: Any  # the transformers text config
    max_len: int  # the longest sequence the stage must hold (its engine refuses to start otherwise)
    what: str  # where max_len comes from, for messages

    def per_token(self, pp: int, tp: int, partition: tuple[int, ...] | None, dtype: Any) -> int:
        from omnimesh.models.qwen3_omni.paged_kv import block_bytes

        layers = max(end - start for start, end in _ranges(self.config.num_hidden_layers, pp, partition))
        return block_bytes(self.config, layers, tp, 1, dtype)

    def one_sequence(self, per_token: int, block_size: int) -> int:
        return -(-self.max_len // block_size) * block_size * per_token


def _kv_shape(config: Any, stage: str, cfg: StageConfig) -> KVShape:
    if stage == "thinker":
        text = config.thinker_config.text_config
        limit = int(text.max_position_embeddings)
        if cfg.max_model_len is not None:
            return KVShape(text, cfg.max_model_len, "--max-model-len")
        return KVShape(text, limit, "the thinker's max_position_embeddings; --max-model-len lowers it")
    talker = config.talker_config
    text = getattr(talker, "text_config", None) or talker  # Qwen2.5-Omni's talker config is its LM's config
    return KVShape(text, int(text.max_position_embeddings), "the talker's max_position_embeddings")


@dataclass
class StagePlan:
    """One stage's memory on this host (the first replica's worst rank, rank 0)."""

    stage: str
    cfg: StageConfig
    devices: tuple[str, ...]  # this host's devices of the first replica, rank order
    weights_per_rank: int  # the heaviest rank's share of the split weights
    driver: int  # kept whole on rank 0
    kv_per_token: int | None = None  # per rank (LM stages)
    kv_max_len: int | None = None
    kv_one_sequence: int | None = None  # per rank
    kv_pool: int = 0  # per rank, what the plan counts (see the module docstring)
    cache: int = 0  # rank 0: the encoder cache at its capacity (--encoder-cache-memory), on the encoder's device
    budget: int | None = None  # per rank: the smallest device's memory x gpu_memory_utilization (CUDA)
    missing: int = 0  # per rank, beyond the budget
    copies: list[str] = field(default_factory=list)  # each replica's devices ("cuda:0,cuda:1"), for the table
    recommendation: str | None = None  # when it does not fit: the layout that would, or why none does
    fits_with: tuple[int, int] | None = None  # that layout's (pp, tp)

    @property
    def need(self) -> int:
        """Rank 0's bytes: its share, the driver's part, its KV, the encoder's cache."""
        return self.weights_per_rank + self.driver + self.kv_pool + self.cache

    @property
    def layout(self) -> str:
        out = f"{self.cfg.pp} x {self.cfg.tp}"
        return out + (f" x{self.cfg.num_replicas}" if self.cfg.num_replicas > 1 else "")


@dataclass
class MemoryPlan:
    model_dir: Path
    device: str  # "cuda" | "cpu"
    dtype: str
    memory: dict[str, int]  # device -> bytes (CPU: {"cpu": host RAM})
    memory_source: str
    stages: list[StagePlan] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # each one a reason it does not fit (exit 2 on CUDA)
    refusals: list[str] = field(default_factory=list)  # what a stage would refuse at start-up (exit 2 anywhere)
    advice: list[str] = field(default_factory=list)
    total_cpu: int = 0  # CPU: every stage's ranks together

    @property
    def ok(self) -> bool:
        return not self.errors and not self.refusals

    def table(self) -> str:
        head = ("stage", "pp x tp", "devices", "weights/rank", "+ on rank 0", "KV/token", "KV, one sequence",
                "need/rank", "budget/rank", "fits")
        rows = [head]
        for s in self.stages:
            kv = "-" if s.kv_one_sequence is None else f"{fmt_bytes(s.kv_one_sequence)} ({s.kv_max_len} tok)"
            fits = "yes" if not s.missing else f"NO: {fmt_bytes(s.missing)} missing"
            budget = "-" if s.budget is None else f"{fmt_bytes(s.budget)} ({s.cfg.gpu_memory_utilization:g})"
            rows.append((s.stage, s.layout, " | ".join(s.copies) or ",".join(s.devices), fmt_bytes(s.weights_per_rank), fmt_bytes(s.driver + s.cache),
                         "-" if s.kv_per_token is None else fmt_bytes(s.kv_per_token), kv, fmt_bytes(s.need), budget,
                         fits if self.device == "cuda" else "(host RAM)"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        return "\n".join(lines)

    def report(self) -> str:
        where = (", ".join(f"{d} {fmt_bytes(m)}" for d, m in self.memory.items()) if self.device == "cuda"
                 else f"host RAM {fmt_bytes(self.memory['cpu'])}")
        source = " (--device-memory)" if self.memory_source == "--device-memory" else ""
        out = [f"memory plan for {self.model_dir} ({self.dtype} on {self.device}; {where}{source})",
               self.table()]
        if self.device == "cpu":
            out.append(f"all stages on this host: up to {fmt_bytes(self.total_cpu)} of {fmt_bytes(self.memory['cpu'])} "
                       f"RAM (KV pools counted full)")
        out += [f"does not fit: {e}" for e in self.errors]
        out += [f"cannot start: {r}" for r in self.refusals]
        out += self.recommendations()
        out += [f"advice: {a}" for a in self.advice]
        out.append("estimate from the checkpoint's shapes: activations and the CUDA context are not counted"
                   if self.device == "cuda" else "estimate from the checkpoint's shapes; activations not counted")
        if self.ok:
            out.append("everything fits")
        return "\n".join(out)

    def recommendations(self) -> list[str]:
        return [f"{'fits with' if s.fits_with else 'nothing fits'}: stage {s.stage}: {s.recommendation}"
                for s in self.stages if s.recommendation]

    def error_text(self) -> str:
        return ("the model does not fit its devices (`omnimesh plan` with the same flags prints the table):\n  "
                + "\n  ".join(self.errors + self.recommendations()))

    def refusal_text(self) -> str:
        return "\n  ".join(self.refusals)


def host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _cuda_memory(device_memory: int | None, num_devices: int | None) -> tuple[int, Callable[[int], int], str]:
    """(devices per host, memory of device i, where the numbers come from)."""
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible == 0 and device_memory is None:
        raise ValueError("no CUDA device is visible: give --device-memory (and --num-devices) to plan for another "
                         "machine, or plan for --device cpu")
    count = num_devices if num_devices is not None else visible or PLANNED_DEVICES
    if device_memory is not None:
        return count, lambda i: device_memory, "--device-memory"

    def memory(i: int) -> int:
        if i >= visible:
            raise ValueError(f"cuda:{i} is not visible here ({visible} CUDA devices); give --device-memory to plan "
                             f"for devices this host lacks")
        return int(torch.cuda.get_device_properties(i).total_memory)

    return count, memory, "each device's total memory"


def _stage_devices(cfg: StageConfig, replica: int) -> list[str]:
    """The stage replica's devices on a host, in rank order (as the launcher and `lm_layout` give them)."""
    return cfg.replica_devices(replica) or [str(i) for i in range(cfg.ranks_per_node)]


def plan_memory(model_dir: Path, args: ServeArgs, *, only: str | None = None, device_memory: int | None = None,
                num_devices: int | None = None) -> MemoryPlan:
    """The memory plan of every stage the flags run (or just `only`); ValueError for what cannot be planned
    (no CUDA device and no --device-memory, a device the host lacks)."""
    import torch

    from omnimesh.models.model_config import load_config, resolve_dtype
    from omnimesh.models.qwen3_omni.checkpoint_stages import model_family, model_stages
    from omnimesh.models.qwen3_omni.paged_kv import CPU_KV_CACHE_BYTES, kv_cache_dtype

    if args.device == "auto":
        args = replace(args, device="cuda" if torch.cuda.is_available() else "cpu")
    cuda = args.device == "cuda"
    dtype = resolve_dtype(args)
    float_bytes = torch.empty(0, dtype=dtype).element_size()
    config, family = load_config(model_dir), model_family(model_dir)
    tensors = shape_checkpoint(model_dir) if args.load_format == "dummy" else read_checkpoint(model_dir)
    has = model_stages(model_dir)
    configs = {s: c for s, c in args.stage_configs(together=only is None).items()
               if s in has and (s == only if only is not None else c.num_replicas > 0)}
    if only is not None:  # one `omnimesh stage` process is one replica
        configs = {s: replace(c, num_replicas=1) for s, c in configs.items()}
    if cuda:
        count, memory_of, source = _cuda_memory(device_memory, num_devices)
        args.check_devices(count, "CUDA devices", only)
    else:
        count, source = 0, "--device-memory" if device_memory is not None else "the host's RAM"
        host = device_memory if device_memory is not None else host_memory()
        memory_of = lambda i: host  # noqa: E731
    plan = MemoryPlan(Path(model_dir), args.device, str(dtype).removeprefix("torch."), {}, source)
    on_device: dict[str, list[tuple[str, int, float | None]]] = {}  # device -> [(stage, need, utilization | None)]
    for stage, cfg in configs.items():
        if cfg.num_nodes == 1 and args.node_rank > 0:
            continue  # a stage on node 0 only: nothing of it runs on this host
        weights = stage_weights(tensors, STAGE_PARTS[family][stage], float_bytes)
        driver = weights.driver if args.node_rank == 0 or cfg.num_nodes == 1 else 0
        kv = _kv_shape(config, stage, cfg) if stage in LM_STAGES else None
        sp = StagePlan(stage, cfg, (), weights.per_rank(cfg.pp, cfg.tp, cfg.pp_layer_partition), driver)
        if stage == "encoder" and (args.node_rank == 0 or cfg.num_nodes == 1):  # rank 0 keeps its outputs
            sp.cache = parse_size(args.encoder_cache_memory, "--encoder-cache-memory")
        if kv is not None and stage == "thinker" and kv.max_len > (limit := int(kv.config.max_position_embeddings)):
            plan.refusals.append(f"stage thinker: --max-model-len {kv.max_len} exceeds the model's "
                                 f"max_position_embeddings {limit}")  # as its handler refuses after loading
        if kv is not None:
            sp.kv_per_token = kv.per_token(cfg.pp, cfg.tp, cfg.pp_layer_partition, kv_cache_dtype(cfg.kv_cache_dtype, dtype))
            sp.kv_max_len = kv.max_len
            sp.kv_one_sequence = kv.one_sequence(sp.kv_per_token, args.block_size)
            pool = cfg.kv_cache_memory if cfg.kv_cache_memory is not None or cuda else CPU_KV_CACHE_BYTES
            sp.kv_pool = pool if pool is not None else sp.kv_one_sequence
            if pool is not None and pool // (sp.kv_per_token * args.block_size) * args.block_size < kv.max_len:
                plan.refusals.append(  # the engine's own check (lm_engine.py), the same block arithmetic
                    f"stage {stage}: its KV cache of {fmt_bytes(pool)} per rank (kv_cache_memory"
                    f"{'' if cfg.kv_cache_memory is not None else ', the CPU default'}) holds fewer than the "
                    f"{kv.max_len} tokens of one sequence ({kv.what}), {fmt_bytes(sp.kv_one_sequence)} per rank: "
                    f"raise --kv-cache-memory (or this stage's kv_cache_memory in --stage-overrides)"
                    f"{' or lower --max-model-len' if stage == 'thinker' else ''}")
        plan.stages.append(sp)
        if not cuda and cfg.kv_cache_memory is not None and sp.kv_pool > memory_of(0):
            plan.refusals.append(  # pages are touched as it fills: a pool past the host's RAM could never be filled
                f"stage {stage}: its KV cache of {fmt_bytes(sp.kv_pool)} per rank (kv_cache_memory) is more than this "
                f"host's {fmt_bytes(memory_of(0))} of RAM, so it could never fill: lower --kv-cache-memory")
        if not cuda:
            plan.total_cpu += cfg.num_replicas * (weights.split + driver + cfg.world_size * sp.kv_pool + sp.cache)
            sp.devices = ("cpu",)
            continue
        sized_by_utilization = kv is not None and cfg.kv_cache_memory is None
        for replica in range(cfg.num_replicas):
            devices = _stage_devices(cfg, replica)
            if replica == 0:
                sp.devices = tuple(f"cuda:{d}" for d in devices)
            sp.copies.append(",".join(f"cuda:{d}" for d in devices))
            for rank, d in enumerate(devices):
                need = sp.need if rank == 0 else sp.need - sp.driver - sp.cache
                on_device.setdefault(f"cuda:{d}", []).append(
                    (stage, need, cfg.gpu_memory_utilization if sized_by_utilization else None))
        budgets = [int(memory_of(int(d)) * cfg.gpu_memory_utilization) for d in _stage_devices(cfg, 0)]
        sp.budget = min(budgets)
        sp.missing = max(0, max(sp.need - b for b in budgets))  # rank 0 holds the most
        if sp.missing:
            share = fmt_bytes(sp.weights_per_rank)
            kv_text = ("" if kv is None else f" + KV cache {fmt_bytes(sp.kv_pool)} ("
                       + (f"one {kv.max_len}-token sequence, {kv.what}" if cfg.kv_cache_memory is None
                          else "kv_cache_memory") + ")")
            if sp.cache:
                kv_text += f" + encoder cache {fmt_bytes(sp.cache)} on rank 0 (--encoder-cache-memory; 0 = off)"
            plan.errors.append(
                f"stage {stage} (pp {cfg.pp} x tp {cfg.tp} on {','.join(sp.devices)}): needs {fmt_bytes(sp.need)} "
                f"per rank (weights: {share} as its share of pp x tp + {fmt_bytes(driver)} kept whole on rank 0"
                f"{kv_text}), but may take gpu_memory_utilization {cfg.gpu_memory_utilization:g} x "
                f"{fmt_bytes(memory_of(int(_stage_devices(cfg, 0)[0])))} = {fmt_bytes(sp.budget)}: "
                f"{fmt_bytes(sp.missing)} missing per rank")
            sp.recommendation, sp.fits_with = _recommend(stage, cfg, config, weights, kv, dtype, args.block_size,
                                                         count, memory_of, sp.cache)
    if cuda:
        plan.memory = {d: memory_of(int(d.split(":")[1])) for d in sorted(on_device, key=lambda d: int(d[5:]))}
        for d, entries in sorted(on_device.items()):
            _check_shared(plan, d, entries)
    else:
        plan.memory = {"cpu": memory_of(0)}
        weights_only = sum(s.cfg.num_replicas * (s.weights_per_rank * s.cfg.world_size + s.driver)
                           for s in plan.stages)
        here = sum(s.cfg.num_replicas * (s.weights_per_rank * s.cfg.ranks_per_node + s.driver)  # this host's ranks
                   for s in plan.stages)  # (driver 0 off node 0)
        processes = sum(s.cfg.num_replicas * s.cfg.ranks_per_node for s in plan.stages) + (only is None)  # + gateway
        arenas = sum(s.cfg.num_replicas * s.cfg.shm_arena_size for s in plan.stages  # reserved whole at start
                     if s.cfg.transport != "grpc" and (args.node_rank == 0 or s.cfg.num_nodes == 1))
        if (floor := here + processes * PROCESS_FLOOR_BYTES + arenas) > plan.memory["cpu"]:
            plan.refusals.append(  # what is resident whatever the traffic: this start would exhaust the host
                f"{processes} processes ({'the stage ranks and the gateway' if only is None else 'the stage ranks'}:"
                f" " + ", ".join(f"{s.stage} {s.cfg.num_replicas} x {s.cfg.ranks_per_node}" for s in plan.stages)
                + f") need at least {fmt_bytes(floor)} of RAM ({fmt_bytes(here)} of weights, about "
                f"{fmt_bytes(PROCESS_FLOOR_BYTES)} of runtime each and {fmt_bytes(arenas)} of shared-memory arenas), "
                f"but this host has {fmt_bytes(plan.memory['cpu'])}: lower num_replicas or pp x tp, or spread the "
                f"stages over more hosts")
        if plan.total_cpu > plan.memory["cpu"]:
            plan.errors.append(
                f"the stages may take up to {fmt_bytes(plan.total_cpu)} (weights about {fmt_bytes(weights_only)}, "
                f"the rest KV pools when full) of this host's {fmt_bytes(plan.memory['cpu'])} RAM: lower "
                f"--kv-cache-memory (per rank; pages are touched only as the cache fills) or spread the stages over "
                f"more hosts (--num-nodes)")
    return plan


def _check_shared(plan: MemoryPlan, device: str, entries: list[tuple[str, int, float | None]]) -> None:
    """Stages sharing one device: a stage that sizes its KV cache from gpu_memory_utilization takes that
    fraction of the whole device; the others take what they need. Together they must fit the device."""
    if len(entries) < 2:
        return
    memory = plan.memory[device]
    fraction = sum(u for _, _, u in entries if u is not None)
    fixed = sum(need for _, need, u in entries if u is None)
    by_util = [f"{s} ({u:g})" for s, _, u in entries if u is not None]
    if fraction * memory + fixed > memory:
        others = [f"{s} ({fmt_bytes(n)})" for s, n, u in entries if u is None]
        plan.errors.append(
            f"{device} is shared by {', '.join(by_util + others)}: "
            + (f"their gpu_memory_utilization adds up to {fraction:g} of the device" if len(by_util) > 1
               else f"gpu_memory_utilization {fraction:g} of the device")
            + (f" besides {fmt_bytes(fixed)} for the others" if others else "")
            + ", more than the whole device (each of these stages sizes its KV cache to take its fraction of the "
              "device): give stages devices of their own (\"devices\" in --stage-overrides), lower their "
              "gpu_memory_utilization so that together they fit, or give them a fixed kv_cache_memory"
            + "".join(f"; the encoder's part includes its cache, {fmt_bytes(s.cache)} (--encoder-cache-memory; 0 = off)"
                      for s in plan.stages if s.stage == "encoder" and s.cache and s.devices[:1] == (device,)))


def _recommend(stage: str, cfg: StageConfig, config: Any, weights: StageWeights, kv: KVShape | None, dtype: Any,
               block_size: int, per_host: int, memory_of: Callable[[int], int],
               cache: int = 0) -> tuple[str, tuple[int, int] | None]:
    """The smallest pp x tp (tp first, within a host) that the model's layout accepts and that fits: what to
    say, and (pp, tp) (None when no layout up to the stage's hosts' devices fits)."""
    from omnimesh.models.qwen3_omni.paged_kv import kv_cache_dtype
    from omnimesh.models.qwen3_omni.parallel_plan import check_layout

    hosts, limit = cfg.num_nodes, per_host * cfg.num_nodes
    candidates = sorted(((pp, tp) for tp in range(1, limit + 1) for pp in range(1, limit // tp + 1)
                         if pp * tp % hosts == 0 and (pp, tp) != (cfg.pp, cfg.tp)),
                        key=lambda c: (c[0] * c[1], c[1] > per_host, c[0]))
    for pp, tp in candidates:
        try:
            cand = replace(cfg, pp=pp, tp=tp, pp_layer_partition=None, devices=None)
            with _quiet_partitions():
                check_layout(config, {stage: cand})
        except ValueError:
            continue
        need = weights.per_rank(pp, tp) + weights.driver + cache
        if kv is not None:
            one = kv.one_sequence(kv.per_token(pp, tp, None, kv_cache_dtype(cfg.kv_cache_dtype, dtype)), block_size)
            need += cfg.kv_cache_memory if cfg.kv_cache_memory is not None and cfg.kv_cache_memory >= one else one
        budget = min(int(memory_of(i) * cfg.gpu_memory_utilization) for i in range(cand.ranks_per_node))
        if need <= budget:
            override = json.dumps({stage: {"pp": pp, "tp": tp}})
            devices = f" and {cand.ranks_per_node} devices in its \"devices\"" if cfg.devices else ""
            return (f"pp {pp} x tp {tp} ({fmt_bytes(need)} of {fmt_bytes(budget)} per rank): "
                    f"--stage-overrides '{override}'{devices}"), (pp, tp)
    why = "" if kv is None or stage == "thinker" else f" (its KV cache must hold {kv.max_len} tokens, {kv.what})"
    lower = f"lower --max-model-len ({kv.max_len} tokens now), " if kv is not None and stage == "thinker" else ""
    return (f"no pp x tp up to the {limit} CUDA devices of {'its hosts' if hosts > 1 else 'this host'} fits{why}; "
            f"{lower}use devices with more memory, or more hosts (--num-nodes)"), None
