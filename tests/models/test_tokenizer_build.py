"""The tiny tokenizer: fixed ids, single-token role words, chat template, round trips, determinism."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from omnimesh.models.qwen3_omni.tiny import tiny_tokenizer_spec
from omnimesh.models.qwen3_omni.tiny_config import (
    ORDINARY_VOCAB_LIMIT,
    ROLE_TOKENS,
    SPECIAL_TOKENS,
    THINKER_VOCAB,
    TOOL_TOKENS,
)
from omnimesh.models.tokenizer_build import TinyTokenizerSpec, build_tokenizer, load_corpus

AUDIO = "<|audio_start|><|audio_pad|><|audio_end|>"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerBase:
    return build_tokenizer(tiny_tokenizer_spec())


@pytest.fixture(scope="module")
def saved(tok: PreTrainedTokenizerBase, tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    out = tmp_path_factory.mktemp("tok")
    tok.save_pretrained(out)
    assert (out / "chat_template.jinja").is_file()
    return AutoTokenizer.from_pretrained(out, local_files_only=True)


def test_vocab_size_is_exactly_the_model_vocab(tok: PreTrainedTokenizerBase) -> None:
    assert len(tok) == THINKER_VOCAB
    assert sorted(tok.get_vocab().values()) == list(range(THINKER_VOCAB))


@pytest.mark.parametrize("which", ["built", "reloaded"])
def test_special_tokens_sit_at_the_config_ids(which: str, tok: PreTrainedTokenizerBase, saved) -> None:
    t = tok if which == "built" else saved
    for token, want in SPECIAL_TOKENS.items():
        assert t.convert_tokens_to_ids(token) == want, token
        assert t.encode(token, add_special_tokens=False) == [want], token
        assert want in t.all_special_ids, token
    assert t.eos_token_id == SPECIAL_TOKENS["<|im_end|>"]
    assert t.pad_token_id == SPECIAL_TOKENS["<|endoftext|>"]
    assert t.image_token_id == SPECIAL_TOKENS["<|image_pad|>"]
    assert t.audio_token_id == SPECIAL_TOKENS["<|audio_pad|>"]
    assert t.video_token_id == SPECIAL_TOKENS["<|video_pad|>"]
    assert t.audio_bos_token == "<|audio_start|>" and t.vision_eos_token == "<|vision_end|>"


def test_role_words_are_single_ordinary_tokens(tok: PreTrainedTokenizerBase) -> None:
    for word, want in ROLE_TOKENS.items():
        assert tok.encode(word, add_special_tokens=False) == [want], word
        assert want not in tok.all_special_ids, word  # ordinary: survives skip_special_tokens
        assert tok.decode([want], skip_special_tokens=True) == word
        # As in the chat template: right after <|im_start|>, followed by a newline.
        ids = tok.encode(f"<|im_start|>{word}\nhi", add_special_tokens=False)
        assert ids[:3] == [SPECIAL_TOKENS["<|im_start|>"], want, tok.encode("\n", add_special_tokens=False)[0]]


def test_every_other_id_is_a_reserved_special_token(tok: PreTrainedTokenizerBase) -> None:
    fixed = set(SPECIAL_TOKENS.values()) | set(ROLE_TOKENS.values()) | set(TOOL_TOKENS.values())
    special = set(tok.all_special_ids)
    for i in range(ORDINARY_VOCAB_LIMIT, THINKER_VOCAB):
        if i not in fixed:
            assert tok.convert_ids_to_tokens(i) == f"<|reserved_{i}|>"
            assert tok.added_tokens_decoder[i].special
    for text, i in TOOL_TOKENS.items():  # the function-call markers: one token each, kept as text (Qwen's)
        assert tok.encode(text, add_special_tokens=False) == [i] and not tok.added_tokens_decoder[i].special
        assert tok.decode([i], skip_special_tokens=True) == text
    assert not special & set(range(ORDINARY_VOCAB_LIMIT))
    assert not set(tok.added_tokens_decoder) & set(range(ORDINARY_VOCAB_LIMIT))


def test_newline_is_one_token_and_text_uses_only_ordinary_ids(tok: PreTrainedTokenizerBase) -> None:
    assert len(tok.encode("\n", add_special_tokens=False)) == 1
    text = " ".join(load_corpus()[:20]) + "\n\tcafé 東京 🙂 x=3.14; $100!\r\n"
    ids = tok.encode(text, add_special_tokens=False)
    # Role words are ordinary tokens too (" system" -> "Ġ", "system"); nothing else reaches 400+.
    assert all(i < ORDINARY_VOCAB_LIMIT or i in ROLE_TOKENS.values() for i in ids)
    assert len(ids) < len(text.encode("utf-8"))  # merges were learned


@pytest.mark.parametrize(
    "text",
    [
        "Hello world! The quick brown fox.",
        "  leading spaces, trailing spaces  \n\nand blank lines\n",
        "unicode: café, 東京, emoji 🙂, math ∑ x² ≤ 10",
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    ],
)
def test_round_trip_decode(tok: PreTrainedTokenizerBase, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


def test_skip_special_tokens_drops_control_tokens(tok: PreTrainedTokenizerBase) -> None:
    ids = tok.encode("<|im_start|>assistant\nfine<|im_end|><|reserved_500|>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\nfine"


def test_chat_template_text_audio_image(tok: PreTrainedTokenizerBase) -> None:
    messages = [
        {"role": "user", "content": [
            {"type": "audio", "audio": "a.wav"},
            {"type": "image", "image": "b.png"},
            {"type": "text", "text": "What is this?"},
        ]},
    ]
    out = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out == f"<|im_start|>user\n{AUDIO}{IMAGE}What is this?<|im_end|>\n<|im_start|>assistant\n"


def test_chat_template_places_media_where_the_parts_are(saved: PreTrainedTokenizerBase) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
        {"role": "user", "content": [
            {"type": "text", "text": "first "},
            {"type": "image", "image": "x.png"},
            {"type": "text", "text": " then "},
            {"type": "audio", "audio": "y.wav"},
        ]},
    ]
    out = saved.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert out == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\nhello<|im_end|>\n"
        f"<|im_start|>user\nfirst {IMAGE} then {AUDIO}<|im_end|>\n"
    )
    batch = saved.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
    ids = batch["input_ids"]
    assert ids[:3] == [SPECIAL_TOKENS["<|im_start|>"], ROLE_TOKENS["system"], saved.encode("\n")[0]]
    assert ids[-3:] == [SPECIAL_TOKENS["<|im_start|>"], ROLE_TOKENS["assistant"], saved.encode("\n")[0]]
    assert ids.count(SPECIAL_TOKENS["<|image_pad|>"]) == 1 and ids.count(SPECIAL_TOKENS["<|audio_pad|>"]) == 1


def test_chat_template_rejects_a_late_system_message(tok: PreTrainedTokenizerBase) -> None:
    with pytest.raises(Exception, match="only the first message may be a system message"):
        tok.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "system", "content": "x"}], tokenize=False
        )


def test_training_is_deterministic(tok: PreTrainedTokenizerBase) -> None:
    again = build_tokenizer(tiny_tokenizer_spec())
    assert again.backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()


def test_spec_rejects_bad_layouts(tmp_path: Path) -> None:
    spec = tiny_tokenizer_spec()
    with pytest.raises(ValueError, match="more than one token"):
        dataclasses.replace(spec, word_tokens={"user": 400})
    with pytest.raises(ValueError, match="must lie in"):
        dataclasses.replace(spec, word_tokens={"user": 12})
    with pytest.raises(ValueError, match="not one of the special tokens"):
        dataclasses.replace(spec, eos_token="</s>")
    with pytest.raises(ValueError, match="does not exist"):
        build_tokenizer(dataclasses.replace(spec, corpus_path=tmp_path / "missing.txt"))
    assert isinstance(spec, TinyTokenizerSpec)
