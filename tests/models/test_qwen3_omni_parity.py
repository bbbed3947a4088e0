"""The step-wise Qwen3-Omni pieces chained together reproduce `Qwen3OmniMoeForConditionalGeneration.generate`.

Reference: `model.generate(...)` on the tiny random model (its talker codes captured on their way into
code2wav). Ours: encoder -> thinker prefill/decode with a `Sampler` -> talker fed the thinker's text either
token by token (interleaved with thinker decode) or all at once after the thinker finished ->
`Code2WavStreamer` with a small window. Text tokens and codes must be identical, audio within 1e-4.

Run: python -m pytest tests/models/test_qwen3_omni_parity.py -q
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import pytest
import torch
from qwen3_omni_fixtures import IM_END, Media, build_tiny_model, chat_prompt, make_media, torch_threads

from omnimesh.models.qwen3_omni.code2wav import Code2WavStreamer
from omnimesh.models.qwen3_omni.encoder import Qwen3OmniEncoder
from omnimesh.models.qwen3_omni.sampling import Sampler, SamplingParams, talker_sampling_params
from omnimesh.models.qwen3_omni.talker import Qwen3OmniTalker
from omnimesh.models.qwen3_omni.lm_backend import ShardedBackend
from omnimesh.models.qwen3_omni.lm_shard import LMShardSpec
from omnimesh.models.qwen3_omni.tiny import build_tiny_qwen3_omni
from omnimesh.models.qwen3_omni.thinker import Qwen3OmniThinker

CASES = {"text": (False, False, False), "audio": (True, False, False), "image": (False, True, False),
         "audio_image": (True, True, False), "video": (False, False, True), "image_video": (False, True, True)}


@dataclass
class Run:
    tokens: list[int]  # generated text ids
    codes: torch.Tensor  # (G, n) code groups
    wav: torch.Tensor  # (samples,)
    talker_inputs: list[torch.Tensor]  # what the talker's first layer saw: prefill (1, P, H), then (1, 1, H) per step


@contextmanager
def record_layer_inputs(layer: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Collect the hidden states fed to `layer`: the tiny random talker's codes barely depend on its text
    input, so comparing the inputs themselves is what catches a wrong text entry."""
    seen: list[torch.Tensor] = []
    handle = layer.register_forward_pre_hook(lambda _mod, args: seen.append(args[0].detach().clone()))
    try:
        yield seen
    finally:
        handle.remove()


@pytest.fixture(scope="module", autouse=True)
def one_thread():  # type: ignore[no-untyped-def]
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def model(one_thread):  # type: ignore[no-untyped-def]
    m = build_tiny_model()
    # transformers bug (MODELS.md): the talker's rope index needs `audio_config` with audio + image prompts.
    m.talker.config.audio_config = m.thinker.config.audio_config
    return m


@pytest.fixture(scope="module")
def media(model):  # type: ignore[no-untyped-def]
    return {name: make_media(model, audio, image, video=video) for name, (audio, image, video) in CASES.items()}


def media_kwargs(media: Media) -> dict[str, torch.Tensor]:
    kw: dict[str, torch.Tensor] = {}
    if media.input_features is not None and media.feature_attention_mask is not None:
        kw.update(input_features=media.input_features, feature_attention_mask=media.feature_attention_mask)
    if media.pixel_values is not None and media.image_grid_thw is not None:
        kw.update(pixel_values=media.pixel_values, image_grid_thw=media.image_grid_thw)
    if media.pixel_values_videos is not None:
        kw.update(pixel_values_videos=media.pixel_values_videos, video_grid_thw=media.video_grid_thw,
                  video_second_per_grid=media.video_second_per_grid)
    return kw


def reference(model, media: Media, ids: torch.Tensor, **generate_kwargs) -> Run:  # type: ignore[no-untyped-def]
    """`generate`, with the talker codes captured where they enter code2wav."""
    captured: list[torch.Tensor] = []
    original = model.code2wav.chunked_decode

    def capture(codes: torch.Tensor, **kw):  # type: ignore[no-untyped-def]
        captured.append(codes.clone())
        return original(codes, **kw)

    generate_kwargs.setdefault("thinker_eos_token_id", model.config.im_end_token_id)
    model.code2wav.chunked_decode = capture
    try:
        with record_layer_inputs(model.talker.model.layers[0]) as talker_inputs:
            seq, wav = model.generate(
                input_ids=ids.view(1, -1), speaker="Ethan", **media_kwargs(media), **generate_kwargs
            )
    finally:
        del model.code2wav.chunked_decode
    return Run(tokens=seq[0, ids.numel():].tolist(), codes=captured[0][0], wav=wav.view(-1),
               talker_inputs=talker_inputs)


def pipeline(  # type: ignore[no-untyped-def]
    model, media: Media, ids: torch.Tensor, thinker_params: SamplingParams, talker_params: SamplingParams,
    interleave: bool, window: int = 5, generator: torch.Generator | None = None,
) -> Run:
    """Encoder -> thinker -> talker -> streaming code2wav, each on its own sub-module."""
    with record_layer_inputs(model.talker.model.layers[0]) as talker_inputs:
        run = _stages(model, media, ids, thinker_params, talker_params, interleave, window, generator)
    run.talker_inputs = talker_inputs
    return run


def _stages(  # type: ignore[no-untyped-def]
    model, media: Media, ids: torch.Tensor, thinker_params: SamplingParams, talker_params: SamplingParams,
    interleave: bool, window: int, generator: torch.Generator | None, backends=None,
) -> Run:
    """`backends` = (thinker, talker) LMBackends to run the decoders in; default: transformers' modules."""
    encoder = Qwen3OmniEncoder(model.thinker.model.audio_tower, model.thinker.model.visual)
    if backends is None:
        thinker = Qwen3OmniThinker.from_hf(model.thinker, model.config)
        talker = Qwen3OmniTalker(model.talker, model.config)
    else:
        thinker = Qwen3OmniThinker(model.thinker.model.language_model.embed_tokens, backends[0], model.config)
        talker = Qwen3OmniTalker(model.talker, model.config, backends[1], predictor=backends[1].predict)
    vocoder = Code2WavStreamer(model.code2wav, window=window)
    audio = image = deepstack = lengths = None
    if media.input_features is not None and media.feature_attention_mask is not None:
        audio = encoder.encode_audio(media.input_features, media.feature_attention_mask)
        lengths = media.feature_attention_mask.sum(-1)
    if media.pixel_values is not None and media.image_grid_thw is not None:
        image, deepstack = encoder.encode_image(media.pixel_values, media.image_grid_thw)
    video = {}
    if media.pixel_values_videos is not None and media.video_grid_thw is not None:
        embeds, video_deep = encoder.vision_tower_call(
            media.pixel_values_videos, encoder.check_image(media.pixel_values_videos, media.video_grid_thw, "video"))
        video = dict(video_embeds=embeds, video_deepstack=video_deep, video_grid_thw=media.video_grid_thw,
                     video_second_per_grid=media.video_second_per_grid)
    logits, tstate, prompt = thinker.prefill(ids, audio, image, deepstack, media.image_grid_thw, lengths, **video)
    sampler = Sampler(thinker_params, generator)
    tokens: list[int] = []
    text_embeds: list[torch.Tensor] = []
    wav: list[torch.Tensor] = []
    groups: list[torch.Tensor] = []
    state = None

    def drain() -> None:
        while state is not None and talker.can_step(state):
            group = talker.step(state)
            if group is not None:
                groups.append(group)
                wav.append(vocoder.feed(group.view(-1, 1)))

    while True:
        token = sampler.sample(logits, tstate.history())
        tokens.append(token)
        final = sampler.is_stop(token) or len(tokens) >= thinker_params.max_tokens
        if not final:
            logits, embed = thinker.decode(tstate, token)
            text_embeds.append(embed)
        if interleave:
            if state is None and text_embeds:
                state = talker.start(prompt, "Ethan", text_embeds[0], talker_params, sampler.generator)
            elif state is not None and not final:
                talker.push_text(state, embed)
            if final and state is not None:
                talker.finish_text(state)
            drain()
        if final:
            break
    if not interleave:
        state = talker.start(prompt, "Ethan", text_embeds[0], talker_params, sampler.generator)
        for embed in text_embeds[1:]:
            talker.push_text(state, embed)
        talker.finish_text(state)
        drain()
    assert state is not None and state.finished
    wav.append(vocoder.flush())
    return Run(tokens=tokens, codes=torch.stack(groups, dim=1), wav=torch.cat(wav), talker_inputs=[])


def greedy(  # type: ignore[no-untyped-def]
    model, thinker_tokens: int, talker_tokens: int, thinker_eos: int = IM_END, talker_eos: int | None = None
) -> tuple[SamplingParams, SamplingParams]:
    thinker = SamplingParams(temperature=0.0, max_tokens=thinker_tokens, stop_token_ids=(thinker_eos,))
    talker = talker_sampling_params(model.config, do_sample=False, max_tokens=talker_tokens)
    if talker_eos is not None:
        talker = replace(talker, stop_token_ids=(talker_eos,))
    return thinker, talker


def assert_same(ours: Run, ref: Run) -> None:
    assert ours.tokens == ref.tokens
    assert len(ours.talker_inputs) == len(ref.talker_inputs)
    for mine, theirs in zip(ours.talker_inputs, ref.talker_inputs):
        # generate projects the assistant text rows in one GEMM, we project each row as it arrives: ~3e-8
        assert mine.shape == theirs.shape and float((mine - theirs).abs().max()) <= 1e-6
    assert ours.codes.shape == ref.codes.shape
    assert torch.equal(ours.codes, ref.codes)
    assert ours.wav.shape == ref.wav.shape
    scale = float(ref.wav.abs().max())
    assert float((ours.wav - ref.wav).abs().max()) <= 1e-4 * max(scale, 1e-6)  # relative: tiny audio is ~1e-6


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_generate(model, media, case: str) -> None:  # type: ignore[no-untyped-def]
    ids = chat_prompt(media[case])
    ref = reference(model, media[case], ids, thinker_max_new_tokens=6, thinker_do_sample=False,
                    talker_do_sample=False, talker_max_new_tokens=24)
    assert IM_END not in ref.tokens and len(ref.tokens) == 6  # this run stops at max tokens
    assert ref.codes.shape == (4, 23)  # the random talker never says EOS: 24 tokens, the last one uncoded
    thinker, talker = greedy(model, 6, 24)
    for interleave in (True, False):
        assert_same(pipeline(model, media[case], ids, thinker, talker, interleave), ref)


def test_thinker_eos_and_talker_eos(model, media) -> None:  # type: ignore[no-untyped-def]
    """Thinker stops at an EOS it really emits; talker stops at its EOS, then at max tokens before it."""
    m = media["audio"]
    ids = chat_prompt(m)
    free = reference(model, m, ids, thinker_max_new_tokens=8, thinker_do_sample=False,
                     talker_do_sample=False, talker_max_new_tokens=30)
    eos_at = next(i for i in range(2, 8) if free.tokens[i] not in free.tokens[:i])
    thinker_eos = free.tokens[eos_at]
    layer0 = free.codes[0].tolist()
    code_at = next(i for i in range(3, len(layer0)) if layer0[i] not in layer0[:i])
    talker_eos = layer0[code_at]
    kw = dict(thinker_max_new_tokens=8, thinker_do_sample=False, talker_do_sample=False,
              thinker_eos_token_id=thinker_eos, talker_eos_token_id=talker_eos)
    for max_talker, expected_groups in ((30, code_at), (code_at - 1, code_at - 2)):
        ref = reference(model, m, ids, talker_max_new_tokens=max_talker, **kw)
        assert ref.tokens[-1] == thinker_eos and len(ref.tokens) == eos_at + 1
        assert ref.codes.shape[1] == expected_groups
        thinker, talker = greedy(model, 8, max_talker, thinker_eos=thinker_eos, talker_eos=talker_eos)
        for interleave in (True, False):
            assert_same(pipeline(model, m, ids, thinker, talker, interleave), ref)


def test_thinker_eos_as_second_token(model, media) -> None:  # type: ignore[no-untyped-def]
    """Shortest text generate accepts: one spoken token, then EOS (the talker's text is just tts_eos)."""
    m = media["image"]
    ids = chat_prompt(m)
    free = reference(model, m, ids, thinker_max_new_tokens=2, thinker_do_sample=False,
                     talker_do_sample=False, talker_max_new_tokens=12)
    assert free.tokens[1] != free.tokens[0]
    ref = reference(model, m, ids, thinker_max_new_tokens=8, thinker_do_sample=False, talker_do_sample=False,
                    talker_max_new_tokens=12, thinker_eos_token_id=free.tokens[1])
    assert len(ref.tokens) == 2
    thinker, talker = greedy(model, 8, 12, thinker_eos=free.tokens[1])
    assert_same(pipeline(model, m, ids, thinker, talker, interleave=True), ref)


def test_sampled_run_reproducible_and_matches_generate_rng(model, media) -> None:  # type: ignore[no-untyped-def]
    """Same seed => same tokens/codes/audio; a different seed differs. Sharing one generator between thinker
    and talker and running the talker after the thinker consumes random numbers in `generate`'s order, so the
    sampled run even equals `generate` under `torch.manual_seed`."""
    m = media["audio_image"]
    ids = chat_prompt(m)
    thinker = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=1234, max_tokens=6, stop_token_ids=(IM_END,))
    talker = talker_sampling_params(model.config, do_sample=True, max_tokens=20, seed=1234)

    def sampled(seed: int, interleave: bool) -> Run:
        return pipeline(model, m, ids, thinker, talker, interleave, generator=torch.Generator().manual_seed(seed))

    first, again, other = sampled(1234, True), sampled(1234, True), sampled(99, True)
    assert first.tokens == again.tokens and torch.equal(first.codes, again.codes)
    assert torch.equal(first.wav, again.wav)
    assert first.tokens != other.tokens or not torch.equal(first.codes, other.codes)
    # Independent per-request samplers (seeded from SamplingParams.seed) are reproducible too.
    solo = [pipeline(model, m, ids, thinker, talker, interleave=True) for _ in range(2)]
    assert solo[0].tokens == solo[1].tokens and torch.equal(solo[0].codes, solo[1].codes)

    torch.manual_seed(1234)
    ref = reference(model, m, ids, thinker_max_new_tokens=6, thinker_do_sample=True, thinker_temperature=0.7,
                    thinker_top_k=20, thinker_top_p=0.9, talker_do_sample=True, talker_max_new_tokens=20)
    assert_same(sampled(1234, interleave=False), ref)


def test_talker_lookahead_and_errors(model, media) -> None:  # type: ignore[no-untyped-def]
    m = media["text"]
    ids = chat_prompt(m)
    thinker = Qwen3OmniThinker.from_hf(model.thinker, model.config)
    talker = Qwen3OmniTalker(model.talker, model.config)
    logits, tstate, prompt = thinker.prefill(ids)
    _, first = thinker.decode(tstate, int(logits.argmax()))
    with pytest.raises(ValueError, match="valid speakers"):
        talker.start(prompt, "Nobody", first)
    state = talker.start(prompt, "ethan", first, talker_sampling_params(model.config, do_sample=False))
    assert talker.can_step(state) and talker.step(state) is None  # prefill: nothing to emit yet
    assert not talker.can_step(state)  # decode step 0 needs generated token 1's embedding
    with pytest.raises(ValueError, match="not known yet"):
        talker.step(state)
    _, second = thinker.decode(tstate, 7)
    talker.push_text(state, second)
    assert talker.can_step(state)
    group = talker.step(state)
    assert group is not None and group.shape == (model.config.talker_config.num_code_groups,)
    assert not talker.can_step(state)
    talker.finish_text(state)
    assert talker.can_step(state)  # after the text ends every step can run (tts_eos, then tts_pad)
    with pytest.raises(ValueError, match="after finish_text"):
        talker.push_text(state, second)
    bad = chat_prompt(m)[:-1]  # no "\n" after the assistant role: the talker would speak prompt text
    _, _, bad_prompt = thinker.prefill(bad)
    with pytest.raises(ValueError, match="must end with the assistant start"):
        talker.start(bad_prompt, "Ethan", first)


def test_thinker_rejects_mismatched_media(model, media) -> None:  # type: ignore[no-untyped-def]
    thinker = Qwen3OmniThinker.from_hf(model.thinker, model.config)
    ids = chat_prompt(media["audio"])
    fake = torch.zeros(media["audio"].n_audio_tokens - 1, 64)
    with pytest.raises(ValueError, match="audio placeholder"):
        thinker.prefill(ids, audio_embeds=fake, audio_feature_lengths=torch.tensor([300]))
    with pytest.raises(ValueError, match="image placeholder"):
        thinker.prefill(chat_prompt(media["image"]))
    video = media["video"]
    with pytest.raises(ValueError, match=f"prompt has {video.n_video_tokens} video placeholder ids but 0 video embeddings"):
        thinker.prefill(chat_prompt(video))
    rows = torch.zeros(video.n_video_tokens, 64)
    with pytest.raises(ValueError, match="video_embeds need video_second_per_grid"):
        thinker.prefill(chat_prompt(video), video_embeds=rows, video_deepstack=[rows], video_grid_thw=video.video_grid_thw)
    with pytest.raises(ValueError, match=r"expected 1 video_deepstack feature tensors"):
        thinker.prefill(chat_prompt(video), video_embeds=rows, video_grid_thw=video.video_grid_thw,
                        video_second_per_grid=video.video_second_per_grid)


def test_our_parallel_lm_equals_generate(model, media, tmp_path_factory) -> None:  # type: ignore[no-untyped-def]
    """The stages' own decoders (ParallelTextModel and ParallelCodePredictor via LMShard, pp = tp = 1, weights
    read from the folder) instead of transformers' modules: same text tokens and codes as `generate`, audio
    within 1e-4."""
    folder = build_tiny_qwen3_omni(tmp_path_factory.mktemp("tiny") / "m")
    backends = (ShardedBackend.start(LMShardSpec(folder, "thinker")), ShardedBackend.start(LMShardSpec(folder, "talker")))
    for case in ("text", "audio_image", "image_video"):
        ids = chat_prompt(media[case])
        ref = reference(model, media[case], ids, thinker_max_new_tokens=6, thinker_do_sample=False,
                        talker_do_sample=False, talker_max_new_tokens=24)
        thinker, talker = greedy(model, 6, 24)
        ours = _stages(model, media[case], ids, thinker, talker, True, 5, None, backends)
        assert ours.tokens == ref.tokens
        assert torch.equal(ours.codes, ref.codes)
        assert ours.wav.shape == ref.wav.shape
        assert float((ours.wav - ref.wav).abs().max()) <= 1e-4 * max(float(ref.wav.abs().max()), 1e-6)
