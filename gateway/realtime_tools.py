"""Function calling on the Realtime API (gateway/realtime_api.py): the conversation's call items both ways.

Role: the session's `tools` / `tool_choice` (OpenAI's flat function tools, checked as the Responses API checks
them: gateway/responses_tools.py) make each response's `ToolPlan`; a response's calls become `function_call`
items of the conversation, and the client's results come back as `function_call_output` items
(`conversation.item.create`) before its next `response.create`. Here:

- `CallItem` / `OutputItem`: those two items, as the conversation keeps them and as `realtime.item` JSON;
- `parse_call_item(raw, items)`: a client's `conversation.item.create` of either kind (an output must answer a
  call the conversation holds);
- `chat_messages(items)`: the conversation as the chat's turns: calls join the assistant turn before them (its
  words), each output is a `tool` turn.

A spoken response with tools runs as gateway/spoken_calls.py runs it: the talker says the words before a call.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from gateway.events import ChatMessage, TextPart, ToolCall
from gateway.realtime_settings import RealtimeError


@dataclass
class CallItem:
    """A function call the model made (or the client created)."""

    id: str
    call: ToolCall
    role: str = "assistant"

    def to_json(self, status: str = "completed") -> dict[str, Any]:
        return {"id": self.id, "object": "realtime.item", "type": "function_call", "status": status,
                "call_id": self.call.id, "name": self.call.name,
                "arguments": self.call.arguments if status == "completed" else ""}


@dataclass
class OutputItem:
    """The client's result for a call."""

    id: str
    call_id: str
    output: str
    role: str = "tool"

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "object": "realtime.item", "type": "function_call_output", "status": "completed",
                "call_id": self.call_id, "output": self.output}


def new_call_item(call: ToolCall) -> CallItem:
    return CallItem(f"item_{uuid.uuid4().hex}", call)


def parse_call_item(raw: dict[str, Any], items: list[Any]) -> CallItem | OutputItem:
    """`conversation.item.create` of a `function_call` or `function_call_output` item; each mistake names its field."""
    item_id = raw.get("id") or f"item_{uuid.uuid4().hex}"
    call_id = raw.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise RealtimeError("item.call_id must be the call's id (a non-empty string)", "item.call_id")
    if raw["type"] == "function_call":
        if any(isinstance(i, CallItem) and i.call.id == call_id for i in items):  # its output would match both
            raise RealtimeError(f"item.call_id: the conversation already has a function_call with call_id "
                                f"{call_id!r}; each call needs its own id", "item.call_id")
        name, arguments = raw.get("name"), raw.get("arguments", "{}")
        if not isinstance(name, str) or not name or not isinstance(arguments, str):
            raise RealtimeError("a function_call item needs its name and its arguments (JSON text)", "item.name")
        return CallItem(item_id, ToolCall(call_id, name, arguments))
    if not any(isinstance(i, CallItem) and i.call.id == call_id for i in items):
        raise RealtimeError(f"item.call_id: the conversation has no function_call with call_id {call_id!r}",
                            "item.call_id")
    output = raw.get("output")
    if not isinstance(output, str):
        output = json.dumps(output) if output is not None else None
    if output is None:
        raise RealtimeError("a function_call_output item needs its output (the call's result as text)", "item.output")
    return OutputItem(item_id, call_id, output)


def chat_messages(items: list[Any]) -> list[ChatMessage]:
    """The conversation as chat turns: messages as they are, calls on the assistant turn before them, outputs as
    `tool` turns."""
    out: list[ChatMessage] = []
    for item in items:
        if isinstance(item, CallItem):
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":
                out[-1] = ChatMessage("assistant", last.content, (*last.tool_calls, item.call))
            else:
                out.append(ChatMessage("assistant", (), (item.call,)))
        elif isinstance(item, OutputItem):
            out.append(ChatMessage("tool", (TextPart(item.output),), tool_call_id=item.call_id))
        elif item.parts:
            out.append(ChatMessage(item.role, tuple(item.parts)))
    return out
