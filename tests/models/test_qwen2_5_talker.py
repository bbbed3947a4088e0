"""Qwen2.5-Omni's talker, step-wise, equals transformers' talker run as the model intends.

Reference: transformers' `Qwen2_5OmniTalkerForConditionalGeneration` on the tiny Qwen2.5-Omni folder, stepped
greedily with the attention mask `generate` builds for it (repetition penalty 1.05 over its input ids, codec bos
suppressed, as `generate`'s talker settings), from the rows `generate` builds out of the thinker's greedy
output, for a text prompt and one with an audio clip and an image. Why not `generate` itself: transformers 5.23's
`generate` no longer hands the talker its attention mask (a regression of the generation refactor, see
huggingface/transformers#47186), and the talker's forward keys two things on that mask: adding the codec
pad / bos embeddings to its prompt's last two rows, and its M-RoPE index; without it the prompt lacks both and
the positions are plain 0..P-1. `test_generate_drops_the_talkers_mask` pins that, so a fixed transformers shows.
Ours: `Qwen2_5OmniTalker` fed the thinker's rows as the stage feeds them — the prompt rows once, then one reply row per generated token, the
final token's end marker last — over transformers' talker modules (`from_hf`) and over the stage's own decoder
(`ShardedBackend`: `ParallelTextModel` on the talker's weights). Fed interleaved (a decode as soon as its text
entry is known) or all text first, the codes are the same. Bad use is refused: an unknown speaker, a step
before its text entry is known, text after the end.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "e2e"))
from reference import chat_request, png_bytes, sine_wav  # noqa: E402
from transformers import DynamicCache  # noqa: E402
from transformers.generation.logits_process import (  # noqa: E402
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
)

from gateway.prompt import PromptBuilder  # noqa: E402
from omnimesh.models.qwen2_5_omni.talker import Qwen2_5OmniTalker, talker_sampling_params  # noqa: E402
from omnimesh.models.qwen2_5_omni.tiny import build_tiny_qwen2_5_omni  # noqa: E402
from omnimesh.models.qwen2_5_omni.tiny_config import CODEC_IDS, SPECIAL_TOKENS  # noqa: E402

THINKER_MAX = 8
TALKER_MAX = 40
EOS = [SPECIAL_TOKENS["<|im_end|>"], SPECIAL_TOKENS["<|endoftext|>"]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen2_5_omni(tmp_path_factory.mktemp("q25") / "model")


@pytest.fixture(scope="module")
def model(folder: Path) -> Any:
    from transformers import Qwen2_5OmniForConditionalGeneration

    return Qwen2_5OmniForConditionalGeneration.from_pretrained(folder).eval()


def _inputs(folder: Path, media: bool) -> Any:
    req = chat_request("What do you hear and see?" if media else "Tell me about the sea.",
                       sine_wav() if media else None, png_bytes() if media else None, max_tokens=THINKER_MAX,
                       talker_max=TALKER_MAX)
    return PromptBuilder(folder, max_model_len=4096)(req)


def _media(p: Any, prefix: str = "") -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if p.input_features is not None:
        kwargs.update(input_features=p.input_features, feature_attention_mask=p.feature_attention_mask)
    if p.pixel_values is not None:
        kwargs.update({f"{prefix}pixel_values": p.pixel_values, "image_grid_thw": p.image_grid_thw})
    return kwargs


@torch.no_grad()
def reference_codes(model: Any, talker: Qwen2_5OmniTalker, p: Any, prompt: torch.Tensor, generated: list[int],
                    replies: list[torch.Tensor]) -> list[int]:
    """transformers' talker stepped greedily with its attention mask, from `generate`'s rows (see the docstring)."""
    hf = model.talker
    hf.rope_deltas = None  # module state of the previous run
    bos_id, bos_row = talker.text_rows.speakers["chelsie"]
    ids = p.input_ids.view(-1)
    embeds = torch.cat([prompt, bos_row.view(1, -1), replies[0].view(1, -1)]).unsqueeze(0).clone()
    reply = torch.stack([*replies[1:], talker.text_rows.text_end, talker.text_rows.text_pad]).unsqueeze(0)
    text_ids = torch.cat([ids, torch.tensor([bos_id, generated[0]])]).view(1, -1)
    history = torch.tensor([[talker.codec_mask] * ids.numel() + [talker.codec_pad, talker.codec_bos]])
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.05),
                                      SuppressTokensLogitsProcessor([talker.codec_bos])])
    stops = (CODEC_IDS["tts_codec_pad_token_id"], CODEC_IDS["tts_codec_end_token_id"])
    cache = DynamicCache(config=hf.config)
    mask = torch.ones_like(text_ids)
    media = {} if p.image_grid_thw is None else {"image_grid_thw": p.image_grid_thw}
    if p.feature_attention_mask is not None:
        media["audio_feature_lengths"] = p.feature_attention_mask.sum(-1)
    out = hf(inputs_embeds=embeds, attention_mask=mask, input_text_ids=text_ids, thinker_reply_part=reply,
             past_key_values=cache, use_cache=True, **media)
    codes: list[int] = []
    while len(codes) < TALKER_MAX:
        token = int(processors(history, out.logits[:, -1]).argmax(-1))
        history = torch.cat([history, torch.tensor([[token]])], dim=1)
        if token in stops:
            break
        codes.append(token)
        mask = torch.cat([mask, torch.ones(1, 1, dtype=mask.dtype)], dim=1)
        out = hf(input_ids=torch.tensor([[token]]), attention_mask=mask, thinker_reply_part=out.thinker_reply_part,
                 past_key_values=cache, use_cache=True)
    return codes


@torch.no_grad()
def generate_codes(model: Any, p: Any) -> list[int]:
    """`generate`'s codes, caught where they enter token2wav (trimmed at its first stop id there)."""
    caught: list[list[int]] = []
    forward = model.token2wav.forward

    def catch(code: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        caught.append(code[0].tolist())
        return forward(code, *args, **kwargs)

    model.token2wav.forward = catch
    try:
        ids = p.input_ids.view(1, -1)
        # MODELS.md: images go in as thinker_pixel_values (plain pixel_values would reach the talker)
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), speaker="Chelsie",
                       thinker_max_new_tokens=THINKER_MAX, thinker_do_sample=False, thinker_eos_token_id=EOS,
                       talker_do_sample=False, talker_max_new_tokens=TALKER_MAX,
                       talker_eos_token_id=[CODEC_IDS["tts_codec_pad_token_id"], CODEC_IDS["tts_codec_end_token_id"]],
                       **_media(p, "thinker_"))
    finally:
        model.token2wav.forward = forward
    assert len(caught) == 1
    return caught[0]


@torch.no_grad()
def thinker_rows(model: Any, talker: Qwen2_5OmniTalker, p: Any) -> tuple[torch.Tensor, list[int], list[torch.Tensor]]:
    """The thinker's side of the edge: prompt rows (L, E), generated ids, reply rows r_0 .. r_{n-2}."""
    ids = p.input_ids.view(1, -1)
    out = model.thinker.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=THINKER_MAX,
                                 do_sample=False, eos_token_id=EOS, output_hidden_states=True,
                                 return_dict_in_generate=True, **_media(p))
    hs = out.hidden_states
    prompt = talker.prompt_rows(p.input_ids, hs[0][0][0], hs[0][-1][0])
    generated = out.sequences[0, ids.shape[1]:].tolist()
    replies = [hs[k][-1][0, -1] + hs[k][0][0, -1] for k in range(1, len(generated))]
    return prompt, generated, replies


def run_talker(talker: Qwen2_5OmniTalker, p: Any, prompt: torch.Tensor, generated: list[int],
               replies: list[torch.Tensor], interleaved: bool) -> list[int]:
    params = talker_sampling_params(talker.config, do_sample=False, max_tokens=TALKER_MAX)
    state = talker.start(p.input_ids, prompt, generated[0], replies[0], "Chelsie", params,
                         image_grid_thw=p.image_grid_thw,
                         audio_feature_lengths=None if p.feature_attention_mask is None else p.feature_attention_mask.sum(-1))
    pending = list(replies[1:])
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
    if state.codes and state.sampler.is_stop(state.codes[-1]):
        return codes  # the stop id is never emitted
    return codes + state.codes[-1:]  # max tokens: the last sampled code is the last code


@pytest.mark.parametrize("media", [False, True], ids=["text", "audio+image"])
def test_codes_equal_generate(folder: Path, model: Any, media: bool) -> None:
    from omnimesh.models.qwen3_omni.lm_backend import ShardedBackend
    from omnimesh.models.qwen3_omni.lm_shard import LMShardSpec

    p = _inputs(folder, media)
    talker = Qwen2_5OmniTalker.from_hf(model)
    prompt, generated, replies = thinker_rows(model, talker, p)
    assert len(generated) >= 2
    want = reference_codes(model, talker, p, prompt, generated, replies)
    assert len(want) >= 5, want
    for interleaved in (True, False):
        assert run_talker(talker, p, prompt, generated, replies, interleaved) == want
    sharded = ShardedBackend.start(LMShardSpec(folder, "talker"))
    ours = Qwen2_5OmniTalker(talker.proj, talker.codec_embed, sharded, talker.config, talker.text_rows)
    assert run_talker(ours, p, prompt, generated, replies, interleaved=True) == want


def test_misuse_is_refused(folder: Path, model: Any) -> None:
    talker = Qwen2_5OmniTalker.from_hf(model)
    p = _inputs(folder, False)
    prompt, generated, replies = thinker_rows(model, talker, p)
    with pytest.raises(ValueError, match=r"unknown speaker 'nobody'; valid speakers: \['chelsie', 'ethan'\]"):
        talker.start(p.input_ids, prompt, generated[0], replies[0], "nobody")
    with pytest.raises(ValueError, match="2 prompt rows for"):
        talker.start(p.input_ids, prompt[:2], generated[0], replies[0], "ethan")
    state = talker.start(p.input_ids, prompt, generated[0], replies[0], "ethan")
    assert talker.step(state) is None  # the prefill
    with pytest.raises(ValueError, match="text entry 0 is not known yet"):
        talker.step(state)
    talker.finish_text(state)
    with pytest.raises(ValueError, match="push_text after finish_text"):
        talker.push_text(state, replies[0])
    with pytest.raises(ValueError, match="finish_text called twice"):
        talker.finish_text(state)


def test_generate_drops_the_talkers_mask(folder: Path, model: Any) -> None:
    """transformers 5.23: `generate` calls the talker's forward without the attention mask it was given, so the
    prompt gets no codec pad / bos rows (see the module docstring). When this fails, transformers fixed it:
    `generate_codes` then equals `reference_codes`, and the parity test can use `generate` again."""
    seen: list[bool] = []
    hook = model.talker.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get("attention_mask") is not None), with_kwargs=True)
    try:
        generate_codes(model, _inputs(folder, False))
    finally:
        hook.remove()
    assert seen and not any(seen)
