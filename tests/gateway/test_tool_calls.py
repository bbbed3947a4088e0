"""OpenAI function calling (gateway/tool_calls.py, `--enable-auto-tool-choice --tool-call-parser hermes`):

- the Hermes parser: content around the blocks, several calls, arguments kept as JSON text, a malformed block
  left in the content, a block the model did not close; streamed delta by delta (even one character at a
  time) it gives the same content and calls, never sending a partial "<tool_call>" tag as content;
- the rules, as vLLM's: "auto" (the default with tools) needs the flag, "required" / a named function need
  structured outputs (400), a forced call with speech is a 400 ("auto" with speech: tests/gateway/test_spoken_calls.py), tool_choice "none" renders the tools and parses nothing;
- the prompt: tools render in the tiny model's system turn exactly as transformers renders them, earlier calls
  and tool results render as the Qwen template writes them, a template that ignores tools is a 400;
- through a real REST server (scripted pipeline): `message.tool_calls` with finish_reason "tool_calls",
  streamed `tool_calls` deltas with their index, the `openai` client reading both; the flags reach the gateway.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from gateway_harness import RestServer, ScriptedPipeline

from gateway.events import ChatMessage, ChatRequest, Finished, PipelineError, TextDelta, TextPart, ToolCall
from gateway.openai_schema import parse_chat_request
from gateway.prompt import PromptBuilder
from gateway.rest import create_app
from gateway.tool_calls import ToolCallStream, parse_tool_calls, tool_plan
from omnimesh.config.serve_args import ServeArgs
from omnimesh.models.qwen3_omni.tiny import build_tiny_qwen3_omni

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
ANSWER = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
USER = [{"role": "user", "content": "Weather and time in Oslo?"}]


# ------------------------------------------------------------------------------------------ parser


def test_parser_splits_content_and_calls() -> None:
    content, calls = parse_tool_calls(ANSWER)
    assert content == "Let me check.\n\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("chatcmpl-tool-") for c in calls)
    # only calls: no content; arguments given as a JSON string stay that string
    content, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>\n')
    assert content is None and calls[0].arguments == '{"a": 1}'
    assert parse_tool_calls("no calls here") == ("no calls here", [])


def test_parser_keeps_malformed_blocks_as_content_and_takes_an_unclosed_whole_one() -> None:
    bad = '<tool_call>{"name": 3}</tool_call> <tool_call>not json</tool_call>'
    assert parse_tool_calls(bad) == (bad, [])
    content, calls = parse_tool_calls('ok <tool_call>{"name": "f", "arguments": {"x": [1, 2]}}')
    assert content == "ok " and calls[0].name == "f" and json.loads(calls[0].arguments) == {"x": [1, 2]}
    assert parse_tool_calls('ok <tool_call>{"name": "f", "argu') == ('ok <tool_call>{"name": "f", "argu', [])


@pytest.mark.parametrize("step", [1, 2, 5, 13, 1000])
def test_the_stream_gives_what_the_whole_text_gives(step: int) -> None:
    stream, content, calls = ToolCallStream(), [], []
    for at in range(0, len(ANSWER), step):
        text, got = stream.push(ANSWER[at:at + step])
        assert "<tool" not in text and "</tool" not in text  # no tag, whole or partial, leaves as content
        content.append(text)
        calls += got
    tail, more = stream.finish()
    whole_content, whole_calls = parse_tool_calls(ANSWER)
    assert "".join(content) + tail == whole_content and more == []
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]
    assert stream.calls == 2


def test_the_stream_releases_a_held_prefix_that_is_no_tag() -> None:
    stream = ToolCallStream()
    assert stream.push("a <tool") == ("a ", [])
    assert stream.push("box> b") == ("<toolbox> b", [])
    assert stream.push(" <") == (" ", [])
    assert stream.finish() == ("<", [])


# ------------------------------------------------------------------------------------------- rules


def plan(body: dict, enabled: bool = True, modalities: tuple[str, ...] = ("text",)):
    return tool_plan(parse_chat_request(json.dumps({"messages": USER, **body}).encode()), enabled, modalities)


def test_tool_choice_rules_as_vllm() -> None:
    assert plan({"tools": [WEATHER]}).parse and plan({"tools": [WEATHER], "tool_choice": "auto"}).parse
    none = plan({"tools": [WEATHER], "tool_choice": "none"}, enabled=False)
    assert not none.parse and none.tools[0]["function"]["name"] == "get_weather"  # rendered, not parsed
    assert not plan({}).parse and plan({}).tools == ()
    assert plan({"tools": [WEATHER]}, modalities=("text", "audio")).parse  # spoken: the talker stops at a call
    # "required" and a named function need no flag: the answer is constrained to the calls' JSON
    named = plan({"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
                 enabled=False)
    assert named.forced == "get_weather" and not named.parse
    assert named.structured == ("json", json.dumps(WEATHER["function"]["parameters"]))
    required = plan({"tools": [WEATHER, TIME], "tool_choice": "required"}, enabled=False)
    assert required.forced == "required" and required.structured is not None
    schema = json.loads(required.structured[1])
    assert schema["type"] == "array" and [c["properties"]["name"]["enum"] for c in schema["items"]["anyOf"]] == [
        ["get_weather"], ["get_time"]]
    cases = [({"tools": [WEATHER]}, False, ("text",), "requires --enable-auto-tool-choice and --tool-call-parser"),
             ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, True,
              ("text",), r"function 'get_time' is not among the tools \(get_weather\)"),
             ({"tool_choice": "required"}, True, ("text",), "forcing a call needs tools"),
             ({"tools": [WEATHER], "tool_choice": "required"}, True, ("text", "audio"), "nothing to say"),
             ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, True,
              ("text", "audio"), "nothing to say"),
             ({"tools": [WEATHER, WEATHER]}, True, ("text",), "must be unique")]
    for body, enabled, modalities, needle in cases:
        with pytest.raises(PipelineError, match=needle) as e:
            plan(body, enabled, modalities)
        assert e.value.http_status == 400 and e.value.param in ("tools", "tool_choice")


def test_the_flags_are_checked_and_reach_the_gateway(tmp_path: Path) -> None:
    from omnimesh.launcher import MeshLauncher

    with pytest.raises(ValueError, match="--enable-auto-tool-choice requires --tool-call-parser"):
        ServeArgs(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="--tool-call-parser 'mistral': omnimesh knows hermes"):
        ServeArgs(tool_call_parser="mistral")
    argv = MeshLauncher(ServeArgs(enable_auto_tool_choice=True, tool_call_parser="hermes"), tmp_path)._gateway_argv({})
    assert "--enable-auto-tool-choice" in argv and argv[argv.index("--tool-call-parser") + 1] == "hermes"


# ------------------------------------------------------------------------------------------ prompt


@pytest.fixture(scope="module")
def builder(tmp_path_factory: pytest.TempPathFactory) -> PromptBuilder:
    return PromptBuilder(build_tiny_qwen3_omni(tmp_path_factory.mktemp("tiny") / "m"), max_model_len=1024)


def test_tools_and_earlier_calls_render_as_the_template_writes_them(builder: PromptBuilder) -> None:
    messages = (ChatMessage("user", (TextPart("Weather in Oslo?"),)),
                ChatMessage("assistant", (), tool_calls=(ToolCall("c1", "get_weather", '{"city": "Oslo"}'),)),
                ChatMessage("tool", (TextPart("rain"),), tool_call_id="c1"))
    text, _ = builder.render(ChatRequest(request_id="r", model="m", messages=messages, tools=(WEATHER,)))
    template_messages = [{"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]},
                         {"role": "assistant", "content": [], "tool_calls": [
                             {"id": "c1", "type": "function",
                              "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
                         {"role": "tool", "content": [{"type": "text", "text": "rain"}], "tool_call_id": "c1"}]
    assert text == builder.processor.tokenizer.apply_chat_template(template_messages, tools=[WEATHER], tokenize=False,
                                                                   add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n# Tools\n") and json.dumps(WEATHER) in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
            '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nrain\n</tool_response><|im_end|>') in text
    plain, _ = builder.render(ChatRequest(request_id="r", model="m", messages=messages[:1]))
    assert "# Tools" not in plain


def test_arguments_json_cannot_parse_reach_the_template_as_their_text(builder: PromptBuilder) -> None:
    """A call's arguments nested deeper than json.loads follows (a RecursionError: a 500) or holding a lone
    surrogate escape (a str the tokenizer failed on: a 500) are not an object: the template gets their text."""
    builder = PromptBuilder(builder.processor, max_model_len=32_768)
    for arguments in ("[" * 5000 + "]" * 5000, '{"city": "\\ud800"}'):
        messages = (ChatMessage("user", (TextPart("Weather?"),)),
                    ChatMessage("assistant", (), tool_calls=(ToolCall("c1", "get_weather", arguments),)),
                    ChatMessage("tool", (TextPart("rain"),), tool_call_id="c1"))
        request = ChatRequest(request_id="r", model="m", messages=messages, tools=(WEATHER,))
        text, _ = builder.render(request)
        assert f'"arguments": {json.dumps(arguments)}' in text or arguments in text
        assert builder.build(request).prompt_tokens > 0  # tokenized, with the text as it came


def test_an_assistant_turns_reasoning_reaches_the_template(builder: PromptBuilder) -> None:
    """vLLM hands an assistant message's `reasoning` (or `reasoning_content`) to the template as `reasoning_content`:
    a thinking model's template decides where it shows (here, one that writes every turn's)."""
    thinking = PromptBuilder(builder.processor, max_model_len=1024, chat_template=(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
        "</think>{% endif %}{% for p in m.content %}{{ p.text }}{% endfor %}<|im_end|>\n{% endfor %}"))
    messages = (ChatMessage("user", (TextPart("Hi"),)), ChatMessage("assistant", (TextPart("Hello"),), reasoning="greet"),
                ChatMessage("user", (TextPart("Bye"),)))
    text, conv = thinking.render(ChatRequest(request_id="r", model="m", messages=messages))
    assert "<|im_start|>assistant\n<think>greet</think>Hello<|im_end|>" in text
    assert conv.messages[1]["reasoning_content"] == "greet" and "reasoning_content" not in conv.messages[0]
    body = {"messages": [{"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": "Hello", "reasoning_content": "greet"}]}
    assert parse_chat_request(json.dumps(body).encode()).messages[1].reasoning_content == "greet"
    with pytest.raises(PipelineError, match="only assistant messages carry reasoning"):
        parse_chat_request(json.dumps({"messages": [{"role": "user", "content": "Hi", "reasoning": "x"}]}).encode())


def test_rest_hands_on_an_assistant_turns_reasoning(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    body = {"model": "tiny-omni", "messages": [{"role": "user", "content": "Hi"},
                                               {"role": "assistant", "content": "Hello", "reasoning": "greet"},
                                               {"role": "user", "content": "Bye"}]}
    assert httpx.post(f"{rest_server.base_url}/v1/chat/completions", json=body, timeout=10).status_code == 200
    assert pipeline.requests[-1].messages[1].reasoning == "greet"


def test_a_template_without_tools_refuses_them(builder: PromptBuilder) -> None:
    bare = PromptBuilder(builder.processor, max_model_len=1024,
                         chat_template="{% for m in messages %}{{ m.role }}{% endfor %}")
    with pytest.raises(PipelineError, match="does not render tools.*--chat-template") as e:
        bare.render(ChatRequest(request_id="r", model="m", messages=(ChatMessage("user", (TextPart("x"),)),),
                                tools=(WEATHER,)))
    assert e.value.param == "tools"


# ------------------------------------------------------------------------------------------ REST


@pytest.fixture(scope="module")
def tools_server() -> Iterator[tuple[RestServer, ScriptedPipeline]]:
    pipeline = ScriptedPipeline()
    pipeline.script = lambda request: [TextDelta(ANSWER[:20]), TextDelta(ANSWER[20:70]), TextDelta(ANSWER[70:]),
                                       Finished(finish_reason="stop", prompt_tokens=40, completion_tokens=30)]
    with RestServer(create_app(pipeline, served_model_names=("tiny-omni",), auto_tool_choice=True)) as server:
        yield server, pipeline


def test_rest_answers_tool_calls(tools_server) -> None:
    server, pipeline = tools_server
    body = {"model": "tiny-omni", "messages": USER, "tools": [WEATHER, TIME]}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me check.\n\n"
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in choice["message"]["tool_calls"]] == [("function", "get_weather", {"city": "Oslo"}),
                                                          ("function", "get_time", {})]
    assert pipeline.requests[-1].tools == (WEATHER, TIME)
    # the openai client reads the calls, and sends them back with the tool's answer
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x")
    reply = client.chat.completions.create(model="tiny-omni", messages=USER, tools=[WEATHER])  # type: ignore[arg-type]
    call = reply.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert call.function.name == "get_weather" and reply.choices[0].finish_reason == "tool_calls"
    client.chat.completions.create(model="tiny-omni", tools=[WEATHER], messages=[  # type: ignore[arg-type,list-item]
        *USER, reply.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "rain"}])
    sent = pipeline.requests[-1].messages
    assert sent[1].tool_calls == tuple(ToolCall(c.id, c.function.name, c.function.arguments)
                                       for c in reply.choices[0].message.tool_calls or ())
    assert sent[1].tool_calls[0] == ToolCall(call.id, "get_weather", '{"city": "Oslo"}')
    assert sent[2].role == "tool" and sent[2].tool_call_id == call.id


def test_rest_streams_tool_call_deltas(tools_server) -> None:
    server, _ = tools_server
    body = {"model": "tiny-omni", "messages": USER, "tools": [WEATHER, TIME], "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=10) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == "Let me check.\n\n"
    calls = [t for d in deltas for t in d.get("tool_calls") or []]
    assert [(t["index"], t["function"]["name"], json.loads(t["function"]["arguments"])) for t in calls] == [
        (0, "get_weather", {"city": "Oslo"}), (1, "get_time", {})]
    assert all(t["id"].startswith("chatcmpl-tool-") and t["type"] == "function" for t in calls)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # without tools the same text is plain content
    plain = httpx.post(f"{server.base_url}/v1/chat/completions", json={"model": "tiny-omni", "messages": USER},
                       timeout=10).json()["choices"][0]
    assert plain["message"]["content"] == ANSWER and plain["message"]["tool_calls"] == []
    assert plain["finish_reason"] == "stop"


def test_rest_answers_forced_calls() -> None:
    from gateway.rest import create_app

    pipeline = ScriptedPipeline()
    answers = {"named": '{"city": "Oslo"}', "required": '[{"name": "get_time", "parameters": {}}, '
                                                          '{"name": "get_weather", "parameters": {"city": "Rome"}}]'}
    pipeline.script = lambda request: [TextDelta(answers["required" if "array" in request.structured[1] else "named"]),
                                       Finished(finish_reason="stop", prompt_tokens=9, completion_tokens=5)]
    named = {"type": "function", "function": {"name": "get_weather"}}
    with RestServer(create_app(pipeline, served_model_names=("tiny-omni",))) as server:  # no --enable-auto-tool-choice
        for choice, want in ((named, [("get_weather", {"city": "Oslo"})]),
                             ("required", [("get_time", {}), ("get_weather", {"city": "Rome"})])):
            body = {"model": "tiny-omni", "messages": USER, "tools": [WEATHER, TIME], "tool_choice": choice}
            r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=10)
            message = r.json()["choices"][0]["message"]
            assert message["content"] is None and r.json()["choices"][0]["finish_reason"] == "stop"
            assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == want
            assert pipeline.requests[-1].structured is not None  # the thinker was held to the calls' JSON
            with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json={**body, "stream": True},
                              timeout=10) as s:
                deltas = [c["choices"][0]["delta"] for line in s.iter_lines() if line.startswith("data: {")
                          for c in [json.loads(line[6:])] if c["choices"]]
            assert not "".join(d.get("content") or "" for d in deltas)  # the JSON never shows as text
            calls = [t for d in deltas for t in d.get("tool_calls") or []]
            assert [(t["index"], t["function"]["name"], json.loads(t["function"]["arguments"])) for t in calls] == [
                (k, name, args) for k, (name, args) in enumerate(want)]


def test_forced_calls_cut_by_max_tokens_are_still_calls() -> None:
    """As OpenAI and vLLM answer a forced call that max_tokens cut: the call, with its arguments so far, and
    finish_reason "length" (streamed the same); "required" keeps its whole calls and the cut one once its name
    is whole; an answer cut before any name stays text."""
    pipeline = ScriptedPipeline()
    cut = {"named": '{"city": "Os', "required": '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", '
                                                '"parameters": {"ci', "early": '[{"na'}
    say = ["named"]
    pipeline.script = lambda request: [TextDelta(cut[say[0]]),
                                       Finished(finish_reason="length", prompt_tokens=9, completion_tokens=5)]
    named = {"type": "function", "function": {"name": "get_weather"}}
    with RestServer(create_app(pipeline, served_model_names=("tiny-omni",))) as server:
        for key, choice, want in (("named", named, [("get_weather", '{"city": "Os')]),
                                  ("required", "required", [("get_time", "{}"), ("get_weather", '{"ci')]),
                                  ("early", "required", None)):
            say[0] = key
            body = {"model": "tiny-omni", "messages": USER, "tools": [WEATHER, TIME], "tool_choice": choice}
            choice_out = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=10).json()["choices"][0]
            assert choice_out["finish_reason"] == "length"
            message = choice_out["message"]
            if want is None:
                assert message["content"] == cut[key] and message["tool_calls"] == []
                continue
            assert message["content"] is None
            assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == want
            with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json={**body, "stream": True},
                              timeout=10) as s:
                chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
            calls = [t for c in chunks if c["choices"] for t in c["choices"][0]["delta"].get("tool_calls") or []]
            assert [(t["function"]["name"], t["function"]["arguments"]) for t in calls] == want
            assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


def test_rest_without_the_flag_explains(rest_server: RestServer) -> None:
    r = httpx.post(f"{rest_server.base_url}/v1/chat/completions",
                   json={"model": "tiny-omni", "messages": USER, "tools": [WEATHER]}, timeout=10)
    assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "tool_choice"
    r = httpx.post(f"{rest_server.base_url}/v1/chat/completions",
                   json={"model": "tiny-omni", "messages": USER, "tools": [WEATHER], "tool_choice": "none"}, timeout=10)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"] == []


def test_each_choice_streams_its_own_calls(tools_server) -> None:
    """With n = 2 every choice has its own parser: each streams both calls, indexed 0 and 1 within it."""
    server, _ = tools_server
    body = {"model": "tiny-omni", "messages": USER, "tools": [WEATHER, TIME], "stream": True, "n": 2}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=10) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        calls = [t for ch in mine for t in ch["delta"].get("tool_calls") or []]
        assert [(t["index"], t["function"]["name"]) for t in calls] == [(0, "get_weather"), (1, "get_time")]
        assert "".join(ch["delta"].get("content") or "" for ch in mine) == "Let me check.\n\n"
        assert mine[-1]["finish_reason"] == "tool_calls"
