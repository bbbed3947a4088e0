"""Incremental detokenizer and stop strings for the thinker's text.

`Detokenizer`: token ids in, text deltas out, never splitting a UTF-8 character. Each call decodes a short
window of the ids (skipping special tokens; vLLM's prefix / read offsets): the tokens since the start of the
last delta, so a step costs the same at token 8000 as at token 8 (decoding every id generated so far made a
long answer quadratic on the thinker's compute thread); the window's text minus the text of its old part is
the new delta. When the text ends in an incomplete byte sequence (U+FFFD) the delta is held back until the
next token completes it. The deltas join into exactly `decode(all ids)` for byte-level BPE vocabularies.

`StopStrings`: the detokenizer's deltas in, the deltas to emit out, ending the text at the first stop
string (OpenAI's / vLLM's `stop`): before it by default, after it with vLLM's `include_stop_str_in_output`.
Text that could still become the start of a stop string (at most len(longest stop) - 1 chars) is held
back, so a stop string split across tokens is caught and never partly emitted; `finish()` releases it when
the request ends otherwise. A delta pushed with `armed=False` (vLLM's `min_tokens` not reached yet) is
never matched, only held back like any other: a stop string that ends in a later, armed delta still counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class Detokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens  # vLLM's: False keeps them in the text
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read]: the tokens of the last delta (context for the next one)
        self.read = 0  # ids[:read] are in the deltas returned so far

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        return self._delta(final=False)

    def finish(self) -> str:
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        decode = self.tokenizer.decode
        seen = decode(self.ids[self.prefix:self.read], skip_special_tokens=self.skip)
        text = decode(self.ids[self.prefix:], skip_special_tokens=self.skip)
        if len(text) <= len(seen) or (text.endswith("\ufffd") and not final):
            return ""  # nothing new yet (a special token), or a character not whole yet
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(seen):]


class StopStrings:
    """`push(delta, armed) -> (to_emit, stopped)` per text delta; `finish() -> held-back text` at the end.

    After a stop, `stopped` is True and every later call emits nothing. With no stop strings, deltas pass
    through unchanged. Several stop strings: the match that starts first wins (the shorter on a tie).
    """

    def __init__(self, stops: Sequence[str], include_stop: bool = False):
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self.stops = tuple(stops)
        self._by_first: dict[str, list[str]] = {}  # the stop strings by their first character (`_held`)
        for stop in self.stops:
            self._by_first.setdefault(stop[0], []).append(stop)
        self._longest = max((len(stop) for stop in self.stops), default=0)
        self.include_stop = include_stop  # emit the matched stop string as the text's end
        self.pending = ""  # text not emitted yet: a suffix that a stop string could start with
        self.stopped = False
        self.matched: str | None = None  # the stop string that stopped the text

    def push(self, delta: str, armed: bool = True) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return delta, False
        text = self.pending + delta
        if armed:
            hits = [(i, len(s)) for s in self.stops if (i := text.find(s)) >= 0]
            if hits:
                start, length = min(hits)
                self.matched = text[start:start + length]
                self.pending, self.stopped = "", True
                return text[:start + length if self.include_stop else start], True
        keep = self._held(text)
        self.pending = text[len(text) - keep:]
        return text[:len(text) - keep], False

    def finish(self) -> str:
        """The held-back text (nothing after a stop); call once when the request ends."""
        out, self.pending = self.pending, ""
        return out

    def _held(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string. Only the stop
        strings that start with a suffix's first character are tried: a token costs about one check per stop
        string that could match, not one per stop string and suffix (64 stop strings: ~12x less)."""
        for start in range(max(0, len(text) - self._longest + 1), len(text)):
            candidates = self._by_first.get(text[start])
            if not candidates:
                continue
            suffix = text[start:]
            if any(len(stop) > len(suffix) and stop.startswith(suffix) for stop in candidates):
                return len(suffix)
        return 0
