"""Incremental detokenizer and stop strings for the thinker's text.

`Detokenizer`: token ids in, text deltas out, never splitting a UTF-8 character. Each call decodes the ids
generated so far (skipping special tokens) and returns what is new; when the text ends in an incomplete
byte sequence (U+FFFD) the delta is held back until the next token completes it.

`StopStrings`: the detokenizer's deltas in, the deltas to emit out, ending the text before the first stop
string (OpenAI's / vLLM's `stop`: the stop string itself is never emitted). Text that could still become
the start of a stop string (at most len(longest stop) - 1 chars) is held back, so a stop string split
across tokens is caught and never partly emitted; `finish()` releases it when the request ends otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
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


class StopStrings:
    """`push(delta) -> (to_emit, stopped)` per text delta; `finish() -> held-back text` at the end.

    After a stop, `stopped` is True and every later call emits nothing. With no stop strings, deltas pass
    through unchanged.
    """

    def __init__(self, stops: Sequence[str]):
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self.stops = tuple(stops)
        self.pending = ""  # text not emitted yet: a suffix that a stop string could start with
        self.stopped = False

    def push(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return delta, False
        text = self.pending + delta
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:  # the earliest match wins
            self.pending, self.stopped = "", True
            return text[:min(hits)], True
        keep = self._held(text)
        self.pending = text[len(text) - keep:]
        return text[:len(text) - keep], False

    def finish(self) -> str:
        """The held-back text (nothing after a stop); call once when the request ends."""
        out, self.pending = self.pending, ""
        return out

    def _held(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
