"""Per-request stage options (`Open.options`, strings on the wire) read and checked in one place."""

from __future__ import annotations

from omnimesh.v1 import stage_pb2


def count_option(msg: stage_pb2.Open, name: str, default: int, unit: str = "codes") -> int:
    """A whole number >= 1 of `unit` (`default` when absent); ValueError (INVALID_ARGUMENT) otherwise."""
    text = msg.options.get(name, str(default))
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"option {name} must be a whole number of {unit} >= 1, got {text!r}")
    return int(text)


def priority_option(msg: stage_pb2.Open, policy: str) -> int:
    """vLLM's request `priority` (a whole number, lower = sooner; 0 when absent). Other than 0 it needs the
    stage's "priority" scheduling policy; ValueError (INVALID_ARGUMENT) otherwise, as vLLM refuses it."""
    text = msg.options.get("priority")
    if text is None:
        return 0
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"option priority must be a whole number, got {text!r}") from None
    if value and policy != "priority":
        raise ValueError(f"priority {value} needs --scheduling-policy priority; this stage schedules first come, "
                         f"first served (fcfs)")
    return value
