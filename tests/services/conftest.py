"""Fixtures the stage-service tests share: one intra-op thread per module (tiny models are fastest so, and
OpenMP's spinning threads slow a shared 2-core box), a fresh tiny model folder per module, and a roomy
thinker stage for solo reference runs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from omnimesh.config.serve_args import ServeArgs
from omnimesh.models.qwen3_omni.tiny import build_tiny_qwen3_omni
from services.llm.thinker_handler import build_handler as thinker_handler
from tests.models.qwen3_omni_fixtures import torch_threads


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen3_omni(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture(scope="module")
def thinker(model_dir: Path) -> Any:
    """A roomy thinker stage (default budget, 64 blocks of 16) shared by the solo reference runs."""
    # one chunk per token (--stream-interval 1, not the CLI default): the tests read the tokens chunk by chunk
    return thinker_handler(model_dir, ServeArgs(max_model_len=128, kv_cache_memory="1MiB", stream_interval=1))
