"""A request's decoded media are let go once every run that builds from them has built (gateway/media_release.py):
the count per part over the runs, a report given once, a build that meets a part already let go raises, and a
spoken answer with function calls, whose second part builds again, keeps its media. Through real stages and
`fan_out`: tests/gateway/test_prompt_release.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from gateway.choices import choice_requests, fan_out
from gateway.events import (
    AudioPart,
    ChatMessage,
    ChatRequest,
    Finished,
    ImagePart,
    SamplingOverrides,
    TextDelta,
    TextPart,
    VideoPart,
)
from gateway.media_release import own_media
from gateway.pipeline import StagePipeline
from gateway.prompt import render_conversation
from omnimesh.models.qwen3_omni.tiny import tiny_tokenizer_spec
from omnimesh.models.tokenizer_build import build_tokenizer


def _request(*parts: object, rid: str = "r") -> ChatRequest:
    return ChatRequest(request_id=rid, model="m", modalities=("text",),
                       messages=(ChatMessage("user", (TextPart("look"), *parts)),))  # type: ignore[arg-type]


def test_each_part_goes_when_the_last_run_holding_it_has_built() -> None:
    sound = AudioPart(np.ones(1600, np.float32), 16_000)
    video = VideoPart(np.ones((2, 8, 8, 3), np.uint8), 2.0, audio=AudioPart(np.ones(800, np.float32), 16_000))
    image = ImagePart(Image.new("RGB", (8, 8)))
    shared = _request(sound, video, video)  # a part twice in one run is built once
    first, second = choice_requests(shared, 2)
    other = _request(image, rid="p2")  # a completion's second prompt: its own part
    text = _request(rid="t")
    runs = own_media([first, second, other, text])
    assert runs[3] is text and runs[3].media is None  # no media: unchanged
    runs[0].media.built()  # type: ignore[union-attr]
    runs[0].media.built()  # type: ignore[union-attr]  # once only: the second report counts for nothing
    assert not (sound.released or video.released) and sound.waveform.size == 1600
    runs[2].media.built()  # type: ignore[union-attr]
    assert image.released and image.image is None
    runs[1].media.built()  # type: ignore[union-attr]
    assert sound.released and video.released and video.audio is not None and video.audio.released
    assert sound.waveform.size == video.frames.size == video.audio.waveform.size == 0
    assert own_media([text]) == (text,)


def test_a_build_that_meets_a_part_let_go_raises() -> None:
    video = VideoPart(np.ones((2, 8, 8, 3), np.uint8), 2.0)
    assert len(render_conversation(_request(video).messages).videos) == 1
    video.let_go()
    with pytest.raises(RuntimeError, match="let go before this build"):
        render_conversation(_request(video).messages)


async def test_a_spoken_answer_with_calls_keeps_its_media_for_its_second_part() -> None:
    """Its calls part builds the conversation again, so `StagePipeline.run` hands its parts no report: neither
    part's build lets them go."""
    tokenizer = build_tokenizer(tiny_tokenizer_spec())
    token = int(tokenizer.encode("<tool_call>", add_special_tokens=False)[0])
    pipe = StagePipeline({"thinker": []}, SimpleNamespace(processor=SimpleNamespace(tokenizer=tokenizer)),
                         served_models=("m",))  # type: ignore[arg-type]
    seen: list[ChatRequest] = []

    async def run_one(request: ChatRequest):  # type: ignore[no-untyped-def]  # a built part, as _run_request is
        seen.append(request)
        if request.media is not None:
            request.media.built()
        if len(seen) == 1:
            yield TextDelta("Let me check. ")
            yield Finished("stop", 5, 3, stop_reason=token)
        else:
            yield TextDelta('{"name": "f"}')
            yield Finished("stop", 5, 2)

    pipe._run_request = run_one  # type: ignore[method-assign]
    sound = AudioPart(np.ones(1600, np.float32), 16_000)
    request = ChatRequest(request_id="s", model="m", modalities=("text", "audio"), spoken_calls=True,
                          sampling=SamplingOverrides(temperature=0.0),
                          messages=(ChatMessage("user", (sound,)),))
    events = [e async for _, e in fan_out(pipe, [request])]
    assert len(seen) == 2 and all(r.media is None for r in seen)  # both parts ran, neither held a report
    assert isinstance(events[-1], Finished) and not sound.released and sound.waveform.size == 1600
