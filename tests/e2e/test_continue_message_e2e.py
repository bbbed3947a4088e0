"""vLLM's `continue_final_message` through the running mesh (the shared `mesh`), greedy.

The thinker continues the assistant message the client began: its text equals `transformers` `generate` on
the same continued prompt. With speech out the talker speaks the whole message, the client's start and the
continuation, exactly as `generate` speaks it when its thinker writes that message itself (the prompt ending
with the assistant's turn start, the thinker's tokens forced to the start + the continuation): waveform within
1e-4, with and without async chunking. `echo` puts the start before the content (REST, streamed or not), the
audio transcript holds the whole message (streamed too, as `delta.audio.transcript`), and gRPC answers as REST."""

from __future__ import annotations

import json
from dataclasses import replace

import grpc
import httpx
import numpy as np
import pytest
import torch
from reference import chat_request
from test_parity import MAX_TOKENS, TALKER_MAX, run_pipeline
from transformers import LogitsProcessor, LogitsProcessorList

from gateway.events import ChatMessage, TemplateOptions, TextPart
from omnimesh.v1 import omni_pb2, omni_pb2_grpc, stage_pb2

MODEL = "tiny-qwen3-omni"
QUESTION = "Tell me about the sea."
START = "The sea is"
CONTINUE = TemplateOptions(add_generation_prompt=False, continue_final_message=True)


class Forced(LogitsProcessor):
    """The thinker writes `ids` in order (every other id at -inf), from prompt length `start` on."""

    def __init__(self, start: int, ids: list[int]) -> None:
        self.start, self.ids = start, ids

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        step = input_ids.shape[1] - self.start
        forced = torch.full_like(scores, float("-inf"))
        forced[:, self.ids[step]] = 0.0
        return forced


def _requests():
    base = chat_request(QUESTION, None, None, max_tokens=MAX_TOKENS, talker_max=TALKER_MAX)
    cont = replace(base, messages=(*base.messages, ChatMessage("assistant", (TextPart(START),))), template=CONTINUE)
    return base, cont


@pytest.fixture(scope="module")
def spoken(reference):
    """(the continuation's text, the reference waveform of the whole message, of the continuation alone)."""
    base, cont = _requests()
    base_ids = reference.prompts(base).input_ids.tolist()
    cont_ids = reference.prompts(cont).input_ids.tolist()
    assert cont_ids[:len(base_ids)] == base_ids, "the continued prompt should extend the plain one"
    lead = cont_ids[len(base_ids):]
    assert reference.tokenizer.decode(lead) == START
    text = reference.generate(cont, max_tokens=MAX_TOKENS, talker_max=TALKER_MAX, audio=False)

    def speak(ids: list[int]) -> np.ndarray:
        return reference.generate(base, max_tokens=len(ids), talker_max=TALKER_MAX,
                                  thinker_logits_processor=LogitsProcessorList([Forced(len(base_ids), ids)])).audio

    return text, speak(lead + text.token_ids), speak(text.token_ids)


@pytest.mark.parametrize("async_chunk", [True, False], ids=["async-chunk", "no-async-chunk"])
def test_the_talker_speaks_the_whole_continued_message(mesh, tiny_model_dir, spoken, async_chunk):
    ref, whole, rest_only = spoken
    assert whole.size > 0 and (whole.shape != rest_only.shape or not np.allclose(whole, rest_only, atol=1e-3)), \
        "speaking the start changes nothing here: the test could not fail"
    _, cont = _requests()
    text, audio, finished = run_pipeline(mesh, tiny_model_dir, cont, async_chunk)
    assert text == ref.text and finished.completion_tokens == len(ref.token_ids)
    assert audio.shape == whole.shape
    np.testing.assert_allclose(audio, whole, atol=1e-4, rtol=0)


def _body(**extra) -> dict:
    return {"model": MODEL, "temperature": 0, "max_tokens": MAX_TOKENS, "add_generation_prompt": False,
            "continue_final_message": True, "modalities": ["text"],
            "messages": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": START}], **extra}


def test_rest_and_grpc_continue_echo_and_transcribe(mesh, spoken):
    ref = spoken[0]
    plain = httpx.post(f"{mesh.rest}/v1/chat/completions", json=_body(), timeout=120).json()
    assert plain["choices"][0]["message"]["content"] == ref.text
    echoed = httpx.post(f"{mesh.rest}/v1/chat/completions", json=_body(echo=True), timeout=120).json()
    assert echoed["choices"][0]["message"]["content"] == START + ref.text
    with httpx.stream("POST", f"{mesh.rest}/v1/chat/completions", json=_body(echo=True, stream=True), timeout=120) as r:
        deltas = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(d["choices"][0]["delta"].get("content") or "" for d in deltas if d["choices"]) == START + ref.text
    audio = httpx.post(f"{mesh.rest}/v1/chat/completions", timeout=120, json=_body(
        modalities=["text", "audio"], stage_params={"talker": {"temperature": 0, "max_tokens": TALKER_MAX}})).json()
    message = audio["choices"][0]["message"]
    assert message["content"] == ref.text and message["audio"]["transcript"] == START + ref.text
    speak = _body(modalities=["text", "audio"], stream=True, audio={"voice": "ethan", "format": "pcm16"},
                  stage_params={"talker": {"temperature": 0, "max_tokens": TALKER_MAX}})
    with httpx.stream("POST", f"{mesh.rest}/v1/chat/completions", json=speak, timeout=120) as r:
        deltas = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    said = [(d["choices"][0]["delta"].get("audio") or {}).get("transcript") or "" for d in deltas if d["choices"]]
    assert "".join(said) == START + ref.text  # streamed as OpenAI does: the spoken text beside the audio

    msgs = [omni_pb2.ChatMessage(role="user", content=[omni_pb2.ContentPart(text=QUESTION)]),
            omni_pb2.ChatMessage(role="assistant", content=[omni_pb2.ContentPart(text=START)])]
    req = omni_pb2.GenerateRequest(model=MODEL, messages=msgs, modalities=["text"], add_generation_prompt=False,
                                   continue_final_message=True,
                                   sampling=stage_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    with grpc.insecure_channel(mesh.grpc) as ch:
        out = list(omni_pb2_grpc.OmniStub(ch).Generate(req, timeout=120))
    assert "".join(r.text_delta for r in out if r.WhichOneof("kind") == "text_delta") == ref.text


def test_speech_without_an_open_assistant_turn_is_a_400(mesh):
    body = _body(modalities=["text", "audio"], continue_final_message=False)
    r = httpx.post(f"{mesh.rest}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "add_generation_prompt", r.text
