"""The codec window schedule: how many code groups each vocoder decode takes, and so how the talker chunks
the codes it sends (the vocoder advertises its schedule in Info; the gateway hands it to the talker).

Role: a schedule is a list of window sizes, the last one repeating: `--audio-windows 5,25` (the default)
decodes 5 codes first, so the first audio leaves early, then 25 at a time. A listener's player starts at
the first audio, so each window must be made while the audio before it plays: after 5 codes (0.4 s of
audio on Qwen3-Omni) the next 25 must come at 5x real time or the player runs dry. `5,10,20,25` doubles
instead: each window is then about as long as the audio already out, and real time is enough, for one
more decode per request. Windows are cut at the same offsets whatever the timing of the input, so a
request's chunks are the same run to run.
"""

from __future__ import annotations

DEFAULT_WINDOWS = (5, 25)
MAX_ENTRIES = 32


def parse_windows(text: str, what: str = "--audio-windows") -> tuple[int, ...]:
    """'5,10,20,25' -> (5, 10, 20, 25); ValueError naming `what` unless every entry is a whole number >= 1."""
    parts = [p.strip() for p in str(text).split(",")]
    if not parts or len(parts) > MAX_ENTRIES or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise ValueError(f"{what} must be 1 to {MAX_ENTRIES} comma-separated whole numbers of codes >= 1, one per "
                         f"window from the first, the last one repeating (e.g. 5,25 or 5,10,20,25), got {text!r}")
    return tuple(int(p) for p in parts)


def window_size(index: int, windows: tuple[int, ...]) -> int:
    """Codes in window `index` (0-based): the schedule's entry, its last one from there on."""
    return windows[min(index, len(windows) - 1)]


def windows_text(windows: tuple[int, ...]) -> str:
    return ",".join(str(w) for w in windows)
