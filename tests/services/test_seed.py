"""vLLM's --seed in the thinker and talker (services/llm/sampling.py `SeedStream`): a request that brings no seed
gets one drawn from --seed and its place among the stage's unseeded requests, so two servers started with the
same --seed sample the same answers to the same requests in the same order (temperature 1 here), and another
--seed samples others; a request's own seed wins; without --seed requests stay unseeded; a seed outside
[0, 2**63) stops start-up."""

from __future__ import annotations

from pathlib import Path

import pytest

from omnimesh.config.serve_args import ServeArgs
from omnimesh.models.qwen3_omni.sampling import SamplingParams
from omnimesh.transport.frames import StageChunk
from omnimesh.v1 import stage_pb2
from services.llm.sampling import SeedStream
from services.llm.thinker_handler import build_handler as thinker_handler
from tests.services.test_lm_batching import Driver, prompts, token_ids


def answers(model_dir: Path, seed: int | None, own_seed: int | None = None) -> list[list[int]]:
    """Three unseeded requests, one after another, sampled at temperature 1 by a fresh thinker stage."""
    handler = thinker_handler(model_dir, ServeArgs(max_model_len=128, kv_cache_memory="1MiB", seed=seed))
    out = []
    for i in range(3):
        sampling = stage_pb2.SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
        if own_seed is not None:
            sampling.seed = own_seed
        task = handler.open(stage_pb2.Open(request_id=f"r{i}", sampling=sampling))
        assert (task.sampler.params.seed is None) == (seed is None and own_seed is None)
        task.feed(StageChunk(tensors={"input_ids": prompts([9], seed=8)[0]}, final=True))
        d = Driver(handler)
        d.add(task)
        out.append(token_ids(d.run()[f"r{i}"]))
    return out


def test_the_same_seed_samples_the_same_answers(model_dir: Path) -> None:
    first = answers(model_dir, 1234)
    assert answers(model_dir, 1234) == first
    assert len({tuple(a) for a in first}) == 3  # each request its own draw, not one seed for all
    assert answers(model_dir, 99) != first
    assert answers(model_dir, None) != first  # fresh randomness (12 tokens at temperature 1: never equal by chance)
    own = answers(model_dir, 1234, own_seed=5)
    assert own[0] == own[1] == own[2] == answers(model_dir, 77, own_seed=5)[0]  # a request's seed wins


def test_the_stream_is_per_stage_and_leaves_seeded_requests() -> None:
    one, again = SeedStream(7, "thinker"), SeedStream(7, "thinker")  # another run of the same stage
    drawn = [one.fill(SamplingParams()).seed for _ in range(4)]
    assert drawn == [again.fill(SamplingParams()).seed for _ in range(4)] and len(set(drawn)) == 4
    assert SeedStream(7, "talker").fill(SamplingParams()).seed != drawn[0]
    assert one.fill(SamplingParams(seed=3)).seed == 3
    assert SeedStream(None, "thinker").fill(SamplingParams()).seed is None
    for bad in (-1, 2**63):
        with pytest.raises(ValueError, match=r"--seed must be in \[0, 2\*\*63\)"):
            ServeArgs(seed=bad)


def test_serve_hands_the_seed_to_the_sampling_stages(tmp_path: Path) -> None:
    from omnimesh.cli import build_parser
    from omnimesh.launcher import MeshLauncher

    launcher = MeshLauncher(ServeArgs(seed=42), tmp_path)
    for stage in ("thinker", "talker"):
        argv = launcher._stage_argv(stage, 1)
        assert argv[argv.index("--seed") + 1] == "42"
        assert build_parser().parse_args(argv).seed == 42  # and the stage command takes it
    assert "--seed" not in launcher._stage_argv("encoder", 1)
    assert "--seed" not in MeshLauncher(ServeArgs(), tmp_path)._stage_argv("thinker", 1)
