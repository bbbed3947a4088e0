"""`POST /v1/responses` through the shared mesh: a response's text is the answer of the same conversation sent
as a chat completion (instructions as the system turn, an image part included), its usage the chat's, and the
event stream's deltas join into it. Gateway-level shapes and errors: tests/gateway/test_responses.py."""

from __future__ import annotations

import base64
import json

import httpx
from mesh_harness import start_gateway
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


def test_function_calls_are_the_chats(mesh):
    """A forced call through /v1/responses is the chat's forced call on the same conversation (the same
    arguments, greedy), and sending it back with its output renders the prompt the chat renders for the
    assistant's tool_calls and the tool turn (the same prompt tokens, the same answer)."""
    params = {"type": "object", "properties": {"mode": {"enum": ["calm", "storm"]}}, "required": ["mode"],
              "additionalProperties": False}
    ask = [{"role": "user", "content": "Set the mode."}]
    resp = httpx.post(f"{mesh.rest}/v1/responses", timeout=TIMEOUT_S, json={
        "model": MODEL, "input": ask, "max_output_tokens": 40, "temperature": 0,
        "tools": [{"type": "function", "name": "set_mode", "parameters": params}],
        "tool_choice": {"type": "function", "name": "set_mode"}}).json()
    chat_tools = [{"type": "function", "function": {"name": "set_mode", "parameters": params}}]
    chat = httpx.post(f"{mesh.rest}/v1/chat/completions", timeout=TIMEOUT_S, json={
        "model": MODEL, "messages": ask, "max_tokens": 40, "temperature": 0, "tools": chat_tools,
        "tool_choice": {"type": "function", "function": {"name": "set_mode"}}}).json()
    [item] = resp["output"]
    chat_call = chat["choices"][0]["message"]["tool_calls"][0]
    assert item["type"] == "function_call" and item["name"] == "set_mode"
    assert item["arguments"] == chat_call["function"]["arguments"] and json.loads(item["arguments"])["mode"]
    again = httpx.post(f"{mesh.rest}/v1/responses", timeout=TIMEOUT_S, json={
        "model": MODEL, "max_output_tokens": 6, "temperature": 0, "tool_choice": "none",
        "tools": [{"type": "function", "name": "set_mode", "parameters": params}],
        "input": [*ask, item, {"type": "function_call_output", "call_id": item["call_id"], "output": "done"}]}).json()
    chat_again = httpx.post(f"{mesh.rest}/v1/chat/completions", timeout=TIMEOUT_S, json={
        "model": MODEL, "max_tokens": 6, "temperature": 0, "tool_choice": "none", "tools": chat_tools,
        "messages": [*ask, {"role": "assistant", "content": None, "tool_calls": [chat_call]},
                     {"role": "tool", "tool_call_id": chat_call["id"], "content": "done"}]}).json()
    assert again["usage"]["input_tokens"] == chat_again["usage"]["prompt_tokens"]
    assert again["output"][0]["content"][0]["text"] == chat_again["choices"][0]["message"]["content"]


def test_previous_response_id_continues_the_conversation(mesh, tiny_model_dir):
    """A gateway with --responses-store-memory on the shared mesh's stages: a second response that names the first
    answers as the chat answers the whole conversation (the first turn, its answer, the new turn)."""
    gw, url = start_gateway(tiny_model_dir, mesh.stages, "--responses-store-memory", "16MiB")
    try:
        first = httpx.post(f"{url}/v1/responses", timeout=TIMEOUT_S, json={
            "model": MODEL, "input": "Tell me about the sea.", "max_output_tokens": 6, "temperature": 0}).json()
        second = httpx.post(f"{url}/v1/responses", timeout=TIMEOUT_S, json={
            "model": MODEL, "input": "And the sky?", "previous_response_id": first["id"], "max_output_tokens": 6,
            "temperature": 0}).json()
        kept = httpx.get(f"{url}/v1/responses/{second['id']}", timeout=TIMEOUT_S).json()
    finally:
        assert gw.stop() == 0
    said = first["output"][0]["content"][0]["text"]
    chat = httpx.post(f"{mesh.rest}/v1/chat/completions", timeout=TIMEOUT_S, json={
        "model": MODEL, "max_tokens": 6, "temperature": 0, "messages": [
            {"role": "user", "content": "Tell me about the sea."}, {"role": "assistant", "content": said},
            {"role": "user", "content": "And the sky?"}]}).json()
    assert second["output"][0]["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    assert second["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"] and kept == second


def test_logprobs_are_the_chats(mesh):
    """`top_logprobs` on a response: each answer token's entry equals the chat completion's for the same turn."""
    resp = httpx.post(f"{mesh.rest}/v1/responses", timeout=TIMEOUT_S, json={
        "model": MODEL, "input": "Tell me about the sea.", "max_output_tokens": 5, "temperature": 0,
        "top_logprobs": 2}).json()
    chat = httpx.post(f"{mesh.rest}/v1/chat/completions", timeout=TIMEOUT_S, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 5,
        "temperature": 0, "logprobs": True, "top_logprobs": 2}).json()
    got = resp["output"][0]["content"][0]["logprobs"]
    assert got == chat["choices"][0]["logprobs"]["content"] and len(got) == 5
