"""Request validation against OpenAI's chat completions format, and the shared checks."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from gateway.events import PipelineError, SamplingOverrides
from gateway.openai_schema import (ChatCompletionChunk, ChunkChoice, Delta, check_sampling, default_modalities, dump,
                                   error_response, normalize_modalities, parse_chat_request, resolve_model, resolve_voice)


def parse(obj: object) -> object:
    return parse_chat_request(json.dumps(obj).encode())


def test_minimal_request_and_defaults() -> None:
    body = parse({"model": "m", "messages": [{"role": "user", "content": "hi"}], "foo": {"bar": 1}})
    assert body.messages[0].content[0].type == "text" and body.messages[0].content[0].text == "hi"  # type: ignore[attr-defined]
    assert body.stream is False and body.modalities is None and body.stage_overrides() == {}  # type: ignore[attr-defined]
    assert body.sampling() == SamplingOverrides()  # type: ignore[attr-defined]


def test_max_completion_tokens_wins_and_ints_are_floats() -> None:
    body = parse({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "max_completion_tokens": 9,
                  "temperature": 1, "stage_params": {"thinker": {"top_p": 1}, "talker": {"seed": 4}}})
    assert body.sampling() == SamplingOverrides(temperature=1.0, max_tokens=9)  # type: ignore[attr-defined]
    assert body.stage_overrides() == {"thinker": SamplingOverrides(top_p=1.0),  # type: ignore[attr-defined]
                                      "talker": SamplingOverrides(seed=4)}


@pytest.mark.parametrize(("obj", "param", "needle"), [
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "valid list"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}, "messages[0].content[0].text", "string"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "Field required"),
    ({"messages": [{"role": "user", "content": "x"}], "seed": 1.5}, "seed", "integer"),
    ({"messages": [{"role": "user", "content": "x"}], "stage_params": {"talker": {"temperature": "0"}}},
     "stage_params.talker.temperature", "number"),
    ({"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": "1"}, "prompt_logprobs", "integer"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": 5}, "stop", "valid list"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0].function",
     "Field required"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "retrieval", "function": {"name": "f"}}]},
     "tools[0].type", "'function'"),
    ({"messages": [{"role": "tool", "content": "rain"}]}, "messages[0]", "needs the tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0]",
     "only assistant messages make calls"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "Field required"),
    ({"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}, "functions", "not supported"),
    ({"messages": [{"role": "user", "content": "x"}], "logit_bias": [5, 10]}, "logit_bias", "valid dictionary"),
    ({"messages": [{"role": "user", "content": "x"}], "bad_words": "x"}, "bad_words", "valid list"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": "json"}, "response_format",
     "valid dictionary"),
    ({"messages": [{"role": "user", "content": "x"}], "ignore_eos": "yes"}, "ignore_eos", "bool"),
    ({"messages": [{"role": "user", "content": "x"}], "guided_choice": "a"}, "guided_choice", "valid list"),
    ({"messages": [{"role": "user", "content": "x"}], "use_beam_search": True}, "use_beam_search", "not supported"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "always"}, "tool_choice", "'auto'"),
    ({"messages": [{"role": "user", "content": "x"}], "mm_processor_kwargs": {"do_resize": False}},
     "mm_processor_kwargs.do_resize", "unknown field"),
    ({"messages": [{"role": "user", "content": "x"}], "presence_penalty": "1"}, "presence_penalty", "number"),
    ({"messages": [{"role": "user", "content": "x"}], "modalities": []}, "modalities", "at least 1"),
])
def test_schema_errors_name_the_field(obj: dict, param: str | None, needle: str) -> None:
    with pytest.raises(PipelineError) as e:
        parse(obj)
    assert e.value.http_status == 400 and e.value.grpc_code == 3 and e.value.kind == "invalid_request_error"
    assert e.value.param == param and needle in e.value.message


def test_neutral_values_of_unsupported_fields_pass_and_penalties_reach_the_overrides() -> None:
    """What clients send by default (n 1, logprobs false, an empty logit_bias, text response_format, vLLM's
    best_of 1 ...) asks for nothing omnimesh lacks: accepted. presence / frequency penalties are carried."""
    body = parse({"messages": [{"role": "user", "content": "x"}], "n": 1, "logprobs": False, "top_logprobs": 0,
                  "tools": [], "functions": [], "logit_bias": {}, "response_format": {"type": "text"}, "best_of": 1, "use_beam_search": False, "echo": False, "tool_choice": "none",
                  "mm_processor_kwargs": {"use_audio_in_video": False},
                  "presence_penalty": 0.5, "frequency_penalty": -1,
                  "stage_params": {"talker": {"frequency_penalty": 0.25}}})
    assert body.sampling() == SamplingOverrides(presence_penalty=0.5, frequency_penalty=-1.0)  # type: ignore[attr-defined]
    assert body.stage_overrides() == {"talker": SamplingOverrides(frequency_penalty=0.25)}  # type: ignore[attr-defined]


def test_logprobs_ask_the_thinker_for_alternatives() -> None:
    """OpenAI's logprobs / top_logprobs -> the thinker's `logprobs` count (None: off)."""
    def logprobs(**fields: object) -> int | None:
        return parse({"messages": [{"role": "user", "content": "x"}], **fields}).sampling().logprobs  # type: ignore[attr-defined]

    assert logprobs() is None and logprobs(logprobs=False, top_logprobs=0) is None
    assert logprobs(logprobs=True) == 0 and logprobs(logprobs=True, top_logprobs=3) == 3


def test_unknown_fields_are_ignored_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="gateway.openai_schema"):
        for _ in range(3):
            parse({"messages": [{"role": "user", "content": "x"}], "zz_unknown_knob": 1, "user": "u"})
    named = [r.getMessage() for r in caplog.records if "zz_unknown_knob" in r.getMessage()]
    assert len(named) == 1 and "ignored" in named[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="gateway.openai_schema"):  # what the SDKs send to label or route a request
        parse({"messages": [{"role": "user", "content": "x"}], "metadata": {"a": "b"}, "store": False,
               "service_tier": "auto", "prompt_cache_key": "k", "safety_identifier": "s"})
    assert not caplog.records
    assert not any("user" in r.getMessage() for r in caplog.records)  # OpenAI's own labels are not news


def test_check_sampling_ranges() -> None:
    check_sampling(SamplingOverrides(temperature=0.0, top_p=1.0, top_k=1, max_tokens=1, repetition_penalty=1.0), "")
    for top_k in (-1, 0, 2**31 - 1):  # vLLM's -1 and 0 turn top-k off
        check_sampling(SamplingOverrides(top_k=top_k), "")
    for s, field in [(SamplingOverrides(temperature=-0.1), "temperature"), (SamplingOverrides(top_p=1.5), "top_p"),
                     (SamplingOverrides(max_tokens=0), "max_tokens"), (SamplingOverrides(top_k=-2), "top_k"),
                     (SamplingOverrides(top_k=2**31), "top_k"),  # past the stages' int32: was a 500
                     (SamplingOverrides(max_tokens=2**31), "max_tokens"),
                     (SamplingOverrides(repetition_penalty=0.0), "repetition_penalty"),
                     (SamplingOverrides(seed=2**63), "seed"), (SamplingOverrides(presence_penalty=-2.5), "presence_penalty"),
                     (SamplingOverrides(frequency_penalty=float("nan")), "frequency_penalty")]:
        with pytest.raises(PipelineError) as e:
            check_sampling(s, "stage_params.talker")
        assert e.value.param == f"stage_params.talker.{field}"


def test_model_voice_and_modalities_resolution() -> None:
    assert resolve_model(None, ("a", "b")) == "a" and resolve_model("b", ("a", "b")) == "b"
    with pytest.raises(PipelineError) as e:
        resolve_model("c", ("a", "b"))
    assert e.value.http_status == 404 and e.value.grpc_code == 5
    assert error_response(e.value).error.code == "model_not_found"
    def speaking(voices: tuple[str, ...], default: str, no_audio: str | None = None) -> SimpleNamespace:
        return SimpleNamespace(voices=voices, default_voice=default, no_audio=no_audio)

    assert resolve_voice("ETHAN", speaking(("Ethan", "Chelsie"), "Ethan"), "audio.voice") == "Ethan"
    assert resolve_voice(None, speaking(("Ethan", "Chelsie"), "Chelsie"), "audio.voice") == "Chelsie"
    with pytest.raises(PipelineError, match="available: Ethan, Chelsie"):
        resolve_voice("alloy", speaking(("Ethan", "Chelsie"), "Ethan"), "audio.voice")
    with pytest.raises(PipelineError, match="audio output is not available on this server: it has no voices"):
        resolve_voice(None, speaking((), ""), "audio.voice")
    with pytest.raises(PipelineError, match="not available on this server: the model m has no audio output"):
        resolve_voice("Ethan", speaking((), "", "the model m has no audio output"), "audio.voice")
    assert default_modalities(speaking(("Ethan",), "Ethan")) == ("text", "audio")  # type: ignore[arg-type]
    assert default_modalities(speaking((), "")) == ("text",)  # type: ignore[arg-type]
    assert normalize_modalities(None, ("text",)) == ("text",)
    assert normalize_modalities(["audio"], ("text",)) == ("text", "audio")
    assert normalize_modalities(None, ("text", "audio")) == ("text", "audio")


def test_stream_chunk_dump_drops_unset_fields_but_keeps_finish_reason() -> None:
    chunk = ChatCompletionChunk(id="c", created=1, model="m", choices=[ChunkChoice(delta=Delta(content="hi"))])
    assert dump(chunk, drop_none=True) == {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                                           "choices": [{"index": 0, "delta": {"content": "hi"},
                                                        "finish_reason": None}]}


def test_surrogate_pairs_pass_and_lone_halves_are_400() -> None:
    pair = parse_chat_request(b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00 hi"}]}')
    assert pair.messages[0].content[0].text == "\U0001F600 hi"
    hangul = parse_chat_request('{"messages": [{"role": "user", "content": "\ud55c"}]}'.encode())  # bytes ED 95 9C
    assert hangul.messages[0].content[0].text == "\ud55c"
    for lone in (b"\\ud800", b"\\udfff x", b"x \\uDC00", b"\\ud83d\\ude00\\ud800",
                 "\ud800".encode("utf-8", "surrogatepass")):  # a surrogate's bytes (json.loads lets them in)
        with pytest.raises(PipelineError, match="unpaired UTF-16 surrogate") as err:
            parse_chat_request(b'{"messages": [{"role": "user", "content": "' + lone + b'"}]}')
        assert err.value.http_status == 400


def test_deeply_nested_body_is_400() -> None:
    with pytest.raises(PipelineError, match="nest too deeply") as err:
        parse_chat_request(b"[" * 100000 + b"]" * 100000)
    assert err.value.http_status == 400
