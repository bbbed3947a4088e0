"""OpenAI's `frequency_penalty` / `presence_penalty` through the running mesh (the shared `mesh`), greedy,
against `transformers` `generate` on the same folder with vLLM's arithmetic as a logits processor
(transformers has no such penalty): every generated id loses `frequency * count + presence`, counted over
that stage's generated tokens only (the thinker's prompt is never penalised; the talker's generate sees
only its codec tokens). The thinker's text must equal the reference token for token and the waveform
within 1e-4 — and both must differ from the plain greedy answer, so an ignored penalty fails the test.
Through REST the same body gives the same text, and out-of-range values are 400s naming the field.
"""

from __future__ import annotations

from dataclasses import replace

import httpx
import numpy as np
import torch
from reference import chat_request
from test_parity import MAX_TOKENS, TALKER_MAX, run_pipeline
from transformers import LogitsProcessor, LogitsProcessorList

PROMPT = "Tell me about the sea."
THINKER = {"frequency_penalty": 1.5, "presence_penalty": 0.5}
TALKER = {"frequency_penalty": 1.0, "presence_penalty": -0.25}


class OutputPenalty(LogitsProcessor):
    """vLLM's frequency / presence penalties over `input_ids[:, start:]` (the generated part)."""

    def __init__(self, start: int, frequency_penalty: float, presence_penalty: float) -> None:
        self.start, self.frequency, self.presence = start, frequency_penalty, presence_penalty

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        for b in range(scores.shape[0]):
            ids, counts = torch.unique(input_ids[b, self.start:], return_counts=True)
            scores[b, ids] -= self.frequency * counts.to(scores.dtype) + self.presence
        return scores


def _request(penalised: bool):
    req = chat_request(PROMPT, None, None, max_tokens=MAX_TOKENS, talker_max=TALKER_MAX)
    if not penalised:
        return req
    return replace(req, sampling=replace(req.sampling, **THINKER),
                   stage_params={"talker": replace(req.stage_params["talker"], **TALKER)})


def test_penalties_equal_generate_with_vllms_formula(mesh, tiny_model_dir, reference):
    req = _request(penalised=True)
    prompt_len = reference.prompts(req).input_ids.numel()
    ref = reference.generate(
        req, max_tokens=MAX_TOKENS, talker_max=TALKER_MAX,
        thinker_logits_processor=LogitsProcessorList([OutputPenalty(prompt_len, **THINKER)]),
        talker_logits_processor=LogitsProcessorList([OutputPenalty(0, **TALKER)]))
    plain = reference.generate(_request(penalised=False), max_tokens=MAX_TOKENS, talker_max=TALKER_MAX)
    assert ref.text != plain.text, "the penalty changes nothing on this prompt: the test could not fail"
    assert ref.audio.shape != plain.audio.shape or not np.allclose(ref.audio, plain.audio, atol=1e-3)

    text, audio, finished = run_pipeline(mesh, tiny_model_dir, req, True)
    assert text == ref.text and finished is not None
    assert audio.shape == ref.audio.shape and np.abs(audio - ref.audio).max() < 1e-4

    body = {"model": "tiny-qwen3-omni", "messages": [{"role": "user", "content": PROMPT}], "modalities": ["text"],
            "max_tokens": MAX_TOKENS, "temperature": 0, **THINKER}
    r = httpx.post(f"{mesh.rest}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == ref.text


def test_penalties_out_of_range_are_400(mesh):
    for extra, param in (({"presence_penalty": 2.01}, "presence_penalty"),
                         ({"stage_params": {"talker": {"frequency_penalty": -7}}}, "stage_params.talker.frequency_penalty")):
        body = {"model": "tiny-qwen3-omni", "messages": [{"role": "user", "content": PROMPT}], **extra}
        r = httpx.post(f"{mesh.rest}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param and "[-2, 2]" in r.json()["error"]["message"]

