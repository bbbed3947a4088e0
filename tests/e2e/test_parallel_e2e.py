"""The mesh with every stage split over ranks — encoder pp=2, thinker pp=2 x tp=2 (4 processes), talker
pp=2, vocoder tp=2 — answers exactly like `transformers` generate (and so like the pp = tp = 1 mesh): text
token for token, audio within 1e-4. It also runs a vocoder window schedule other than the default
(`--audio-windows 2,3,6`): the vocoder advertises it, the talker chunks its codes to match, and the audio is
still exact. The split thinker caches prompt prefixes (`enable_prefix_caching`): a request sent again is
served mostly from cached blocks that every pp x tp rank reads, and still equals generate; it scores prompts
(`prompt_logprobs`) as transformers' forward does. A thinker rank killed mid-request fails that request promptly with 503, the thinker goes
NOT_SERVING and the gateway's /health names it; nothing hangs; `omnimesh serve` then restarts the thinker
(all its ranks) and it answers as before. This module runs its own mesh."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import numpy as np
import pytest
from mesh_harness import children, kill_rank_mid_request, nice, rank_pids, stage_pid, start_mesh, thread_nices
from reference import chat_request, png_bytes, sine_wav
from test_handoff_e2e import _deltas, _metrics
from test_parity import MAX_TOKENS, TALKER_MAX, run_pipeline

from omnimesh.allocator import find_tcmalloc, loaded
from omnimesh.models.qwen3_omni.code_windows import window_size
from omnimesh.transport.stage_client import StageClient

LAYOUT = ('{"encoder": {"pp": 2}, "thinker": {"pp": 2, "tp": 2, "enable_prefix_caching": true}, "talker": {"pp": 2}, '
          '"vocoder": {"tp": 2, "nice": 3, "bulk_nice": 14}}')
WINDOWS = (2, 3, 6)
SAMPLES_PER_CODE = 1920  # the tiny code2wav's upsampling


@pytest.fixture(scope="module")
def split_mesh(tiny_model_dir: Path):
    mesh = start_mesh(tiny_model_dir, "--stage-overrides", LAYOUT, "--audio-windows", ",".join(map(str, WINDOWS)))
    yield mesh
    mesh.proc.stop()


def test_stages_report_their_layout(split_mesh) -> None:
    async def infos():
        out = {}
        for name in ("encoder", "thinker", "talker", "vocoder"):
            client = StageClient(name, split_mesh.stages[name])
            out[name] = await client.info()
            await client.close()
        return out

    info = asyncio.run(infos())
    assert (info["thinker"].pipeline_parallel_size, info["thinker"].tensor_parallel_size) == (2, 2)
    assert (info["talker"].pipeline_parallel_size, info["talker"].tensor_parallel_size) == (2, 1)
    assert len(rank_pids(stage_pid(split_mesh, "thinker"))) == 3  # ranks 1..3; rank 0 is the stage itself
    assert len(rank_pids(stage_pid(split_mesh, "talker"))) == 1
    assert (info["vocoder"].pipeline_parallel_size, info["vocoder"].tensor_parallel_size) == (1, 2)
    assert len(rank_pids(stage_pid(split_mesh, "vocoder"))) == 1
    assert (info["encoder"].pipeline_parallel_size, info["encoder"].tensor_parallel_size) == (2, 1)
    assert len(rank_pids(stage_pid(split_mesh, "encoder"))) == 1
    voc = info["vocoder"]
    assert (tuple(voc.window_schedule), voc.first_window_codes, voc.window_codes) == (WINDOWS, 2, 6)


def test_stages_run_at_their_os_priority(split_mesh, tiny_model_dir) -> None:
    """Every stage process keeps the launcher's priority unless its `nice` is set (the vocoder's is 3 here);
    ranks inherit it. After a request, the thinker's and talker's bulk threads (steps with no request waiting
    for its first output) run at nice +19 (the default) and the vocoder's at +14 below its own (its
    `bulk_nice` here); their other compute threads at the stage's own priority; the encoder has none."""
    want = {"encoder": (0, None), "thinker": (0, 19), "talker": (0, 19), "vocoder": (3, 14)}
    # A bulk thread starts at a stage's first bulk step. On a loaded host the vocoder can get all of a request's
    # codes before its first step and decode them in that one (urgent) step (5 requests of 40 codes did, once, in a
    # CI run): send requests of 3x the codes, so they come over a longer time, until each stage that has a bulk
    # lane has used it (bounded).
    for _ in range(10):
        req = chat_request("Hello there.", sine_wav(), None, max_tokens=MAX_TOKENS, talker_max=3 * TALKER_MAX)
        run_pipeline(split_mesh, tiny_model_dir, req, async_chunk=True)
        if all(f"{s}-bulk" in thread_nices(stage_pid(split_mesh, s)) for s, (_, bulk) in want.items() if bulk):
            break
    base = nice(split_mesh.proc.proc.pid)
    for stage, (extra, bulk) in want.items():
        pid = stage_pid(split_mesh, stage)
        expected = min(19, base + extra)
        assert [nice(p) for p in (pid, *rank_pids(pid))] == [expected] * (1 + len(rank_pids(pid))), stage
        threads = thread_nices(pid)
        assert threads[f"{stage}-compute"] == {expected}, (stage, threads)
        assert threads.get(f"{stage}-bulk") == ({min(19, expected + bulk)} if bulk else None), (stage, threads)


def test_stages_ranks_and_gateway_run_on_tcmalloc_where_installed(split_mesh) -> None:
    """`--malloc auto` (the default): every stage process of this CPU mesh, each of its ranks and the gateway
    re-executed themselves on tcmalloc when it is installed; without it they all stay on glibc's."""
    want = "tcmalloc" if find_tcmalloc() else "glibc"
    pids = children(split_mesh.proc.proc.pid)
    assert set(pids) == {"gateway", "stage encoder", "stage thinker", "stage talker", "stage vocoder"}
    for role, pid in pids.items():
        assert [loaded(p) for p in (pid, *rank_pids(pid))] == [want] * (1 + len(rank_pids(pid))), role


@pytest.mark.parametrize("media", ["text", "audio+image"])
def test_split_mesh_equals_generate(split_mesh, tiny_model_dir, reference, media) -> None:
    wav, png = (sine_wav(), png_bytes()) if media == "audio+image" else (None, None)
    req = chat_request("Tell me about the sea.", wav, png, max_tokens=MAX_TOKENS, talker_max=TALKER_MAX)
    ref = reference.generate(req, max_tokens=MAX_TOKENS, talker_max=TALKER_MAX)
    before = _metrics(split_mesh.rest)
    text, audio, finished = run_pipeline(split_mesh, tiny_model_dir, req, async_chunk=True)
    talker_chunks = _deltas(before, _metrics(split_mesh.rest), "omnimesh:inter_token_latency_seconds_count")["talker"] + 1
    assert text == ref.text and finished.completion_tokens == len(ref.token_ids)
    assert audio.shape == ref.audio.shape
    np.testing.assert_allclose(audio, ref.audio, atol=1e-4, rtol=0)
    codes, windows = len(ref.audio) // SAMPLES_PER_CODE, []
    while sum(windows) < codes:  # the talker's chunks follow the vocoder's schedule: 2, 3, 6, 6, ...
        windows.append(window_size(len(windows), WINDOWS))
    assert codes > sum(WINDOWS) and talker_chunks == len(windows), (codes, talker_chunks)


def test_split_thinker_serves_a_cached_prefix_exactly(split_mesh, tiny_model_dir, reference) -> None:
    req = chat_request("Tell me about the rivers of the north.", None, None, max_tokens=MAX_TOKENS, talker_max=TALKER_MAX)
    ref = reference.generate(req, max_tokens=MAX_TOKENS, talker_max=TALKER_MAX)
    finished = []
    for _ in range(2):
        text, audio, done = run_pipeline(split_mesh, tiny_model_dir, req, async_chunk=True)
        assert text == ref.text and audio.shape == ref.audio.shape
        np.testing.assert_allclose(audio, ref.audio, atol=1e-4, rtol=0)
        finished.append(done)
    again = finished[1]
    assert again.cached_tokens == (again.prompt_tokens - 1) // 16 * 16 > finished[0].cached_tokens


def test_split_thinker_scores_the_prompt(split_mesh, reference) -> None:
    """prompt_logprobs on the pp=2 x tp=2 thinker: the last pp rank's TP ranks all-gather each scored row's
    logits (a collective every TP rank joins) and the scores equal transformers' forward."""
    from test_completions_e2e import check_prompt_logprobs

    from gateway.events import ChatRequest

    ids = reference.tokenizer("Rivers of the north run cold and clear")["input_ids"]
    r = httpx.post(f"{split_mesh.rest}/v1/completions", timeout=60, json={
        "model": "tiny-qwen3-omni", "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0, "prompt_logprobs": 3})
    assert r.status_code == 200, r.text
    _, rows = reference.prompt_logprobs(ChatRequest(request_id="ref", model="m", messages=(), prompt_ids=tuple(ids)))
    check_prompt_logprobs(r.json()["choices"][0]["prompt_logprobs"], ids, rows, 3, reference.tokenizer)


def test_thinker_rank_killed_mid_request(split_mesh) -> None:
    """Runs last in this module: it breaks the thinker on purpose."""
    thinker = stage_pid(split_mesh, "thinker")
    ranks = rank_pids(thinker)
    restarted = kill_rank_mid_request(split_mesh, "thinker", ranks[-1])
    assert len(rank_pids(restarted)) == len(ranks) == 3
