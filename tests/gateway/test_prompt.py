"""Prompt preparation on the built-in tiny Qwen3-Omni folder: chat template, placeholder expansion,
media features, and the 400s (no user message, prompt longer than max_model_len)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from gateway.events import (AudioPart, ChatMessage, ChatRequest, ImagePart, PipelineError, SamplingOverrides, TextPart,
                            VideoPart)
from gateway.media import resample

tiny = pytest.importorskip("omnimesh.models.qwen3_omni.tiny",
                           reason="the tiny Qwen3-Omni builder (omnimesh/models/qwen3_omni/tiny.py) is not there yet")
from omnimesh.models.qwen3_omni.tiny_config import SPECIAL_TOKENS  # noqa: E402

from gateway.prompt import PromptBuilder  # noqa: E402
from gateway.transcription_api import transcription_request  # noqa: E402

AUDIO_PAD, IMAGE_PAD = SPECIAL_TOKENS["<|audio_pad|>"], SPECIAL_TOKENS["<|image_pad|>"]
VIDEO_PAD, VISION_START = SPECIAL_TOKENS["<|video_pad|>"], SPECIAL_TOKENS["<|vision_start|>"]


@pytest.fixture(scope="module")
def builder(tmp_path_factory: pytest.TempPathFactory) -> PromptBuilder:
    folder = tiny.build_tiny_qwen3_omni(Path(tmp_path_factory.mktemp("tiny")) / "qwen3-omni")
    return PromptBuilder(folder, max_model_len=512)


def request(*messages: ChatMessage, max_tokens: int | None = None) -> ChatRequest:
    return ChatRequest(request_id="r", model="m", messages=messages, sampling=SamplingOverrides(max_tokens=max_tokens))


def user(*parts: object) -> ChatMessage:
    return ChatMessage(role="user", content=tuple(parts))  # type: ignore[arg-type]


def sine(seconds: float, rate: int) -> np.ndarray:
    return (0.3 * np.sin(2 * np.pi * 440 * np.arange(int(seconds * rate)) / rate)).astype(np.float32)


def test_text_prompt_is_the_templated_token_ids(builder: PromptBuilder) -> None:
    req = request(ChatMessage("system", (TextPart("be brief"),)), user(TextPart("hello there")))
    out = builder(req)
    text, _ = builder.render(req)
    assert text.startswith("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello there<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n")
    expected = builder.processor.tokenizer(text)["input_ids"]
    assert out.input_ids.dtype == torch.int64 and out.input_ids.ndim == 1 and out.input_ids.tolist() == list(expected)
    assert out.prompt_tokens == len(expected)
    assert out.input_features is None and out.feature_attention_mask is None
    assert out.pixel_values is None and out.image_grid_thw is None


def test_audio_and_image_placeholders_match_the_features(builder: PromptBuilder) -> None:
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

    out = builder.build(request(user(TextPart("what?"), AudioPart(sine(1.0, 16_000), 16_000),
                                     ImagePart(Image.new("RGB", (64, 64), (1, 2, 3))),
                                     AudioPart(sine(0.5, 16_000), 16_000))))
    assert out.input_features is not None and out.feature_attention_mask is not None
    assert out.input_features.shape == (2, 128, 100) and out.input_features.dtype == torch.float32
    assert out.feature_attention_mask.sum(-1).tolist() == [100, 50]  # 10 ms hop, zero-padded to the longest
    n_audio = int(_get_feat_extract_output_lengths(out.feature_attention_mask.sum(-1), 50).sum())
    assert int((out.input_ids == AUDIO_PAD).sum()) == n_audio
    assert out.image_grid_thw is not None and out.image_grid_thw.tolist() == [[1, 4, 4]]
    assert out.pixel_values is not None and out.pixel_values.shape == (16, 3 * 2 * 16 * 16)
    assert int((out.input_ids == IMAGE_PAD).sum()) == 16 // 4  # merge 2x2
    assert out.prompt_tokens == out.input_ids.shape[0]


def test_videos_become_patches_grids_and_seconds(builder: PromptBuilder) -> None:
    """Two clips in one message, in order: each its own `<|video_pad|>` run, grid and seconds per grid."""
    rng = np.random.default_rng(3)
    clip = lambda n, h, w: rng.integers(0, 256, (n, h, w, 3), dtype=np.uint8)  # noqa: E731
    out = builder.build(request(user(VideoPart(clip(4, 64, 64), fps=2.0), TextPart("and"),
                                     VideoPart(clip(3, 32, 64), fps=2.0), TextPart("what changed?"))))
    assert out.video_grid_thw is not None and out.video_grid_thw.tolist() == [[2, 4, 4], [2, 2, 4]]
    assert out.pixel_values_videos is not None and out.pixel_values_videos.shape == (32 + 16, 3 * 2 * 16 * 16)
    assert out.video_second_per_grid is not None and out.video_second_per_grid.tolist() == [1.0, 1.0]
    pads = (out.input_ids == VIDEO_PAD).long()
    starts = (pads[1:] - pads[:-1] == 1).nonzero().view(-1) + 1  # where each run of video pads begins
    assert [int(out.input_ids[i - 1]) for i in starts] == [VISION_START, VISION_START]
    assert [int(pads[i:].cumprod(0).sum()) for i in starts] == [32 // 4, 16 // 4]  # one run per clip, in order
    assert out.pixel_values is None and out.input_features is None
    assert [builder.processor.video_processor.token_count(v) for v in (clip(4, 64, 64), clip(3, 32, 64))] == [8, 4]
    with pytest.raises(PipelineError, match="different rates"):
        builder.build(request(user(VideoPart(clip(4, 32, 32), fps=2.0), VideoPart(clip(4, 32, 32), fps=1.0))))


def test_a_video_beyond_max_model_len_is_refused_from_its_shape(builder: PromptBuilder,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    frames = np.zeros((16, 64, 64, 3), np.uint8)  # 8 temporal patches of 4 tokens: 32 tokens
    monkeypatch.setattr(builder, "max_model_len", 32)
    resized: list[object] = []
    monkeypatch.setattr(builder.processor.video_processor, "_frames_chw", resized.append)  # never reached
    with pytest.raises(PipelineError, match="the videos alone are 32 tokens.*is 32 tokens") as e:
        builder.build(request(user(VideoPart(frames, 2.0))))
    assert e.value.http_status == 400 and resized == []


def test_an_image_blown_up_by_its_requests_min_pixels_is_refused_from_its_shape(builder: PromptBuilder) -> None:
    """A request's own min_pixels would resize a 32x32 image into ~2000 tokens of float patches (gigabytes at
    larger settings) before the length check: its token count comes from the resize rule first, and it is the
    count the processor then gives."""
    from dataclasses import replace

    image = ImagePart(Image.new("RGB", (32, 32), (10, 200, 30)))
    fits = replace(request(user(image, TextPart("what is it?"))), processor_kwargs=(("max_pixels", 65536.0),
                                                                                   ("min_pixels", 65536.0)))
    pad = builder.processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert int((builder.build(fits).input_ids == pad).sum()) == 65536 // (16 * 16 * 4)  # 256 tokens: it fits
    big = replace(fits, processor_kwargs=(("max_pixels", 2e6), ("min_pixels", 2e6)))
    processor = builder.processor_for(big)
    resized: list[object] = []
    processor.image_processor._preprocess = lambda *a, **k: resized.append(a)  # never reached
    with pytest.raises(PipelineError, match="the images alone are 2025 tokens at this request's processor settings.*"
                                            "is 512 tokens") as e:
        builder.build(big)
    assert e.value.http_status == 400 and resized == []


def test_use_audio_in_video_interleaves_the_soundtrack(builder: PromptBuilder) -> None:
    """A video carrying its soundtrack: the soundtrack is the second audio (after the standalone clip, in
    prompt order), its `<|audio_pad|>`s sit between the video's temporal patches inside the vision span."""
    rng = np.random.default_rng(4)
    frames = rng.integers(0, 256, (6, 64, 64, 3), dtype=np.uint8)  # 3 temporal patches of 4 tokens, 1 s each
    track = AudioPart(sine(3.0, 16_000), 16_000)
    out = builder.build(request(user(AudioPart(sine(0.5, 16_000), 16_000), VideoPart(frames, 2.0, audio=track),
                                     TextPart("what do you hear?"))))
    assert out.use_audio_in_video and out.feature_attention_mask is not None
    assert out.feature_attention_mask.sum(-1).tolist() == [50, 300]  # the clip, then the soundtrack
    ids = out.input_ids.tolist()
    span = ids[ids.index(VISION_START) + 1:]
    span = span[:span.index(SPECIAL_TOKENS["<|vision_end|>"])]
    assert span[0] == SPECIAL_TOKENS["<|audio_start|>"] and span[-1] == SPECIAL_TOKENS["<|audio_end|>"]
    kinds = "".join("v" if t == VIDEO_PAD else "a" if t == AUDIO_PAD else "?" for t in span[1:-1])
    # 13 audio positions per second (the processor's position_id_per_seconds): each patch at its start time
    assert kinds == "vvvv" + "a" * 13 + "vvvv" + "a" * 13 + "vvvv" + "a" * (len(kinds) - 38), kinds
    plain = builder.build(request(user(VideoPart(frames, 2.0), TextPart("what do you see?"))))
    assert not plain.use_audio_in_video and plain.input_features is None
    with pytest.raises(PipelineError, match="1 of 2 videos carry their soundtrack"):
        builder.build(request(user(VideoPart(frames, 2.0, audio=track), VideoPart(frames, 2.0))))


def test_audio_at_another_rate_is_resampled_first(builder: PromptBuilder) -> None:
    at_8k = builder.build(request(user(AudioPart(sine(0.5, 8000), 8000))))
    at_16k = builder.build(request(user(AudioPart(resample(sine(0.5, 8000), 8000, 16_000), 16_000))))
    np.testing.assert_array_equal(at_8k.input_ids, at_16k.input_ids)
    np.testing.assert_allclose(at_8k.input_features, at_16k.input_features, atol=1e-6)  # type: ignore[arg-type]


def test_no_user_message_is_400(builder: PromptBuilder) -> None:
    with pytest.raises(PipelineError, match="at least one user message") as e:
        builder.build(request(ChatMessage("system", (TextPart("x"),))))
    assert e.value.http_status == 400 and e.value.param == "messages"
    # a Responses input of only a function call and its output: named as that API names it
    with pytest.raises(PipelineError, match="^input: at least one user message") as e:
        builder.build(replace(request(ChatMessage("assistant", (TextPart("x"),))), conversation_param="input"))
    assert e.value.param == "input"
    with pytest.raises(PipelineError, match="shorten the prompt") as e:  # a transcription's over-long prompt
        builder.build(replace(request(user(TextPart("word " * 100_000))), conversation_param="prompt"))
    assert e.value.param == "prompt"


def test_template_rejection_is_400(builder: PromptBuilder) -> None:
    with pytest.raises(PipelineError, match="chat template rejected") as e:
        builder.build(request(user(TextPart("a")), ChatMessage("system", (TextPart("late system"),))))
    assert e.value.http_status == 400


def test_prompt_longer_than_max_model_len_is_400_with_both_numbers(builder: PromptBuilder) -> None:
    req = request(user(TextPart("hello " * 20)))
    n = builder.build(req).prompt_tokens
    small = PromptBuilder(builder.processor, max_model_len=n)
    with pytest.raises(PipelineError, match=f"the prompt is {n} tokens.*max_model_len\\) is {n} tokens") as e:
        small.build(req)
    assert e.value.http_status == 400
    roomy = PromptBuilder(builder.processor, max_model_len=n + 5)
    assert roomy.build(request(user(TextPart("hello " * 20)), max_tokens=5)).prompt_tokens == n
    with pytest.raises(PipelineError, match="lower max_tokens to at most 5") as e:
        roomy.build(request(user(TextPart("hello " * 20)), max_tokens=6))
    assert e.value.param == "max_tokens"


def test_a_prompt_text_too_long_to_fit_is_refused_before_it_is_tokenized(builder: PromptBuilder,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokenizing costs ~1 s of a gateway core per MB: a text longer than max_model_len tokens of the vocabulary's
    longest could cover is a 400 at once. The bound never refuses a prompt that fits: the longest tokens repeated
    up to max_model_len (each the most characters one token covers) pass it and get the tokens-counted answer."""
    small = PromptBuilder(builder.processor, max_model_len=64)
    longest = max(builder.processor.tokenizer.get_vocab(), key=len)
    limit = 4 * len(longest) * 64
    tokenized: list[str] = []
    process = PromptBuilder._process
    def counted(self: PromptBuilder, text: str, *rest: object):
        tokenized.append(text)
        return process(self, text, *rest)

    monkeypatch.setattr(PromptBuilder, "_process", counted)
    with pytest.raises(PipelineError, match=rf"the prompt is \d+ characters, more than the 64 tokens of this model's "
                                            rf"maximum context length \(max_model_len\) can hold \(no prompt over "
                                            rf"{limit} characters fits") as e:
        small.build(request(user(TextPart("a" * limit))))
    assert (e.value.http_status, e.value.param, tokenized) == (400, "messages", [])
    with pytest.raises(PipelineError, match="the prompt is 7[0-9] tokens, but"):  # the worst case that could fit
        small.build(request(user(TextPart(longest * 64))))
    assert len(tokenized) == 1
    cut = ChatRequest(request_id="r", model="m", messages=(user(TextPart("ab " * limit)),),
                      sampling=SamplingOverrides(), truncate_prompt_tokens=32)  # cut after tokenizing: not refused
    assert small.build(cut).prompt_tokens == 32


def test_media_items_are_named_by_their_content_and_settings(builder: PromptBuilder) -> None:
    """The thinker's prefix cache keys media rows by these digests (gateway/media_digest.py): one per item, in
    prompt order per modality; equal for equal content, different for other samples, pixels or settings."""
    from gateway.media_digest import media_digests

    def build(*parts: object, **kwargs: float) -> dict[str, torch.Tensor]:
        req = ChatRequest(request_id="r", model="m", messages=(user(TextPart("what?"), *parts),),
                          processor_kwargs=tuple(sorted(kwargs.items())))
        return builder.build(req).media_hashes if not kwargs else media_digests(
            [], [p.image for p in parts if isinstance(p, ImagePart)], [], kwargs)

    a, b = AudioPart(sine(1.0, 16_000), 16_000), AudioPart(sine(0.5, 16_000), 16_000)
    red, blue = ImagePart(Image.new("RGB", (64, 64), (200, 0, 0))), ImagePart(Image.new("RGB", (64, 64), (0, 0, 200)))
    out = build(a, red, b)
    assert set(out) == {"audio_hashes", "image_hashes"} and out["audio_hashes"].shape == (2,)
    assert out["audio_hashes"].dtype == torch.int64 and bool((out["audio_hashes"] >= 0).all())
    assert torch.equal(build(a, red, b)["audio_hashes"], out["audio_hashes"])  # deterministic
    assert out["audio_hashes"][0] != out["audio_hashes"][1]
    assert torch.equal(build(b, blue, a)["audio_hashes"], out["audio_hashes"].flip(0))  # prompt order
    assert build(b, blue, a)["image_hashes"] != out["image_hashes"]
    assert build(red, max_pixels=4096.0)["image_hashes"] != build(red, max_pixels=8192.0)["image_hashes"]
    assert builder.build(request(user(TextPart("no media")))).media_hashes == {}
    # no thinker replica caches prefixes: the digests are not made (the pipeline asks with hash_media=False)
    plain = ChatRequest(request_id="r", model="m", messages=(user(TextPart("what?"), a, red),))
    assert builder.build(plain, hash_media=False).media_hashes == {}
    assert torch.equal(builder.build(plain, hash_media=False).input_ids, builder.build(plain).input_ids)


def test_an_image_the_resize_rule_refuses_is_a_400(builder: PromptBuilder) -> None:
    """The processor's resize rule refuses an aspect ratio over 200 (a 3000x2 strip) with a ValueError: a 400
    that says so, not an internal error."""
    strip = ImagePart(Image.new("RGB", (3000, 2), (10, 200, 30)))
    with pytest.raises(PipelineError, match="could not prepare the prompt: .*aspect ratio") as e:
        builder.build(request(user(strip, TextPart("what is it?"))))
    assert e.value.http_status == 400 and e.value.param == "messages"


def test_audio_too_loud_to_analyse_is_a_400(builder: PromptBuilder) -> None:
    """Finite float samples far past 1.0 overflow the float32 spectrum into infinities; the thinker then sampled
    from NaN logits (a 500). A 400 that says to scale it down; loud but sane audio (peak 8) still goes through."""
    loud = sine(1.0, 16_000) * np.float32(1e30)
    with pytest.raises(PipelineError, match="too loud to analyse") as e:
        builder.build(request(user(TextPart("what?"), AudioPart(loud, 16_000))))
    assert e.value.http_status == 400 and e.value.param == "messages"
    with pytest.raises(PipelineError, match="^file: an audio input is too loud") as e:  # a transcription's upload
        builder.build(transcription_request("tiny", AudioPart(loud, 16_000), None, media_param="file"))
    assert e.value.param == "file"
    out = builder.build(request(user(AudioPart(sine(1.0, 16_000) * np.float32(8), 16_000))))
    assert out.input_features is not None and bool(torch.isfinite(out.input_features).all())
