"""`omnimesh.json_text.loads`: JSON nested deeper than Python's parser follows is a JSONDecodeError (the
callers' 400 / INVALID_ARGUMENT), not a RecursionError (a 500, or grpcio's UNKNOWN); everything else is
`json.loads`'s."""

from __future__ import annotations

import json

import pytest

from omnimesh.json_text import LoneSurrogate, TooDeep, loads


@pytest.mark.parametrize("text", ["[" * 50_000 + "]" * 50_000, '{"a":' * 50_000 + "1" + "}" * 50_000, "[" * 50_000])
def test_too_deep_is_a_decode_error(text: str) -> None:
    with pytest.raises(json.JSONDecodeError, match="nest too deeply") as err:
        loads(text)
    assert isinstance(err.value, TooDeep)
    with pytest.raises(TooDeep):
        loads(text.encode())


def test_the_rest_is_json_loads() -> None:
    assert loads('{"a": [1, 2.5, null, "\\u00fc"]}') == {"a": [1, 2.5, None, "ü"]}
    assert loads(b"[" * 100 + b"]" * 100) == json.loads("[" * 100 + "]" * 100)
    with pytest.raises(json.JSONDecodeError, match="Expecting value") as err:
        loads("[1,")
    assert not isinstance(err.value, TooDeep)


@pytest.mark.parametrize("half", ["\\ud800", "\\udfff x", "x \\uDC00", "\\ud83d\\ude00\\ud800"])
def test_a_lone_surrogate_escape_is_a_decode_error(half: str) -> None:
    """JSON lets one stand alone; the tokenizer then failed on it (a TypeError, a 500), also inside a call's
    arguments or a tool's schema: those are JSON inside a JSON string, which the body's own check cannot see."""
    for text in (f'{{"a": ["{half}"]}}', f'{{"{half}": 1}}'):
        with pytest.raises(json.JSONDecodeError, match="unpaired UTF-16 surrogate") as err:
            loads(text)
        assert isinstance(err.value, LoneSurrogate) and not isinstance(err.value, TooDeep)
        with pytest.raises(LoneSurrogate):
            loads(text.encode())
    with pytest.raises(LoneSurrogate):  # its UTF-8-style bytes, which json.loads decodes with "surrogatepass"
        loads(b'["' + "\ud800".encode("utf-8", "surrogatepass") + b'"]')
    deep = "[" * 900 + '"\\ud800"' + "]" * 900  # found at any depth
    with pytest.raises(LoneSurrogate):
        loads(deep)


def test_pairs_and_escaped_backslashes_are_text() -> None:
    assert loads('["\\ud83d\\ude00", "\\\\ud800", "\\u00fc"]') == ["\U0001F600", "\\ud800", "ü"]
    assert loads('["\ud55c"]'.encode()) == ["\ud55c"]  # Hangul: bytes ED 95 9C


def test_text_without_a_surrogate_escape_skips_the_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    """The escape scan costs ~20 ms a MB: a Realtime audio event or a body of base64 media (no backslash at all)
    and text whose escapes are no surrogates are let through by a substring search alone."""
    import omnimesh.json_text as json_text

    class Refuse:
        def search(self, _: object) -> None:
            raise AssertionError("scanned")

    monkeypatch.setattr(json_text, "_HALF_TEXT", Refuse())
    monkeypatch.setattr(json_text, "_HALF_BYTES", Refuse())
    audio = '{"type": "input_audio_buffer.append", "audio": "' + "QUJD" * 100_000 + '"}'
    for text in (audio, '{"text": "\\u00fc\\u4e2d"}'):
        assert loads(text) and loads(text.encode())
    with pytest.raises(AssertionError, match="scanned"):  # a surrogate escape, paired or not, is scanned
        loads('["\\ud83d\\ude00"]')
