"""Spawn one stage's pp x tp gloo ranks as processes, run a scenario on each, and collect what they return.

Role: the launcher the distributed model tests share. A test passes a module-level `scenario(ps, *args) ->
dict` (picklable by reference: the ranks import the test module, so keep transformers' modeling out of
its top-level imports); every rank runs it on its own `ParallelState`. Nothing can hang: the rendezvous and
every collective time out after `RENDEZVOUS_TIMEOUT_S`, the parent waits at most `deadline_s`, and ranks still
alive after that are killed.

Data flow:
    run_layout(pp, tp, scenario, *args)
      -> pp*tp processes forked from a forkserver with torch and the modeling code imported (free TCP port),
         each: torch.set_num_threads(1)
         -> init_parallel_state(pp, tp, rank, 127.0.0.1, port, "gloo") -> scenario(ps, *args) -> dict
         -> tensors as numpy (torch's queue pickling shares memory that dies with the process) -> queue
      -> parent: results by rank with tensors restored, or pytest.fail with every rank's traceback

Also shared by those tests: the `one_thread` module fixture (import it into a test module to make it autouse
there), `build_tiny` (the tiny folder, builder imported lazily), `rewrite_folder` and its uses
(`with_talker_routers`, `with_random_tower`, `without_key`), `fake_tp3` and the byte / key accounting helpers.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import shutil
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from omnimesh.parallel.parallel_state import ParallelState, destroy_parallel_state, init_parallel_state
from omnimesh.proc_utils import free_port

RENDEZVOUS_TIMEOUT_S = 30.0
LAYOUT_DEADLINE_S = 60.0
Scenario = Callable[..., dict[str, Any]]



def to_numpy(obj: Any) -> Any:
    """Tensors (also inside dicts, lists, tuples) as numpy arrays, for the trip through the queue."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy()
    if isinstance(obj, dict):
        return {k: to_numpy(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(to_numpy(v) for v in obj)
    return obj


def to_torch(obj: Any) -> Any:
    """The inverse of `to_numpy`."""
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: to_torch(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(to_torch(v) for v in obj)
    return obj


def _worker(rank: int, pp: int, tp: int, port: int, scenario: Scenario, args: tuple[Any, ...], results: Any) -> None:
    torch.set_num_threads(1)
    try:
        ps = init_parallel_state(pp, tp, rank, "127.0.0.1", port, "gloo", timeout_s=RENDEZVOUS_TIMEOUT_S)
        try:
            out = scenario(ps, *args)
        finally:
            destroy_parallel_state(ps)
        results.put((rank, to_numpy(out), None))
    except Exception:  # noqa: BLE001  (reported to the parent, which fails the test with the traceback)
        results.put((rank, None, traceback.format_exc()))


def run_single(scenario: Scenario, *args: Any) -> dict[str, Any]:
    """The same scenario on `ParallelState.single()` in this process (one thread), as the reference."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return scenario(ParallelState.single(), *args)
    finally:
        torch.set_num_threads(before)


# What every rank imports anyway: a forkserver imports it once per test session and forks each rank from there
# (a spawned rank spent ~3 s of CPU importing it: tests/parallel took 251 s with "spawn", 163 s so). The server only
# imports, it never runs torch, so a forked rank inherits no threads or process groups; it also keeps the environment
# of its first use (no test of this harness changes the environment for its ranks).
RANK_PRELOAD = ["torch", "torch.distributed", "safetensors.torch", "omnimesh.parallel.parallel_state",
                "transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe",
                "transformers.models.qwen2_5_omni.modeling_qwen2_5_omni"]


def _rank_context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(RANK_PRELOAD)
    return ctx


def run_layout(pp: int, tp: int, scenario: Scenario, *args: Any,
               deadline_s: float = LAYOUT_DEADLINE_S) -> list[dict[str, Any]]:
    """Spawn pp*tp gloo ranks running `scenario(ps, *args)`; return their dicts by rank. Never hangs."""
    ctx = _rank_context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, pp, tp, port, scenario, args, results), daemon=True)
             for r in range(pp * tp)]
    for p in procs:
        p.start()
    got: dict[int, dict[str, Any]] = {}
    errors: list[str] = []
    deadline = time.monotonic() + deadline_s
    try:
        while len(got) + len(errors) < len(procs):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                errors.append(f"timed out after {deadline_s:.0f}s; ranks reported: {sorted(got)}")
                break
            try:
                rank, out, err = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:  # look for ranks that died without reporting
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in got]
                if dead:
                    errors.append(f"ranks {dead} died with exit codes {[procs[i].exitcode for i in dead]}")
                    break
                continue
            if err is not None:
                errors.append(f"rank {rank}:\n{err}")
            else:
                got[rank] = to_torch(out)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if errors:
        pytest.fail(f"layout pp={pp} tp={tp} failed:\n" + "\n".join(errors))
    return [got[r] for r in range(pp * tp)]


def bytes_matching(sizes: dict[str, int], *parts: str) -> int:
    """Total bytes of the parameters whose names contain any of `parts`."""
    return sum(n for name, n in sizes.items() if any(p in name for p in parts))


def assert_memory_split(ranks: list[dict[str, Any]], reference: dict[str, Any], pp: int, tp: int,
                        replicated: tuple[str, ...], sharded_whole: tuple[str, ...] = ()) -> None:
    """Each rank holds at most its 1/(pp*tp) share of the parameters (+10%) plus what every TP rank holds
    whole (`replicated`; `sharded_whole`: parts a rank holds beyond its share, e.g. vocab shards); across the
    ranks nothing is held twice except the replicated parts, once per TP rank."""
    total = reference["param_bytes"]
    for o in ranks:
        allowance = bytes_matching(o["sizes"], *replicated, *sharded_whole)
        assert o["param_bytes"] <= 1.1 * total / (pp * tp) + allowance, (o.get("rank"), o["param_bytes"], total)
    assert sum(o["param_bytes"] for o in ranks) == total + (tp - 1) * bytes_matching(reference["sizes"], *replicated)


def param_sizes(module: torch.nn.Module) -> dict[str, int]:
    return {name: p.numel() * p.element_size() for name, p in module.named_parameters()}


def layers_read(keys: list[str] | tuple[str, ...], name: str = "layers") -> set[int]:
    """Layer indices among checkpoint keys `...{name}.{i}....` (`name` "layers", or "blocks" for the vision tower)."""
    return {int(k.split(f"{name}.")[1].split(".")[0]) for k in keys if f".{name}." in k}


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """torch on one thread for the test module that imports this fixture (autouse there)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def build_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3-Omni folder in a fresh temp dir."""
    from omnimesh.models.qwen3_omni.tiny import build_tiny_qwen3_omni  # here, not at the top: spawned ranks
    # import the test modules (and so this one), and the builder pulls in the whole transformers model

    return build_tiny_qwen3_omni(tmp_path_factory.mktemp("tiny") / "qwen3-omni")


def rewrite_folder(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A copy of the model folder `src` at `dst` (config.json + model.safetensors) with `edit` applied to its tensors."""
    dst.mkdir(parents=True)
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def with_talker_routers(src: Path, dst: Path, seed: int = 0) -> Path:
    """A copy of the tiny folder whose talker MoE routers are N(0, 0.05) instead of zero.

    transformers 5.23 never initialises the talker's router (`mlp.gate.weight`), so the tiny build stores
    zeros: every token then ties over all 8 experts, and top-k tie-breaking (device-dependent) would be all
    the talker's routing ever tested.
    """
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        gen = torch.Generator().manual_seed(seed)
        routers = sorted(k for k in tensors
                         if k.startswith("talker.model.layers.") and k.endswith(".mlp.gate.weight"))
        assert routers and all(not tensors[k].any() for k in routers), "tiny talker routers are no longer zero"
        for key in routers:
            tensors[key] = torch.randn(tensors[key].shape, generator=gen) * 0.05

    return rewrite_folder(src, dst, edit)


def with_random_tower(src: Path, dst: Path, prefix: str, seed: int = 0) -> Path:
    """A copy of the tiny folder whose tensors under `prefix` are re-drawn: weights N(0, 1/fan_in),
    biases N(0, 0.1^2), norm weights 1 + N(0, 0.1^2). Keeps every other tensor."""
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        gen = torch.Generator().manual_seed(seed)
        for key in sorted(k for k in tensors if k.startswith(prefix)):
            t = tensors[key]
            noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
            if t.dim() > 1:
                tensors[key] = noise / t[0].numel() ** 0.5  # (out, fan_in, ...)
            elif key.endswith(".weight"):  # layer-norm scale
                tensors[key] = 1.0 + 0.1 * noise
            else:
                tensors[key] = 0.1 * noise

    return rewrite_folder(src, dst, edit)


def without_key(src: Path, dst: Path, key: str) -> Path:
    """A copy of the model folder with the tensor `key` deleted."""
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        del tensors[key]

    return rewrite_folder(src, dst, edit)


def fake_tp3() -> ParallelState:
    """A tp = 3 state for constructors that must refuse it before touching any process group."""
    return ParallelState(world_size=3, rank=0, pp_size=1, tp_size=3, pp_rank=0, tp_rank=0, backend="gloo",
                         device=torch.device("cpu"), tp_group=object())


# ---- the tower tests' shared parts (audio and vision, both families) ----

def thinker_sub_config(model_dir: Path, name: str) -> Any:
    """`thinker_config.<name>` of the folder (the config classes only; no modeling module is imported)."""
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(model_dir, local_files_only=True).thinker_config, name)


def masked_clips(lengths: tuple[int, ...], n_mel: int = 128, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Valid frames (n_mel, sum T_valid) and feature_lens (B,), taken from a padded batch with a mask (the
    padding is noise too): what the encoder stage feeds a tower."""
    gen = torch.Generator().manual_seed(seed)
    padded = torch.randn(len(lengths), n_mel, max(lengths), generator=gen)  # (B, n_mel, T)
    mask = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]  # (B, T)
    return padded.permute(0, 2, 1)[mask].permute(1, 0), mask.sum(1)


def load_tower_rank(cls: Any, config: Any, n_layers: int, ps: ParallelState,
                    model_dir: Path) -> tuple[Any, tuple[int, int], tuple[str, ...]]:
    """This rank's tower (its even share of the `n_layers` blocks), loaded: (tower, layer range, keys read)."""
    from omnimesh.parallel.partition import partition_layers

    layer_range = partition_layers(n_layers, ps.pp_size)[ps.pp_rank]
    tower = cls(config, ps, layer_range)
    return tower, layer_range, tower.load_weights(model_dir)


def tower_result(ps: ParallelState, tower: torch.nn.Module, layer_range: tuple[int, int], keys: tuple[str, ...],
                 **outputs: Any) -> dict[str, Any]:
    """What a tower scenario returns: its outputs and the byte / key accounting the layout tests check."""
    return {"rank": ps.rank, "layer_range": layer_range, "keys": keys,
            "param_bytes": sum(p.numel() * p.element_size() for p in tower.parameters()),
            "sizes": param_sizes(tower), **outputs}


def assert_reads_own_blocks(ranks: list[dict[str, Any]], name: str, first_key: str, last_key: str,
                            n_layers: int) -> None:
    """Each rank read only its own blocks (`name` "layers" or "blocks"), `first_key` only on the first pipeline
    rank (the front end) and `last_key` only on the last (the head)."""
    for o in ranks:
        start, end = o["layer_range"]
        assert layers_read(o["keys"], name) == set(range(start, end))
        assert (first_key in o["keys"]) == (start == 0)
        assert (last_key in o["keys"]) == (end == n_layers)


def assert_tp3_refused(check: Callable[..., None], cls: Any, config: Any, heads: str) -> None:
    """tp=3 on a tower of 4 heads and pp=3 on one of 2 layers are refused by name, by the layout check and by the
    constructor (before it touches any process group)."""
    message = rf"tensor-parallel size tp=3 must divide the {heads}=4 .*valid tp values for this tower: \[1, 2, 4\]"
    with pytest.raises(ValueError, match=message):
        check(config, 1, 3)
    with pytest.raises(ValueError, match=message):
        cls(config, fake_tp3(), (0, 2))
    with pytest.raises(ValueError, match=r"pp=3 exceeds the model's 2 layers"):
        check(config, 3, 1)
