"""Deterministic tiny byte-level BPE tokenizers for the built-in test models.

Role: turn a `TinyTokenizerSpec` (vocab size, fixed special-token ids, role words, chat template) into a
`transformers` Qwen2-style tokenizer whose ids match the tiny model config exactly. Family builders
(`qwen3_omni/tiny.py`) hold the spec; this file knows nothing about any one model.

Data flow:
    data/tiny_corpus.txt + spec.word_tokens --BpeTrainer--> ordered vocab + merges
      --renumber--> ordinary tokens at 0..ordinary_limit-1, word tokens / special tokens at their fixed ids,
                    every other id below vocab_size a reserved special token `<|reserved_N|>`
      --Qwen2Tokenizer(vocab, merges, special tokens, chat template)--> tokenizer (save_pretrained-able)

Every id below `vocab_size` sits in the BPE model's own vocab, so `transformers` keeps the special
tokens at their model ids when it re-adds them on load, and `len(tokenizer) == vocab_size`.
Training is deterministic: the `tokenizers` BPE trainer breaks ties by pair order and sorts its
alphabet, so two builds (even in different processes) produce the same bytes.

Run: python -c "from omnimesh.models.qwen3_omni.tiny import tiny_tokenizer_spec; \
from omnimesh.models.tokenizer_build import build_tokenizer; print(len(build_tokenizer(tiny_tokenizer_spec())))"
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerBase, Qwen2Tokenizer

# Qwen2's pre-tokenizer split: contractions, letter runs (with one leading non-letter), single digits,
# punctuation runs, newlines, whitespace. Same string as `transformers.models.qwen2.tokenization_qwen2`.
QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
TINY_CORPUS_PATH = Path(__file__).resolve().parent / "data" / "tiny_corpus.txt"
RESERVED_TEMPLATE = "<|reserved_{}|>"


@dataclass(frozen=True)
class TinyTokenizerSpec:
    """What a tiny tokenizer must look like; every id is fixed by the model config it serves."""

    vocab_size: int
    """Total ids, ordinary + word + special + reserved; equals the model's embedding rows."""
    ordinary_limit: int
    """Learned BPE tokens (bytes and merges) get ids below this."""
    special_tokens: Mapping[str, int]
    """Special (control) token text -> exact id; each is matched before BPE and skipped on decode."""
    word_tokens: Mapping[str, int]
    """Ordinary words that must encode to exactly one token at this id (e.g. chat role names)."""
    eos_token: str
    pad_token: str
    chat_template: str
    named_tokens: Mapping[str, str] = field(default_factory=dict)
    """Extra named special tokens (attribute -> token text), e.g. {"image_token": "<|image_pad|>"}."""
    text_tokens: Mapping[str, int] = field(default_factory=dict)
    """Added tokens that are not special (matched before BPE, kept on decode) -> exact id, as Qwen3's <think>."""
    model_max_length: int = 4096
    corpus_path: Path = TINY_CORPUS_PATH

    def __post_init__(self) -> None:
        if not 256 < self.ordinary_limit <= self.vocab_size:
            raise ValueError(
                f"ordinary_limit={self.ordinary_limit} must be in (256, vocab_size={self.vocab_size}]: "
                "a byte-level BPE needs 256 ids for its byte alphabet alone."
            )
        kinds = {"special": self.special_tokens, "word": self.word_tokens, "text": self.text_tokens}
        fixed = {**self.special_tokens, **self.word_tokens, **self.text_tokens}
        if len(fixed) != sum(len(tokens) for tokens in kinds.values()):
            twice = sorted(t for t in fixed if sum(t in tokens for tokens in kinds.values()) > 1)
            raise ValueError(f"tokens {twice} are listed under more than one of the special, word and text tokens")
        ids = list(fixed.values())
        if len(set(ids)) != len(ids):
            dup = sorted({i for i in ids if ids.count(i) > 1})
            raise ValueError(f"token ids {dup} are assigned to more than one token; give each its own id")
        bad = {t: i for t, i in fixed.items() if not self.ordinary_limit <= i < self.vocab_size}
        if bad:
            raise ValueError(
                f"fixed token ids must lie in [ordinary_limit={self.ordinary_limit}, "
                f"vocab_size={self.vocab_size}); these do not: {bad}"
            )
        for name, token in {"eos_token": self.eos_token, "pad_token": self.pad_token, **self.named_tokens}.items():
            if token not in self.special_tokens:
                raise ValueError(
                    f"{name}={token!r} is not one of the special tokens {sorted(self.special_tokens)}"
                )
        for word in self.word_tokens:
            if not word or any(ch.isspace() for ch in word):
                raise ValueError(f"word token {word!r} must be a non-empty word without whitespace")


def load_corpus(path: Path = TINY_CORPUS_PATH) -> list[str]:
    """Return the non-empty lines of a plain-text training corpus."""
    if not path.is_file():
        raise ValueError(f"tokenizer corpus {path} does not exist")
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _bpe_pipeline(model: models.Model) -> Tokenizer:
    tok = Tokenizer(model)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train_byte_level_bpe(
    lines: Sequence[str], n_tokens: int, required_words: Sequence[str] = ()
) -> tuple[list[str], list[tuple[str, str]]]:
    """Train a byte-level BPE with `n_tokens` tokens (256 bytes + merges) on `lines`.

    Each of `required_words` is fed as a stand-alone pre-token more often than any pair in `lines` can
    occur, so its merges are learned first and it ends up as one token. Returns (tokens in id order,
    merges in priority order), both in ByteLevel's printable-unicode alphabet.
    """
    if n_tokens < 256:
        raise ValueError(f"n_tokens={n_tokens} is below the 256-byte alphabet of a byte-level BPE")
    # A pair occurs at most once per character of the corpus, so this count outranks every corpus pair.
    weight = sum(len(line) for line in lines) + 1
    training = list(lines) + ["\n".join([word] * weight) for word in required_words]
    tok = _bpe_pipeline(models.BPE())
    trainer = trainers.BpeTrainer(
        vocab_size=n_tokens,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(training, trainer=trainer)
    vocab: dict[str, int] = tok.get_vocab(with_added_tokens=False)
    tokens = sorted(vocab, key=vocab.__getitem__)
    merges = _merges_of(tok)
    encoded = {word: tok.encode(word).tokens for word in required_words}
    split = {word: pieces for word, pieces in encoded.items() if len(pieces) != 1}
    if split:
        raise ValueError(
            f"BPE training left required words split into several tokens: {split}; "
            f"raise n_tokens (now {n_tokens}) so their merges fit"
        )
    return tokens, merges


def _merges_of(tok: Tokenizer) -> list[tuple[str, str]]:
    """The trained merges in priority order (tokenizer.json stores each as "a b" or ["a", "b"])."""
    merges: list[tuple[str, str]] = []
    for m in json.loads(tok.to_str())["model"]["merges"]:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        merges.append((a, b))
    return merges


def assign_ids(spec: TinyTokenizerSpec, trained: Sequence[str]) -> dict[str, int]:
    """Lay out the full vocab: trained ordinary tokens first, fixed tokens at their ids, reserved the rest."""
    words_bl = {_to_byte_level(w): i for w, i in spec.word_tokens.items()}
    ordinary = [t for t in trained if t not in words_bl]
    if len(ordinary) > spec.ordinary_limit:
        raise ValueError(
            f"{len(ordinary)} ordinary tokens do not fit below ordinary_limit={spec.ordinary_limit}"
        )
    vocab: dict[str, int] = {t: i for i, t in enumerate(ordinary)}
    vocab.update(words_bl)
    vocab.update(spec.special_tokens)
    vocab.update(spec.text_tokens)
    used = set(vocab.values())
    for i in range(spec.vocab_size):
        if i not in used:
            vocab[RESERVED_TEMPLATE.format(i)] = i
    if len(vocab) != spec.vocab_size:
        raise ValueError(
            f"vocab layout has {len(vocab)} entries, expected vocab_size={spec.vocab_size}: "
            "a reserved token name collides with a real token"
        )
    return dict(sorted(vocab.items(), key=lambda kv: kv[1]))


def _to_byte_level(word: str) -> str:
    """The ByteLevel (GPT-2 printable) spelling of `word`, i.e. how it appears in a BPE vocab."""
    pieces = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(word)
    return "".join(p for p, _ in pieces)


def build_tokenizer(spec: TinyTokenizerSpec) -> PreTrainedTokenizerBase:
    """Train (deterministically) and wrap the tiny tokenizer described by `spec`."""
    lines = load_corpus(spec.corpus_path)
    trained, merges = train_byte_level_bpe(
        lines, n_tokens=spec.ordinary_limit + len(spec.word_tokens), required_words=list(spec.word_tokens)
    )
    vocab = assign_ids(spec, trained)
    special_ids = {i for t, i in vocab.items() if t in spec.special_tokens or t.startswith("<|reserved_")}
    added = {
        i: AddedToken(t, special=i in special_ids, normalized=False, lstrip=False, rstrip=False, single_word=False)
        for t, i in vocab.items()
        if i in special_ids or t in spec.text_tokens
    }
    by_id = sorted(spec.special_tokens, key=lambda t: spec.special_tokens[t])
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,  # type: ignore[arg-type]  # BPE takes (a, b) pairs; the hint says "a b" strings
        eos_token=spec.eos_token,
        pad_token=spec.pad_token,
        unk_token=None,  # type: ignore[arg-type]  # byte-level BPE has no unknown token (as real Qwen)
        bos_token=None,
        added_tokens_decoder=added,
        # As Qwen's `additional_special_tokens`: every control token except the pad/unk text.
        extra_special_tokens=[t for t in by_id if t != spec.pad_token],
        model_specific_special_tokens=dict(spec.named_tokens),
        model_max_length=spec.model_max_length,
        chat_template=spec.chat_template,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )
    _check_layout(tokenizer, spec)
    return tokenizer


def _check_layout(tokenizer: PreTrainedTokenizerBase, spec: TinyTokenizerSpec) -> None:
    if len(tokenizer) != spec.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} ids, expected vocab_size={spec.vocab_size}")
    for token, want in {**spec.special_tokens, **spec.word_tokens, **spec.text_tokens}.items():
        got = tokenizer.encode(token, add_special_tokens=False)
        if got != [want]:
            raise ValueError(f"{token!r} encodes to {got}, expected the single id [{want}]")
    newline = tokenizer.encode("\n", add_special_tokens=False)
    if len(newline) != 1:
        raise ValueError(f"'\\n' must be one token, got {newline}")
