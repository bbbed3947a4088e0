"""How a chat's messages become its prompt: vLLM's `add_generation_prompt`, `continue_final_message` and
`chat_template_kwargs` (REST chat and /tokenize, gRPC `GenerateRequest`), checked the same way for each.

- `add_generation_prompt` (default true): the prompt ends with the assistant's turn start
  (`<|im_start|>assistant\\n`), so the model writes the answer.
- `continue_final_message` (default false; needs add_generation_prompt false, as in vLLM): the final message
  stays open and the model continues it — an assistant message the client began ("prefill"). With speech out
  the talker speaks the whole assistant message, the client's start and the continuation, as if the thinker
  had written all of it (services/llm/thinker_task.py sends the start's rows first), so the final message
  must then be the assistant's; `echo` (REST chat) puts that start before the generated text.
- `chat_template_kwargs`: variables the chat template reads (e.g. a template's `enable_thinking`), a JSON
  object. The names `apply_chat_template` itself takes are not variables and are refused, each with the field
  that sets it. `chat_template` (vLLM's): the request's own Jinja template, rendered only by a server started
  with `--trust-request-chat-template` (the prompt builder refuses it otherwise). The server's
  `--default-chat-template-kwargs` (`parse_default_kwargs`, checked the same way)
  are under every request's: the prompt builder and the reasoning parser read them, the request's own win.

Speech out needs the prompt to end inside the assistant's turn (the talker speaks from its start), so
`add_generation_prompt: false` without `continue_final_message` is refused there. Everything else is the
template's to render (gateway/prompt.py); a message it cannot place (transformers' "the final message does
not appear in the chat") is the prompt builder's 400.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from gateway.events import ChatMessage, TemplateOptions, TextPart
from gateway.media import invalid_request
from omnimesh import json_text

# apply_chat_template's own parameters: not template variables; where a request sets each instead
_RESERVED: dict[str, str] = {
    "add_generation_prompt": "the request's own add_generation_prompt",
    "continue_final_message": "the request's own continue_final_message",
    "tools": "the request's tools",
    "chat_template": "the request's own chat_template (or the server's --chat-template)",
    "conversation": "the request's messages",
    "messages": "the request's messages",
    "documents": "nothing: omnimesh renders no documents",
    "tokenize": "nothing: the gateway tokenizes",
    "return_dict": "nothing: the gateway tokenizes",
    "return_tensors": "nothing: the gateway tokenizes",
    "return_assistant_tokens_mask": "nothing: the gateway tokenizes",
    "padding": "nothing: the gateway tokenizes",
    "truncation": "truncate_prompt_tokens",
    "max_length": "truncate_prompt_tokens",
    "tokenizer_kwargs": "nothing: the gateway tokenizes",
}
MAX_KWARGS_BYTES = 64 * 1024  # their JSON: template variables, not a second request body
MAX_TEMPLATE_BYTES = 64 * 1024  # a request's own chat template (Qwen3-Omni's is ~6 KiB)


def template_options(add_generation_prompt: bool | None, continue_final_message: bool | None,
                     kwargs: Any, roles: Sequence[str], *, audio_out: bool, prefix: str = "",
                     chat_template: str | None = None) -> TemplateOptions:
    """A request's fields (None: the default) -> `TemplateOptions`; a 400 naming the field for a combination
    that cannot be rendered or spoken. `roles`: the messages' roles in order; `prefix`: the fields' path in
    the body ("" at the top level)."""
    generation = True if add_generation_prompt is None else add_generation_prompt
    cont = bool(continue_final_message)
    name = f"{prefix}continue_final_message"
    if cont and generation:
        raise invalid_request(f"{name}: cannot be used with add_generation_prompt: true (the default): the prompt "
                              "would both continue the final message and start a new assistant turn; send "
                              "add_generation_prompt: false", name)
    if audio_out and cont and (not roles or roles[-1] != "assistant"):
        last = roles[-1] if roles else "none"
        raise invalid_request(f"{name}: with audio output the final message must be the assistant's (the talker "
                              f"speaks the assistant's turn), got a '{last}' message; ask for modalities "
                              "[\"text\"] to continue another message", name)
    if audio_out and not generation and not cont:
        where = f"{prefix}add_generation_prompt"
        raise invalid_request(f"{where}: audio output needs the prompt to end inside the assistant's turn (the "
                              "talker speaks it from its start): leave add_generation_prompt true, or continue an "
                              "assistant message with continue_final_message: true", where)
    if chat_template is not None and (not chat_template.strip() or len(chat_template.encode()) > MAX_TEMPLATE_BYTES):
        raise invalid_request(f"{prefix}chat_template: a Jinja template of 1 to {MAX_TEMPLATE_BYTES} bytes",
                              f"{prefix}chat_template")
    return TemplateOptions(generation, cont, check_kwargs(kwargs, f"{prefix}chat_template_kwargs"), chat_template)


def check_kwargs(kwargs: Any, param: str) -> dict[str, Any]:
    """`chat_template_kwargs` (None or a JSON object) -> the variables; reserved names and other shapes -> 400."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise invalid_request(f"{param}: must be a JSON object of template variables, got {type(kwargs).__name__}",
                              param)
    for key in kwargs:
        if not key.isidentifier():
            raise invalid_request(f"{param}: {key!r} is not a template variable name (letters, digits and _)", param)
        if key in _RESERVED:
            raise invalid_request(f"{param}.{key}: not a template variable; set it through {_RESERVED[key]}",
                                  f"{param}.{key}")
    if len(json.dumps(kwargs)) > MAX_KWARGS_BYTES:
        raise invalid_request(f"{param}: at most {MAX_KWARGS_BYTES} bytes of JSON", param)
    return dict(kwargs)


def parse_kwargs_json(text: str, param: str) -> dict[str, Any]:
    """gRPC's `chat_template_kwargs` (JSON text; empty: none) -> the variables, checked as REST's."""
    if not text:
        return {}
    try:
        value = json_text.loads(text)  # nested too deeply: TooDeep, a JSONDecodeError
    except json.JSONDecodeError as e:
        raise invalid_request(f"{param}: not JSON: {e}", param) from None
    return check_kwargs(value, param)



def parse_default_kwargs(text: str | None) -> dict[str, Any]:
    """vLLM's --default-chat-template-kwargs (a JSON object; None or empty: none) -> the variables every
    request's template gets unless its own chat_template_kwargs set them; ValueError naming the flag."""
    from gateway.events import PipelineError

    flag = "--default-chat-template-kwargs"
    if not text:
        return {}
    try:
        return parse_kwargs_json(text, flag)
    except PipelineError as e:
        raise ValueError(str(e)) from None


def final_assistant_text(messages: Sequence[ChatMessage]) -> str:
    """The final message's text when it is the assistant's (what continue_final_message continues and echo
    repeats), its parts joined as the chat template joins them; else ''."""
    if not messages or messages[-1].role != "assistant":
        return ""
    return "".join(p.text for p in messages[-1].content if isinstance(p, TextPart))
