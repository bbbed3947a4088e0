"""gRPC's raw prompts (`GenerateRequest.prompt` / `prompt_token_ids`, as REST's /v1/completions) over the
scripted pipeline with the tiny model's tokenizer: the thinker gets exactly the tokens (the text tokenized
as /v1/completions tokenizes it, no chat template), text out only; what a raw prompt cannot carry is
INVALID_ARGUMENT naming the field. Through the mesh: tests/e2e/test_completions_e2e.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from gateway_harness import GrpcServer, ScriptedPipeline
from test_grpc_api import INVALID_ARGUMENT, generate

from gateway.prompt import PromptBuilder
from omnimesh.models.qwen3_omni.tiny import build_tiny_qwen3_omni
from omnimesh.v1 import omni_pb2, stage_pb2


@pytest.fixture(scope="module")
def builder(tmp_path_factory: pytest.TempPathFactory) -> PromptBuilder:
    return PromptBuilder(build_tiny_qwen3_omni(Path(tmp_path_factory.mktemp("tiny")) / "m"), max_model_len=512)


@pytest.fixture(scope="module")
def served(builder: PromptBuilder) -> Iterator[tuple[GrpcServer, ScriptedPipeline]]:
    pipeline = ScriptedPipeline()
    pipeline.prepare = builder  # type: ignore[attr-defined]  # what StagePipeline has: its tokenizer takes prompts
    with GrpcServer(pipeline) as server:
        yield server, pipeline


def raw(**kw: object) -> omni_pb2.GenerateRequest:
    return omni_pb2.GenerateRequest(model="tiny-omni", **kw)  # type: ignore[arg-type]


def test_a_text_prompt_runs_as_its_tokens(served: tuple[GrpcServer, ScriptedPipeline], builder: PromptBuilder) -> None:
    server, pipeline = served
    out = generate(server, raw(prompt="The sea is", sampling=stage_pb2.SamplingParams(max_tokens=3, temperature=0.0)))
    assert [r.WhichOneof("kind") for r in out] == ["text_delta", "text_delta", "done"]  # no audio by default
    sent = pipeline.requests[-1]
    assert sent.prompt_ids == tuple(builder.processor.tokenizer("The sea is")["input_ids"]) and sent.messages == ()
    assert sent.modalities == ("text",) and sent.sampling.max_tokens == 3
    generate(server, raw(prompt_token_ids=[5, 6, 7], modalities=["text"]))
    assert pipeline.requests[-1].prompt_ids == (5, 6, 7)


@pytest.mark.parametrize(("kw", "field"), [
    ({"prompt": "a", "prompt_token_ids": [1]}, "prompt_token_ids"),
    ({"prompt": "a", "messages": [omni_pb2.ChatMessage(role="user", content=[omni_pb2.ContentPart(text="x")])]},
     "prompt"),
    ({"prompt": "a", "modalities": ["text", "audio"]}, "modalities"),
    ({"prompt_token_ids": [1, 10**9]}, "prompt_token_ids[1]"),
    ({"prompt_token_ids": [-1]}, "prompt_token_ids[0]"),
    ({"prompt": "a", "tools": [omni_pb2.Tool(name="f")]}, "tools"),
    ({"prompt": "a", "continue_final_message": True}, "continue_final_message"),
    ({"prompt": "a", "chat_template_kwargs": "{}"}, "chat_template_kwargs"),
    ({"prompt": "a", "structured_output": omni_pb2.StructuredOutput(kind="regex", spec="(")}, "structured_output"),
])
def test_what_a_raw_prompt_cannot_carry(served: tuple[GrpcServer, ScriptedPipeline], kw: dict, field: str) -> None:
    server, pipeline = served
    before = len(pipeline.requests)
    err = generate(server, raw(**kw))[-1].error
    assert err.code == INVALID_ARGUMENT and err.message.startswith(field), err.message
    assert len(pipeline.requests) == before


def test_without_a_tokenizer_a_text_prompt_is_refused(grpc_server: GrpcServer) -> None:
    err = generate(grpc_server, raw(prompt="hello"))[-1].error  # the shared scripted pipeline has no builder
    assert err.code == INVALID_ARGUMENT and "no tokenizer" in err.message
