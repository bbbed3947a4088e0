"""Per-stage settings: parallel layout, memory, scheduling — and `--stage-overrides` parsing.

Role: the frozen dataclasses that say how one stage runs, each validated in `__post_init__` with a
message that names the numbers and the fix. `StageConfig.resolve(defaults, overrides)` merges the
global flags with the JSON given to `--stage-overrides` (keyed by stage name or id).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

from omnimesh import json_text

STAGES: tuple[str, ...] = ("encoder", "thinker", "talker", "vocoder")
STAGE_IDS: dict[str, str] = {str(i): name for i, name in enumerate(STAGES)}
TRANSPORT_CHOICES: tuple[str, ...] = ("auto", "grpc", "shm", "cuda-ipc")
# dtypes of the thinker's / talker's paged KV cache, vLLM's names (omnimesh/models/qwen3_omni/paged_kv.py maps them)
KV_CACHE_DTYPE_CHOICES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")
# --load-format, vLLM's names: auto and safetensors read the folder's safetensors; dummy reads no weights (random
# values, omnimesh/models/loader.py). vLLM's other formats need files or libraries omnimesh does not read.
LOAD_FORMATS: tuple[str, ...] = ("auto", "safetensors", "dummy")
VLLM_ONLY_LOAD_FORMATS: tuple[str, ...] = ("pt", "npcache", "tensorizer", "sharded_state", "gguf", "bitsandbytes",
                                           "mistral", "runai_streamer", "runai_streamer_sharded", "fastsafetensors")
# below this a CPU tensor goes inline even on a shared-memory edge: a slot's publish, claim and release
# (byte-range locks) cost the same however small the tensor. `bench/handoff.py --sizes 256B,4KiB,16KiB,
# 64KiB,256KiB --transports shm,grpc` on the 2-core CPU machine: held 0.64 ms by reference vs 0.54 ms
# inline up to 64 KiB, shm ahead only from 256 KiB; inline bytes also cross the gateway, so the line is lower
SHM_MIN_TENSOR_BYTES = 16 * 2**10
# OS priority (nice increment) of a stage's bulk steps on CPU when the stage config leaves it open: steps in
# which no request waits for its first output (see EngineLoop). On cores shared by the stages, the first-audio
# path (a new request's encoder work, prefill and first tokens, first codes, first window; the gateway) runs
# first, the vocoder's later windows behind it, LLM steps of running requests last: such a step costs
# about the same for 1 request as for 16, so one that waits carries more of them. A/B on the 2-core CPU
# machine against the whole LLM processes at nice +8 (README): TTFP p50 at c=8 -13%, at c=16 -18%, req/s
# the same; at c=32 TTFP -43% but req/s -13% (LLM steps are urgent nearly all the time). The vocoder's later
# windows at +14 instead of +4 (8 paired runs of 32 / 128 / 256 requests at c = 1 / 8 / 16, commit c8afa05):
# TTFP p50 at c=8 75-102 ms (median 85) against 94-111 (96), at c=16 93-111 against 104-139 ms; requests/s
# at c=16 16.5-17.6 (median 17.2) against 16.5-18.9 (17.6), within the noise; playback stalls the same
BULK_NICE_ON_CPU = {"thinker": 19, "talker": 19, "vocoder": 14}
# steps a streaming request of the thinker / talker sits out, at most, while requests waiting for their first
# output step alone (EngineLoop `yield_steps`). A/B on the 2-core CPU machine against 0 (every step carries
# every ready request; README), 3 pairs at c = 1 / 8 / 16: 16 gave TTFP p50 at c=8 104-116 vs 122-139 ms, at
# c=16 128-141 vs 176-193 ms, requests/s at c=16 -3% (within the noise); 4 cut TTFP at c=8 less (114-126 ms):
# a request's first output takes ~6 steps, and with 4 every fifth of them carries every stream again. At 16
# a stream still gets a step per ~70 ms here, faster than the 80 ms of audio a talker step makes
YIELD_STEPS = {"thinker": 16, "talker": 16}
# model rounds one compute call of the thinker / talker may run while every request in it waits for its first
# output (a thinker's eager tokens after its first, a talker's first chunk of codes): no trip through the
# engine loop, the servicer, the gateway and the next stage between the rounds, which on shared cores cost
# more than a round. Paired runs on the 2-core CPU machine (one mesh, 8 against 1 alternating every 8 s;
# README): TTFP p50 at c=8 78.8 vs 92.3 ms (5 pairs), at c=1 45.5 vs 50.0 ms, c=16 20.1 vs 18.9 req/s (4 pairs)
FIRST_OUTPUT_ROUNDS = {"thinker": 8, "talker": 8}


def _is_nice_increment(value: object) -> bool:
    """A whole number from 0 (as started) to 19 (the lowest priority)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 19


@dataclass(frozen=True, slots=True)
class StageConfig:
    """How one stage runs. Field docs double as `--stage-overrides` documentation."""

    pp: int = field(default=1, metadata={"help": "pipeline-parallel ranks (contiguous layer ranges)"})
    tp: int = field(default=1, metadata={"help": "tensor-parallel ranks (sharded weight matrices)"})
    devices: str | None = field(default=None, metadata={"help": "comma-separated device ids, e.g. '0,1'"})
    num_replicas: int = field(default=1, metadata={
        "help": "independent copies of the stage under `omnimesh serve`, each with pp x tp ranks of its own; the "
                "gateway sends each request to the least busy one. 0 for the talker and vocoder (both): they do not "
                "run, and the mesh answers text only"})
    gpu_memory_utilization: float = field(default=0.9, metadata={"help": "fraction of each device the stage may take"})
    max_num_seqs: int = field(default=256, metadata={"help": "most requests the stage runs at once"})
    max_waiting_requests: int = field(default=256, metadata={
        "help": "most requests the stage's LLM engine keeps waiting beyond its free seats (the thinker checks it); "
                "one more is refused (RESOURCE_EXHAUSTED, HTTP 429) at once instead of queued (0: never queue)"})
    max_model_len: int | None = field(default=None, metadata={"help": "longest prompt + output, in tokens"})
    max_num_batched_tokens: int | None = field(
        default=None, metadata={"help": "most tokens in one engine step; longer prompts are prefilled in chunks"})
    kv_cache_memory: int | None = field(
        default=None, metadata={"help": "KV-cache bytes per rank, e.g. '2GiB' (CPU default 4GiB; CUDA: from utilization)"})
    kv_cache_dtype: str = field(
        default="auto", metadata={"help": "dtype of the KV cache's keys and values: auto (the model's), float32, "
                                          "bfloat16, float16, fp8 (= fp8_e4m3) or fp8_e5m2"})
    pp_layer_partition: tuple[int, ...] | None = field(
        default=None, metadata={"help": "layers per pipeline rank, e.g. [3, 5]; must sum to the layer count"}
    )
    transport: str = field(
        default="auto", metadata={"help": "where the stage's output tensors travel: auto | grpc | shm | cuda-ipc"})
    shm_arena_size: int = field(
        default=256 * 2**20, metadata={"help": "bytes of the stage's shared-memory arena, e.g. '1GiB' (0: none)"})
    nice: int = field(
        default=0, metadata={"help": "OS priority of the stage's processes as a nice increment, 0 (as started) to "
                                     "19 (lowest)"})
    bulk_nice: int | None = field(
        default=None, metadata={"help": "how much lower (nice increment, 0-19) the stage's steps run when no request in "
                                        "them waits for its first output; default on CPU: 19 for the thinker and "
                                        "talker, 4 for the vocoder, 0 for the encoder; on CUDA 0"})
    yield_steps: int | None = field(
        default=None, metadata={"help": "while requests wait for their first output, they step alone and a streaming "
                                        "request sits out at most this many steps in a row (0: every step carries "
                                        "every ready request); default 16 for the thinker and talker, 0 elsewhere"})
    first_output_rounds: int | None = field(
        default=None, metadata={"help": "model rounds one step may run back to back while every request in it waits "
                                        "for its first output (1: one round per step); default 8 for the thinker "
                                        "and talker"})
    shm_min_tensor_size: int = field(
        default=SHM_MIN_TENSOR_BYTES, metadata={"help": "smallest output tensor that goes by shared-memory reference on "
                                                        "a co-located edge; smaller ones go inline, e.g. '16KiB' (0: all)"})
    scheduling_policy: str = field(
        default="fcfs", metadata={"help": "the thinker's / talker's order: fcfs (arrival) or priority (vLLM's: a "
                                          "request's priority, lower first, arrival among equals; a waiting request "
                                          "takes the seat and blocks of a lower-priority running one)"})
    enable_prefix_caching: bool = field(
        default=False, metadata={"help": "the thinker reuses the KV-cache blocks of a prompt prefix it has "
                                         "computed for an earlier request (vLLM's automatic prefix caching)"})
    enable_chunked_prefill: bool = field(
        default=True, metadata={"help": "the thinker / talker prefills a prompt longer than a step's budget over several "
                                        "steps (false: whole, in one step; the step must then hold max_model_len "
                                        "tokens)"})
    default_sampling_params: dict[str, Any] | None = field(
        default=None, metadata={"help": "the thinker's / talker's default sampling, over the model's own (requests "
                                        "still set theirs), as vLLM-Omni's per-stage default_sampling_params: "
                                        "temperature, top_p, top_k, min_p, max_tokens, repetition_penalty, "
                                        "presence_penalty, frequency_penalty; e.g. {\"temperature\": 0.7}"})
    num_nodes: int = field(
        default=1, metadata={"help": "hosts the stage's pp x tp ranks span, pp x tp / num_nodes consecutive ranks on each "
                                     "(node 0 runs the stage's server); default: --num-nodes for a stage of more than "
                                     "one rank, 1 (node 0 only) for a single rank"})

    def __post_init__(self) -> None:
        for name in ("pp", "tp", "num_replicas", "max_num_seqs", "num_nodes"):
            value = getattr(self, name)
            least = 0 if name == "num_replicas" else 1  # 0 replicas: a stage not run (resolve_stage says which may)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name} must be a whole number >= {least}, got {value!r}")
        mw = self.max_waiting_requests
        if not isinstance(mw, int) or isinstance(mw, bool) or mw < 0:
            raise ValueError(f"max_waiting_requests must be a whole number >= 0 (0: never queue), got {mw!r}")
        if not (0.0 < self.gpu_memory_utilization <= 1.0):
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}; 0.9 is the usual value"
            )
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.kv_cache_memory is not None and (not isinstance(self.kv_cache_memory, int) or self.kv_cache_memory < 1):
            raise ValueError(f"kv_cache_memory must be a size in bytes >= 1 (e.g. '512MiB'), got {self.kv_cache_memory!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_CHOICES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.transport not in TRANSPORT_CHOICES:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORT_CHOICES)}, got {self.transport!r}")
        if not isinstance(self.shm_arena_size, int) or self.shm_arena_size < 0:
            raise ValueError(f"shm_arena_size must be a size in bytes >= 0 (e.g. '256MiB'), got {self.shm_arena_size!r}")
        if not isinstance(self.shm_min_tensor_size, int) or self.shm_min_tensor_size < 0:
            raise ValueError(f"shm_min_tensor_size must be a size in bytes >= 0 (e.g. '16KiB'), "
                             f"got {self.shm_min_tensor_size!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if not _is_nice_increment(self.nice):
            raise ValueError(f"nice must be a whole number from 0 (as started) to 19 (lowest priority), got {self.nice!r}; "
                             f"a stage can only lower its own priority")
        if self.bulk_nice is not None and not _is_nice_increment(self.bulk_nice):
            raise ValueError(f"bulk_nice must be a whole number from 0 (same priority as the stage's other steps) to 19 "
                             f"(lowest), got {self.bulk_nice!r}")
        if self.yield_steps is not None and (not isinstance(self.yield_steps, int) or isinstance(self.yield_steps, bool)
                                             or self.yield_steps < 0):
            raise ValueError(f"yield_steps must be a whole number >= 0 (0: every step carries every ready request), "
                             f"got {self.yield_steps!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}")
        if not isinstance(self.enable_chunked_prefill, bool):
            raise ValueError(f"enable_chunked_prefill must be true or false, got {self.enable_chunked_prefill!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}")
        if self.default_sampling_params is not None:
            if not isinstance(self.default_sampling_params, dict):
                raise ValueError(f"default_sampling_params must be an object such as {{\"temperature\": 0.7}}, got "
                                 f"{self.default_sampling_params!r}")
            from omnimesh.models.qwen3_omni.sampling import SamplingParams, with_defaults

            with_defaults(SamplingParams(), self.default_sampling_params, "default_sampling_params")
        rounds = self.first_output_rounds
        if rounds is not None and (not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1):
            raise ValueError(f"first_output_rounds must be a whole number >= 1 (1: one model round per step), got {rounds!r}")
        if self.world_size % self.num_nodes:
            raise ValueError(
                f"pp x tp = {self.pp} x {self.tp} = {self.world_size} ranks cannot be spread evenly over num_nodes = "
                f"{self.num_nodes} hosts (each host runs pp x tp / num_nodes consecutive ranks); make pp x tp a multiple "
                f"of {self.num_nodes} (e.g. pp = {self.num_nodes} with tp inside a host), or keep the stage on node 0 "
                f"with num_nodes 1 in --stage-overrides"
            )
        if self.num_replicas > 1 and self.num_nodes > 1:
            raise ValueError(
                f"num_replicas = {self.num_replicas} with num_nodes = {self.num_nodes}: a stage is either copied on "
                f"one host or spread over several, not both; set num_nodes 1 for it in --stage-overrides, or start "
                f"its copies on their hosts and name each in the gateway's --stages"
            )
        if self.devices is not None and self.device_list():
            n, grid = len(self.device_list()), f"{self.pp} x {self.tp}"
            if self.num_replicas > 1 and n != self.world_size * self.num_replicas:
                raise ValueError(
                    f"devices {self.devices!r} names {n} devices but pp x tp x num_replicas = {grid} x "
                    f"{self.num_replicas} = {self.world_size * self.num_replicas}; give exactly pp x tp devices per "
                    f"replica (replica k takes the k-th group of pp x tp)")
            if self.num_replicas == 1 and n != self.ranks_per_node:
                if self.num_nodes == 1:
                    raise ValueError(f"devices {self.devices!r} names {n} devices but pp x tp = {grid} = "
                                     f"{self.world_size}; give exactly pp x tp devices")
                raise ValueError(f"devices {self.devices!r} names {n} devices but each of the {self.num_nodes} hosts "
                                 f"runs pp x tp / num_nodes = {grid} / {self.num_nodes} = {self.ranks_per_node} ranks; "
                                 f"give exactly {self.ranks_per_node} device ids (the same ids serve on every host)")
        if self.pp_layer_partition is not None:
            if len(self.pp_layer_partition) != self.pp or any(n < 1 for n in self.pp_layer_partition):
                raise ValueError(
                    f"pp_layer_partition {list(self.pp_layer_partition)} must list {self.pp} positive layer counts (one per pipeline rank)"
                )

    def effective_bulk_nice(self, stage: str, device: str) -> int:
        """How much lower the stage's bulk steps run: its own setting, else BULK_NICE_ON_CPU for a stage that
        is not on CUDA (a GPU step's host thread mostly waits for the device), else 0."""
        if self.bulk_nice is not None:
            return self.bulk_nice
        return BULK_NICE_ON_CPU.get(stage, 0) if device != "cuda" else 0

    def effective_yield_steps(self, stage: str) -> int:
        """The stage's own `yield_steps`, else YIELD_STEPS (the LLM stages), else 0."""
        return self.yield_steps if self.yield_steps is not None else YIELD_STEPS.get(stage, 0)

    def effective_first_output_rounds(self, stage: str) -> int:
        """The stage's own `first_output_rounds`, else FIRST_OUTPUT_ROUNDS (the LLM stages), else 1."""
        return self.first_output_rounds if self.first_output_rounds is not None else FIRST_OUTPUT_ROUNDS.get(stage, 1)

    @property
    def world_size(self) -> int:
        return self.pp * self.tp

    def replica_devices(self, replica: int) -> list[str]:
        """The devices of replica `replica` (0-based): its group of pp x tp in `devices`; [] when none are given."""
        devices = self.device_list()
        return devices[replica * self.world_size:(replica + 1) * self.world_size]

    @property
    def ranks_per_node(self) -> int:
        """Ranks on each host: node n runs global ranks [n * ranks_per_node, (n + 1) * ranks_per_node)."""
        return self.world_size // self.num_nodes

    def device_list(self) -> list[str]:
        if not self.devices:
            return []
        items = [d.strip() for d in str(self.devices).split(",") if d.strip()]
        for d in items:
            if not d.isdigit():
                raise ValueError(f"devices {self.devices!r}: {d!r} is not a device index")
        if len(set(items)) != len(items):
            raise ValueError(f"devices {self.devices!r} repeats a device")
        return items


_KEYS = {f.name: f for f in fields(StageConfig)}
_ALIASES = {"pipeline_parallel_size": "pp", "tensor_parallel_size": "tp", "replicas": "num_replicas"}


def typed_number(value: Any, kind: type, what: str, noun: str = "a number") -> Any:
    """A JSON value for a numeric setting of type `kind` (int: whole numbers only; booleans refused) ->
    kind(value); ValueError '<what>: <value> is not a whole number' (or `noun`) otherwise, infinities and NaN
    included (JSON's `Infinity` / `NaN` tokens, a protobuf double)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{what}: {value!r} is not a finite number")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise ValueError(f"{what}: {value!r} is not {'a whole number' if kind is int else noun}")
    return kind(value)


def parse_json_object(text: str, flag: str, keyed: str) -> dict[str, Any]:
    """A flag's JSON object value (`keyed` says by what, for the error) -> dict; errors name the flag."""
    try:
        raw = json_text.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag} is not valid JSON ({exc.msg} at char {exc.pos}): {text!r}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{flag} must be a JSON object {keyed}, got {type(raw).__name__}")
    return raw


def parse_stage_overrides(text: str | None) -> dict[str, dict[str, Any]]:
    """Parse `--stage-overrides` JSON into {stage name: {field: value}}; every error says what to fix."""
    if not text:
        return {}
    raw = parse_json_object(text, "--stage-overrides", "keyed by stage")
    out: dict[str, dict[str, Any]] = {}
    for key, settings in raw.items():
        stage = STAGE_IDS.get(str(key), str(key))
        if stage not in STAGES:
            raise ValueError(
                f"--stage-overrides: unknown stage {key!r}; stages are {', '.join(STAGES)} (or ids 0-{len(STAGES) - 1})"
            )
        if stage in out:
            raise ValueError(f"--stage-overrides names stage {stage!r} twice")
        if not isinstance(settings, dict):
            raise ValueError(f"--stage-overrides[{key!r}] must be an object, got {settings!r}")
        clean: dict[str, Any] = {}
        for name, value in settings.items():
            name = _ALIASES.get(name, name)
            if name not in _KEYS:
                raise ValueError(
                    f"--stage-overrides[{key!r}]: unknown key {name!r}; known keys: {', '.join(sorted(_KEYS))}"
                )
            if name == "pp_layer_partition" and value is not None:
                value = _layer_counts(value, f"--stage-overrides[{key!r}].pp_layer_partition")
            if name == "kv_cache_memory" and value is not None:
                value = parse_bytes(value, f"--stage-overrides[{key!r}].kv_cache_memory")
            if name in ("shm_arena_size", "shm_min_tensor_size"):
                value = parse_size(value, f"--stage-overrides[{key!r}].{name}")
            if name == "devices" and value is not None:
                value = ",".join(str(v) for v in value) if isinstance(value, list) else str(value)
            clean[name] = value
        out[stage] = clean
    return out


def _layer_counts(value: Any, where: str) -> tuple[int, ...]:
    """pp_layer_partition as given in JSON ([3, 5] or "3,5") -> (3, 5); anything else a ValueError naming it
    (the counts' number and sign are checked against pp with the rest of the stage's settings)."""
    parts = value.split(",") if isinstance(value, str) else value
    counts: list[int] = []
    for part in parts if isinstance(parts, list) else [None]:
        if isinstance(part, str) and part.strip().lstrip("-").isdigit():
            part = int(part)
        if isinstance(part, bool) or not isinstance(part, int):
            raise ValueError(f"{where} must list whole layer counts, one per pipeline rank ([3, 5] or \"3,5\"), "
                             f"got {value!r}")
        counts.append(part)
    return tuple(counts)


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def fmt_bytes(n: float) -> str:
    """1536 -> '1.5 KiB', 2**31 -> '2 GiB' (binary units, 3 significant digits below 100)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.3g} {unit}" if n < 100 else f"{n:.0f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


MAX_BYTES = 2**60  # 1 EiB: a size beyond it is a typo (99999999TiB overflowed a tensor's size; 1e30 an int64)


def parse_bytes(value: Any, what: str = "size") -> int:
    """'4GiB', '512MiB', '2G', '1e9' or a number -> bytes (decimal units K/M/G/T, binary KiB/MiB/GiB/TiB)."""
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected a size like '4GiB', got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        text = str(value).strip().lower().replace(" ", "")
        split = len(text.rstrip("kmgtib"))
        number_text, unit = text[:split], text[split:]
        try:
            number = float(number_text)
        except ValueError:
            raise ValueError(f"{what}: {value!r} is not a size; write e.g. '4GiB', '512MiB' or a byte count") from None
        if unit not in _UNITS:
            raise ValueError(f"{what}: unknown unit {unit!r} in {value!r}; use B, KiB, MiB, GiB, TiB (or K, M, G, T)")
    if not math.isfinite(number) or number * _UNITS[unit] > MAX_BYTES:  # nan / inf, or past any machine's memory
        raise ValueError(f"{what}: {value!r} is not a size this server can hold (at most 1 EiB)")
    size = int(number * _UNITS[unit])
    if size < 1:
        raise ValueError(f"{what} must be at least 1 byte, got {value!r}")
    return size


def parse_size(value: Any, what: str) -> int:
    """Like `parse_bytes`, but 0 (nothing) is allowed."""
    if value in (0, "0"):
        return 0
    return parse_bytes(value, what)


SPEECH_STAGES = ("talker", "vocoder")  # the stages a text-only mesh leaves out (num_replicas 0)


def resolve_stage(defaults: StageConfig, overrides: dict[str, Any], stage: str) -> StageConfig:
    try:
        cfg = replace(defaults, **overrides)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"stage {stage}: {exc}") from exc
    if cfg.num_replicas == 0 and stage not in SPEECH_STAGES:
        raise ValueError(f"stage {stage}: num_replicas 0 leaves out a stage every request needs; only the talker and "
                         f"vocoder may be left out (both: a text-only mesh)")
    return cfg
