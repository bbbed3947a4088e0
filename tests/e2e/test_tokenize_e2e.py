"""/tokenize, /detokenize and --chat-template through real processes:
- on the shared mesh, /tokenize of a chat's messages counts what that chat's `usage.prompt_tokens` says,
  and /detokenize turns the ids back into the templated prompt;
- a second `omnimesh gateway` with `--chat-template FILE` on the same stages: /tokenize gives the ids of
  transformers' `apply_chat_template(chat_template=...)`, and the greedy answer equals `generate` on
  those ids (so the template reached the model, not only the tokenizer endpoint);
- a gateway with a template that prints each content whole (no loop over parts) takes contents as strings
  (--chat-template-content-format auto, said at start-up): a chat with audio gets the audio's placeholder
  on a line of its own in the prompt, and its greedy answer equals `generate` on that prompt;
- a gateway with `--default-chat-template-kwargs` renders every prompt with those variables unless the
  request's own chat_template_kwargs set them.
"""

from __future__ import annotations

from pathlib import Path

import httpx
from mesh_harness import start_gateway
from reference import chat_request, openai_content, png_bytes, sine_wav

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\nPlease answer: {% for p in m.content %}"
            "{% if p.type == 'text' %}{{ p.text }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PROMPT = "Tell me about the sea."
MESSAGES = [{"role": "user", "content": PROMPT}]
MAX_TOKENS = 8
STRING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _chat(url: str) -> dict:
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                   json={"model": "tiny-qwen3-omni", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_tokenize_counts_the_chat_prompt(mesh, reference) -> None:
    tok = httpx.post(f"{mesh.rest}/tokenize", json={"model": "tiny-qwen3-omni", "messages": MESSAGES}, timeout=30)
    assert tok.status_code == 200, tok.text
    assert tok.json()["count"] == _chat(mesh.rest)["usage"]["prompt_tokens"]
    back = httpx.post(f"{mesh.rest}/detokenize", json={"tokens": tok.json()["tokens"]}, timeout=30).json()["prompt"]
    assert back == reference.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)


def test_chat_template_flag_reaches_the_model(mesh, tiny_model_dir, reference, tmp_path: Path) -> None:
    f = tmp_path / "template.jinja"
    f.write_text(TEMPLATE, encoding="utf-8")
    proc, url = start_gateway(tiny_model_dir, mesh.stages, "--chat-template", str(f))
    try:
        proc.wait_for_line(r"chat template from --chat-template \(\d+ characters\)", timeout_s=30)
        parts = [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]  # as the gateway renders it
        text = reference.tokenizer.apply_chat_template(parts, tokenize=False, add_generation_prompt=True,
                                                       chat_template=TEMPLATE)
        assert "Please answer: " + PROMPT in text
        tok = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES}, timeout=30).json()
        assert tok["tokens"] == reference.tokenizer(text)["input_ids"]
        answer = _chat(url)
        assert answer["usage"]["prompt_tokens"] == tok["count"]
        own, reference.prompts.chat_template = reference.prompts.chat_template, TEMPLATE
        try:
            ref = reference.generate(chat_request(PROMPT, None, None, max_tokens=MAX_TOKENS, talker_max=1),
                                     max_tokens=MAX_TOKENS, talker_max=1, audio=False)
        finally:
            reference.prompts.chat_template = own
        assert answer["choices"][0]["message"]["content"] == ref.text
        assert answer["choices"][0]["message"]["content"] != _chat(mesh.rest)["choices"][0]["message"]["content"]
    finally:
        assert proc.stop() == 0, proc.output()


def test_a_string_template_hears_the_audio(mesh, tiny_model_dir, reference, tmp_path: Path) -> None:
    f = tmp_path / "string.jinja"
    f.write_text(STRING_TEMPLATE, encoding="utf-8")
    proc, url = start_gateway(tiny_model_dir, mesh.stages, "--chat-template", str(f))
    try:
        proc.wait_for_line(r"takes message contents as strings, media as placeholders in the text \(detected",
                           timeout_s=30)
        wav = sine_wav(0.5)
        messages = [{"role": "user", "content": openai_content(PROMPT, wav, None)}]
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": "tiny-qwen3-omni", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0})
        assert r.status_code == 200, r.text
        tok = httpx.post(f"{url}/tokenize", json={"messages": messages}, timeout=30).json()
        assert r.json()["usage"]["prompt_tokens"] == tok["count"]
        prompt = httpx.post(f"{url}/detokenize", json={"tokens": tok["tokens"]}, timeout=30).json()["prompt"]
        assert prompt.startswith("<|im_start|>user\n<|audio_start|><|audio_pad|><|audio_pad|>")
        assert prompt.endswith(f"<|audio_pad|><|audio_end|>\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n")
        own = reference.prompts.chat_template, reference.prompts.content_format
        reference.prompts.chat_template, reference.prompts.content_format = STRING_TEMPLATE, "string"
        try:
            ref = reference.generate(chat_request(PROMPT, wav, None, max_tokens=MAX_TOKENS, talker_max=1),
                                     max_tokens=MAX_TOKENS, talker_max=1, audio=False)
        finally:
            reference.prompts.chat_template, reference.prompts.content_format = own
        assert r.json()["choices"][0]["message"]["content"] == ref.text
    finally:
        assert proc.stop() == 0, proc.output()


def test_server_default_template_variables(mesh, tiny_model_dir) -> None:
    proc, url = start_gateway(tiny_model_dir, mesh.stages, "--default-chat-template-kwargs", '{"add_vision_id": true}')
    try:
        proc.wait_for_line(r'chat template variables \{"add_vision_id": true\} by default', timeout_s=30)
        messages = [{"role": "user", "content": openai_content("What is it?", None, png_bytes(32))}]

        def prompt(**extra: object) -> str:
            tok = httpx.post(f"{url}/tokenize", json={"messages": messages, **extra}, timeout=30)
            assert tok.status_code == 200, tok.text
            return httpx.post(f"{url}/detokenize", json={"tokens": tok.json()["tokens"]}, timeout=30).json()["prompt"]

        assert "Picture 1: <|vision_start|>" in prompt()
        assert "Picture 1" not in prompt(chat_template_kwargs={"add_vision_id": False})
    finally:
        assert proc.stop() == 0, proc.output()
