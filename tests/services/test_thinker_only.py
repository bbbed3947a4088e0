"""A thinker stage over a thinker-only checkpoint (config `enable_audio_output: false`): it captures nothing for a
talker, answers text, and a request asking it to feed a talker is refused with INVALID_ARGUMENT saying why."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest

from omnimesh.config.serve_args import ServeArgs
from omnimesh.engine.task import StageRequestError
from omnimesh.models.qwen3_omni.tiny import build_tiny_qwen3_omni
from omnimesh.v1 import stage_pb2
from services.llm.thinker_handler import build_handler as thinker_handler
from tests.services.test_lm_batching import Driver, open_thinker, prompts


@pytest.fixture(scope="module")
def handler(tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = build_tiny_qwen3_omni(tmp_path_factory.mktemp("thinking") / "m", audio_output=False)
    return thinker_handler(Path(folder), ServeArgs(max_model_len=256, kv_cache_memory="1MiB"))


def test_it_answers_text_and_refuses_to_feed_a_talker(handler: Any) -> None:
    assert handler.thinker.accept_hidden_layer is None  # nothing to capture for a talker
    task = open_thinker(handler, "t", prompts([12], seed=3)[0], 6)
    d = Driver(handler)
    d.add(task)
    d.run()
    assert task.finished and task.completion_tokens == 6
    with pytest.raises(StageRequestError) as refused:
        handler.open(stage_pb2.Open(request_id="s", options={"talker_inputs": "1"}))
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and "thinker-only" in refused.value.message
