"""Session fixtures for end-to-end tests: one tiny model folder, one running mesh (`omnimesh serve`),
and the `transformers` reference model, shared by every e2e test (a mesh takes ~10-30 s to start). The
shared mesh exports its traces (--otlp-traces-endpoint) to `traces`, a receiver in this process, so every
e2e test runs with tracing on; the meshes tests start for themselves run with it off."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from mesh_harness import Mesh, start_mesh  # noqa: E402
from reference import ReferenceModel  # noqa: E402
from bench.otlp_receiver import TraceCollector  # noqa: E402

from omnimesh.models.qwen3_omni.tiny import build_tiny_qwen3_omni  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen3_omni(tmp_path_factory.mktemp("models") / "tiny-qwen3-omni")


@pytest.fixture(scope="session")
def traces():
    collector = TraceCollector()
    yield collector
    collector.stop()


@pytest.fixture(scope="session")
def mesh(tiny_model_dir: Path, traces: TraceCollector):
    m: Mesh = start_mesh(tiny_model_dir, "--otlp-traces-endpoint", traces.endpoint,
                         env={"OTEL_BSP_SCHEDULE_DELAY": "200"})  # spans leave within 0.2 s (default 5 s)
    yield m
    code = m.proc.stop()
    assert code == 0, f"omnimesh serve exited with {code} on SIGTERM:\n{m.proc.output()}"


@pytest.fixture(scope="session")
def reference(tiny_model_dir: Path) -> ReferenceModel:
    return ReferenceModel(tiny_model_dir)
