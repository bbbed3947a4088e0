"""Tools through the shared mesh (started without --enable-auto-tool-choice): /tokenize and the thinker see the
tools rendered into the prompt as the model's template writes them (the same ids `transformers` gives), a
chat with tool_choice "none" answers with the tools in its prompt, and "auto" is a 400 naming the flags, as in
vLLM. The parsing of tool calls out of the thinker's text: tests/gateway/test_tool_calls.py."""

from __future__ import annotations

import json

import httpx
from transformers import AutoTokenizer

MODEL = "tiny-qwen3-omni"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]


def test_tools_render_into_the_prompt_and_auto_needs_the_flag(mesh, tiny_model_dir) -> None:
    tokens = httpx.post(f"{mesh.rest}/tokenize", json={"model": MODEL, "messages": MESSAGES, "tools": TOOLS},
                        timeout=60).json()["tokens"]
    want = AutoTokenizer.from_pretrained(tiny_model_dir).apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]}], tools=TOOLS,
        add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert tokens == list(want)

    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    plain = httpx.post(f"{mesh.rest}/v1/chat/completions", json=body, timeout=60)
    none = httpx.post(f"{mesh.rest}/v1/chat/completions", json={**body, "tools": TOOLS, "tool_choice": "none"},
                      timeout=60)
    assert plain.status_code == none.status_code == 200, none.text
    assert none.json()["usage"]["prompt_tokens"] == len(tokens) > plain.json()["usage"]["prompt_tokens"]
    assert none.json()["choices"][0]["message"]["tool_calls"] == []

    auto = httpx.post(f"{mesh.rest}/v1/chat/completions", json={**body, "tools": TOOLS}, timeout=60)
    assert auto.status_code == 400 and auto.json()["error"]["param"] == "tool_choice"
    assert "--enable-auto-tool-choice and --tool-call-parser" in auto.json()["error"]["message"]


def test_a_forced_call_comes_back_as_tool_calls(mesh) -> None:
    """tool_choice "required" / a named function need no flag: the thinker's text is held to the calls' JSON
    (structured outputs), which the tiny model's random weights would never write on their own."""
    tools = [{"type": "function", "function": {"name": "set_mode", "parameters": {
        "type": "object", "properties": {"mode": {"enum": ["calm", "storm"]}}, "required": ["mode"],
        "additionalProperties": False}}}]
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 80, "temperature": 0, "tools": tools}
    named = httpx.post(f"{mesh.rest}/v1/chat/completions", timeout=60,
                       json={**body, "tool_choice": {"type": "function", "function": {"name": "set_mode"}}}).json()
    call = named["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["name"] == "set_mode" and json.loads(call["function"]["arguments"])["mode"] in ("calm", "storm")
    assert named["choices"][0]["message"]["content"] is None
    # (the random weights never close a list of calls: parallel_tool_calls false makes it one call)
    required = httpx.post(f"{mesh.rest}/v1/chat/completions", timeout=60,
                          json={**body, "tool_choice": "required", "parallel_tool_calls": False}).json()
    calls = required["choices"][0]["message"]["tool_calls"]
    assert len(calls) == 1 and calls[0]["function"]["name"] == "set_mode"
    assert all(json.loads(c["function"]["arguments"])["mode"] in ("calm", "storm") for c in calls)
