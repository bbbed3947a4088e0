"""Tools through the shared mesh (started without --enable-auto-tool-choice): /tokenize and the thinker see the
tools rendered into the prompt as the model's template writes them (the same ids `transformers` gives), a
chat with tool_choice "none" answers with the tools in its prompt, and "auto" is a 400 naming the flags, as in
vLLM. The parsing of tool calls out of the thinker's text: tests/gateway/test_tool_calls.py."""

from __future__ import annotations

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
