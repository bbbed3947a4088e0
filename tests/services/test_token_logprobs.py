"""services/llm/token_logprobs.py: each token's exact bytes (byte-level BPE symbols mapped back, so tokens
that split a UTF-8 character join into it), and entries equal to log_softmax of the raw logits with the
top alternatives best first and -inf sent as -9999; --logprobs-mode's raw / processed logprobs / logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from omnimesh.models.qwen3_omni.sampling import SamplingParams
from services.llm.token_logprobs import FLOOR, TokenBytes, token_logprob

TEXT = "Hello, wörld! 世界 🎉 naïve\ttabs\n"


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(model_dir)


def test_token_bytes_join_into_the_text(tokenizer) -> None:  # type: ignore[no-untyped-def]
    token_bytes = TokenBytes(tokenizer)
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    pieces = [token_bytes(i) for i in ids]
    assert b"".join(pieces) == TEXT.encode("utf-8")
    assert any(len(p) and not _utf8(p) for p in pieces), "the text should split a character across tokens"
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert token_bytes(im_end) == b"<|im_end|>"  # a special token: its own spelling
    assert token_bytes(ids[0]) is token_bytes(ids[0])  # cached


def _utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_entries_are_the_raw_distribution(tokenizer) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    logits = torch.randn(64) * 3
    logits[5] = -float("inf")  # masked
    expected = torch.log_softmax(logits, dim=-1)
    entry = token_logprob(logits, 11, 4, TokenBytes(tokenizer))
    assert entry.token_id == 11 and entry.logprob == pytest.approx(float(expected[11]), abs=1e-6)
    best = torch.argsort(expected, descending=True)[:4].tolist()
    assert [t.token_id for t in entry.top] == best
    assert [t.logprob for t in entry.top] == pytest.approx([float(expected[i]) for i in best], abs=1e-6)
    assert token_logprob(logits, 5, 0, TokenBytes(tokenizer)).logprob == FLOOR  # -inf is not valid JSON
    assert not token_logprob(logits, 11, 0, TokenBytes(tokenizer)).top


def test_params_bound_the_alternatives() -> None:
    """The stage bounds them by its vocabulary (the gateway by --max-logprobs)."""
    assert SamplingParams(logprobs=64, vocab_size=64).logprobs == 64
    with pytest.raises(ValueError, match=r"logprobs must be in \[0, 64\] alternatives per token \(the vocabulary\), got 65"):
        SamplingParams(logprobs=65, vocab_size=64)
    with pytest.raises(ValueError, match="got -1"):
        SamplingParams(logprobs=-1)


def test_only_the_thinker_takes_logprobs() -> None:
    """The stages read `logprobs` off the wire; the talker (audio codes, no text) refuses it."""
    from omnimesh.v1 import stage_pb2
    from services.llm.sampling import merge_sampling

    msg = stage_pb2.SamplingParams(logprobs=3)
    assert merge_sampling(SamplingParams(), msg).logprobs == 3
    assert merge_sampling(SamplingParams(), stage_pb2.SamplingParams()).logprobs is None
    with pytest.raises(ValueError, match="logprobs are for the thinker's text tokens; this stage emits audio codes"):
        merge_sampling(SamplingParams(), msg, text=False)


def test_logprobs_modes_report_raw_or_processed_scores(model_dir: Path) -> None:
    """--logprobs-mode (vLLM's) on a sampled request (temperature 0.7, top_k 3, a seed: the same tokens in
    every mode): raw = the model's logits (log-softmaxed or not); processed = what the token was sampled from,
    the logits / 0.7 with all but the 3 best masked, so only 3 alternatives are finite."""
    from omnimesh.config.serve_args import ServeArgs
    from omnimesh.transport.frames import StageChunk
    from omnimesh.v1 import stage_pb2
    from services.llm.thinker_handler import build_handler
    from tests.services.test_lm_batching import Driver, Recorder, prompts

    got: dict[str, tuple[list, list[torch.Tensor]]] = {}
    for mode in ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"):
        handler = build_handler(model_dir, ServeArgs(max_model_len=64, kv_cache_memory="1MiB", stream_interval=1,
                                                     logprobs_mode=mode))
        rec = Recorder(handler.batcher.engine)
        task = handler.open(stage_pb2.Open(request_id="r", sampling=stage_pb2.SamplingParams(
            temperature=0.7, top_k=3, seed=1, max_tokens=6, logprobs=5, ignore_eos=True)))
        task.feed(StageChunk(tensors={"input_ids": prompts([9], seed=2)[0]}, final=True))
        d = Driver(handler)
        d.add(task)
        entries = [e for c in d.run()["r"] for e in c.logprobs]
        rec.stop()
        got[mode] = (entries, rec.logits["r"])
    tokens = [e.token_id for e in got["raw_logprobs"][0]]
    assert len(tokens) == 6 and all([e.token_id for e in got[m][0]] == tokens for m in got)  # the same run
    for step, token in enumerate(tokens):
        raw = got["raw_logprobs"][1][step]
        processed = raw / 0.7
        processed[torch.argsort(raw, descending=True)[3:]] = -float("inf")
        want = {"raw_logprobs": torch.log_softmax(raw, -1), "raw_logits": raw,
                "processed_logprobs": torch.log_softmax(processed, -1), "processed_logits": processed}
        for mode, scores in want.items():
            entry = got[mode][0][step]
            assert entry.logprob == pytest.approx(float(scores[token]), abs=1e-4), (mode, step)
            best = [t.logprob for t in entry.top]
            assert best == pytest.approx([max(float(v), FLOOR) for v in torch.sort(scores, descending=True)[0][:5]],
                                         abs=1e-4), (mode, step)
        assert [t.logprob for t in got["processed_logprobs"][0][step].top].count(FLOOR) == 2  # top-k 3 of 5


def test_the_logprobs_mode_flag_is_checked_and_reaches_the_thinker(tmp_path: Path) -> None:
    from omnimesh.config.serve_args import ServeArgs
    from omnimesh.launcher import MeshLauncher

    launcher = MeshLauncher(ServeArgs(logprobs_mode="processed_logits"), tmp_path)
    thinker = launcher._stage_argv("thinker", 1)
    assert thinker[thinker.index("--logprobs-mode") + 1] == "processed_logits"
    assert "--logprobs-mode" not in launcher._stage_argv("talker", 2)

    with pytest.raises(ValueError, match="--logprobs-mode must be one of raw_logprobs, raw_logits, processed_logprobs, "
                                         "processed_logits, got 'final'"):
        ServeArgs(logprobs_mode="final")
