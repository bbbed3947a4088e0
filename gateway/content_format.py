"""How message contents reach the chat template: vLLM's --chat-template-content-format.

Data flow:
    the chat template's source --detect_content_format (jinja's AST: does it loop over a message's
      content?)--> "openai" (contents stay part lists: {"type": "text", "text"} / {"type": "audio"} / ...)
      or "string" (each content becomes one string)
    render_conversation's part lists --as_strings (text parts as they are, each media part as the model's
      placeholder, e.g. <|audio_start|><|audio_pad|><|audio_end|>, joined by newlines)--> the template

Qwen's own templates loop over the parts and write the placeholders themselves ("openai"). A text-only
template (an operator's --chat-template, or one that tests `message.content is string` as Qwen3's text
models do) would drop the parts or fail on a list; for it the gateway writes the placeholders into the
text, where the processor expands them as it would the model template's. "auto" (the default) decides
once, from the template, as vLLM does; the start-up log says which it chose.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

log = logging.getLogger(__name__)

CONTENT_FORMATS = ("auto", "string", "openai")


def check_content_format(value: str) -> str:
    """The flag's value, or ValueError naming the choices."""
    if value not in CONTENT_FORMATS:
        raise ValueError(f"--chat-template-content-format {value!r}: choose one of {', '.join(CONTENT_FORMATS)}")
    return value


@functools.lru_cache(maxsize=64)  # a request's own template (--trust-request-chat-template) is read once
def detect_content_format(template: str) -> str:
    """"openai" when the template iterates over a message's content (directly, through a filter, or through
    a variable set from it), else "string". A template jinja cannot parse is left to its render's own error
    and counted as "openai", omnimesh's format before this flag."""
    from jinja2 import nodes

    try:
        tree = _environment().parse(template)
    except Exception as exc:  # TemplateSyntaxError: rendering will say so, naming the template
        log.warning("chat template: cannot parse it to detect its content format (%s); using 'openai'", exc)
        return "openai"
    aliases = {a.target.name for a in tree.find_all(nodes.Assign)
               if isinstance(a.target, nodes.Name) and _is_content(a.node, set())}
    return "openai" if any(_is_content(f.iter, aliases) for f in tree.find_all(nodes.For)) else "string"


def _environment() -> Any:
    """A jinja environment that parses what transformers renders (its extensions included)."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        return _compile_jinja_template("").environment
    except Exception:  # another transformers layout: plain jinja with the loop controls HF templates use
        import jinja2

        return jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])


def _is_content(node: Any, aliases: set[str]) -> bool:
    """`x.content`, `x['content']`, a name set from one, or either through filters (`x.content | list`)."""
    from jinja2 import nodes

    while isinstance(node, nodes.Filter) and node.node is not None:
        node = node.node
    if isinstance(node, nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
    return isinstance(node, nodes.Name) and node.name in aliases


def media_placeholders(processor: Any) -> dict[str, str]:
    """Each media part's text in a prompt, as the model's own template writes it (Qwen3-Omni
    <|audio_start|><|audio_pad|><|audio_end|>, Qwen2.5-Omni <|audio_bos|><|AUDIO|><|audio_eos|>, ...)."""
    return {"audio": processor.audio_bos_token + processor.audio_token + processor.audio_eos_token,
            "image": processor.vision_bos_token + processor.image_token + processor.vision_eos_token,
            "video": processor.vision_bos_token + processor.video_token + processor.vision_eos_token}


def as_strings(messages: list[dict[str, Any]], placeholders: dict[str, str]) -> list[dict[str, Any]]:
    """Template messages with each part list made one string: text parts and media placeholders in order,
    joined by newlines (vLLM's string format, which joins the texts so and puts placeholders on lines of
    their own); the messages' other fields unchanged."""
    out = []
    for message in messages:
        parts = message["content"]
        text = "\n".join(p["text"] if p["type"] == "text" else placeholders[p["type"]] for p in parts)
        out.append({**message, "content": text})
    return out
