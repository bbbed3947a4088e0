"""The Qwen2.5-Omni vocoder stage's handler and task (services/vocoder/token2wav_handler.py), in-process.

A request's `codes` chunks, fed in pieces, decode at the end of the stream to what one token2wav call on all of
them gives (seed and speaker from the Open's options; the defaults: seed 0, Chelsie); an empty stream ends with
an empty pcm chunk. The stage's batcher decodes every ended stream in one call, each request's samples its solo
ones (to float rounding), within its caps (requests and codes per step; the rest stay for the next step). Bad
input is refused by name: a seed that is not an integer and an unknown speaker at Open (INVALID_ARGUMENT), codes
of the wrong shape, dtype or range, or more than the DiT's positions hold, at feed (ValueError, which the
servicer answers as INVALID_ARGUMENT). Info says the family, 24 kHz and the window the talker chunks its codes by.
"""

from __future__ import annotations


import grpc
import pytest
import torch

from omnimesh.engine.task import StageRequestError
from omnimesh.models.qwen2_5_omni.tiny import build_tiny_qwen2_5_omni
from omnimesh.models.qwen2_5_omni.token2wav import load_token2wav
from omnimesh.server.stage_failure import StageFailure
from omnimesh.transport.frames import StageChunk
from omnimesh.v1 import stage_pb2
from services.vocoder.token2wav_handler import (
    CPU_ROWS,
    DEFAULT_SEED,
    DEFAULT_STEP_CODES,
    WINDOW_CODES,
    Token2WavBatcher,
    Token2WavHandler,
)

NUM_EMBEDS = 512  # the tiny DiT's codec table


@pytest.fixture(scope="module")
def handler(tmp_path_factory: pytest.TempPathFactory) -> Token2WavHandler:
    folder = build_tiny_qwen2_5_omni(tmp_path_factory.mktemp("q25") / "model")
    return Token2WavHandler(load_token2wav(folder), "m", StageFailure(), NUM_EMBEDS)


def _open(handler: Token2WavHandler, request_id: str = "r", **options: str):  # noqa: ANN202
    return handler.open(stage_pb2.Open(request_id=request_id, options=options))


def test_codes_in_pieces_decode_at_the_end_as_one_call(handler: Token2WavHandler) -> None:
    codes = torch.randint(0, 500, (1, 30), generator=torch.Generator().manual_seed(0))
    task = _open(handler, speaker="ethan", seed="7")
    task.feed(StageChunk(tensors={"codes": codes[:, :12]}))
    assert not task.ready()
    task.feed(StageChunk(tensors={"codes": codes[:, 12:]}, final=True))
    assert task.ready()
    (chunk,) = task.step()
    assert task.finished and task.completion_tokens == 30
    assert torch.equal(chunk.tensors["pcm"], handler.token2wav(codes[0], "ethan", 7))
    default = _open(handler)
    default.feed(StageChunk(tensors={"codes": codes}, final=True))
    assert torch.equal(default.step()[0].tensors["pcm"], handler.token2wav(codes[0], "chelsie", DEFAULT_SEED))
    empty = _open(handler)
    empty.feed(StageChunk(final=True))
    assert empty.step()[0].tensors["pcm"].numel() == 0 and empty.finished
    info = handler.info()
    assert (info.family, info.sample_rate, info.window_codes, info.device) == ("qwen2.5-omni", 24000, WINDOW_CODES, "cpu")


def test_bad_options_and_codes_are_refused_by_name(handler: Token2WavHandler) -> None:
    with pytest.raises(StageRequestError, match="option seed must be an integer, got 'x'") as bad:
        _open(handler, seed="x")
    assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(StageRequestError, match="unknown speaker 'nobody'; valid speakers: chelsie, ethan") as bad:
        _open(handler, speaker="nobody")
    assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT
    task = _open(handler)
    with pytest.raises(ValueError, match=r"codes must be \(1, n\) \(one codec stream\), got \(2, 3\)"):
        task.feed(StageChunk(tensors={"codes": torch.zeros(2, 3, dtype=torch.long)}))
    with pytest.raises(ValueError, match=r"codes must be in \[0, 512\), got \[0, 512\]"):
        task.feed(StageChunk(tensors={"codes": torch.tensor([[0, 512]])}))
    with pytest.raises(ValueError, match="codes must be integer ids, got float32"):
        task.feed(StageChunk(tensors={"codes": torch.zeros(1, 3)}))
    assert handler.max_codes == 16384  # the tiny DiT's 32768 positions, 2 frames a code
    task.feed(StageChunk(tensors={"codes": torch.zeros(1, 16000, dtype=torch.long)}))
    with pytest.raises(ValueError, match="more than 16384 codes in one utterance"):
        task.feed(StageChunk(tensors={"codes": torch.zeros(1, 385, dtype=torch.long)}))


def test_the_batcher_decodes_ended_streams_together_within_its_caps(handler: Token2WavHandler) -> None:
    assert handler.batcher.max_requests == CPU_ROWS  # the CPU stage's default caps
    assert handler.batcher.max_codes == DEFAULT_STEP_CODES == 8192
    draw = torch.Generator().manual_seed(1)
    streams = [(torch.randint(0, 500, (1, n), generator=draw), speaker, seed)
               for n, speaker, seed in [(9, "ethan", "1"), (31, "chelsie", "2"), (0, "ethan", "3"), (20, "ethan", "4")]]

    def opened() -> list:
        tasks = []
        for i, (codes, speaker, seed) in enumerate(streams):
            task = _open(handler, f"r{i}", speaker=speaker, seed=seed)
            task.feed(StageChunk(tensors={"codes": codes}, final=True))
            tasks.append(task)
        return tasks

    results = handler.batcher.step_batch(opened())
    for i, (codes, speaker, seed) in enumerate(streams):
        (chunk,) = results[f"r{i}"]
        alone = handler.token2wav(codes[0], speaker, int(seed))
        assert chunk.tensors["pcm"].shape == alone.shape == (codes.shape[1] * 480,)
        assert torch.allclose(chunk.tensors["pcm"], alone, atol=1e-5, rtol=0)
    # caps: at most 2 requests; at most 35 codes (the 31-code stream does not fit beside the 9-code one and
    # waits; the first request always goes)
    tasks = opened()
    assert list(Token2WavBatcher(handler.token2wav, max_requests=2).step_batch(tasks)) == ["r0", "r1"]
    assert tasks[0].finished and not tasks[2].finished and tasks[2].ready()
    tasks = opened()
    assert list(Token2WavBatcher(handler.token2wav, max_codes=35).step_batch(tasks)) == ["r0", "r2", "r3"]
    assert not tasks[1].finished and tasks[1].n_pending == 31
    assert list(Token2WavBatcher(handler.token2wav, max_codes=1).step_batch(tasks[1:2])) == ["r1"]
    with pytest.raises(ValueError, match="max_codes must be >= 1, got 0"):
        Token2WavBatcher(handler.token2wav, max_codes=0)
