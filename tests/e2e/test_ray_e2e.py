"""`omnimesh serve --distributed-executor-backend ray`: the thinker's second tp rank runs as a Ray actor (on a Ray
instance the thinker's process starts for itself, no spawned rank process), the mesh answers exactly like
`transformers` generate; an actor killed mid-request fails that request with 503 and `serve` restarts the thinker
on a new Ray instance; stopping the mesh leaves no Ray process behind. This module runs its own mesh."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest
from mesh_harness import alive, cmdline, kill_rank_mid_request, ppid, rank_pids, stage_pid, start_mesh
from reference import chat_request, sine_wav
from test_parity import MAX_TOKENS, TALKER_MAX, run_pipeline

from omnimesh.transport.stage_client import StageClient

pytest.importorskip("ray", reason="Ray is installed by scripts/setup.sh (omnimesh[ray])")


def _ray_processes() -> dict[int, str]:
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            argv = " ".join(cmdline(int(entry.name)))
            if ("ray::" in argv or "raylet" in argv or "gcs_server" in argv) and alive(int(entry.name)):
                out[int(entry.name)] = argv
    return out


def _actor(before: set[int]) -> int | None:
    """The one Ray actor process holding a rank of this mesh (None if there is none yet)."""
    actors = [pid for pid, argv in _ray_processes().items() if pid not in before and "_RankActor" in argv]
    assert len(actors) <= 1, actors
    return actors[0] if actors else None


@pytest.fixture(scope="module")
def ray_mesh(tiny_model_dir: Path):
    before = set(_ray_processes())
    mesh = start_mesh(tiny_model_dir, "--distributed-executor-backend", "ray",
                      "--stage-overrides", '{"thinker": {"tp": 2}}')
    yield mesh, before
    mesh.proc.stop()


def test_thinker_rank_runs_as_a_ray_actor_and_the_mesh_equals_generate(ray_mesh, tiny_model_dir, reference) -> None:
    mesh, before = ray_mesh

    async def info():
        client = StageClient("thinker", mesh.stages["thinker"])
        try:
            return await client.info()
        finally:
            await client.close()

    thinker = asyncio.run(info())
    assert (thinker.pipeline_parallel_size, thinker.tensor_parallel_size) == (1, 2)
    assert rank_pids(stage_pid(mesh, "thinker")) == []  # no spawned rank process: Ray runs rank 1
    assert _actor(before) is not None
    req = chat_request("Tell me about the sea.", sine_wav(), None, max_tokens=MAX_TOKENS, talker_max=TALKER_MAX)
    ref = reference.generate(req, max_tokens=MAX_TOKENS, talker_max=TALKER_MAX)
    text, audio, finished = run_pipeline(mesh, tiny_model_dir, req, async_chunk=True)
    assert text == ref.text and finished.completion_tokens == len(ref.token_ids)
    np.testing.assert_allclose(audio, ref.audio, atol=1e-4, rtol=0)


def test_a_dead_ray_actor_fails_its_request_and_serve_restarts_the_stage(ray_mesh) -> None:
    """The actor holding the thinker's rank 1 is killed mid-request: 503 naming the thinker and the actor's pid,
    then `omnimesh serve` restarts the thinker, whose new process starts a new Ray instance with a new actor;
    the old instance's processes die with the old thinker."""
    mesh, before = ray_mesh
    old = stage_pid(mesh, "thinker")
    victim = _actor(before)
    old_ray = [pid for pid in _ray_processes() if ppid(pid) == old]  # the old thinker's GCS and raylet
    assert old_ray
    restarted = kill_rank_mid_request(mesh, "thinker", victim)
    assert restarted != old and _actor(before) not in (victim, None)
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in old_ray) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in old_ray if alive(pid)]


def test_stopping_the_mesh_leaves_no_ray_process(ray_mesh) -> None:
    """Runs last in this module: it stops the mesh."""
    mesh, before = ray_mesh
    ours = set(_ray_processes()) - before
    assert ours, "the thinker started no Ray processes"
    mesh.proc.stop()
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in ours) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in ours if alive(pid)], {pid: argv for pid, argv in _ray_processes().items() if pid in ours}
