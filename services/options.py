"""Per-request stage options (`Open.options`, strings on the wire) read and checked in one place."""

from __future__ import annotations

from omnimesh.v1 import stage_pb2


def count_option(msg: stage_pb2.Open, name: str, default: int, unit: str = "codes") -> int:
    """A whole number >= 1 of `unit` (`default` when absent); ValueError (INVALID_ARGUMENT) otherwise."""
    text = msg.options.get(name, str(default))
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"option {name} must be a whole number of {unit} >= 1, got {text!r}")
    return int(text)
