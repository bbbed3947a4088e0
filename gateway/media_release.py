"""A request's decoded media are let go once every run that builds a prompt from them has built it.

Role: a request's media are decoded into its `ChatRequest`'s parts (video frames: up to `max_video_pixels`,
768 MB, for one video; images; waveforms). The prompt built from them is let go at the first event
(gateway/pipeline.py `_HeldPrompt`), but the parts themselves were held by the route, the choices' runs and
the pipeline for as long as the request lasted, through its whole spoken answer, so a gateway's memory grew
with the number of media requests in flight. `own_media(runs)` counts, for each media part, the runs whose
prompt is built from it (`n` choices share their request's parts; a completion's prompts have their own). Each
run reports once, through its `RunMedia`, when its build is over (built, failed, or cancelled before it
built), and a part that no run still needs lets its data go (`AudioPart.let_go` and its kind). A build that
meets a part already let go raises (gateway/prompt.py): never a prompt silently without its media.

Only runs that build from their parts once are handed over here (`choices.fan_out`: the REST and gRPC fronts'
requests). Parts that are built from again keep their data: a Realtime conversation's items (never handed
over) and a spoken answer with function calls, whose second part builds the conversation again
(`StagePipeline.run` drops that run's `RunMedia`, so its parts' count never reaches zero).

Data flow: `fan_out(pipeline, own_media(runs))` -> `StagePipeline._run_request` builds -> `RunMedia.built()`
-> the last run's report lets each part go.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from gateway.events import AudioPart, ChatRequest, ImagePart, VideoPart

MediaPart = AudioPart | ImagePart | VideoPart


class RunMedia:
    """One run's hold on its request's media parts; `built()` (on the event loop) gives it up, once."""

    __slots__ = ("_parts", "_holders")

    def __init__(self, parts: tuple[MediaPart, ...], holders: dict[int, int]) -> None:
        self._parts: tuple[MediaPart, ...] | None = parts
        self._holders = holders  # id(part) -> the runs still to build from it, shared by the request's runs

    def built(self) -> None:
        parts, self._parts = self._parts, None
        for part in parts or ():
            self._holders[id(part)] -= 1
            if not self._holders[id(part)]:
                part.let_go()


def own_media(runs: Sequence[ChatRequest]) -> tuple[ChatRequest, ...]:
    """`runs` with a `RunMedia` each (unchanged when they have no media): their parts are let go once every
    run that holds them has built its prompt."""
    holders: dict[int, int] = {}
    held: list[tuple[MediaPart, ...]] = []
    for run in runs:
        parts = {id(p): p for m in run.messages for p in m.content
                 if isinstance(p, AudioPart | ImagePart | VideoPart)}  # a part twice in one run: built once
        for key in parts:
            holders[key] = holders.get(key, 0) + 1
        held.append(tuple(parts.values()))
    if not holders:
        return tuple(runs)
    return tuple(replace(run, media=RunMedia(parts, holders)) if parts else run for run, parts in zip(runs, held))
