"""The thinker adapter over a Qwen2.5-Omni config: its M-RoPE index, audio token count and talker hand-off.

(`thinker_prompt`: its talker reads every prompt row's final hidden + its embedding, the media rows' embeddings
zeroed, and speaks only generated text; tests/models/test_qwen2_5_talker.py checks the rows the talker gets.)

`mrope.prompt_positions` with a Qwen2.5-Omni spec equals the model's own `get_rope_index` on a prompt whose
6 s video interleaves with its soundtrack in 2 s chunks (where Qwen2.5-Omni's index differs from Qwen3-Omni's,
which the test shows too); `Qwen3OmniThinker` counts audio rows by Qwen2.5's formula, refuses a mismatched
count, captures every prompt row's final hidden for its talker, and builds the talker's prompt rows.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "e2e"))
from reference import chat_request, mp4_bytes  # noqa: E402

from gateway.prompt import PromptBuilder  # noqa: E402
from omnimesh.models.qwen2_5_omni.tiny import build_tiny_qwen2_5_omni  # noqa: E402
from omnimesh.models.qwen3_omni.mrope import MropeSpec, prompt_positions  # noqa: E402
from omnimesh.models.model_config import load_config  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen2_5_omni(tmp_path_factory.mktemp("q25") / "model")


def test_positions_equal_the_models_rope_index(folder: Path) -> None:
    from transformers import Qwen2_5OmniForConditionalGeneration

    req = chat_request("hi", None, None, max_tokens=4, talker_max=0, modalities=("text",),
                       mp4=mp4_bytes(n_frames=36, rate=6, sound=True), model_dir=folder, use_audio_in_video=True)
    p = PromptBuilder(folder, max_model_len=4096)(req)
    assert p.video_grid_thw is not None and p.feature_attention_mask is not None and p.video_second_per_grid is not None
    lengths, seconds = p.feature_attention_mask.sum(-1), p.video_second_per_grid.float()
    spec = MropeSpec.for_thinker(load_config(folder))
    ours, delta = prompt_positions(p.input_ids, spec, None, lengths, p.video_grid_thw, seconds, True)
    ids = p.input_ids.view(1, -1)
    thinker = Qwen2_5OmniForConditionalGeneration.from_pretrained(folder).thinker
    ref, ref_delta = thinker.model.get_rope_index(ids, None, p.video_grid_thw, torch.ones_like(ids), True, lengths,
                                                  p.video_second_per_grid)
    assert torch.equal(ours[1:, 0].long(), ref[:, 0].long()) and delta == int(ref_delta)
    assert torch.equal(ours[0, 0], torch.arange(ids.shape[1], dtype=ours.dtype))  # row 0: text positions
    qwen3, _ = prompt_positions(p.input_ids, dataclasses.replace(spec, family="qwen3_omni"), None, lengths,
                                p.video_grid_thw, seconds, True)
    assert not torch.equal(qwen3, ours)  # the prompt tells the two families' rules apart


def test_the_thinker_counts_audio_rows_by_qwen2_5s_rule(folder: Path) -> None:
    from omnimesh.models.qwen3_omni.lm_backend import HFBackend
    from omnimesh.models.qwen3_omni.thinker import Qwen3OmniThinker

    from transformers import Qwen2_5OmniForConditionalGeneration

    full = Qwen2_5OmniForConditionalGeneration.from_pretrained(folder)
    text_model = full.thinker.model.language_model
    thinker = Qwen3OmniThinker(text_model.embed_tokens, HFBackend(text_model, full.thinker.lm_head), full.config)
    assert thinker.audio_tokens(torch.tensor([300, 457, 200])).tolist() == [75, 114, 50]
    assert thinker.accept_hidden_layer == 4 and thinker.reply_rows and thinker.deepstack_layers == 0
    audio = int(full.config.thinker_config.audio_token_id)
    ids = torch.tensor([1, 2] + [audio] * 50 + [3])
    embeds = torch.zeros(50, 64)
    prompt = thinker.prepare(ids, audio_embeds=embeds, audio_feature_lengths=torch.tensor([200]))
    assert prompt.positions.shape == (4, ids.numel()) and int(prompt.mm_mask.sum()) == 50
    with pytest.raises(ValueError, match=r"audio_feature_lengths \[300\] give 75 audio tokens, the prompt has 50"):
        thinker.prepare(ids, audio_embeds=embeds, audio_feature_lengths=torch.tensor([300]))
    capture = thinker.capture_rows(prompt)
    assert capture is not None and bool(capture.all())  # every row's final hidden goes to the talker
    hidden = torch.randn(ids.numel(), 64)
    talk = thinker.talker_prompt(prompt, hidden)
    want = hidden + prompt.embeds.masked_fill(prompt.mm_mask.view(-1, 1), 0.0)
    assert torch.equal(talk.prompt_embeds, want) and torch.equal(talk.prompt_embeds[2:52], hidden[2:52])
    assert thinker.assistant_lead(ids) == 0 and talk.multimodal_hidden.numel() == 0
    row = thinker.reply_row(torch.ones(64), torch.full((1, 1, 64), 2.0))
    assert row.shape == (1, 64) and bool((row == 3).all())
    # a continued assistant message (its config names no turn tokens: the tokenizer's): its rows are spoken first
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert thinker.assistant_lead(ids) == 0 and thinker.turns is None

    class SplitRole:  # a tokenizer whose "assistant" is two tokens: no lead is found (nothing is spoken first)
        unk_token_id = tokenizer.unk_token_id
        convert_tokens_to_ids = tokenizer.convert_tokens_to_ids

        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [11, 12]

    thinker.set_turn_tokens(SplitRole())
    assert thinker.turns is None
    thinker.set_turn_tokens(tokenizer)
    turn = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    cont = torch.tensor([*ids[:-1].tolist(), *turn, 11, 12, 13])  # the turn's start, then three of the client's
    prompt = thinker.prepare(cont, audio_embeds=embeds, audio_feature_lengths=torch.tensor([200]))
    assert thinker.assistant_lead(cont) == 3
    assert thinker.assistant_lead(torch.tensor([*cont.tolist(), tokenizer.convert_tokens_to_ids("<|im_end|>")])) == 0
    hidden = torch.randn(cont.numel(), 64)
    talk = thinker.talker_prompt(prompt, hidden, lead=3)
    rows = hidden + prompt.embeds.masked_fill(prompt.mm_mask.view(-1, 1), 0.0)
    assert torch.equal(talk.input_ids, cont[:-3]) and torch.equal(talk.prompt_embeds, rows[:-3])
    assert talk.first_token is not None and talk.first_token.tolist() == [11]  # the talker positions with it
    assert torch.equal(thinker.lead_rows(prompt, hidden, 3), rows[-3:])  # r of each, as if generated


def test_the_checkpoint_runs_four_stages_each_over_pp_x_tp(folder: Path, tmp_path: Path) -> None:
    import json

    from omnimesh.config.stage_config import StageConfig
    from omnimesh.models.qwen3_omni.checkpoint_stages import model_family, model_stages, text_only_reason
    from omnimesh.models.qwen3_omni.parallel_plan import check_layout

    assert model_family(folder) == "qwen2.5-omni"
    assert model_stages(folder) == ("encoder", "thinker", "talker", "vocoder") and text_only_reason(folder) is None
    config = load_config(folder)
    assert check_layout(config, {"encoder": StageConfig(pp=2, tp=2), "thinker": StageConfig(pp=2, tp=2),
                                 "talker": StageConfig(pp=2, tp=2), "vocoder": StageConfig(pp=2, tp=2)}) == []
    with pytest.raises(ValueError, match="tp=3 does not divide the audio tower's 4 attention heads"):
        check_layout(config, {"encoder": StageConfig(tp=3)})
    with pytest.raises(ValueError, match="tp=3 does not divide the token2wav DiT's 4 attention heads"):
        check_layout(config, {"vocoder": StageConfig(tp=3)})
    with pytest.raises(ValueError, match="tp=3 does not divide the thinker LM's 4 attention heads"):
        check_layout(config, {"thinker": StageConfig(tp=3)})
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match=r"holds a 'llama' model; omnimesh serves model_type 'qwen3_omni_moe' or "
                                         r"'qwen2_5_omni'"):
        model_family(other)
