"""Checked weight loading: one sub-module's weights out of a whole-model Hugging Face folder.

Role: a stage process (encoder, thinker, talker, vocoder) needs only its own part of a checkpoint.
`transformers`' sub-model `from_pretrained` silently keeps random weights when the keys do not line up
(shared/MODELS.md), so every stage loads through here instead: read only the safetensors shards and keys
under one checkpoint prefix, strip the prefix, map them onto the module, and raise a ValueError naming
what is missing. Nothing here knows a model family: the family adapter passes the prefix, the config
path and the module factory.

Data flow:
    model.safetensors | model.safetensors.index.json -> keys under `prefix` (only those shards opened)
      -> names relative to the module (per-expert tensors stacked per `StackedParam`)
      -> shape check -> module.load_state_dict(strict=False) with our own missing/unexpected checks
A read that takes longer than PROGRESS_EVERY_S logs how far it is (bytes and files, from the files' headers) as it
goes and its rate at the end (`ReadProgress`), as vLLM's "Loading safetensors checkpoint shards" bar does.

--load-format dummy (vLLM's flag): no file is read; every parameter is filled with values drawn uniformly from
[-1e-3, 1e-3] by a generator seeded from its checkpoint key, on the parameter's own device (so a tensor every tp rank
keeps whole is the same on each). Persistent buffers keep what the module's constructor gave them. For benchmarks
and deployment checks of a model's shape (config, tokenizer and processor files are still read), as in vLLM.
The stage process sets it once (`set_load_format`); its ranks, which may run in other processes or on Ray, get
it from `LoadFormatFactory` around their program factory.

Usage:
    module = build_submodule(model_dir, config_path="code2wav_config", factory=Code2WavClass, prefix="code2wav.")
    report = load_state_dict(model_dir, "talker.", talker_module, stacked=HF_PER_EXPERT_MOE)
"""

from __future__ import annotations

import contextlib
import json
import logging
import struct
import time
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from omnimesh.config.stage_config import LOAD_FORMATS, fmt_bytes

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
log = logging.getLogger(__name__)

_SHOW = 5  # how many key names an error message lists
PROGRESS_EVERY_S = 10.0  # how often a long checkpoint read logs how far it is (ReadProgress)
DUMMY_RANGE = 1e-3  # vLLM's dummy weights: uniform in [-1e-3, 1e-3]
_load_format = "auto"  # this process's (set_load_format)

# per checkpoint key, the (parameter, its weight_loader, that loader's extra args) it is sharded into
Plan = dict[str, list[tuple[torch.nn.Parameter, Callable[..., None], tuple[Any, ...]]]]


def set_load_format(load_format: str) -> None:
    """How this process's loads get their weights from now on (--load-format; ValueError naming the choices)."""
    global _load_format
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    _load_format = load_format


def dummy_weights() -> bool:
    """True when this process fills weights with random values instead of reading them (--load-format dummy)."""
    return _load_format == "dummy"


@dataclass(frozen=True)
class LoadFormatFactory:
    """A rank's program factory that first sets the stage's load format in the process it runs in (picklable:
    mp ranks and Ray actors build their programs from it)."""

    load_format: str
    factory: Callable[[Any], Any]

    def __call__(self, ps: Any) -> Any:
        set_load_format(self.load_format)
        return self.factory(ps)


def with_load_format(factory: Callable[[Any], Any], load_format: str) -> Callable[[Any], Any]:
    """`factory` for ranks that load as `load_format` says: wrapped in a LoadFormatFactory unless it is "auto" (what
    node 0's executor (mp_executor.start_program) and a headless node (stage_registry.rank_program) both hand their
    ranks)."""
    return factory if load_format == "auto" else LoadFormatFactory(load_format, factory)


def fill_dummy(tensor: torch.Tensor, key: str) -> None:
    """Fill a floating-point tensor in place with --load-format dummy's values for checkpoint `key`."""
    if not tensor.is_floating_point():
        return
    generator = torch.Generator(device=tensor.device).manual_seed(zlib.crc32(key.encode()))
    with torch.no_grad():
        tensor.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=generator)


@dataclass(frozen=True)
class StackedParam:
    """A module parameter that checkpoints store as one tensor per expert (and per projection).

    A module parameter whose name ends with `suffix` and has shape (E, ...) is assembled from
    `sources` (each with "{e}" for the expert index, replacing `suffix` in the name): for every expert
    the source tensors are concatenated along dim 0, then the E results are stacked on a new dim 0.
    """

    suffix: str
    sources: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.sources or any("{e}" not in s for s in self.sources):
            raise ValueError(
                f"StackedParam {self.suffix!r}: every source needs an '{{e}}' field, got {self.sources}"
            )

    def matches(self, name: str) -> bool:
        return name == self.suffix or name.endswith("." + self.suffix)

    def source_names(self, name: str, n_experts: int) -> list[list[str]]:
        """Per expert, the relative checkpoint names that make up module parameter `name`."""
        base = name[: len(name) - len(self.suffix)]
        return [[base + s.format(e=e) for s in self.sources] for e in range(n_experts)]


# The usual Hugging Face MoE checkpoint layout (Qwen2/3-MoE, OLMoE, DeepSeek, ...): separate
# gate/up/down Linear weights per expert, which `transformers` 5 fuses into 3-D expert tensors.
HF_PER_EXPERT_MOE: tuple[StackedParam, ...] = (
    StackedParam(
        "mlp.experts.gate_up_proj", ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight")
    ),
    StackedParam("mlp.experts.down_proj", ("mlp.experts.{e}.down_proj.weight",)),
)


@dataclass(frozen=True)
class LoadReport:
    """What `load_state_dict` did: module entries filled, checkpoint keys under the prefix left unused."""

    prefix: str
    loaded: int
    unexpected: tuple[str, ...]


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Map every tensor name in the folder's safetensors checkpoint to the file that holds it."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no 'weight_map'; cannot tell which shard holds which tensor")
        return {key: model_dir / shard for key, shard in weight_map.items()}
    single = model_dir / SINGLE_FILE
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {key: single for key in f.keys()}
    raise ValueError(f"{model_dir} holds neither {SINGLE_FILE} nor {INDEX_FILE}")


def _head(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_SHOW])
    return shown + (f", ... ({len(names) - _SHOW} more)" if len(names) > _SHOW else "")


def _expected_entries(module: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
    """Module state entries (params + persistent buffers) and, per entry, the names it is tied to."""
    state = module.state_dict(keep_vars=True)
    by_tensor: dict[int, list[str]] = defaultdict(list)
    for name, tensor in state.items():
        by_tensor[id(tensor)].append(name)
    aliases = {name: by_tensor[id(tensor)] for name, tensor in state.items()}
    return state, aliases


def _plan(
    state: dict[str, torch.Tensor],
    aliases: dict[str, list[str]],
    available: set[str],
    stacked: Sequence[StackedParam],
) -> tuple[dict[str, list[list[str]]], list[str]]:
    """For each module entry, the relative checkpoint names to read; plus the names that are absent.

    An entry read directly is one group of one name; a stacked entry is one group per expert.
    """
    plan: dict[str, list[list[str]]] = {}
    missing: list[str] = []
    for name, tensor in state.items():
        if name in available:
            plan[name] = [[name]]
            continue
        spec = next((s for s in stacked if s.matches(name)), None)
        if spec is not None and tensor.dim() >= 1:
            groups = spec.source_names(name, tensor.shape[0])
            absent = [src for group in groups for src in group if src not in available]
        else:
            groups, absent = [], [name]
        if not absent:
            plan[name] = groups
        elif not any(alias in available for alias in aliases[name] if alias != name):
            missing.extend(absent)  # (a tied alias that the checkpoint holds fills this entry instead)
    return plan, missing


def safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """A safetensors file's tensor entries (dtype, shape, data_offsets) from its header alone: 8 bytes of header
    length, then the JSON header; no tensor data is read."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


class ReadProgress:
    """How far a long checkpoint read is, as vLLM's "Loading safetensors checkpoint shards" bar says it: a log line
    every PROGRESS_EVERY_S seconds once the read has taken that long, and one when it ends; a quick read (the tiny
    model's) says nothing. The total is the files' own sizes of the tensors this process reads, from their headers,
    parsed only once a first line is due (a quick read opens no header twice)."""

    def __init__(self, what: str, by_file: dict[Path, list[str]]) -> None:
        self.what, self.by_file = what, by_file
        self.total: int | None = None
        self.done = self.files_done = 0
        self.start = self.noted = time.monotonic()

    def _total(self) -> int:
        if self.total is None:
            self.total = 0
            for path, keys in self.by_file.items():
                header = safetensors_header(path)
                self.total += sum(header[key]["data_offsets"][1] - header[key]["data_offsets"][0] for key in keys)
        return self.total

    def read(self, tensor: torch.Tensor) -> None:
        self.done += tensor.numel() * tensor.element_size()  # as stored: safetensors hands back the file's dtype
        now = time.monotonic()
        if now - self.start >= PROGRESS_EVERY_S and now - self.noted >= PROGRESS_EVERY_S:
            self.noted = now
            total = self._total()
            log.info("%s: read %s of %s (%.0f%%) from %d of %d checkpoint file(s) in %.0f s", self.what,
                     fmt_bytes(self.done), fmt_bytes(total), 100 * self.done / max(total, 1),
                     self.files_done + 1, len(self.by_file), now - self.start)

    def finish(self) -> None:
        took = time.monotonic() - self.start
        if took >= PROGRESS_EVERY_S:
            log.info("%s: read %s from %d checkpoint file(s) in %.0f s (%s/s)", self.what, fmt_bytes(self.done),
                     len(self.by_file), took, fmt_bytes(self.done / max(took, 1e-9)))


def iter_tensors(files: dict[str, Path], keys: Iterable[str], what: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (key, tensor) for exactly `keys`, one tensor at a time, opening each shard once; a long read logs its
    progress under `what` (`ReadProgress`).

    For sharded loading: the caller narrows each full tensor to its shard and drops it before the next
    one is read, so a rank never holds more than one full tensor beyond its own shards.
    """
    by_file: dict[Path, list[str]] = defaultdict(list)
    for key in sorted(set(keys)):
        by_file[files[key]].append(key)
    progress = ReadProgress(what, by_file)
    for path, names in sorted(by_file.items()):
        with safe_open(str(path), framework="pt") as f:
            for key in names:
                tensor = f.get_tensor(key)
                progress.read(tensor)
                yield key, tensor
        progress.files_done += 1
    progress.finish()


def load_state_dict(
    model_dir: Path,
    prefix: str,
    module: torch.nn.Module,
    *,
    stacked: Sequence[StackedParam] = (),
    strict_unexpected: bool = False,
) -> LoadReport:
    """Load the checkpoint tensors under `prefix` into `module`, checking that nothing is missing.

    Every parameter and persistent buffer of `module` must come from the checkpoint (directly, via a
    tied alias, or assembled per `stacked`); otherwise a ValueError names the missing checkpoint keys.
    Keys under `prefix` that the module does not use are reported, and raise when `strict_unexpected`.
    A module on the `meta` device gets the loaded tensors assigned (cast to its parameter dtypes).
    """
    if not prefix.endswith("."):
        raise ValueError(f"prefix {prefix!r} must end with '.' (e.g. 'talker.') so it cannot match a longer name")
    if dummy_weights():
        return _fill_module(prefix, module)
    files = checkpoint_files(Path(model_dir))
    rel_files = {key[len(prefix):]: path for key, path in files.items() if key.startswith(prefix)}
    if not rel_files:
        tops = sorted({key.split(".", 1)[0] + "." for key in files})
        raise ValueError(f"no checkpoint keys start with {prefix!r} in {model_dir}; top-level prefixes: {tops}")

    state, aliases = _expected_entries(module)
    plan, missing = _plan(state, aliases, set(rel_files), stacked)
    if missing:
        full = [prefix + name for name in missing]
        raise ValueError(
            f"{len(full)} weight(s) of {type(module).__name__} are missing from {model_dir} "
            f"under prefix {prefix!r}: {_head(full)}"
        )

    used = {src for groups in plan.values() for group in groups for src in group}
    unexpected = tuple(sorted(prefix + key for key in set(rel_files) - used))
    if unexpected and strict_unexpected:
        raise ValueError(
            f"{len(unexpected)} checkpoint key(s) under {prefix!r} are not used by {type(module).__name__}: "
            f"{_head(list(unexpected))}"
        )

    raw = dict(iter_tensors(files, {prefix + src for src in used}, f"{type(module).__name__} ({prefix}*)"))
    tensors: dict[str, torch.Tensor] = {}
    for name, groups in plan.items():
        if groups == [[name]]:
            tensors[name] = raw[prefix + name]
        else:  # (E, ...): per expert, its pieces joined on dim 0, then experts stacked
            tensors[name] = torch.stack([torch.cat([raw[prefix + s] for s in group], dim=0) for group in groups])

    wrong = [
        f"{prefix}{name}: checkpoint {tuple(t.shape)} vs module {tuple(state[name].shape)}"
        for name, t in tensors.items()
        if t.shape != state[name].shape
    ]
    if wrong:
        raise ValueError(f"{len(wrong)} shape mismatch(es) loading {type(module).__name__}: {_head(wrong)}")

    on_meta = any(t.is_meta for t in state.values())
    if on_meta:
        tensors = {name: t.to(dtype=state[name].dtype) for name, t in tensors.items()}
    module.load_state_dict(tensors, strict=False, assign=on_meta)
    return LoadReport(prefix=prefix, loaded=len(tensors), unexpected=unexpected)


def _fill_module(prefix: str, module: torch.nn.Module) -> LoadReport:
    """--load-format dummy for a whole module: every parameter (a tied one once) filled from its checkpoint key;
    buffers as the constructor made them (so the module must not be on `meta`: it is filled in place)."""
    if any(p.is_meta for p in module.parameters()):
        raise RuntimeError(f"{type(module).__name__} is on the meta device: dummy weights fill parameters in place")
    params = dict(module.named_parameters())  # (tied parameters appear once)
    for name, param in params.items():
        fill_dummy(param, prefix + name)
    return LoadReport(prefix=prefix, loaded=len(params), unexpected=())


def load_plan(module: torch.nn.Module, model_dir: Path, plan: Plan, what: str,
              files: dict[str, Path] | None = None) -> tuple[str, ...]:
    """Read exactly the plan's keys (one full tensor at a time) and shard each into its parameters; the keys read.

    Every parameter of `module` must be in the plan (else RuntimeError: a bug in the plan, not the user's); a key
    the checkpoint lacks is a ValueError naming it and `what`. With --load-format dummy no file is opened: each
    parameter is filled from its first key (`fill_dummy`).
    """
    covered = {id(param) for entries in plan.values() for param, _, _ in entries}
    uncovered = [name for name, param in module.named_parameters() if id(param) not in covered]
    if uncovered:
        raise RuntimeError(f"checkpoint plan misses parameters {uncovered[:_SHOW]}")  # a bug here, not the user's
    if dummy_weights():
        filled: set[int] = set()
        for key, entries in plan.items():
            for param, _, _ in entries:
                if id(param) not in filled:
                    filled.add(id(param))
                    fill_dummy(param, key)
        return tuple(sorted(plan))
    files = files if files is not None else checkpoint_files(Path(model_dir))
    missing = sorted(k for k in plan if k not in files)
    if missing:
        raise ValueError(f"{len(missing)} weight(s) for {what} are missing from {model_dir}: {_head(missing)}")
    with torch.no_grad():
        for key, full in iter_tensors(files, plan, what):
            for param, loader, args in plan[key]:
                loader(param, full, *args)  # copy_ casts to the param dtype
    return tuple(sorted(plan))


def sub_config(config: Any, config_path: str) -> Any:
    """Follow a dotted attribute path ('thinker_config.audio_config'; '' is the config itself)."""
    node = config
    for part in filter(None, config_path.split(".")):
        if not hasattr(node, part):
            raise ValueError(f"config {type(node).__name__} has no attribute {part!r} (path {config_path!r})")
        node = getattr(node, part)
    return node


@contextlib.contextmanager
def _cheap_construction(dtype: torch.dtype | None) -> Iterator[None]:
    """Skip random initialisation (every weight is loaded next) and build in `dtype`."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers: fall back to plain (slower) initialisation
        no_init_weights = contextlib.nullcontext  # type: ignore[assignment]
    previous = torch.get_default_dtype()
    if dtype is not None:
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
        torch.set_default_dtype(dtype)
    try:
        with no_init_weights():
            yield
    finally:
        torch.set_default_dtype(previous)


def build_submodule(
    model_dir: Path,
    *,
    config_path: str,
    factory: Callable[[Any], torch.nn.Module],
    prefix: str,
    stacked: Sequence[StackedParam] = (),
    dtype: torch.dtype | None = None,
    strict_unexpected: bool = False,
) -> torch.nn.Module:
    """Build `factory(config.<config_path>)` without random init, load its weights checked, set eval().

    `config_path` is a dotted path into the folder's `config.json` config object (e.g. 'code2wav_config');
    `factory` is usually the sub-model class; `prefix` is where its weights sit in the checkpoint.
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(Path(model_dir), local_files_only=True)
    cfg = sub_config(config, config_path)
    with _cheap_construction(dtype):
        module = factory(cfg)
    load_state_dict(Path(model_dir), prefix, module, stacked=stacked, strict_unexpected=strict_unexpected)
    return module.eval()
