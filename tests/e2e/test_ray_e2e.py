"""`omnimesh serve --distributed-executor-backend ray`: the thinker's second tp rank runs as a Ray actor (on a Ray
instance the thinker's process starts for itself, no spawned rank process), the mesh answers exactly like
`transformers` generate, and stopping the mesh leaves no Ray process behind. This module runs its own mesh."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest
from mesh_harness import alive, cmdline, rank_pids, stage_pid, start_mesh
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
    actors = {pid: argv for pid, argv in _ray_processes().items() if pid not in before and "_RankActor" in argv}
    assert len(actors) == 1, actors
    req = chat_request("Tell me about the sea.", sine_wav(), None, max_tokens=MAX_TOKENS, talker_max=TALKER_MAX)
    ref = reference.generate(req, max_tokens=MAX_TOKENS, talker_max=TALKER_MAX)
    text, audio, finished = run_pipeline(mesh, tiny_model_dir, req, async_chunk=True)
    assert text == ref.text and finished.completion_tokens == len(ref.token_ids)
    np.testing.assert_allclose(audio, ref.audio, atol=1e-4, rtol=0)


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
