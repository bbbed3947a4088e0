"""Function calling on OpenAI's Responses API (`POST /v1/responses`): its tools, its call items, both ways.

Role: the Responses API spells function calling its own way; this module turns it into the chat's
(gateway/tool_calls.py, which the chat completions share) and back:

- request `tools` (`{"type": "function", "name", "description", "parameters", "strict"}`, flat) and
  `tool_choice` ("none" / "auto" / "required" / `{"type": "function", "name"}`) -> a `ToolPlan` by the chat's
  rules (`plan_tools`: "auto", the default with tools, needs --enable-auto-tool-choice --tool-call-parser;
  "required" and a named function hold the thinker's text to the calls' JSON). Hosted tools (web_search,
  file_search, mcp, ...) and other tool choices are 400s naming the field: omnimesh runs no tool itself.
- input items `function_call` (an earlier answer's call, sent back) and `function_call_output` (the client's
  result for it) -> the chat's assistant `tool_calls` and `tool` turns, which the chat template renders (calls
  following an assistant message join it, as one assistant turn); an output whose call_id no earlier call
  carries is a 400. A `reasoning` item (an earlier answer's, sent back as the SDKs do) becomes the
  `reasoning` of the assistant turn after it, which the chat template reads as `reasoning_content` (a
  thinking model's template shows it where it wants it, usually only within the current tool loop).
- the calls the thinker made -> `function_call` output items (`call_item`): `call_id` the call's id, `arguments`
  JSON text, after the message (which is left out when the answer is only calls).

Data flow: ResponsesRequest.tools / tool_choice / parallel_tool_calls -> `responses_tool_plan` -> ChatRequest.tools
+ structured; `input` items -> `item_messages` -> chat `Message`s; the answer's text -> `ToolAnswer` -> items.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import Field

from gateway.events import ToolCall
from gateway.media import invalid_request
from gateway.openai_schema import ContentPart, FunctionCall, Message, MessageToolCall, StrictBody, validate_body
from gateway.tool_calls import ToolPlan, plan_tools


class FunctionTool(StrictBody):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema object
    strict: bool | None = None

    def as_chat(self) -> dict[str, Any]:
        """The chat's form (`{"type": "function", "function": {...}}`), which the chat template renders."""
        return {"type": "function", "function": self.model_dump(exclude_none=True, exclude={"type"})}


class NamedFunction(StrictBody):
    type: Literal["function"]
    name: str = Field(min_length=1)


class FunctionCallItem(StrictBody):
    """A call an earlier answer made (its `function_call` output item, sent back)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str  # JSON text
    id: str | None = None
    status: str | None = None


class OutputText(StrictBody):
    type: Literal["input_text", "output_text"]
    text: str


class FunctionCallOutputItem(StrictBody):
    """The client's result for a call: text, or text parts."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[OutputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningItem(StrictBody):
    """An earlier answer's reasoning, sent back: its text goes with the assistant turn after it."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] | None = None
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: str | None = None

    def text(self) -> str:
        """Its `reasoning_text` parts joined ("" when it carries none: a summary or encrypted content only)."""
        return "".join(p.get("text", "") for p in self.content or () if isinstance(p, dict)
                       and p.get("type") == "reasoning_text" and isinstance(p.get("text"), str))


def responses_tool_plan(tools: list[Any] | None, choice: Any, parallel_tool_calls: bool | None,
                        auto_enabled: bool, modalities: tuple[str, ...] = ("text",), where: str = "") -> ToolPlan:
    """The request's `tools` / `tool_choice` / `parallel_tool_calls` as the chat's `ToolPlan`. The Realtime API
    spells its tools the same way: its session's fields are under `where` ("session.")."""
    defs = []
    for i, raw in enumerate(tools or ()):
        kind = raw.get("type") if isinstance(raw, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise invalid_request(f"{where}tools[{i}].type: {kind!r} is a hosted tool, which omnimesh does not run; "
                                  "give function tools ({\"type\": \"function\", \"name\", \"parameters\"}) and run "
                                  "them yourself", f"{where}tools[{i}].type")
        defs.append(validate_body(FunctionTool, raw, (*where.split(".")[:-1], "tools", i)).as_chat())
    if choice is None or choice in ("none", "auto", "required"):
        return plan_tools(tuple(defs), choice, None, parallel_tool_calls, auto_enabled, modalities)
    if isinstance(choice, dict) and choice.get("type") == "function":
        named = validate_body(NamedFunction, choice, (*where.split(".")[:-1], "tool_choice")).name
        return plan_tools(tuple(defs), None, named, parallel_tool_calls, auto_enabled, modalities)
    raise invalid_request(f"{where}tool_choice: give \"none\", \"auto\", \"required\" or {{\"type\": \"function\", "
                          f"\"name\": ...}} (got {str(choice)[:80]}; omnimesh runs no hosted tools)", f"{where}tool_choice")


def item_messages(item: Any, i: int, out: list[Message], calls: set[str]) -> bool:
    """A `function_call` / `function_call_output` / `reasoning` input item (`input[i]`) appended to `out` as the
    chat's turns; `calls` gathers the call ids seen so far. False when the item is none of those (a message)."""
    kind = item.get("type") if isinstance(item, dict) else None
    if kind == "function_call":
        fc = validate_body(FunctionCallItem, item, ("input", i))
        made = MessageToolCall(id=fc.call_id, function=FunctionCall(name=fc.name, arguments=fc.arguments))
        if out and out[-1].role == "assistant":  # the answer's text and its calls: one assistant turn
            out[-1].tool_calls = [*(out[-1].tool_calls or []), made]
        else:
            out.append(Message(role="assistant", content=[], tool_calls=[made]))
        calls.add(fc.call_id)
        return True
    if kind == "function_call_output":
        result = validate_body(FunctionCallOutputItem, item, ("input", i))
        if result.call_id not in calls:
            raise invalid_request(f"input[{i}].call_id: no function_call before it has call_id {result.call_id!r} "
                                  "(send the call's item back before its output)", f"input[{i}].call_id")
        out.append(Message(role="tool", content=[ContentPart(type="text", text=result.text())],
                           tool_call_id=result.call_id))
        return True
    if kind == "reasoning":  # an assistant turn that has only thought so far; its answer or calls join it
        thought = validate_body(ReasoningItem, item, ("input", i)).text()
        if thought:
            out.append(Message(role="assistant", content=[], reasoning=thought))
        return True
    if kind == "item_reference":
        raise invalid_request(f"input[{i}].type: an item_reference points at a stored item; omnimesh stores "
                              "nothing: send the item itself", f"input[{i}].type")
    return False


def call_item(call: ToolCall) -> dict[str, Any]:
    """A call the thinker made as the Responses API's `function_call` output item."""
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": "completed"}
