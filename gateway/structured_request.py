"""A chat request's structured output: OpenAI's `response_format`, vLLM's `structured_outputs` and its older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` -> one (kind, spec) for the thinker.

Data flow: a chat or completion request body -> `structured_spec` (at most one of them; the spec compiled once here, so a
bad schema, regex or grammar is a 400 naming its field before any stage works) -> ChatRequest.structured ->
the thinker's `structured_output` option (services/llm/structured_output.py masks its logits by it).
"""

from __future__ import annotations

import importlib.util
import json
from typing import Any

from gateway.events import PipelineError
from gateway.media import invalid_request
from gateway.openai_schema import SamplingBody
from services.llm.structured_output import grammar_for


def require_llguidance(param: str) -> None:
    """501 naming the package when this server cannot compile structured outputs (a declared dependency, so
    only a trimmed install lacks it)."""
    if importlib.util.find_spec("llguidance") is None:
        raise PipelineError(f"{param}: this server cannot run structured outputs: llguidance is not installed; its "
                            "operator must install it (pip install llguidance)", http_status=501, grpc_code=12,
                            kind="server_error", param=param)


def _spec(kind: str, value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def structured_spec(body: SamplingBody) -> tuple[str, str] | None:
    """(kind, spec) with kind json | regex | choice | grammar, or None when the request asks for none."""
    found: list[tuple[str, str, str]] = []  # (field, kind, spec)
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", "json", '{"type": "object"}'))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise invalid_request("response_format.json_schema.schema: a json_schema response format needs its "
                                  "schema", "response_format.json_schema.schema")
        found.append(("response_format", "json", json.dumps(rf.json_schema.schema_)))
    so = body.structured_outputs
    if so is not None:
        for name, kind, value in (("json", "json", so.json_), ("regex", "regex", so.regex),
                                  ("choice", "choice", so.choice), ("grammar", "grammar", so.grammar)):
            if value is not None:
                found.append((f"structured_outputs.{name}", kind, _spec(kind, value)))
        if so.json_object:
            found.append(("structured_outputs.json_object", "json", '{"type": "object"}'))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        if (value := getattr(body, name)) is not None:
            found.append((name, kind, _spec(kind, value)))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(f for f, _, _ in found)
        raise invalid_request(f"{found[1][0]}: give one structured output per request, got {names}", found[1][0])
    field, kind, spec = found[0]
    require_llguidance(field)
    try:
        grammar_for(kind, spec)
    except ValueError as e:
        raise invalid_request(f"{field}: {e}", field) from None
    return kind, spec
