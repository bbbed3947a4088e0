"""`--limit-mm-per-prompt` and `--input-limits` -> `InputLimits`: vLLM's syntax, sizes with units, and an
error naming the flag and the fix for every bad value; `--allowed-media-domains` -> the exact hosts."""

from __future__ import annotations

import re

import pytest

from gateway.input_limits import SIZE_FIELDS, InputLimits, limits_from_flags, parse_media_domains


def test_no_flags_are_the_defaults() -> None:
    assert limits_from_flags(None, None) == InputLimits()
    assert limits_from_flags("", "") == InputLimits()


def test_limit_mm_per_prompt_takes_vllms_forms() -> None:
    limits = limits_from_flags('{"image": 2, "video": 0, "audio": {"count": 3}}', None)
    assert limits.limit_mm_per_prompt == {"image": 2, "video": 0, "audio": 3}
    assert limits.max_media_items == InputLimits().max_media_items  # the sizes keep their defaults


def test_input_limits_set_sizes_with_units() -> None:
    limits = limits_from_flags(None, '{"max_request_bytes": "16MiB", "max_fetch_bytes": 1000, '
                                     '"max_audio_seconds": 30, "video_decode_timeout_s": 2.5, "max_media_items": 4}')
    assert limits.max_request_bytes == 16 * 2**20 and limits.max_fetch_bytes == 1000
    assert limits.max_audio_seconds == 30.0 and limits.video_decode_timeout_s == 2.5 and limits.max_media_items == 4
    assert limits.max_image_pixels == InputLimits().max_image_pixels
    assert "limit_mm_per_prompt" not in SIZE_FIELDS and "max_video_pixels" in SIZE_FIELDS


@pytest.mark.parametrize(("mm", "sizes", "message"), [
    ("{image: 2}", None, r"--limit-mm-per-prompt is not valid JSON"),
    ('["image"]', None, r"--limit-mm-per-prompt must be a JSON object keyed by modality"),
    ('{"images": 2}', None, r"unknown modality 'images'; this model takes audio, image, video"),
    ('{"image": -1}', None, r"\[\'image\'\]: -1 is not a count; write a whole number >= 0 \(0: refuse image input\)"),
    ('{"image": 1.5}', None, r"1.5 is not a count"),
    ('{"image": true}', None, r"True is not a count"),
    ('{"image": {"count": 2, "width": 512}}', None, r"is not a count"),
    (None, '{"max_pixels": 5}', r"unknown limit 'max_pixels'; limits are max_request_bytes, "),
    (None, '{"image": 5}', r"per-modality counts go in --limit-mm-per-prompt"),
    (None, '{"max_media_items": 2.5}', r"--input-limits\['max_media_items'\]: 2.5 is not a whole number"),
    (None, '{"max_audio_seconds": "30s"}', r"'30s' is not a number of seconds"),
    (None, '{"max_request_bytes": "lots"}', r"--input-limits\['max_request_bytes'\]: 'lots' is not a size"),
    (None, '{"max_audio_seconds": 0}', r"--input-limits: max_audio_seconds must be positive, got 0"),
    (None, '{"max_media_items": 0}', r"--input-limits: max_media_items must be positive"),
])
def test_bad_values_name_the_flag(mm: str | None, sizes: str | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        limits_from_flags(mm, sizes)


def test_the_start_up_log_names_what_differs() -> None:
    from gateway.input_limits import describe_limits

    assert describe_limits(InputLimits()) == "the defaults"
    limits = limits_from_flags('{"image": 2, "video": 0}', '{"max_audio_seconds": 30}')
    assert describe_limits(limits) == "max_audio_seconds=30 (default 600), image parts <= 2, video refused"
    bytes_ = limits_from_flags(None, '{"media_build_memory": "2GiB", "max_request_bytes": 1000000}')
    assert describe_limits(bytes_) == ("max_request_bytes=977 KiB (default 64 MiB), media_build_memory=2 GiB "
                                       "(default 1 GiB)")


def test_allowed_media_domains_are_hosts_as_a_url_names_them() -> None:
    """Exact, lower-case hosts; anything a URL's host could never equal is refused at start-up (a typo would only
    ever refuse media, silently)."""
    from omnimesh.config.serve_args import ServeArgs

    assert parse_media_domains(None) == frozenset()
    assert parse_media_domains("Media.Example.com, 10.0.0.5,[::1],localhost,") == {
        "media.example.com", "10.0.0.5", "::1", "localhost"}
    for bad in ("https://a.example", "a.example:8080", "a.example/media", "*.a.example", "-a.example", "a..example",
                "a b", "{"):
        with pytest.raises(ValueError, match=f"--allowed-media-domains: '{re.escape(bad)}' is not a host name"):
            parse_media_domains(bad)
        with pytest.raises(ValueError, match="--allowed-media-domains"):
            ServeArgs(allowed_media_domains=f"ok.example,{bad}")
