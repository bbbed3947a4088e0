"""`--chat-template` (gateway/prompt.py): a file or an inline Jinja template replaces the model's; the
prompt is exactly what transformers' `apply_chat_template(chat_template=...)` renders, tokenized; a
template that does not render stops start-up naming the flag, one that drops media placeholders is
warned about at start-up and its media requests are 400s; a value that is neither a file nor a template
is refused."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from gateway.events import AudioPart, ChatMessage, ChatRequest, PipelineError, TemplateOptions, TextPart
from gateway.prompt import PromptBuilder, load_chat_template
from omnimesh.config.serve_args import ServeArgs
from omnimesh.models.qwen3_omni.tiny import build_tiny_qwen3_omni

# text parts only (media dropped): what a custom template for a text-only deployment might look like
TEXT_ONLY = ("{% for m in messages %}[{{ m.role }}]{% for p in m.content %}{% if p.type == 'text' %}{{ p.text }}"
             "{% endif %}{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.fixture(scope="module")
def processor(tmp_path_factory: pytest.TempPathFactory):
    folder = build_tiny_qwen3_omni(Path(tmp_path_factory.mktemp("tiny")) / "qwen3-omni")
    return PromptBuilder(folder, max_model_len=512).processor


def chat(*messages: ChatMessage) -> ChatRequest:
    return ChatRequest(request_id="r", model="m", messages=messages)


def user(*parts: object) -> ChatMessage:
    return ChatMessage(role="user", content=tuple(parts))  # type: ignore[arg-type]


def test_load_from_a_file_or_inline(tmp_path: Path) -> None:
    f = tmp_path / "t.jinja"
    f.write_text(TEXT_ONLY, encoding="utf-8")
    assert load_chat_template(str(f)) == TEXT_ONLY
    assert load_chat_template(TEXT_ONLY) == TEXT_ONLY
    with pytest.raises(ValueError, match="no such file, and not an inline Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="--chat-template"):
        ServeArgs(chat_template=str(tmp_path / "missing.jinja"))
    assert ServeArgs(chat_template=str(f)).chat_template == str(f)
    long = "{% for m in messages %}" + "{{ m.role }}: {{ m.content }}\n" * 10 + "{% endfor %}"  # > a file name's 255
    assert load_chat_template(long) == long and ServeArgs(chat_template=long).chat_template == long
    with pytest.raises(ValueError, match="no such file, and not an inline Jinja template"):
        load_chat_template("t" * 300)


def test_the_prompt_is_what_transformers_renders_with_it(processor, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="gateway.prompt"):
        custom = PromptBuilder(processor, max_model_len=512, chat_template=TEXT_ONLY)
    assert "renders 0 <|audio_pad|> placeholders" in caplog.text  # said once, at start-up
    default = PromptBuilder(processor, max_model_len=512)
    req = chat(ChatMessage("system", (TextPart("be brief"),)), user(TextPart("hello there")))
    conv = [{"role": "system", "content": [{"type": "text", "text": "be brief"}]},
            {"role": "user", "content": [{"type": "text", "text": "hello there"}]}]
    expected = processor.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True,
                                                       chat_template=TEXT_ONLY)
    text, _ = custom.render(req)
    assert text == expected == "[system]be brief<|im_end|>\n[user]hello there<|im_end|>\n[assistant]"
    built = custom.build(req)
    assert built.input_ids.tolist() == list(processor.tokenizer(expected)["input_ids"])
    assert built.input_ids.tolist() != default.build(req).input_ids.tolist()
    bare = replace(req, template=TemplateOptions(add_generation_prompt=False))
    assert custom.encode(bare).tolist() == list(
        processor.tokenizer(expected.removesuffix("[assistant]"))["input_ids"])
    with pytest.raises(PipelineError, match="could not prepare the prompt") as e:  # the template dropped the audio
        custom.build(chat(user(TextPart("listen"), AudioPart(np.zeros(16_000, np.float32), 16_000))))
    assert e.value.http_status == 400


def test_a_template_that_does_not_render_stops_start_up(processor) -> None:
    with pytest.raises(ValueError, match="--chat-template does not render a system \\+ user message: TemplateSyntaxError"):
        PromptBuilder(processor, max_model_len=512, chat_template="{% for %}")
    with pytest.raises(ValueError, match="UndefinedError|does not render"):
        PromptBuilder(processor, max_model_len=512, chat_template="{{ nothing.here }}")


def test_messages_a_custom_template_rejects_are_400_naming_it(processor) -> None:
    strict = "{% if messages | length > 1 %}{{ raise_exception('one message only') }}{% endif %}" + TEXT_ONLY
    b = PromptBuilder(processor, max_model_len=512, chat_template=strict.replace("messages | length > 1", "false"))
    assert b.render(chat(user(TextPart("a"))))[0].startswith("[user]a")
    b.chat_template = strict  # past the start-up probe (two messages): what a request then gets
    with pytest.raises(PipelineError, match="the --chat-template chat template rejected them: one message only") as e:
        b.build(chat(user(TextPart("a")), user(TextPart("b"))))
    assert e.value.http_status == 400
