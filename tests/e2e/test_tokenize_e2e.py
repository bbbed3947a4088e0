"""/tokenize, /detokenize and --chat-template through real processes:
- on the shared mesh, /tokenize of a chat's messages counts what that chat's `usage.prompt_tokens` says,
  and /detokenize turns the ids back into the templated prompt;
- a second `omnimesh gateway` with `--chat-template FILE` on the same stages: /tokenize gives the ids of
  transformers' `apply_chat_template(chat_template=...)`, and the greedy answer equals `generate` on
  those ids (so the template reached the model, not only the tokenizer endpoint).
"""

from __future__ import annotations

from pathlib import Path

import httpx
from mesh_harness import start_gateway
from reference import chat_request

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\nPlease answer: {% for p in m.content %}"
            "{% if p.type == 'text' %}{{ p.text }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PROMPT = "Tell me about the sea."
MESSAGES = [{"role": "user", "content": PROMPT}]
MAX_TOKENS = 8


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
