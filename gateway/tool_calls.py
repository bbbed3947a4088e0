"""OpenAI function calling on the REST API: which requests may use tools, and the thinker's text -> `tool_calls`.

Role: a request's `tools` render into the prompt through the chat template (gateway/prompt.py, as vLLM passes
them); the model answers a call as a Hermes-style block in its text (Qwen2.5 / Qwen3 / Qwen3-Omni):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Oslo"}}
    </tool_call>

`tool_choice` "required" or a named function forces the call, as vLLM does, with or without the flags: the
thinker's text is held to the calls' JSON by a structured output (`ToolPlan.structured`) and `forced_calls`
reads the calls from it. With vLLM's `--enable-auto-tool-choice --tool-call-parser hermes` and
`tool_choice` "auto" (the default when tools are given) the gateway parses those blocks out of the text: `parse_tool_calls` for a whole answer,
`ToolCallStream` for a streamed one (text outside the blocks streams on as content; each call leaves as one
`tool_calls` delta when its block closes; a partial "<tool_call>" at the end of a delta is held back until
the next one says whether it is a tag). A block that is not a JSON object with a string `name` stays in the
content verbatim. A choice that made calls finishes with "tool_calls".

Data flow: ChatCompletionRequest -> `tool_plan(body, enabled)` (400s for what cannot be honoured) ->
ChatRequest.tools -> prompt; the thinker's text -> parser -> ResponseMessage.tool_calls / Delta.tool_calls.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from gateway.events import ToolCall
from gateway.media import invalid_request
from gateway.openai_schema import ChatCompletionRequest
from omnimesh import json_text

START, END = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolPlan:
    tools: tuple[dict, ...]  # for the chat template
    parse: bool  # turn <tool_call> blocks into tool_calls
    forced: str | None = None  # "required", or the named function: the answer IS the call(s) (`forced_calls`)
    structured: tuple[str, str] | None = None  # the JSON schema that forces it (the thinker's structured output)


NO_TOOLS = ToolPlan((), parse=False)


def tool_plan(body: ChatCompletionRequest, auto_enabled: bool, modalities: tuple[str, ...]) -> ToolPlan:
    """A REST body's `tools` / `tool_choice` / `parallel_tool_calls` (`plan_tools`)."""
    choice = body.tool_choice
    return plan_tools(tuple(t.model_dump(exclude_none=True) for t in body.tools or ()),
                      choice if isinstance(choice, str) or choice is None else None,
                      None if isinstance(choice, str) or choice is None else choice.function.name,
                      body.parallel_tool_calls, auto_enabled, modalities)


def plan_tools(tools: tuple[dict, ...], choice: str | None, named: str | None, parallel_tool_calls: bool | None,
               auto_enabled: bool, modalities: tuple[str, ...]) -> ToolPlan:
    """What a request's tools (OpenAI's `{"type": "function", "function": {...}}` each) and tool choice
    ("none", "auto", "required", None, or `named`: one function) ask for, as vLLM answers them: "none" renders
    the tools and parses nothing; "auto" (the default with tools) needs --enable-auto-tool-choice; "required"
    and a named function constrain the answer to the calls' JSON (structured outputs), with or without the
    flag. Mistakes are 400s naming the field."""
    if named is not None:
        choice = named
    elif choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolPlan(tools, parse=False)
    if not tools:
        if choice == "auto":
            return ToolPlan(tools, parse=False)
        raise invalid_request("tool_choice: forcing a call needs tools", "tool_choice")
    if "audio" in modalities and choice != "auto":  # "auto": the talker stops where a call starts (spoken_calls.py)
        raise invalid_request("tool_choice: a forced call is the whole answer, with nothing to say; with "
                              "tool_choice \"required\" or a named function ask for modalities [\"text\"]",
                              "tool_choice")
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise invalid_request(f"tools: function names must be unique, got {names}", "tools")
    if named is not None:  # a named function: the answer is its arguments
        name = named
        if name not in names:
            raise invalid_request(f"tool_choice: function {name!r} is not among the tools ({', '.join(names)})",
                                  "tool_choice")
        return ToolPlan(tools, parse=False, forced=name,
                        structured=("json", json.dumps(_parameters(tools[names.index(name)]))))
    if choice == "required":  # the answer is a list of calls, each {"name": ..., "parameters": ...}, or just one
        # with OpenAI's parallel_tool_calls false
        calls = [{"type": "object", "properties": {"name": {"enum": [t["function"]["name"]]}, "parameters": _parameters(t)},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
        schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan(tools, parse=False, forced="required", structured=("json", json.dumps(schema)))
    if not auto_enabled:
        raise invalid_request("tool_choice: \"auto\" tool choice requires --enable-auto-tool-choice and "
                              "--tool-call-parser to be set (or send tool_choice \"none\")", "tool_choice")
    return ToolPlan(tools, parse=True)


def _parameters(tool: dict) -> dict:
    """A tool's arguments schema (any object when it gives none)."""
    return tool["function"].get("parameters") or {"type": "object"}


def forced_calls(plan: ToolPlan, text: str) -> list[ToolCall] | None:
    """The calls a forced answer (`plan.forced`) holds: its JSON, which the grammar shaped. Cut short by
    max_tokens (finish_reason "length"), it is still the calls, as OpenAI and vLLM answer: a named function's
    arguments are the text as far as it got; "required" gives each whole call and the cut one with its name and
    its arguments so far. None when not even a call's name was written: then the text stays content."""
    try:
        value = json_text.loads(text)
    except ValueError:
        if plan.forced != "required":
            return [ToolCall(id=new_call_id(), name=str(plan.forced), arguments=text.strip())]
        return _cut_calls(text)
    if plan.forced != "required":
        return [ToolCall(id=new_call_id(), name=str(plan.forced), arguments=json.dumps(value, ensure_ascii=False))]
    if not isinstance(value, list):
        return None
    return [ToolCall(id=new_call_id(), name=c["name"], arguments=json.dumps(c["parameters"], ensure_ascii=False))
            for c in value if isinstance(c, dict) and "name" in c and "parameters" in c] or None


# a call of a "required" answer cut inside its parameters: {"name": "...", "parameters": <what was written>
_CUT_CALL = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:\s*(.*)\Z', re.S)


def _cut_calls(text: str) -> list[ToolCall] | None:
    """A "required" answer's list cut short: its whole calls, then the cut one if its name is whole."""
    decoder, calls, pos = json.JSONDecoder(), [], text.find("[") + 1
    if pos == 0:
        return None
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        try:
            value, pos = decoder.raw_decode(text, pos)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser follows
            cut = _CUT_CALL.match(text, pos)
            if cut:
                calls.append(ToolCall(id=new_call_id(), name=json.loads(cut[1]), arguments=cut[2].strip()))
            return calls or None
        if not (isinstance(value, dict) and "name" in value and "parameters" in value):
            return calls or None
        calls.append(ToolCall(id=new_call_id(), name=str(value["name"]),
                              arguments=json.dumps(value["parameters"], ensure_ascii=False)))


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"  # vLLM's form


def _call(block: str) -> ToolCall | None:
    """The call one block's JSON names, or None when it is not one."""
    try:
        value = json_text.loads(block)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=new_call_id(), name=value["name"], arguments=text)


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """The Hermes format, for a whole answer -> (the content outside well-formed blocks, None when only
    whitespace is left and there were calls; the calls, in order). A block the model did not close before it
    stopped counts when its JSON is whole."""
    stream = ToolCallStream()
    content, calls = stream.push(text)
    tail, more = stream.finish()
    content += tail
    calls += more
    if calls and not content.strip():
        return None, calls
    return content, calls


class ToolCallStream:
    """The Hermes format, delta by delta: `push(text)` -> (content to send now, calls completed now)."""

    def __init__(self) -> None:
        self._held = ""  # content that may be the start of a tag
        self._block: str | None = None  # the open block's text, None outside one
        self.calls = 0

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        content, calls = [], []
        buf = self._held + text
        self._held = ""
        while buf:
            if self._block is None:
                at = buf.find(START)
                if at < 0:
                    keep = _partial_suffix(buf, START)
                    content.append(buf[:len(buf) - keep])
                    self._held = buf[len(buf) - keep:]
                    break
                content.append(buf[:at])
                self._block, buf = "", buf[at + len(START):]
            else:
                joined = self._block + buf
                at = joined.find(END)
                if at < 0:
                    self._block, buf = joined, ""
                    break
                block, buf = joined[:at], joined[at + len(END):]
                self._block = None
                call = _call(block)
                if call is None:
                    content.append(START + block + END)
                else:
                    calls.append(call)
                    self.calls += 1
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The end of the answer: what was held back, and an unclosed block (a call when its JSON is whole)."""
        held, block = self._held, self._block
        self._held, self._block = "", None
        if block is None:
            return held, []
        call = _call(block)
        if call is None:
            return held + START + block, []
        self.calls += 1
        return held, [call]


class ToolAnswer:
    """One streamed choice's text shaped by its `ToolPlan`: `push(text)` -> (content to send now, calls
    completed now); `finish()` -> the same at the end. Parsed (auto): `ToolCallStream`. Forced: everything is
    held, and at the end it is the calls (`forced_calls`, cut ones included), or the text when no call was begun. No tools: the
    text as it comes. `calls` counts the calls made so far (a delta's first call index is `calls - len(new)`)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self._parser = ToolCallStream() if plan.parse else None
        self._held: list[str] = []
        self.calls = 0

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.plan.forced is not None:
            self._held.append(text)
            return "", []
        if self._parser is None:
            return text, []
        content, calls = self._parser.push(text)
        self.calls += len(calls)
        return content, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        if self.plan.forced is not None:
            text = "".join(self._held)
            calls = forced_calls(self.plan, text) or []
            self.calls += len(calls)
            return ("" if calls else text), calls
        if self._parser is None:
            return "", []
        content, calls = self._parser.finish()
        self.calls += len(calls)
        return content, calls

    def finish_reason(self, reason: str) -> str:
        """The choice's finish reason: "tool_calls" when parsed calls were made (a forced answer keeps its own)."""
        return "tool_calls" if self._parser is not None and self.calls else reason


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (0 when none)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
