"""JSON text a client sent (a request body, a Realtime event, a tool's parameters, a call's arguments, a
structured-output schema, gRPC's `chat_template_kwargs`, a batch file's line), parsed so that what Python's
parser lets through but nothing after it can take is the client's mistake, not a crash:

- nesting deeper than the parser follows: `json.loads` raises RecursionError past ~1,000 levels of arrays /
  objects (`[[[[...]]]]` is 2 bytes a level), which was a 500 / INTERNAL, or UNKNOWN through grpcio;
- an unpaired UTF-16 surrogate: JSON lets the escape `\\ud800` stand alone (and `json.loads` decodes bytes
  with "surrogatepass", so a surrogate's UTF-8-style bytes ED A0..BF .. get in too), but no UTF-8 text holds
  one: the tokenizer failed on it (a TypeError, a 500), even inside a call's arguments or a tool's schema.

`loads` raises either as a `json.JSONDecodeError` subclass, so every caller's existing "not JSON" answer
(400 / INVALID_ARGUMENT, an `invalid_json` Realtime event) covers them.
"""

from __future__ import annotations

import json
import re
from typing import Any

TOO_DEEP = "its arrays / objects nest too deeply to parse"
LONE_SURROGATE = ("a string has an unpaired UTF-16 surrogate (an escape such as \\ud800, or its bytes): not valid "
                  "Unicode")

# a high-surrogate escape not followed by a low one, or a low one not after a high one: maybe half a pair (an
# escaped backslash before "ud800" also matches; `_unpaired` decides). Pairs, as in every emoji that a client's
# json.dumps writes as \ud83d\ude00, never match, so they cost no walk over the value
_HALF = r"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F]"
_HALF_TEXT = re.compile(_HALF)
_HALF_BYTES = re.compile(_HALF.encode())


class Refused(json.JSONDecodeError):
    """JSON that `json.loads` took (or could not follow) but no caller can use; its text is the reason alone."""

    def __init__(self, why: str) -> None:
        super().__init__(why, "", 0)

    def __str__(self) -> str:
        return self.msg


class TooDeep(Refused):
    def __init__(self) -> None:
        super().__init__(TOO_DEEP)


class LoneSurrogate(Refused):
    def __init__(self) -> None:
        super().__init__(LONE_SURROGATE)


def loads(text: str | bytes | bytearray) -> Any:
    """`json.loads`, with nesting too deep for it raised as `TooDeep` and a lone surrogate as `LoneSurrogate`."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise TooDeep() from None
    # a surrogate escape starts \ud or \uD: a substring search (memchr speed) before the regex, which costs ~20 ms
    # a MB (a Realtime event of audio, a body of base64 media: none of them has a backslash)
    if isinstance(text, str):
        maybe = ("\\ud" in text or "\\uD" in text) and _HALF_TEXT.search(text) is not None
    else:
        maybe = ((b"\\ud" in text or b"\\uD" in text) and _HALF_BYTES.search(text) is not None) or b"\xed" in text
    if maybe and _unpaired(value):
        raise LoneSurrogate()
    return value


def _unpaired(value: Any) -> bool:
    """Whether a string anywhere in `value` (keys too) is not encodable text; iterative, for any depth."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False
