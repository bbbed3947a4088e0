"""GPU path (skipped without CUDA): an NCCL process group of one rank, the thinker's LM shard on a CUDA
device giving the CPU's greedy tokens, its KV cache sized from `--gpu-memory-utilization`, and a seeded draw from CUDA
logits taking the CPU's token. Run on a lent GPU machine with `python -m pytest -m gpu`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnimesh.models.qwen3_omni.lm_shard import LMInitCache, LMShard, LMShardSpec, LMStep
from omnimesh.models.qwen3_omni.paged_kv import DECODE_GATHER_BYTES
from omnimesh.models.qwen3_omni.tiny import build_tiny_qwen3_omni
from omnimesh.parallel.mp_executor import free_port
from omnimesh.parallel.parallel_state import ParallelState, destroy_parallel_state, init_parallel_state

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _positions(n: int) -> torch.Tensor:
    return torch.arange(n).view(1, 1, n).expand(4, 1, n)  # (4, 1, T) text-only M-RoPE positions


def test_nccl_group_of_one() -> None:
    ps = init_parallel_state(1, 1, 0, "127.0.0.1", free_port(), "nccl", timeout_s=60)
    try:
        assert ps.device.type == "cuda" and ps.backend == "nccl"
    finally:
        destroy_parallel_state(ps)


def test_thinker_shard_on_cuda_matches_cpu(tmp_path: Path) -> None:
    folder = build_tiny_qwen3_omni(tmp_path / "tiny")
    spec = LMShardSpec(folder, "thinker")
    cpu = LMShard(spec, ParallelState.single("cpu"))
    gpu = LMShard(spec, ParallelState.single("cuda"))
    x = torch.randn(1, 7, 64, generator=torch.Generator().manual_seed(0))
    a = cpu.execute(LMStep(0, x, _positions(7)))
    b = gpu.execute(LMStep(0, x, _positions(7)))
    assert a is not None and b is not None
    assert int(a.logits.argmax()) == int(b.logits.argmax())
    torch.testing.assert_close(a.logits, b.logits, atol=1e-4, rtol=1e-4)


def test_kv_cache_on_cuda_takes_what_the_utilization_leaves(tmp_path: Path) -> None:
    """Per instance, as vLLM's: the pool fits in `utilization x total - this rank's weights - a profiled
    step's activations - the gathered decodes' bound` (what else uses the device counts against its own
    fraction); a utilization below this rank's own weights is refused with a message naming the flag."""
    folder = build_tiny_qwen3_omni(tmp_path / "tiny")
    shard = LMShard(LMShardSpec(folder, "thinker"), ParallelState.single("cuda"))
    free, total = torch.cuda.mem_get_info()
    weights = torch.cuda.memory_allocated()
    room = 64 * 2**20
    utilization = (weights + room + DECODE_GATHER_BYTES) / total  # the gathered decodes' transient stays free
    blocks = shard.execute(LMInitCache(16, None, utilization, profile_tokens=256))
    assert blocks >= 1 and shard.pool is not None
    assert 0 < shard.pool.nbytes() <= room
    with pytest.raises(ValueError, match="no room for a KV cache.*--gpu-memory-utilization"):
        shard.execute(LMInitCache(16, None, weights / total / 2, profile_tokens=256))


def test_a_seeded_draw_from_cuda_logits_is_the_cpu_draw() -> None:
    """A sampled pick from logits on the GPU (the code predictor's, on a CUDA rank) draws from the request's CPU
    stream, so it runs (torch refuses a CPU generator for CUDA probabilities) and picks what the CPU picks."""
    from omnimesh.models.qwen3_omni.sampling import Sampler, SamplingParams

    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=7)
    rows = torch.randn(40, 2048, generator=torch.Generator().manual_seed(1)) * 3
    on_cpu, on_gpu = Sampler(params), Sampler(params)
    assert [on_gpu.sample(row.cuda()) for row in rows] == [on_cpu.sample(row) for row in rows]
