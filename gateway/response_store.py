"""Stored responses of the Responses API: `store`, `previous_response_id` and `/v1/responses/{id}`.

Role: with `--responses-store-memory SIZE` the gateway keeps each answered response (unless the request says
`store: false`) in this process's memory, newest last, dropping the least recently used once their size passes
SIZE, as vLLM keeps them in memory. A stored response holds:
- the `response` object as answered (`GET /v1/responses/{id}`),
- its input items as the client sent them (`GET /v1/responses/{id}/input_items`),
- the conversation so far as chat messages (`Message`s): the previous response's conversation, this input
  (not its `instructions`: OpenAI does not carry those over) and this answer (its text as an assistant turn,
  its function calls on it). A request with `previous_response_id` continues that conversation.
Without the flag nothing is kept: `store` is answered false and `previous_response_id` is a 400 that says
how to turn it on. With several gateways behind a balancer a conversation's requests must reach the one that
stored it (or send the whole conversation as `input`). Media in an input (data URLs) are kept as sent, and
count towards SIZE.

Data flow: ResponsesRoutes.build -> `get(previous_response_id)` -> its conversation + the new input -> the
chat; the answer -> `put(id, StoredResponse)`; GET / DELETE -> `get` / `delete`.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.openai_schema import Message
from omnimesh.config.stage_config import parse_bytes


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object as answered
    input_items: list[dict[str, Any]]  # this request's input, as items (a string input: one user message)
    conversation: list[Message]  # the chat so far, this answer included (no instructions)
    # what the conversation takes, counted as it grew: each request's body and each answer's output (JSON bytes),
    # so a long conversation with media is not serialized again at every turn
    conversation_bytes: int
    size: int = field(init=False)

    def __post_init__(self) -> None:
        self.size = self.conversation_bytes + len(json.dumps(self.response))

    def call_ids(self) -> set[str]:
        """The ids of the calls the conversation made (a later input may answer them)."""
        return {c.id for m in self.conversation for c in m.tool_calls or ()}


class ResponseStore(Collector):
    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 1:
            raise ValueError(f"the response store needs at least 1 byte, got {budget_bytes}")
        self.budget = budget_bytes
        self.used = 0
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, stored: StoredResponse) -> bool:
        """Keep it (dropping the least recently used ones over the budget); False when it alone is larger."""
        if stored.size > self.budget:
            return False
        with self._lock:
            old = self._items.pop(response_id, None)
            self.used -= old.size if old is not None else 0
            self._items[response_id] = stored
            self.used += stored.size
            while self.used > self.budget:
                _, dropped = self._items.popitem(last=False)
                self.used -= dropped.size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            stored = self._items.get(response_id)
            if stored is not None:
                self._items.move_to_end(response_id)
            return stored

    def delete(self, response_id: str) -> bool:
        with self._lock:
            stored = self._items.pop(response_id, None)
            if stored is None:
                return False
            self.used -= stored.size
            return True

    def __len__(self) -> int:
        return len(self._items)

    def collect(self) -> Iterable[Metric]:
        """Its Prometheus series (the gateway's /metrics registers the store as a collector)."""
        with self._lock:
            kept, used = len(self._items), self.used
        return [GaugeMetricFamily("omnimesh:responses_stored", "Responses API answers kept (--responses-store-memory)",
                                  value=kept),
                GaugeMetricFamily("omnimesh:responses_store_bytes", "Bytes the kept responses take (their JSON)",
                                  value=used),
                GaugeMetricFamily("omnimesh:responses_store_capacity_bytes", "--responses-store-memory", value=self.budget)]


def responses_store(size: str | None) -> ResponseStore | None:
    """--responses-store-memory (e.g. '512MiB') as the gateway's store; None keeps nothing."""
    if size is None:
        return None
    return ResponseStore(parse_bytes(size, "--responses-store-memory"))
