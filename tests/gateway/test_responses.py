"""OpenAI's `POST /v1/responses` (gateway/responses_api.py) against a scripted pipeline: the chat it runs
(instructions as the system turn, the input's text, image and audio parts, an earlier assistant turn), the
`response` object (one assistant message, usage with cached input tokens, "incomplete" at
max_output_tokens), the event stream in order with sequence numbers, `text.format` as a structured output,
the official `openai` client (`output_text`, streaming), and every unsupported or bad field as a 400 naming
it. Through a real mesh: tests/e2e/test_responses_e2e.py."""

from __future__ import annotations

import base64
import json

import httpx
import openai
import pytest
from test_rest import wav_file

from gateway.events import AudioPart, Finished, ImagePart, TextDelta, TextPart

PNG = ("iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAAFklEQVR4nGP8z8DAwMDAxMDAwMDAAAANHQEDasKb6QAAAABJRU5ErkJggg==")


def post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/responses", json={"model": "tiny-omni", **body}, timeout=10)


def test_a_string_input_and_instructions(rest_server, pipeline) -> None:
    r = post(rest_server, {"input": "Hi there", "instructions": "Be brief.", "max_output_tokens": 9,
                           "temperature": 0.5, "metadata": {"k": "v"}})
    assert r.status_code == 200, r.text
    [req] = pipeline.requests
    assert [(m.role, m.content) for m in req.messages] == [("system", (TextPart("Be brief."),)),
                                                          ("user", (TextPart("Hi there"),))]
    assert req.modalities == ("text",) and req.sampling.max_tokens == 9 and req.sampling.temperature == 0.5
    assert req.conversation_param == req.media_param == "input"  # what the prompt's errors name (not `messages`)
    body = r.json()
    assert body["id"] == req.request_id and body["id"].startswith("resp_") and body["object"] == "response"
    assert body["status"] == "completed" and body["incomplete_details"] is None and body["store"] is False
    [item] = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant" and item["status"] == "completed"
    assert item["content"] == [{"type": "output_text", "text": "Hello world", "annotations": [], "logprobs": []}]
    assert body["usage"] == {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 2,
                             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 9}
    assert body["metadata"] == {"k": "v"} and body["instructions"] == "Be brief." and body["max_output_tokens"] == 9


def test_message_items_with_media_and_an_earlier_turn(rest_server, pipeline) -> None:
    audio = {"data": base64.b64encode(wav_file(0.25)).decode(), "format": "wav"}
    r = post(rest_server, {"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                     {"type": "input_image", "image_url": f"data:image/png;base64,{PNG}"},
                                     {"type": "input_audio", "input_audio": audio}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "A picture.", "annotations": []}]},
        {"role": "developer", "content": "Now say more."}]})
    assert r.status_code == 200, r.text
    user, assistant, dev = pipeline.requests[-1].messages
    assert isinstance(user.content[1], ImagePart) and isinstance(user.content[2], AudioPart)
    assert assistant.role == "assistant" and assistant.content == (TextPart("A picture."),)
    assert dev.role == "system" and dev.content == (TextPart("Now say more."),)


def test_max_output_tokens_makes_it_incomplete(rest_server, pipeline) -> None:
    pipeline.script = lambda request: [TextDelta("cut"), Finished("length", prompt_tokens=5, completion_tokens=3,
                                                                  cached_tokens=4)]
    body = post(rest_server, {"input": "x", "max_output_tokens": 3}).json()
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete" and body["usage"]["input_tokens_details"]["cached_tokens"] == 4


def test_text_format_is_a_structured_output(rest_server, pipeline) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    r = post(rest_server, {"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": schema}}})
    assert r.status_code == 200, r.text
    assert pipeline.requests[-1].structured == ("json", json.dumps(schema))
    assert r.json()["text"] == {"format": {"type": "json_schema", "name": "s", "schema": schema}}
    post(rest_server, {"input": "x", "text": {"format": {"type": "json_object"}}})
    assert pipeline.requests[-1].structured == ("json", '{"type": "object"}')


def test_the_event_stream(rest_server, pipeline) -> None:
    with httpx.stream("POST", f"{rest_server.base_url}/v1/responses", timeout=10,
                      json={"model": "tiny-omni", "input": "Hi", "stream": True}) as r:
        assert r.status_code == 200
        lines = list(r.iter_lines())
    kinds = [line[len("event: "):] for line in lines if line.startswith("event: ")]
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [e["type"] for e in events] == kinds and [e["sequence_number"] for e in events] == list(range(len(kinds)))
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Hello world"
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "Hello world"
    assert events[0]["response"]["status"] == "in_progress" and events[-1]["response"]["usage"]["total_tokens"] == 9


def test_the_openai_client(rest_server, pipeline) -> None:
    client = openai.OpenAI(base_url=f"{rest_server.base_url}/v1", api_key="none")
    out = client.responses.create(model="tiny-omni", input="Hi", instructions="Be brief.")
    assert out.output_text == "Hello world" and out.status == "completed" and out.usage.output_tokens == 2
    deltas = [e.delta for e in client.responses.create(model="tiny-omni", input="Hi", stream=True)
              if e.type == "response.output_text.delta"]
    assert "".join(deltas) == "Hello world"


@pytest.mark.parametrize(("body", "param", "needle"), [
    ({}, "input", "Field required"),
    ({"input": []}, "input", "at least one message"),
    ({"input": 5}, "input", "at least one message"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "--responses-store-memory"),
    ({"input": "x", "conversation": "conv_1"}, "conversation", "not supported"),
    ({"input": "x", "background": True}, "background", "--responses-store-memory"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}]}, "tool_choice", "--enable-auto-tool-choice"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type", "hosted tool"),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name", "Field required"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "mcp"}}, "tool_choice",
     "give \"none\""),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice", "'g' is not among the tools"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": "required",
      "text": {"format": {"type": "json_object"}}}, "text.format", "cannot both shape"),
    ({"input": [{"type": "function_call_output", "call_id": "c1", "output": "rain"}]}, "input[0].call_id",
     "no function_call before it"),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "f"}]}, "input[0].arguments", "Field required"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "stores nothing"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort", "Input should be"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", ">= 1"),
    ({"input": "x", "n": 2}, "n", "one output"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0].image_url",
     "needs its image_url"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content",
     "input_text"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0]", "'user'"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format.schema", "needs its schema"),
    ({"input": "x", "text": {"format": {"type": "json_object"}}, "guided_regex": "a"}, "text.format",
     "one structured output"),
    ({"input": "x", "model": "gpt-5"}, "model", "gpt-5"),
    # accepted silently before
    ({"input": "x", "include": ["bogus"]}, "include", "'bogus' is not one of message.output_text.logprobs"),
    ({"input": "x", "truncation": "bogus"}, "truncation", "'auto' or 'disabled'"),
    ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "at most 16 pairs"),
    ({"input": "x", "metadata": {"k": "v" * 513}}, "metadata", "values of at most 512"),
])
def test_bad_bodies(rest_server, pipeline, body, param, needle) -> None:
    r = post(rest_server, body) if "model" in body else httpx.post(f"{rest_server.base_url}/v1/responses",
                                                                     json={"model": "tiny-omni", **body}, timeout=10)
    assert r.status_code == (404 if param == "model" else 400), r.text
    err = r.json()["error"]
    assert err["param"].startswith(param) and needle in err["message"], err
    assert pipeline.requests == []


def test_media_errors_name_the_input_item(rest_server, pipeline) -> None:
    """A part the media loader refuses is named by the Responses body's own fields (`input[i].content[j]...`),
    never by the chat messages they become (instructions add a system turn; call items fold into one assistant
    turn), and an image's field is `image_url` (a string here, not chat's `{"url"}`)."""
    bad_png = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}
    calls = [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "rain"}]
    cases = [
        ({"instructions": "Be brief.", "input": [*calls, {"role": "user", "content": [
            {"type": "input_text", "text": "and this?"}, bad_png]}]}, "input[2].content[1].image_url", 400),
        ({"input": [{"role": "user", "content": "hi"}, {"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]},
         "input[1].content[0].input_audio", 400),
        ({"input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "t"}]},
                    {"role": "assistant", "content": [bad_png]}]}, "input[1].content[0]", 400),
        ({"input": [{"role": "user", "content": [bad_png] * 300}]}, "input", 400),
    ]
    for body, param, status in cases:
        r = post(rest_server, body)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["param"] == param and "messages[" not in err["message"], err
    assert "an 'assistant' message" in post(rest_server, cases[2][0]).json()["error"]["message"]
    assert pipeline.requests == []


def test_a_failure_midstream_is_an_error_event(rest_server, pipeline) -> None:
    from gateway.events import PipelineError

    pipeline.script = lambda request: [TextDelta("a"), PipelineError("thinker died", http_status=503, grpc_code=14,
                                                                      kind="service_unavailable")]
    with httpx.stream("POST", f"{rest_server.base_url}/v1/responses", timeout=10,
                      json={"model": "tiny-omni", "input": "Hi", "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[-1]["type"] == "error" and events[-1]["message"] == "thinker died"
    assert events[-1]["code"] == "service_unavailable"
    assert "response.completed" not in [e["type"] for e in events]


def test_reasoning_effort_reaches_the_chat_template(rest_server, pipeline) -> None:
    """OpenAI's `reasoning.effort` (Responses) and `reasoning_effort` (chat) become the chat template's
    `reasoning_effort` variable, as vLLM passes them (a template that reads it thinks harder or less); the
    response echoes its `reasoning` settings; a client's own chat_template_kwargs win."""
    r = post(rest_server, {"input": "x", "reasoning": {"effort": "low", "summary": "auto"}})
    assert r.status_code == 200 and r.json()["reasoning"] == {"effort": "low", "summary": "auto"}, r.text
    assert pipeline.requests[-1].template.kwargs == {"reasoning_effort": "low"}
    chat = {"model": "tiny-omni", "messages": [{"role": "user", "content": "x"}], "reasoning_effort": "high"}
    assert httpx.post(f"{rest_server.base_url}/v1/chat/completions", json=chat, timeout=10).status_code == 200
    assert pipeline.requests[-1].template.kwargs == {"reasoning_effort": "high"}
    chat["chat_template_kwargs"] = {"reasoning_effort": "medium", "x": 1}
    httpx.post(f"{rest_server.base_url}/v1/chat/completions", json=chat, timeout=10)
    assert pipeline.requests[-1].template.kwargs == {"reasoning_effort": "medium", "x": 1}
    assert post(rest_server, {"input": "x"}).json()["reasoning"] is None


def test_the_answers_logprobs_when_asked(rest_server, pipeline) -> None:
    """`top_logprobs` / `include: ["message.output_text.logprobs"]`: the thinker is asked for them and each answer
    token's entry comes on the output_text part (the chat's shape), whole and with the stream's text deltas."""
    from omnimesh.v1 import stage_pb2

    def entry(token: bytes, lp: float) -> stage_pb2.TokenLogprob:
        return stage_pb2.TokenLogprob(token_id=1, token=token, logprob=lp,
                                      top=[stage_pb2.TopLogprob(token_id=2, token=b"x", logprob=-3.0)])

    pipeline.script = lambda request: [TextDelta("Hello", logprobs=(entry(b"Hello", -0.5),)),
                                       TextDelta(" world", logprobs=(entry(b" world", -1.0),)),
                                       Finished("stop", prompt_tokens=7, completion_tokens=2)]
    body = post(rest_server, {"input": "Hi", "top_logprobs": 1, "include": ["message.output_text.logprobs"]}).json()
    assert pipeline.requests[-1].sampling.logprobs == 1
    lps = body["output"][0]["content"][0]["logprobs"]
    assert [(t["token"], t["logprob"], t["bytes"]) for t in lps] == [("Hello", -0.5, list(b"Hello")),
                                                                    (" world", -1.0, list(b" world"))]
    assert lps[0]["top_logprobs"] == [{"token": "x", "logprob": -3.0, "bytes": [120]}]
    post(rest_server, {"input": "Hi", "include": ["message.output_text.logprobs", "reasoning.encrypted_content"]})
    assert pipeline.requests[-1].sampling.logprobs == 0  # include alone: the tokens' own, no alternatives
    post(rest_server, {"input": "Hi"})
    assert pipeline.requests[-1].sampling.logprobs is None
    with httpx.stream("POST", f"{rest_server.base_url}/v1/responses", timeout=10,
                      json={"model": "tiny-omni", "input": "Hi", "stream": True, "top_logprobs": 1}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [[t["token"] for t in e["logprobs"]] for e in deltas] == [["Hello"], [" world"]]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert done["logprobs"] == lps == events[-1]["response"]["output"][0]["content"][0]["logprobs"]
    r = httpx.post(f"{rest_server.base_url}/v1/responses", json={"model": "tiny-omni", "input": "x",
                                                                  "top_logprobs": 21}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
