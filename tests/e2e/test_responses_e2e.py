"""`POST /v1/responses` through the shared mesh: a response's text is the answer of the same conversation sent
as a chat completion (instructions as the system turn, an image part included), its usage the chat's, and the
event stream's deltas join into it. Gateway-level shapes and errors: tests/gateway/test_responses.py."""

from __future__ import annotations

import base64
import json

import httpx
from reference import png_bytes

MODEL = "tiny-qwen3-omni"
TIMEOUT_S = 120.0


def test_a_response_is_the_same_chat(mesh):
    image = f"data:image/png;base64,{base64.b64encode(png_bytes()).decode()}"
    r = httpx.post(f"{mesh.rest}/v1/responses", timeout=TIMEOUT_S, json={
        "model": MODEL, "instructions": "Answer briefly.", "max_output_tokens": 10, "temperature": 0,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "What is in the picture?"},
                                               {"type": "input_image", "image_url": image}]}]})
    assert r.status_code == 200, r.text
    resp = r.json()
    chat = httpx.post(f"{mesh.rest}/v1/chat/completions", timeout=TIMEOUT_S, json={
        "model": MODEL, "max_tokens": 10, "temperature": 0,
        "messages": [{"role": "system", "content": "Answer briefly."},
                     {"role": "user", "content": [{"type": "text", "text": "What is in the picture?"},
                                                  {"type": "image_url", "image_url": {"url": image}}]}]}).json()
    text = resp["output"][0]["content"][0]["text"]
    assert text == chat["choices"][0]["message"]["content"] and text
    assert resp["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert resp["usage"]["output_tokens"] == chat["usage"]["completion_tokens"]
    assert resp["status"] == ("incomplete" if chat["choices"][0]["finish_reason"] == "length" else "completed")
    deltas = []
    with httpx.stream("POST", f"{mesh.rest}/v1/responses", timeout=TIMEOUT_S, json={
            "model": MODEL, "instructions": "Answer briefly.", "max_output_tokens": 10, "temperature": 0,
            "stream": True, "input": [{"role": "user", "content": [
                {"type": "input_text", "text": "What is in the picture?"},
                {"type": "input_image", "image_url": image}]}]}) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if event["type"] == "response.output_text.delta":
                    deltas.append(event["delta"])
    assert "".join(deltas) == text
