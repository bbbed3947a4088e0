"""Incremental detokenizer: token ids in, text deltas out, never splitting a UTF-8 character.

Each call decodes the ids generated so far (skipping special tokens) and returns what is new; when the
text ends in an incomplete byte sequence (U+FFFD) the delta is held back until the next token completes it.
"""

from __future__ import annotations

from typing import Any


class Detokenizer:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        return self._delta(final=False)

    def finish(self) -> str:
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd") and not final:
            return ""
        delta = text[len(self.text):] if text.startswith(self.text) else text
        self.text = text
        return delta
