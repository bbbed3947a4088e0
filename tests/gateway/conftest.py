"""Shared fixtures of the gateway tests: one scripted pipeline, one REST and one gRPC server per session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from gateway_harness import GrpcServer, RestServer, ScriptedPipeline

from gateway.input_limits import InputLimits
from gateway.rest import create_app

# Small limits so the 413 paths are cheap to reach; --limit-mm-per-prompt '{"audio": 2, "video": 1}'.
TEST_LIMITS = InputLimits(max_request_bytes=1_000_000, max_audio_seconds=5.0, max_image_pixels=256 * 256,
                          max_media_items=4, limit_mm_per_prompt={"audio": 2, "video": 1})
SERVED_NAMES = ("tiny-omni", "omni-alias")


@pytest.fixture(scope="session")
def shared_pipeline() -> ScriptedPipeline:
    return ScriptedPipeline()


@pytest.fixture()
def pipeline(shared_pipeline: ScriptedPipeline) -> Iterator[ScriptedPipeline]:
    shared_pipeline.reset()
    yield shared_pipeline
    shared_pipeline.reset()


@pytest.fixture(scope="session")
def rest_server(shared_pipeline: ScriptedPipeline) -> Iterator[RestServer]:
    app = create_app(shared_pipeline, served_model_names=SERVED_NAMES, limits=TEST_LIMITS)
    with RestServer(app) as server:
        yield server


@pytest.fixture(scope="session")
def grpc_server(shared_pipeline: ScriptedPipeline) -> Iterator[GrpcServer]:
    with GrpcServer(shared_pipeline, limits=TEST_LIMITS) as server:
        yield server


@pytest.fixture(scope="session")
def auto_tools_server() -> Iterator[tuple[RestServer, ScriptedPipeline]]:
    """A REST server with --enable-auto-tool-choice over a scripted pipeline of its own."""
    pipeline = ScriptedPipeline()
    with RestServer(create_app(pipeline, served_model_names=("tiny-omni",), auto_tool_choice=True)) as s:
        yield s, pipeline
