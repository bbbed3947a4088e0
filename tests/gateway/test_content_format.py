"""--chat-template-content-format (gateway/content_format.py): which templates loop over a message's parts
(jinja's AST, as vLLM decides "auto"), contents made strings with each media item as the model's own
placeholder (Qwen3-Omni's and Qwen2.5-Omni's), the prompt a text-only template then gives (the ids the
processor makes of the same text and audio), the choice forced either way, and the flag's checks."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from gateway.content_format import as_strings, detect_content_format, media_placeholders
from gateway.events import AudioPart, ChatMessage, ChatRequest, PipelineError, TextPart
from gateway.prompt import PromptBuilder
from omnimesh.config.serve_args import ServeArgs
from omnimesh.launcher import MeshLauncher
from omnimesh.models.qwen2_5_omni.tiny import build_tiny_qwen2_5_omni
from omnimesh.models.qwen3_omni.tiny import build_tiny_qwen3_omni

# Qwen3's text models' way: the content printed whole (here without the `is string` test, which a list fails)
STRING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen3_omni(Path(tmp_path_factory.mktemp("tiny")) / "qwen3-omni")


@pytest.fixture(scope="module")
def processor(folder: Path):
    return PromptBuilder(folder, max_model_len=512).processor


def chat(*parts: object, **fields: object) -> ChatRequest:
    return ChatRequest(request_id="r", model="m", messages=(ChatMessage("user", tuple(parts)),),  # type: ignore[arg-type]
                       **fields)  # type: ignore[arg-type]


def clip(seconds: float = 0.5) -> AudioPart:
    return AudioPart(np.sin(np.arange(int(16_000 * seconds), dtype=np.float32) / 9), 16_000)


@pytest.mark.parametrize(("template", "expected"), [
    (STRING_TEMPLATE, "string"),
    ("{% for m in messages %}{% if m.content is string %}{{ m.content }}{% endif %}{% endfor %}", "string"),
    ("{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}", "openai"),
    ("{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endfor %}", "openai"),
    ("{% for m in messages %}{% set c = m.content %}{% for p in c %}{{ p.text }}{% endfor %}{% endfor %}", "openai"),
    ("{% for m in messages %}{% for p in m.content | selectattr('type', 'eq', 'text') %}{{ p.text }}{% endfor %}"
     "{% endfor %}", "openai"),
    # transformers' own {% generation %} tag parses (its environment, not bare jinja's)
    ("{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}", "string"),
    ("{% for m in messages %", "openai"),  # unparsable: its render will say so; the old behaviour meanwhile
])
def test_detection(template: str, expected: str) -> None:
    assert detect_content_format(template) == expected


def test_the_models_own_templates_take_part_lists(folder: Path, tmp_path: Path) -> None:
    assert PromptBuilder(folder, max_model_len=512).content_format == "openai"
    assert PromptBuilder(build_tiny_qwen2_5_omni(tmp_path / "q25"), max_model_len=512).content_format == "openai"


def test_placeholders_are_each_familys_own(processor, tmp_path: Path) -> None:
    assert media_placeholders(processor) == {"audio": "<|audio_start|><|audio_pad|><|audio_end|>",
                                             "image": "<|vision_start|><|image_pad|><|vision_end|>",
                                             "video": "<|vision_start|><|video_pad|><|vision_end|>"}
    q25 = PromptBuilder(build_tiny_qwen2_5_omni(tmp_path / "q25"), max_model_len=512).processor
    assert media_placeholders(q25) == {"audio": "<|audio_bos|><|AUDIO|><|audio_eos|>",
                                       "image": "<|vision_bos|><|IMAGE|><|vision_eos|>",
                                       "video": "<|vision_bos|><|VIDEO|><|vision_eos|>"}


def test_as_strings_keeps_the_order_and_the_other_fields() -> None:
    marks = {"audio": "A", "image": "I", "video": "V"}
    messages = [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "audio"}, {"type": "image"},
                                             {"type": "text", "text": "y"}, {"type": "video"}]},
                {"role": "assistant", "content": [], "tool_calls": [{"id": "c"}], "reasoning_content": "r"},
                {"role": "tool", "content": [{"type": "text", "text": "42"}], "tool_call_id": "c"}]
    assert as_strings(messages, marks) == [
        {"role": "user", "content": "x\nA\nI\ny\nV"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c"}], "reasoning_content": "r"},
        {"role": "tool", "content": "42", "tool_call_id": "c"}]
    assert messages[0]["content"][0] == {"type": "text", "text": "x"}  # the input is not changed


def test_a_string_template_gets_the_placeholders(processor, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="gateway.prompt"):
        builder = PromptBuilder(processor, max_model_len=512, chat_template=STRING_TEMPLATE)
    assert builder.content_format == "string" and "placeholders" not in caplog.text  # the probe's audio is there
    audio = clip()
    req = chat(TextPart("listen"), audio, TextPart("what is it?"))
    text, _ = builder.render(req)
    assert text == ("<|im_start|>user\nlisten\n<|audio_start|><|audio_pad|><|audio_end|>\nwhat is it?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    built = builder.build(req)
    expected = processor(text=[text], audio=[audio.waveform], return_tensors="pt")
    assert built.input_ids.tolist() == expected["input_ids"][0].tolist()
    assert int((built.input_ids == processor.audio_token_id).sum()) > 1  # expanded to the clip's frames
    assert built.input_features is not None


def test_the_flag_overrides_the_detection(processor, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="gateway.prompt"):
        forced = PromptBuilder(processor, max_model_len=512, chat_template=STRING_TEMPLATE, content_format="openai")
    assert "--chat-template-content-format string" in caplog.text  # the warning says what to do
    with pytest.raises(PipelineError, match="could not prepare the prompt") as e:  # the list printed, no placeholder
        forced.build(chat(TextPart("listen"), clip()))
    assert e.value.http_status == 400
    # the model's own template also takes strings: the same prompt but for the newlines between parts
    own = PromptBuilder(processor, max_model_len=512)
    as_string = PromptBuilder(processor, max_model_len=512, content_format="string")
    req = chat(TextPart("listen"), clip(), TextPart("now"))
    assert own.render(req)[0].replace("listen<|audio_start|>", "listen\n<|audio_start|>").replace(
        "<|audio_end|>now", "<|audio_end|>\nnow") == as_string.render(req)[0]
    with pytest.raises(ValueError, match="--chat-template-content-format 'lists': choose one of auto, string, openai"):
        PromptBuilder(processor, max_model_len=512, content_format="lists")


def test_the_flag_is_checked_and_reaches_the_gateway(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--chat-template-content-format 'x'"):
        ServeArgs(chat_template_content_format="x")
    argv = MeshLauncher(ServeArgs(chat_template_content_format="string"), tmp_path)._gateway_argv({})
    assert argv[argv.index("--chat-template-content-format") + 1] == "string"


def test_a_requests_own_template_needs_the_flag(processor) -> None:
    """vLLM's request `chat_template`: a 400 naming --trust-request-chat-template unless the server has it; with
    it, the request's template renders (its content format read from it: here strings, so the audio's
    placeholder is written in) and a template without tools refuses a request with tools, naming whose."""
    from dataclasses import replace

    from gateway.chat_template_options import template_options
    from gateway.events import TemplateOptions

    own = TemplateOptions(chat_template=STRING_TEMPLATE)
    req = chat(TextPart("listen"), clip(), template=own)
    with pytest.raises(PipelineError, match="start it with --trust-request-chat-template") as e:
        PromptBuilder(processor, max_model_len=512).render(req)
    assert e.value.http_status == 400 and e.value.param == "chat_template"
    trusting = PromptBuilder(processor, max_model_len=512, trust_request_template=True)
    text, _ = trusting.render(req)
    assert text == ("<|im_start|>user\nlisten\n<|audio_start|><|audio_pad|><|audio_end|><|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert trusting.render(chat(TextPart("listen"), clip()))[0] == PromptBuilder(processor, max_model_len=512).render(
        chat(TextPart("listen"), clip()))[0]  # without one: the server's template, as before
    tools = ({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},)
    with pytest.raises(PipelineError, match="tools: the request's chat template does not render tools"):
        trusting.render(replace(req, tools=tools))
    for bad in ("", "x" * (64 * 1024 + 1)):
        with pytest.raises(PipelineError, match="chat_template: a Jinja template of 1 to 65536 bytes"):
            template_options(None, None, None, ["user"], audio_out=False, chat_template=bad)
    with pytest.raises(PipelineError, match="the request's chat template rejected them"):
        trusting.render(chat(TextPart("hi"), template=TemplateOptions(chat_template="{{ raise_exception('no') }}")))
