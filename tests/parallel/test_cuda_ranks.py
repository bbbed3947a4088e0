"""GPU path (skipped without CUDA): an NCCL process group of one rank running a collective, the thinker's LM
shard on a CUDA device giving the CPU's greedy tokens (one step, and the serving path's packed batches over the
paged pool), its KV cache sized from `--gpu-memory-utilization`, and seeded and penalised picks from CUDA logits
taking the CPU's tokens. Run on a lent GPU machine with `python -m pytest -m gpu`. Two ranks on one GPU are
refused by NCCL, so the tp / pp collectives over NCCL need a machine with two GPUs (gloo runs them on CPU)."""

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
        ones = torch.ones(4, device=ps.device)
        torch.distributed.all_reduce(ones)  # the world group; NCCL makes its communicator at the first collective
        torch.cuda.synchronize()
        assert ones.tolist() == [1.0] * 4
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


def test_a_penalised_greedy_batch_on_cuda_logits_is_the_cpu_pick() -> None:
    """The batch pick with a repetition penalty (every talker's default) builds its history's rows on the
    logits' device: indexing with a mask from the other device is an error in torch."""
    from omnimesh.models.qwen3_omni.sampling import Sampler, SamplingParams, greedy_batch

    params = SamplingParams(temperature=0, repetition_penalty=1.3)
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(2))
    histories = [[int(logits[0].argmax()), 7], [], [int(logits[2].argmax()), 499, 600]]  # 600: past the head
    want = greedy_batch([Sampler(params) for _ in range(3)], logits, histories)
    assert want is not None and want[0] != int(logits[0].argmax())  # the penalty moved the pick
    assert greedy_batch([Sampler(params) for _ in range(3)], logits.cuda(), histories) == want


def test_packed_batches_on_cuda_match_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The serving path (LMBatch over the paged pool, as the engine packs it: a prompt prefilled in chunks
    beside another request's decodes) on CUDA, its decodes one per gathered SDPA call, gives the CPU's logits
    step by step: the steps a CPU engine sent are replayed on a CUDA shard and a CPU shard with equal pools."""
    from omnimesh.config.serve_args import ServeArgs
    from omnimesh.models.qwen3_omni import paged_kv
    from omnimesh.models.qwen3_omni.lm_shard import LMBatch
    from omnimesh.models.qwen3_omni.tiny_config import ORDINARY_VOCAB_LIMIT
    from omnimesh.transport.frames import StageChunk
    from omnimesh.v1 import stage_pb2
    from services.llm.thinker_handler import build_handler

    folder = build_tiny_qwen3_omni(tmp_path / "tiny")
    handler = build_handler(folder, ServeArgs(max_model_len=128, kv_cache_memory="1MiB", max_num_batched_tokens=8))
    engine = handler.batcher.engine
    batches: list[LMBatch] = []

    def recording(inner):
        def call(command):
            if isinstance(command, LMBatch):
                batches.append(command)
            return inner(command)
        return call

    engine.backend.submit, engine.backend.run = recording(engine.backend.submit), recording(engine.backend.run)
    g = torch.Generator().manual_seed(0)
    live = []
    for rid, n, max_tokens in (("short", 5, 16), ("long", 40, 4)):
        task = handler.open(stage_pb2.Open(request_id=rid, sampling=stage_pb2.SamplingParams(temperature=0,
                                                                                             max_tokens=max_tokens)))
        task.feed(StageChunk(tensors={"input_ids": torch.randint(0, ORDINARY_VOCAB_LIMIT, (n,), generator=g)},
                             final=True))
        live.append(task)
    while live:
        for value in handler.batcher.step_batch([t for t in live if t.ready()]).values():
            if isinstance(value, BaseException):
                raise value
        for task in [t for t in live if t.finished]:
            task.close()
            live.remove(task)
    assert sum(len(b.layout.prefills) > 0 and b.layout.num_tokens > 1 for b in batches) >= 5  # chunks beside decodes

    monkeypatch.setattr(paged_kv, "DECODE_GATHER_BYTES", 1)  # one decode per gathered call
    spec = LMShardSpec(folder, "thinker")
    cpu, gpu = LMShard(spec, ParallelState.single("cpu")), LMShard(spec, ParallelState.single("cuda"))
    init = LMInitCache(engine.allocator.block_size, 2**20)
    assert cpu.execute(init) == gpu.execute(init) == engine.allocator.num_blocks
    for step, batch in enumerate(batches):
        a, b = cpu.execute(batch), gpu.execute(batch)
        assert a is not None and b is not None
        assert a.logits.argmax(-1).tolist() == b.logits.cpu().argmax(-1).tolist(), step
        torch.testing.assert_close(b.logits.cpu(), a.logits, atol=1e-4, rtol=1e-4, msg=f"step {step}")
