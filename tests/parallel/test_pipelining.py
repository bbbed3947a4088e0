"""Pipeline parallelism keeps both ranks busy: with pp=2 and several requests in flight, rank 0 works on one
request's step while rank 1 works on another's (overlapping busy intervals in the ranks' traces), and
every request still gets exactly the numbers it gets alone on one rank."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from omnimesh.models.qwen3_omni.lm_backend import ShardedBackend
from omnimesh.models.qwen3_omni.lm_shard import TRACE_ENV, LMShardSpec
from omnimesh.models.qwen3_omni.tiny import build_tiny_qwen3_omni

REQUESTS, DECODE_STEPS, PROMPT = 8, 3, 9


def positions(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n).view(1, 1, n).expand(4, 1, n)  # (4, 1, T) text positions


def inputs(i: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return [torch.randn(1, PROMPT, 64, generator=g)] + [torch.randn(1, 1, 64, generator=g) for _ in range(DECODE_STEPS)]


def run_request(backend: ShardedBackend, i: int) -> list[torch.Tensor]:
    handle = backend.open()
    logits, pos = [], 0
    for x in inputs(i):
        logits.append(backend.forward(handle, x, positions(pos, x.shape[1])).logits)
        pos += x.shape[1]
    backend.close(handle)
    return logits


def overlaps(a: list[dict], b: list[dict]) -> int:
    return sum(1 for x in a for y in b if x["handle"] != y["handle"] and max(x["start"], y["start"]) < min(x["end"], y["end"]))


def test_two_pipeline_ranks_work_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    folder = build_tiny_qwen3_omni(tmp_path / "tiny")
    spec = LMShardSpec(folder, "thinker")
    alone = ShardedBackend.start(spec)
    expected = [run_request(alone, i) for i in range(REQUESTS)]

    trace = tmp_path / "trace"
    trace.mkdir()
    monkeypatch.setenv(TRACE_ENV, str(trace))
    split = ShardedBackend.start(spec, pp=2, tp=1, timeout_s=60)
    try:
        with ThreadPoolExecutor(2) as pool:  # two requests in flight, as the engine runs a pp=2 stage
            got = list(pool.map(lambda i: run_request(split, i), range(REQUESTS)))
    finally:
        split.shutdown()
    for mine, ref in zip(got, expected):
        for a, b in zip(mine, ref):
            assert int(a.argmax()) == int(b.argmax())
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    rank0 = [json.loads(line) for line in (trace / "thinker-rank0.jsonl").read_text().splitlines()]
    rank1 = [json.loads(line) for line in (trace / "thinker-rank1.jsonl").read_text().splitlines()]
    assert len(rank0) == len(rank1) == REQUESTS * (1 + DECODE_STEPS)
    assert overlaps(rank0, rank1) > 0, "the two pipeline ranks never worked at the same time"
