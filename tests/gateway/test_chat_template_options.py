"""vLLM's add_generation_prompt / continue_final_message / chat_template_kwargs and the chat's `echo`:
the checks (gateway/chat_template_options.py), the prompt the builder renders with them (equal to
`apply_chat_template`'s), the thinker's split of a continued assistant message (`assistant_lead`), and
the REST, /tokenize and gRPC fronts over the scripted pipeline."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import httpx
import pytest
from gateway_harness import GrpcServer, RestServer, ScriptedPipeline
from test_grpc_api import INVALID_ARGUMENT, generate, hello

from gateway.chat_template_options import MAX_KWARGS_BYTES, parse_default_kwargs, parse_kwargs_json, template_options
from gateway.events import ChatMessage, ChatRequest, Finished, PipelineError, TemplateOptions, TextDelta, TextPart
from gateway.prompt import PromptBuilder, render_conversation
from omnimesh.models.qwen3_omni.tiny import build_tiny_qwen3_omni
from omnimesh.v1 import omni_pb2

CONVERSATION = (ChatMessage("system", (TextPart("Be brief."),)), ChatMessage("user", (TextPart("Hello there"),)),
                ChatMessage("assistant", (TextPart("Sure, "), TextPart("here is  "))))


def chat(template: TemplateOptions, messages: tuple[ChatMessage, ...] = CONVERSATION) -> ChatRequest:
    return ChatRequest(request_id="r", model="m", messages=messages, modalities=("text",), template=template)


# --------------------------------------------------------------------------------------------- the checks
@pytest.mark.parametrize(("args", "param", "needle"), [
    ((True, True, None, ["user", "assistant"]), "continue_final_message", "add_generation_prompt: false"),
    ((None, True, None, ["user", "assistant"]), "continue_final_message", "add_generation_prompt: false"),
    ((False, None, None, ["user"]), "add_generation_prompt", "audio output needs"),
    ((False, True, None, ["user"]), "continue_final_message", "got a 'user' message"),
    ((None, None, {"tools": []}, ["user"]), "chat_template_kwargs.tools", "the request's tools"),
    ((None, None, {"add_generation_prompt": False}, ["user"]), "chat_template_kwargs.add_generation_prompt",
     "the request's own add_generation_prompt"),
    ((None, None, {"chat_template": "x"}, ["user"]), "chat_template_kwargs.chat_template", "--chat-template"),
    ((None, None, {"my-var": 1}, ["user"]), "chat_template_kwargs", "not a template variable name"),
    ((None, None, {"big": "x" * MAX_KWARGS_BYTES}, ["user"]), "chat_template_kwargs", "at most"),
    ((None, None, [1], ["user"]), "chat_template_kwargs", "must be a JSON object"),
])
def test_combinations_that_cannot_be_rendered_or_spoken_are_400s(args: tuple, param: str, needle: str) -> None:
    generation, cont, kwargs, roles = args
    with pytest.raises(PipelineError, match=needle) as e:
        template_options(generation, cont, kwargs, roles, audio_out=True)
    assert (e.value.http_status, e.value.param) == (400, param)


def test_what_text_output_allows() -> None:
    assert template_options(None, None, None, ["user"], audio_out=True) == TemplateOptions()
    # text out: a prompt may end after the last message, or continue any message (as vLLM)
    assert template_options(False, None, None, ["user"], audio_out=False) == TemplateOptions(False, False, {})
    assert template_options(False, True, {"add_vision_id": True}, ["user"], audio_out=False) == \
        TemplateOptions(False, True, {"add_vision_id": True})
    assert template_options(False, True, None, ["user", "assistant"], audio_out=True).continue_final_message
    assert parse_kwargs_json("", "chat_template_kwargs") == {}
    assert parse_kwargs_json('{"enable_thinking": false}', "chat_template_kwargs") == {"enable_thinking": False}
    for bad, needle in (("{", "not JSON"), ("[]", "must be a JSON object"),
                        ('{"x": ' + "[" * 50_000 + "]" * 50_000 + "}", "not JSON: its arrays / objects nest too")):
        with pytest.raises(PipelineError, match=needle):
            parse_kwargs_json(bad, "chat_template_kwargs")


# ----------------------------------------------------------------------------------- the prompt they give
@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen3_omni(Path(tmp_path_factory.mktemp("tiny")) / "qwen3-omni")


@pytest.fixture(scope="module")
def builder(tiny_model_dir: Path) -> PromptBuilder:
    return PromptBuilder(tiny_model_dir, max_model_len=512)


def test_the_prompt_is_what_apply_chat_template_renders(builder: PromptBuilder) -> None:
    conv = render_conversation(CONVERSATION).messages
    tok = builder.processor.tokenizer
    for options in (TemplateOptions(), TemplateOptions(add_generation_prompt=False),
                    TemplateOptions(add_generation_prompt=False, continue_final_message=True)):
        text, _ = builder.render(chat(options))
        assert text == tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=options.add_generation_prompt,
                                               continue_final_message=options.continue_final_message)
    text, _ = builder.render(chat(TemplateOptions(add_generation_prompt=False, continue_final_message=True)))
    assert text.endswith("<|im_start|>assistant\nSure, here is  ")  # open: no <|im_end|>, spacing kept
    assert builder.render(chat(TemplateOptions()))[0].endswith("here is  <|im_end|>\n<|im_start|>assistant\n")


def test_template_variables_reach_the_template(builder: PromptBuilder) -> None:
    from PIL import Image

    from gateway.events import ImagePart

    image = ChatMessage("user", (ImagePart(Image.new("RGB", (32, 32))), TextPart("what is it?")))
    plain, _ = builder.render(chat(TemplateOptions(), (image,)))
    named, _ = builder.render(chat(TemplateOptions(kwargs={"add_vision_id": True}), (image,)))
    assert "Picture 1: <|vision_start|>" in named and "Picture 1" not in plain


def test_server_defaults_sit_under_the_requests_variables(builder: PromptBuilder) -> None:
    """--default-chat-template-kwargs: every request's template gets them, a request's own win; the reasoning
    parser reads them as the template does (a server whose default is enable_thinking false does not think)."""
    from PIL import Image

    from gateway.events import ImagePart
    from gateway.reasoning import ReasoningParser

    image = ChatMessage("user", (ImagePart(Image.new("RGB", (32, 32))), TextPart("what is it?")))
    named = PromptBuilder(builder.processor, max_model_len=512,
                          default_kwargs=parse_default_kwargs('{"add_vision_id": true}'))
    assert "Picture 1: <|vision_start|>" in named.render(chat(TemplateOptions(), (image,)))[0]
    assert "Picture 1" not in named.render(chat(TemplateOptions(kwargs={"add_vision_id": False}), (image,)))[0]
    assert "Picture 1" not in builder.render(chat(TemplateOptions(), (image,)))[0]
    quiet = ReasoningParser("qwen3", parse_default_kwargs('{"enable_thinking": false}'))
    assert not quiet.thinking({}) and quiet.thinking({"enable_thinking": True})
    assert ReasoningParser("qwen3").thinking({})


@pytest.mark.parametrize(("text", "match"), [
    ("[1]", "--default-chat-template-kwargs: must be a JSON object"),
    ('{"tools": []}', "--default-chat-template-kwargs.tools: not a template variable"),
    ("{", "--default-chat-template-kwargs: not JSON"),
])
def test_bad_server_defaults_stop_start_up(text: str, match: str, builder: PromptBuilder, tmp_path: Path) -> None:
    from omnimesh.config.serve_args import ServeArgs
    from omnimesh.launcher import MeshLauncher

    with pytest.raises(ValueError, match=match):
        ServeArgs(default_chat_template_kwargs=text)
    assert parse_default_kwargs(None) == parse_default_kwargs("") == {}
    argv = MeshLauncher(ServeArgs(default_chat_template_kwargs='{"a": 1}'), tmp_path)._gateway_argv({})
    assert argv[argv.index("--default-chat-template-kwargs") + 1] == '{"a": 1}'
    strict = "{% if strict %}{{ raise_exception('strict mode has no system message') }}{% endif %}x"
    with pytest.raises(ValueError, match="--chat-template with --default-chat-template-kwargs does not render"):
        PromptBuilder(builder.processor, max_model_len=512, chat_template=strict, default_kwargs={"strict": 1})
    own = copy.copy(builder.processor)  # a model whose own template breaks with these defaults
    own.tokenizer = copy.copy(own.tokenizer)
    own.tokenizer.chat_template = strict
    assert PromptBuilder(own, max_model_len=512).default_kwargs == {}  # without defaults it is not probed
    with pytest.raises(ValueError, match="the model's chat template with --default-chat-template-kwargs does not "
                                         "render a system \\+ user message: .*strict mode"):
        PromptBuilder(own, max_model_len=512, default_kwargs={"strict": True})


def test_a_message_the_template_cannot_continue_is_a_400(builder: PromptBuilder) -> None:
    with pytest.raises(PipelineError, match="chat template rejected them") as e:  # no text to continue
        builder.render(chat(TemplateOptions(False, True), (*CONVERSATION[:2], ChatMessage("assistant", ()))))
    assert e.value.http_status == 400


def test_the_thinker_splits_off_a_continued_assistant_message(tiny_model_dir: Path, builder: PromptBuilder) -> None:
    """`assistant_lead`: the rows after the last `<|im_start|>assistant\\n`, only while that turn is open."""
    from transformers import AutoConfig

    from omnimesh.models.qwen3_omni.thinker import Qwen3OmniThinker

    thinker = Qwen3OmniThinker.__new__(Qwen3OmniThinker)
    thinker.turns = AutoConfig.from_pretrained(tiny_model_dir)  # Qwen3-Omni's config names the turn tokens
    tok = builder.processor.tokenizer
    cont = builder.encode(chat(TemplateOptions(False, True)))
    lead = thinker.assistant_lead(cont)
    assert tok.decode(cont[-lead:]) == "Sure, here is  " and tok.decode(cont[-lead - 3:-lead]) == "<|im_start|>assistant\n"
    assert thinker.assistant_lead(builder.encode(chat(TemplateOptions()))) == 0  # ends with the turn's start
    assert thinker.assistant_lead(builder.encode(chat(TemplateOptions(add_generation_prompt=False)))) == 0  # closed
    assert thinker.assistant_lead(builder.encode(chat(TemplateOptions(), CONVERSATION[:2]))) == 0
    assert thinker.assistant_lead(builder.encode(chat(TemplateOptions(False), CONVERSATION[:2]))) == 0  # none at all


# ------------------------------------------------------------------------------------------- the fronts
PREFILL = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]


def post(server: RestServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=10)


def test_rest_chat_passes_the_options_and_echoes(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    body = {"messages": PREFILL, "add_generation_prompt": False, "continue_final_message": True,
            "chat_template_kwargs": {"enable_thinking": False}, "echo": True, "n": 2}
    r = post(rest_server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert [c["message"]["content"] for c in r.json()["choices"]] == ["Once uponHello world"] * 2
    assert pipeline.requests[-1].template == TemplateOptions(False, True, {"enable_thinking": False})
    assert "Once upon" not in post(rest_server, "/v1/chat/completions", {**body, "echo": False}).text
    # echo without a final assistant message: nothing to put first (vLLM's rule: the same role only)
    alone = post(rest_server, "/v1/chat/completions", {"messages": PREFILL[:1], "echo": True}).json()
    assert alone["choices"][0]["message"]["content"] == "Hello world"


def test_rest_stream_echoes_first_and_audio_transcript_has_the_whole_message(
        rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    body = {"messages": [*PREFILL[:1], {"role": "assistant", "content": "Once upon  "}], "stream": True,
            "echo": True, "add_generation_prompt": False, "continue_final_message": True}
    with httpx.stream("POST", f"{rest_server.base_url}/v1/chat/completions", json=body, timeout=10) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    contents = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
    assert contents[:4] == ["", "Once upon  ", "Hello", " world"]  # the message as sent
    spoken = post(rest_server, "/v1/chat/completions", {**body, "stream": False, "echo": False,
                                                        "modalities": ["text", "audio"]}).json()
    message = spoken["choices"][0]["message"]
    # the talker speaks the whole assistant message (its start as sent, then the continuation)
    assert message["content"] == "Hello world" and message["audio"]["transcript"] == "Once upon  Hello world"


@pytest.mark.parametrize(("extra", "param"), [
    ({"continue_final_message": True}, "continue_final_message"),
    ({"add_generation_prompt": False, "modalities": ["text", "audio"]}, "add_generation_prompt"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
    ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
    ({"add_generation_prompt": 0}, "add_generation_prompt"),
])
def test_rest_refusals_name_the_field(rest_server: RestServer, pipeline: ScriptedPipeline, extra: dict,
                                      param: str) -> None:
    r = post(rest_server, "/v1/chat/completions", {"messages": PREFILL, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert not pipeline.requests


def test_grpc_takes_the_same_options(grpc_server: GrpcServer, pipeline: ScriptedPipeline) -> None:
    pipeline.script = lambda request: [TextDelta(" a time"), Finished("stop", 5, 2)]
    turn = omni_pb2.ChatMessage(role="assistant", content=[omni_pb2.ContentPart(text="Once upon")])
    req = hello(modalities=["text", "audio"], add_generation_prompt=False, continue_final_message=True,
                chat_template_kwargs='{"enable_thinking": false}')
    req.messages.append(turn)
    out = generate(grpc_server, req)
    assert out[-1].WhichOneof("kind") == "done"
    assert pipeline.requests[-1].template == TemplateOptions(False, True, {"enable_thinking": False})
    assert generate(grpc_server, hello()) and pipeline.requests[-1].template == TemplateOptions()
    for bad, param in (({"continue_final_message": True}, "continue_final_message"),
                       ({"chat_template_kwargs": "{"}, "chat_template_kwargs"),
                       ({"add_generation_prompt": False}, "add_generation_prompt")):  # audio out by default
        err = generate(grpc_server, hello(**bad))[-1].error
        assert err.code == INVALID_ARGUMENT and param in err.message, (bad, err)
