"""`--reasoning-parser` (gateway/reasoning.py): a thinking model's reasoning apart from its answer.

- the split, as vLLM's qwen3 parser: `<think>` dropped, reasoning up to `</think>`, no end = all reasoning (cut
  off), `enable_thinking: false` = all answer; streamed delta by delta (at every cut, one character at a time
  too) it gives exactly the whole text's split and never sends part of a marker;
- through a real REST server (scripted pipeline): `message.reasoning` / `reasoning_content` and `content`,
  streamed `delta.reasoning` then `delta.content`, `include_reasoning: false`, tool calls parsed from the answer
  only, speech refused while the model reasons, the structured output's start marker handed to the thinker,
  the `openai` client reading it; no parser: the text is untouched; a bad parser name stops start-up.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from gateway_harness import GrpcServer, RestServer, ScriptedPipeline

from gateway.events import ChatRequest, Finished, TextDelta
from gateway.pipeline import _structured
from gateway.reasoning import END, AnswerSplit, ReasoningParser, ThoughtTokens, check_parser
from gateway.rest import create_app
from omnimesh.config.serve_args import ServeArgs
from omnimesh.v1 import omni_pb2, omni_pb2_grpc

QWEN3 = ReasoningParser("qwen3")
USER = [{"role": "user", "content": "Is 9.11 more than 9.8?"}]


def _streamed(pieces: list[str], thinking: bool = True) -> tuple[str, str]:
    s = AnswerSplit(QWEN3, thinking)
    out = [s.push(p) for p in pieces] + [s.finish()]
    return "".join(r for r, _ in out), "".join(a for _, a in out)


def _whole(text: str, thinking: bool = True) -> tuple[str | None, str]:
    return AnswerSplit(QWEN3, thinking).whole(text)


@pytest.mark.parametrize(("text", "want"), [
    ("<think>\nCompare the tenths.\n</think>\n\nNo, 9.8 is more.", ("\nCompare the tenths.\n", "\n\nNo, 9.8 is more.")),
    ("Compare the tenths.</think>No.", ("Compare the tenths.", "No.")),  # the template opened <think>
    ("  <think>a</think>b", ("a", "b")),
    ("Still thinking when max_tokens hit", ("Still thinking when max_tokens hit", "")),
    ("</think>only the answer", (None, "only the answer")),
    ("a</think>", ("a", "")),
    ("x <think> y</think>z", ("x <think> y", "z")),  # only a leading <think> opens the reasoning
    ("a</think>b</think>c", ("a", "b</think>c")),  # the first end ends it
    ("", (None, "")),
])
def test_split_as_vllms_qwen3_parser(text: str, want: tuple[str | None, str]) -> None:
    assert _whole(text) == want


def test_a_request_that_does_not_think_is_all_answer() -> None:
    assert not QWEN3.thinking({"enable_thinking": False})
    assert QWEN3.thinking({}) and QWEN3.thinking({"enable_thinking": True})
    assert ReasoningParser("deepseek_r1").thinking({"enable_thinking": False})  # R1 has no switch
    assert _whole("<think>a</think>b", thinking=False) == (None, "<think>a</think>b")
    assert _streamed(["<think>a", "</think>b"], thinking=False) == ("", "<think>a</think>b")
    assert AnswerSplit(None, True).whole("<think>a</think>b") == (None, "<think>a</think>b")  # no parser
    assert AnswerSplit(QWEN3, True, include=False).whole("<think>a</think>b") == (None, "b")


def test_streamed_split_equals_the_whole_texts_at_every_cut() -> None:
    texts = ["<think>\nCompare.\n</think>\n\nNo.", "Compare.</think>No.", "a</thi", "<thin", "  <think>x</think",
             "plain <t>ext </th> </think >", "a</think>b</think>c", "<<think>>x</</think>>y", "\n\n"]
    rng = random.Random(7)
    alphabet = ["<think>", "</think>", "<", "/", "think", ">", "a", " ", "\n", "</th", "ink>"]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12))) for _ in range(300)]
    for text in texts:
        r, a = _whole(text)
        whole = (r or "", a)
        assert _streamed(list(text)) == whole, text  # one character at a time
        for _ in range(5):
            cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 4))))
            pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
            assert _streamed(pieces) == whole, (text, pieces)


def test_no_piece_of_a_marker_goes_out_early() -> None:
    s = AnswerSplit(QWEN3, True)
    assert s.push("<thi") == ("", "")
    assert s.push("nk>I see") == ("I see", "")
    assert s.push(" it</th") == (" it", "")  # "</th" held: it may be the end marker
    assert s.push("ink>Yes") == ("", "Yes")
    assert s.push(" </think>") == ("", " </think>")  # after the end: all answer


def test_parser_names_are_vllms() -> None:
    assert check_parser("qwen3") == "qwen3" and check_parser("deepseek_r1") == "deepseek_r1" and check_parser(None) is None
    with pytest.raises(ValueError, match="--reasoning-parser must be one of qwen3, deepseek_r1"):
        ServeArgs(reasoning_parser="granite")


# ------------------------------------------------------------------------------------- REST
ANSWER = ["<think>\nNine point one one", " has one tenth; nine point eight has eight.\n</th", "ink>\n\n",
          "No, 9.8 is ", "more."]


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[RestServer, ScriptedPipeline]]:
    pipeline = ScriptedPipeline()
    with RestServer(create_app(pipeline, served_model_names=("tiny-omni",), auto_tool_choice=True,
                               reasoning=QWEN3)) as s:
        yield s, pipeline


@pytest.fixture()
def scripted(server) -> Iterator[tuple[RestServer, ScriptedPipeline]]:
    s, pipeline = server
    pipeline.reset()
    pipeline.script = lambda request: [*(TextDelta(t) for t in ANSWER),
                                       Finished(finish_reason="stop", prompt_tokens=9, completion_tokens=20)]
    yield s, pipeline


def _post(server: RestServer, **body) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/chat/completions", json={"model": "tiny-omni", "messages": USER, **body},
                      timeout=10)


def _chunks(server: RestServer, **body) -> list[dict]:
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", timeout=10,
                      json={"model": "tiny-omni", "messages": USER, "stream": True, **body}) as r:
        assert r.status_code == 200
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


THOUGHT = "\nNine point one one has one tenth; nine point eight has eight.\n"


def test_rest_answer_carries_the_reasoning_apart(scripted) -> None:
    server, pipeline = scripted
    r = _post(server)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["reasoning"] == message["reasoning_content"] == THOUGHT
    assert message["content"] == "\n\nNo, 9.8 is more."


def test_rest_stream_sends_reasoning_then_answer(scripted) -> None:
    server, _ = scripted
    deltas = [c["choices"][0]["delta"] for c in _chunks(server)]
    assert deltas[0] == {"role": "assistant", "content": ""}
    thought = "".join(d.get("reasoning", "") for d in deltas)
    assert thought == "".join(d.get("reasoning_content", "") for d in deltas) == THOUGHT
    assert "".join(d.get("content", "") for d in deltas) == "\n\nNo, 9.8 is more."
    last_thought = max(i for i, d in enumerate(deltas) if "reasoning" in d)
    assert all("reasoning" not in d for d in deltas[last_thought + 1:])
    assert not any("</" in d.get("content", "") + d.get("reasoning", "") for d in deltas)  # no marker leaks


def test_include_reasoning_false_drops_it(scripted) -> None:
    server, _ = scripted
    message = _post(server, include_reasoning=False).json()["choices"][0]["message"]
    assert message["reasoning"] is None and message["content"] == "\n\nNo, 9.8 is more."
    deltas = [c["choices"][0]["delta"] for c in _chunks(server, include_reasoning=False)]
    assert not any("reasoning" in d for d in deltas)
    assert "".join(d.get("content", "") for d in deltas) == "\n\nNo, 9.8 is more."


def test_enable_thinking_false_leaves_the_text_whole(scripted) -> None:
    server, _ = scripted
    message = _post(server, chat_template_kwargs={"enable_thinking": False}).json()["choices"][0]["message"]
    assert message["reasoning"] is None and message["content"] == "".join(ANSWER)


def test_a_continued_message_past_its_reasoning_is_all_answer(scripted) -> None:
    """continue_final_message: an assistant message that already closed its thought continues the answer; one
    still inside it continues the thought (REST and gRPC alike)."""
    server, pipeline = scripted
    for lead, reasons in (("<think>\nNine point eight.</think>\n\nNo", False), ("<think>\nNine point", True)):
        messages = [*USER, {"role": "assistant", "content": lead}]
        body = {"messages": messages, "continue_final_message": True, "add_generation_prompt": False}
        message = _post(server, **body).json()["choices"][0]["message"]
        assert (pipeline.requests[-1].reasoning_end is not None) is reasons
        assert (message["reasoning"] is not None) is reasons and message["content"] == ("\n\nNo, 9.8 is more." if reasons
                                                                                      else "".join(ANSWER))
    with GrpcServer(pipeline, reasoning=QWEN3) as g, grpc.insecure_channel(f"127.0.0.1:{g.port}") as ch:
        request = omni_pb2.GenerateRequest(model="tiny-omni", modalities=["text"], continue_final_message=True,
                                           add_generation_prompt=False, messages=[
            omni_pb2.ChatMessage(role="user", content=[omni_pb2.ContentPart(text="Is 9.11 more than 9.8?")]),
            omni_pb2.ChatMessage(role="assistant", content=[omni_pb2.ContentPart(text="a</think>b")])])
        out = list(omni_pb2_grpc.OmniStub(ch).Generate(request, timeout=10))
    assert "".join(r.text_delta for r in out) == "".join(ANSWER) and pipeline.requests[-1].reasoning_end is None


def test_cut_off_reasoning_has_no_answer(scripted) -> None:
    server, pipeline = scripted
    pipeline.script = lambda request: [TextDelta("<think>\nLet me see"), Finished("length", 9, 4)]
    choice = _post(server).json()["choices"][0]
    assert choice["message"]["reasoning"] == "\nLet me see" and choice["message"]["content"] is None
    assert choice["finish_reason"] == "length"
    body = {"model": "tiny-omni", "input": "Hm?", "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/responses", json=body, timeout=10) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    last = events[-1]["response"]
    assert last["status"] == "incomplete" and [o["type"] for o in last["output"]] == ["reasoning", "message"]
    assert last["output"][1]["content"][0]["text"] == ""
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [(e["item"]["type"], e["output_index"]) for e in added] == [("reasoning", 0), ("message", 1)]


def test_tool_calls_come_from_the_answer_only(scripted) -> None:
    server, pipeline = scripted
    call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    pipeline.script = lambda request: [TextDelta("I could call <tool_call> here.</think>"), TextDelta(call),
                                       Finished("stop", 9, 20)]
    tools = [{"type": "function", "function": {"name": "get_time"}}]
    choice = _post(server, tools=tools).json()["choices"][0]
    assert choice["message"]["reasoning"] == "I could call <tool_call> here."
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_time"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    deltas = [c["choices"][0]["delta"] for c in _chunks(server, tools=tools)]
    assert [t["function"]["name"] for d in deltas for t in d.get("tool_calls") or []] == ["get_time"]


def test_speech_is_refused_while_the_model_reasons(scripted) -> None:
    server, pipeline = scripted
    r = _post(server, modalities=["text", "audio"])
    assert r.status_code == 400 and r.json()["error"]["param"] == "modalities"
    assert "--reasoning-parser qwen3" in r.json()["error"]["message"] and "enable_thinking" in r.json()["error"]["message"]
    r = _post(server, modalities=["text", "audio"], chat_template_kwargs={"enable_thinking": False})
    assert r.status_code == 200, r.text


def test_structured_output_waits_for_the_end_of_the_reasoning(scripted) -> None:
    server, pipeline = scripted
    assert _post(server, response_format={"type": "json_object"}).status_code == 200
    request: ChatRequest = pipeline.requests[-1]
    assert request.structured is not None and request.reasoning_end == END
    assert _structured(request) == {"structured_output": '["json", "{\\"type\\": \\"object\\"}"]',
                                    "structured_after": "</think>"}  # the thinker's options
    _post(server, response_format={"type": "json_object"}, chat_template_kwargs={"enable_thinking": False})
    assert pipeline.requests[-1].reasoning_end is None  # it does not reason: the grammar shapes it all
    assert "structured_after" not in _structured(pipeline.requests[-1])


def test_openai_client_reads_the_reasoning(scripted) -> None:
    server, _ = scripted
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
    message = client.chat.completions.create(model="tiny-omni", messages=USER).choices[0].message  # type: ignore[arg-type]
    assert message.model_extra is not None and message.model_extra["reasoning"] == THOUGHT
    stream = client.chat.completions.create(model="tiny-omni", messages=USER, stream=True)  # type: ignore[arg-type]
    parts = [(c.choices[0].delta.model_extra or {}).get("reasoning") or "" for c in stream if c.choices]
    assert "".join(parts) == THOUGHT


def test_grpc_sends_reasoning_deltas_then_the_answer() -> None:
    pipeline = ScriptedPipeline()
    pipeline.script = lambda request: [*(TextDelta(t) for t in ANSWER), Finished("stop", 9, 20)]

    def run(stub, **fields) -> list:
        request = omni_pb2.GenerateRequest(model="tiny-omni", **{"modalities": ["text"], **fields}, messages=[
            omni_pb2.ChatMessage(role="user", content=[omni_pb2.ContentPart(text="Is 9.11 more than 9.8?")])])
        return list(stub.Generate(request, timeout=10))

    with GrpcServer(pipeline, reasoning=QWEN3) as server, grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = omni_pb2_grpc.OmniStub(ch)
        out = run(stub)
        kinds = [r.WhichOneof("kind") for r in out]
        assert "".join(r.reasoning_delta for r in out) == THOUGHT and kinds[-1] == "done"
        assert "".join(r.text_delta for r in out) == "\n\nNo, 9.8 is more."
        assert max(i for i, k in enumerate(kinds) if k == "reasoning_delta") < kinds.index("text_delta")
        assert pipeline.requests[-1].reasoning_end == END
        quiet = run(stub, include_reasoning=False)
        assert "reasoning_delta" not in [r.WhichOneof("kind") for r in quiet]
        assert "".join(r.text_delta for r in quiet) == "\n\nNo, 9.8 is more."
        off = run(stub, chat_template_kwargs='{"enable_thinking": false}')
        assert "".join(r.text_delta for r in off) == "".join(ANSWER) and pipeline.requests[-1].reasoning_end is None
        refused = run(stub, modalities=["text", "audio"])
    assert refused[0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "--reasoning-parser qwen3" in refused[0].error.message


def test_responses_api_puts_a_reasoning_item_before_the_message(scripted) -> None:
    server, _ = scripted
    body = {"model": "tiny-omni", "input": "Is 9.11 more than 9.8?"}
    out = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=10).json()["output"]
    assert [o["type"] for o in out] == ["reasoning", "message"]
    assert out[0]["content"] == [{"type": "reasoning_text", "text": THOUGHT}]
    assert out[1]["content"][0]["text"] == "\n\nNo, 9.8 is more."
    with httpx.stream("POST", f"{server.base_url}/v1/responses", json={**body, "stream": True}, timeout=10) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    kinds = [e["type"] for e in events]
    first_text = kinds.index("response.output_text.delta")
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert events[2]["item"]["type"] == "reasoning" and events[2]["output_index"] == 0
    assert kinds[first_text - 5:first_text] == ["response.reasoning_text.done", "response.content_part.done",
                                                "response.output_item.done", "response.output_item.added",
                                                "response.content_part.added"]
    assert events[first_text - 2]["item"]["type"] == "message" and events[first_text]["output_index"] == 1
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == THOUGHT
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "\n\nNo, 9.8 is more."
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    done = events[-1]["response"]["output"]
    assert events[-1]["type"] == "response.completed" and [o["type"] for o in done] == ["reasoning", "message"]
    assert done[0]["content"] == out[0]["content"] and done[1]["content"] == out[1]["content"]


def test_without_a_parser_the_text_is_untouched() -> None:
    pipeline = ScriptedPipeline()
    pipeline.script = lambda request: [*(TextDelta(t) for t in ANSWER), Finished("stop", 9, 20)]
    with RestServer(create_app(pipeline, served_model_names=("tiny-omni",))) as server:
        message = _post(server).json()["choices"][0]["message"]
    assert message["content"] == "".join(ANSWER) and "reasoning" not in message and "reasoning_content" not in message


def test_the_flag_reaches_the_gateway() -> None:
    from omnimesh.launcher import MeshLauncher

    argv = MeshLauncher(ServeArgs(reasoning_parser="qwen3"), Path("/m"))._gateway_argv({"thinker": ["127.0.0.1:1"]})
    assert argv[argv.index("--reasoning-parser") + 1] == "qwen3"


def test_responses_usage_counts_the_reasoning_tokens(scripted) -> None:
    """`output_tokens_details.reasoning_tokens`: the tokens before the answer began, the end marker included
    (from each delta's token count), whole and streamed; all of them when the thought was cut off; none for a
    request that does not think."""
    server, pipeline = scripted
    deltas = ["<think>", "\nNine", " point", "</think>", "\n\nNo", " more."]
    pipeline.script = lambda request: [*(TextDelta(t, usage=(9, k + 1)) for k, t in enumerate(deltas)),
                                       Finished("stop", 9, len(deltas))]

    def usage(**extra) -> tuple[dict, dict]:
        body = {"model": "tiny-omni", "input": "Hm?", **extra}
        whole = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=10).json()["usage"]
        with httpx.stream("POST", f"{server.base_url}/v1/responses", json={**body, "stream": True}, timeout=10) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        return whole, events[-1]["response"]["usage"]

    for got in usage():
        assert got["output_tokens"] == 6 and got["output_tokens_details"] == {"reasoning_tokens": 4}
    for split in (AnswerSplit(QWEN3, thinking=False), AnswerSplit(None, thinking=True)):  # no thought: none
        counted = ThoughtTokens(split)
        for k, t in enumerate(deltas):
            counted.push(t, (9, k + 1))
        assert counted.total(len(deltas)) == 0
    pipeline.script = lambda request: [TextDelta("<think>", usage=(9, 1)), TextDelta("\nLet me", usage=(9, 3)),
                                       Finished("length", 9, 3)]
    for got in usage():
        assert got["output_tokens_details"] == {"reasoning_tokens": 3}
