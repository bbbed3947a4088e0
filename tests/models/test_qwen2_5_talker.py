"""Qwen2.5-Omni's talker, step-wise, equals transformers' talker run as the model intends.

Reference (tests/e2e/reference_qwen2_5.py): transformers' `Qwen2_5OmniTalkerForConditionalGeneration` on the tiny
Qwen2.5-Omni folder, stepped greedily with the attention mask `generate` builds for it, from the rows `generate`
builds out of the thinker's greedy output, for a text prompt, one with an audio clip and an image, and one with a
6 s video whose soundtrack interleaves with its frames (the talker's M-RoPE index reads `use_audio_in_video`);
the codes must be equal and every step's logits within 1e-5 (the random tiny weights barely feel positions,
so the logits are what would catch a wrong index).
`test_generate_drops_the_talkers_mask` pins why not `generate` itself (transformers 5.23 no longer hands the
talker that mask). Ours: `Qwen2_5OmniTalker` fed the thinker's rows as the stage feeds them — the prompt rows
once, then one reply row per generated token, the final token's end marker last — over transformers' talker
modules (`from_hf`) and as the talker stage loads it (`load_qwen2_5_talker`: its projection, codec table and
thinker rows read alone from the folder, the decoder a `ShardedBackend`: `ParallelTextModel` on the talker's
weights). Fed interleaved (a decode as soon as its text entry is known) or all text first, the codes are the
same. Bad use is refused: an unknown speaker, rows that do not match the ids, a prompt without its first token,
a step before its text entry is known, text after the end.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "e2e"))
from reference import chat_request, mp4_bytes, png_bytes, sine_wav  # noqa: E402
from reference_qwen2_5 import THINKER_EOS, TALKER_STOPS, Qwen2_5Reference, ThinkerOutput, media_kwargs  # noqa: E402

from omnimesh.models.qwen2_5_omni.talker import (  # noqa: E402
    Qwen2_5OmniTalker,
    load_qwen2_5_talker,
    talker_sampling_params,
)
from omnimesh.models.qwen2_5_omni.tiny import build_tiny_qwen2_5_omni  # noqa: E402
from omnimesh.models.qwen3_omni.thinker import TalkerPrompt  # noqa: E402

THINKER_MAX = 8
TALKER_MAX = 40


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen2_5_omni(tmp_path_factory.mktemp("q25") / "model")


@pytest.fixture(scope="module")
def reference(folder: Path) -> Qwen2_5Reference:
    return Qwen2_5Reference(folder)


def _inputs(reference: Qwen2_5Reference, media: bool | str) -> Any:
    if media == "video+sound":
        req = chat_request("What happens here?", None, None, max_tokens=THINKER_MAX, talker_max=TALKER_MAX,
                           mp4=mp4_bytes(n_frames=36, rate=6, sound=True), model_dir=reference.model_dir,
                           use_audio_in_video=True)
        return reference.prompts(req)
    req = chat_request("What do you hear and see?" if media else "Tell me about the sea.",
                       sine_wav() if media else None, png_bytes() if media else None, max_tokens=THINKER_MAX,
                       talker_max=TALKER_MAX)
    return reference.prompts(req)


def edge_prompt(p: Any, rows: torch.Tensor, first_token: int) -> TalkerPrompt:
    """The thinker -> talker prompt as the thinker stage sends it for Qwen2.5-Omni."""
    return TalkerPrompt(input_ids=p.input_ids.view(-1), prompt_embeds=rows, multimodal_hidden=rows[:0],
                        tts_embeds=rows[:0], image_grid_thw=p.image_grid_thw,
                        audio_feature_lengths=None if p.feature_attention_mask is None else p.feature_attention_mask.sum(-1),
                        video_grid_thw=p.video_grid_thw, video_second_per_grid=p.video_second_per_grid,
                        use_audio_in_video=bool(p.use_audio_in_video), first_token=torch.tensor([first_token]))


def run_talker(talker: Qwen2_5OmniTalker, p: Any, thinker: ThinkerOutput, interleaved: bool,
               logits: list[torch.Tensor] | None = None) -> list[int]:
    """Our talker fed as the stage feeds it -> its codes; `logits` collects each step's raw logits (V,)."""
    params = talker_sampling_params(talker.config, do_sample=False, max_tokens=TALKER_MAX)
    backend = talker.backend
    if logits is not None:
        def record(*args: Any, **kwargs: Any) -> Any:
            out = backend.forward(*args, **kwargs)
            logits.append(out.logits.clone())
            return out

        talker.backend = types.SimpleNamespace(open=backend.open, close=backend.close, forward=record)  # type: ignore[assignment]
    try:
        state = talker.start(edge_prompt(p, thinker.prompt_rows, thinker.generated[0]), "Chelsie",
                             thinker.replies[0], params)
        pending = list(thinker.replies[1:])
        if not interleaved:
            for row in pending:
                talker.push_text(state, row)
            talker.finish_text(state)
            pending = []
        codes: list[int] = []
        while not state.finished:
            if interleaved and not talker.can_step(state):
                if pending:
                    talker.push_text(state, pending.pop(0))
                else:
                    talker.finish_text(state)
                continue
            out = talker.step(state)
            if out is not None:
                codes += out.tolist()
        talker.release(state)
    finally:
        talker.backend = backend
    final = talker.final_group(state)  # at max tokens the last code is spoken too
    return codes + ([] if final is None else final.tolist())


@pytest.mark.parametrize("media", [False, True, "video+sound"], ids=["text", "audio+image", "video+sound"])
def test_codes_equal_transformers(folder: Path, reference: Qwen2_5Reference, media: bool | str) -> None:
    from omnimesh.models.qwen3_omni.lm_backend import ShardedBackend
    from omnimesh.models.qwen3_omni.lm_shard import LMShardSpec

    p = _inputs(reference, media)
    thinker = reference.thinker(p, THINKER_MAX)
    assert len(thinker.generated) >= 2
    want_logits: list[torch.Tensor] = []
    want = reference.codes(p, thinker, "chelsie", TALKER_MAX, want_logits)
    assert len(want) >= 5, want
    for interleaved in (True, False):
        got_logits: list[torch.Tensor] = []
        assert run_talker(reference.talker, p, thinker, interleaved, got_logits) == want
        assert len(got_logits) == len(want_logits)
        assert max(float((a - b).abs().max()) for a, b in zip(got_logits, want_logits)) < 1e-5
    ours = load_qwen2_5_talker(folder, torch.float32, ShardedBackend.start(LMShardSpec(folder, "talker")))
    assert torch.equal(ours.text_rows.text_end, reference.talker.text_rows.text_end)
    assert ours.speakers == reference.talker.speakers == ["chelsie", "ethan"]
    assert run_talker(ours, p, thinker, interleaved=True) == want


def test_misuse_is_refused(reference: Qwen2_5Reference) -> None:
    talker = reference.talker
    p = _inputs(reference, False)
    thinker = reference.thinker(p, THINKER_MAX)
    rows, first, r0 = thinker.prompt_rows, thinker.generated[0], thinker.replies[0]
    with pytest.raises(ValueError, match=r"unknown speaker 'nobody'; valid speakers: \['chelsie', 'ethan'\]"):
        talker.start(edge_prompt(p, rows, first), "nobody", r0)
    with pytest.raises(ValueError, match="2 prompt rows for"):
        talker.start(edge_prompt(p, rows[:2], first), "ethan", r0)
    with pytest.raises(ValueError, match="the prompt has no first_token"):
        talker.start(TalkerPrompt(p.input_ids, rows, rows[:0], rows[:0]), "ethan", r0)
    state = talker.start(edge_prompt(p, rows, first), "ethan", r0)
    assert talker.step(state) is None  # the prefill
    with pytest.raises(ValueError, match="text entry 0 is not known yet"):
        talker.step(state)
    talker.finish_text(state)
    with pytest.raises(ValueError, match="push_text after finish_text"):
        talker.push_text(state, r0)
    with pytest.raises(ValueError, match="finish_text called twice"):
        talker.finish_text(state)


@torch.no_grad()
def test_generate_drops_the_talkers_mask(reference: Qwen2_5Reference) -> None:
    """transformers 5.23: `generate` calls the talker's forward without the attention mask it was given, so the
    talker's prompt gets no codec pad / bos rows and plain positions. When this fails, transformers fixed it: the
    reference can go back to `generate` (whose codes then equal `Qwen2_5Reference.codes`)."""
    model = reference.model
    seen: list[bool] = []
    hook = model.talker.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get("attention_mask") is not None), with_kwargs=True)
    p = _inputs(reference, False)
    ids = p.input_ids.view(1, -1)
    try:
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), speaker="Chelsie",
                       thinker_max_new_tokens=THINKER_MAX, thinker_do_sample=False, thinker_eos_token_id=THINKER_EOS,
                       talker_do_sample=False, talker_max_new_tokens=8, talker_eos_token_id=list(TALKER_STOPS),
                       **media_kwargs(p, "thinker_"))
    finally:
        hook.remove()
    assert seen and not any(seen)


def test_ids_token2wav_cannot_voice_are_never_picked(folder: Path) -> None:
    """`generate`'s suppressed codec bos, and (unlike `generate`, whose token2wav would fail on one) every id at or
    above the DiT's `num_embeds` but the two stops. The tiny DiT voices all 512 ids; the real one 8193 of 8448."""
    import copy

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    tk = config.talker_config
    stops = (tk.tts_codec_pad_token_id, tk.tts_codec_end_token_id)
    assert talker_sampling_params(config).suppress_tokens == (tk.tts_codec_start_token_id,)  # 512 voiced
    narrower = copy.deepcopy(config)
    narrower.token2wav_config.dit_config.num_embeds = 500  # the control ids 500.. are then unvoiced
    p = talker_sampling_params(narrower)
    assert p.stop_token_ids == stops and set(p.suppress_tokens) == set(range(500, 512)) - set(stops)
    assert tk.tts_codec_start_token_id in p.suppress_tokens
