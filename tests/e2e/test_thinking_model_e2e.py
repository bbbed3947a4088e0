"""A thinker-only checkpoint (Qwen3-Omni-30B-A3B-Thinking's layout: config `enable_audio_output: false`, weights
`thinker.*` only, `<think>` / `</think>` in its vocab) served by `omnimesh serve --reasoning-parser qwen3`:

- the launcher starts the encoder and thinker only, and says why; `omnimesh stage talker` on it exits 2 saying so;
- its thinker is the full tiny model's (same seed): with thinking off (`enable_thinking: false`) the answer is
  the full mesh's text answer token for token; with it on (the default) that same text is all reasoning (the
  random weights never write `</think>`: a thought cut off by max_tokens), streamed alike;
- speech is a 400 naming the checkpoint on REST, /v1/audio/speech and gRPC; gRPC's default is text then;
- a structured output waits for the end of the reasoning: `logit_bias` makes `</think>` the first token, and
  only after it does the grammar hold the answer to its choices;
- the full model served text only (`omnimesh serve` with num_replicas 0 for the talker and vocoder): only the
  encoder and thinker start, the same text, speech a 400 saying the gateway has no talker / vocoder stage;
  `/v1/audio/voices` lists none there, and the tiny talker's speakers on the whole mesh.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from mesh_harness import Mesh, refused_stage, start_mesh

from omnimesh.models.qwen3_omni.tiny import build_tiny_qwen3_omni
from omnimesh.models.qwen3_omni.tiny_config import THINK_TOKENS
from omnimesh.v1 import omni_pb2, omni_pb2_grpc, stage_pb2

NAME = "tiny-thinking"
USER = [{"role": "user", "content": "Tell me about the sea."}]
OFF = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def thinking_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen3_omni(tmp_path_factory.mktemp("thinking") / "tiny-thinking", audio_output=False)


@pytest.fixture(scope="module")
def thinking(thinking_dir: Path) -> Iterator[Mesh]:
    m = start_mesh(thinking_dir, "--reasoning-parser", "qwen3", "--served-model-name", NAME)
    yield m
    assert m.proc.stop() == 0, m.proc.output()


def _chat(url: str, model: str, **extra) -> httpx.Response:
    body = {"model": model, "messages": USER, "max_tokens": 16, "temperature": 0, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def test_only_the_encoder_and_thinker_run(thinking: Mesh, thinking_dir: Path) -> None:
    assert sorted(thinking.stages) == ["encoder", "thinker"]
    assert "has no audio output: its config.json sets enable_audio_output to false" in thinking.proc.output()
    stderr = refused_stage(thinking_dir, "talker")
    assert "stage talker: the model tiny-thinking has no audio output" in stderr
    assert "start the encoder and thinker stages" in stderr


def test_its_answer_is_the_full_models_text_split_as_reasoning(thinking: Mesh, mesh: Mesh) -> None:
    full = _chat(mesh.rest, "tiny-qwen3-omni").json()["choices"][0]
    off = _chat(thinking.rest, NAME, **OFF).json()["choices"][0]
    assert off["message"]["content"] == full["message"]["content"] and off["message"]["reasoning"] is None
    on = _chat(thinking.rest, NAME).json()["choices"][0]
    assert on["message"]["reasoning"] == on["message"]["reasoning_content"] == full["message"]["content"]
    assert on["message"]["content"] is None and on["finish_reason"] == full["finish_reason"] == "length"
    body = {"model": NAME, "messages": USER, "max_tokens": 16, "temperature": 0, "stream": True}
    deltas = []
    with httpx.stream("POST", f"{thinking.rest}/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                deltas += [c["delta"] for c in json.loads(line[6:])["choices"]]
    assert "".join(d.get("reasoning") or "" for d in deltas) == full["message"]["content"]
    assert not "".join(d.get("content") or "" for d in deltas)


def test_speech_is_refused_naming_the_checkpoint(thinking: Mesh) -> None:
    r = _chat(thinking.rest, NAME, modalities=["text", "audio"], **OFF)
    assert r.status_code == 400 and "has no audio output" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "modalities"
    r = httpx.post(f"{thinking.rest}/v1/audio/speech", json={"model": NAME, "input": "Hello."}, timeout=60)
    assert r.status_code == 400 and "enable_audio_output" in r.json()["error"]["message"], r.text
    request = omni_pb2.GenerateRequest(
        model=NAME, messages=[omni_pb2.ChatMessage(role="user", content=[omni_pb2.ContentPart(text="Hi.")])],
        sampling=stage_pb2.SamplingParams(temperature=0.0, max_tokens=4))
    with grpc.insecure_channel(thinking.grpc) as ch:
        stub = omni_pb2_grpc.OmniStub(ch)
        out = list(stub.Generate(request, timeout=60))  # no modalities: text, as the server speaks none
        assert out[-1].WhichOneof("kind") == "done" and not any(r.WhichOneof("kind") == "audio" for r in out)
        request.modalities[:] = ["text", "audio"]
        refused = list(stub.Generate(request, timeout=60))
    assert [r.WhichOneof("kind") for r in refused] == ["error"]
    assert refused[0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "has no audio output" in refused[0].error.message


def test_the_grammar_shapes_the_answer_after_the_reasoning(thinking: Mesh) -> None:
    end = str(THINK_TOKENS["</think>"])
    choices = ["calm", "rough"]
    forced = _chat(thinking.rest, NAME, logit_bias={end: 100}, structured_outputs={"choice": choices}).json()
    message = forced["choices"][0]["message"]
    assert message["reasoning"] is None and message["content"] in choices, message  # "</think>" came first
    # thinking off: the grammar holds the whole text (the bias cannot put the marker in)
    plain = _chat(thinking.rest, NAME, logit_bias={end: 100}, structured_outputs={"choice": choices}, **OFF).json()
    assert plain["choices"][0]["message"]["content"] in choices


def test_the_full_model_served_text_only(mesh: Mesh, tiny_model_dir: Path) -> None:
    """A text-only deployment of a model that has a talker (`num_replicas` 0 for the talker and vocoder): only the
    encoder and thinker start, the text is the whole mesh's, speech is a 400 saying the gateway has no talker /
    vocoder stage, and `/v1/audio/voices` lists none (the whole mesh lists the tiny talker's speakers)."""
    none = '{"talker": {"num_replicas": 0}, "vocoder": {"num_replicas": 0}}'
    text_only = start_mesh(tiny_model_dir, "--stage-overrides", none)
    try:
        assert sorted(text_only.stages) == ["encoder", "thinker"]
        assert "num_replicas 0 for the talker and vocoder: text out only" in text_only.proc.output()
        url = text_only.rest
        assert _chat(url, "tiny-qwen3-omni").json()["choices"][0]["message"]["content"] == \
            _chat(mesh.rest, "tiny-qwen3-omni").json()["choices"][0]["message"]["content"]
        r = _chat(url, "tiny-qwen3-omni", modalities=["text", "audio"])
        assert r.status_code == 400 and "given no talker / vocoder stage" in r.json()["error"]["message"], r.text
        voices = httpx.get(f"{url}/v1/audio/voices", timeout=30).json()
        assert voices["voices"] == [] and "no talker / vocoder stage" in voices["reason"]
        full = httpx.get(f"{mesh.rest}/v1/audio/voices", timeout=30).json()
        assert full == {"voices": ["ethan", "aiden", "chelsie"], "default": "ethan"}  # the tiny talker's speakers
    finally:
        assert text_only.proc.stop() == 0, text_only.proc.output()
