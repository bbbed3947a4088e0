"""vLLM's `prompt_logprobs` in its response shapes, from the thinker's entries.

Data flow: a request's `prompt_logprobs: k` -> the thinker scores each prompt row against the next prompt
token as it prefills (services/llm/thinker_task.py) -> its first chunk carries one `TokenLogprob` per prompt
token from the second (id, bytes, log-probability, rank, the k likeliest ids) -> `TextDelta.prompt_logprobs`
-> here: `[None, {"<id>": {"logprob", "rank", "decoded_token"}, ...}, ...]`, vLLM's shape on a chat
response (top level) and on each completion choice: the first prompt token has no context (None); each other
maps the prompt token's id and its k alternatives' ids (ranks 1..k) to their values. The prompt token comes
first; when it is among the likeliest, its entry is the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omnimesh.v1 import stage_pb2


def token_text(e: stage_pb2.TokenLogprob | stage_pb2.TopLogprob, as_ids: bool) -> str:
    """An entry's token as text: its bytes (U+FFFD where it holds part of a character), or 'token_id:<id>'
    (--return-tokens-as-token-ids, as vLLM writes it)."""
    return f"token_id:{e.token_id}" if as_ids else e.token.decode("utf-8", errors="replace")


def prompt_logprobs_json(entries: Sequence[stage_pb2.TokenLogprob], k: int, as_ids: bool = False
                         ) -> list[dict[str, Any] | None]:
    """The entries in vLLM's shape, each with its first `k` alternatives."""
    out: list[dict[str, Any] | None] = [None]
    for e in entries:
        position = {str(e.token_id): {"logprob": e.logprob, "rank": e.rank, "decoded_token": token_text(e, as_ids)}}
        for rank, t in enumerate(e.top[:k], start=1):
            position.setdefault(str(t.token_id), {"logprob": t.logprob, "rank": rank,
                                                  "decoded_token": token_text(t, as_ids)})
        out.append(position)
    return out
