"""vLLM's /tokenize and /detokenize (gateway/tokenize_api.py) on the tiny model's real tokenizer and
processor: messages give exactly the ids a chat's prompt gets (audio placeholders expanded), a prompt
the tokenizer's own ids; detokenize inverts tokenize; wrong bodies, unknown models and ids outside the
vocabulary are 400 / 404 naming the field; with --api-key both need the key, /version does not."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from gateway_harness import RestServer, ScriptedPipeline
from test_rest import png_data_uri, wav_file

from gateway.events import AudioPart, ChatMessage, ChatRequest, TextPart
from gateway.media import decode_wav
from gateway.prompt import PromptBuilder
from gateway.rest import VERSION, create_app
from omnimesh.models.qwen3_omni.tiny import build_tiny_qwen3_omni

KEY = "sk-tok"


@pytest.fixture(scope="module")
def builder(tmp_path_factory: pytest.TempPathFactory) -> PromptBuilder:
    return PromptBuilder(build_tiny_qwen3_omni(Path(tmp_path_factory.mktemp("tiny")) / "qwen3-omni"), max_model_len=512)


@pytest.fixture(scope="module")
def server(shared_pipeline: ScriptedPipeline, builder: PromptBuilder) -> Iterator[RestServer]:
    with RestServer(create_app(shared_pipeline, served_model_names=("tiny-omni",), prompts=builder)) as s:
        yield s


def post(server: RestServer, path: str, body: object, **kw: object) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=30, **kw)  # type: ignore[arg-type]


def test_messages_are_tokenized_as_the_chat_prompt(server: RestServer, builder: PromptBuilder) -> None:
    wav = wav_file(0.5)
    body = {"model": "tiny-omni", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                     {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(),
                                                                             "format": "wav"}}]}]}
    r = post(server, "/tokenize", body)
    assert r.status_code == 200, r.text
    got = r.json()
    wave, rate = decode_wav(wav, max_seconds=5)
    chat = ChatRequest(request_id="x", model="m", messages=(
        ChatMessage("system", (TextPart("be brief"),)),
        ChatMessage("user", (TextPart("what is this?"), AudioPart(wave, rate)))))
    expected = builder.build(chat)
    assert got["tokens"] == expected.input_ids.tolist() and got["count"] == expected.prompt_tokens
    assert got["max_model_len"] == 512 and got["token_strs"] is None
    assert got["tokens"].count(builder.processor.tokenizer.convert_tokens_to_ids("<|audio_pad|>")) > 1  # expanded
    bare = post(server, "/tokenize", {**body, "add_generation_prompt": False}).json()
    assert bare["tokens"] == got["tokens"][:bare["count"]] and bare["count"] < got["count"]


def test_too_many_messages_are_counted_before_validation(server: RestServer) -> None:
    r = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}] * 4097})
    assert r.status_code == 413 and "at most 4096" in r.json()["error"]["message"]


def test_messages_take_the_chat_template_options(server: RestServer, builder: PromptBuilder) -> None:
    """continue_final_message and chat_template_kwargs as a chat takes them (vLLM's /tokenize fields)."""
    tok = builder.processor.tokenizer
    body = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}],
            "add_generation_prompt": False, "continue_final_message": True}
    r = post(server, "/tokenize", body)
    assert r.status_code == 200, r.text
    assert tok.decode(r.json()["tokens"]).endswith("<|im_start|>assistant\nOnce upon")
    image = {"type": "image_url", "image_url": {"url": png_data_uri()}}
    seen = post(server, "/tokenize", {"messages": [{"role": "user", "content": [image]}],
                                      "chat_template_kwargs": {"add_vision_id": True}}).json()
    assert "Picture 1: " in tok.decode(seen["tokens"])
    wrong = post(server, "/tokenize", {**body, "add_generation_prompt": True})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "continue_final_message"


def test_prompt_tokens_strs_and_detokenize_round_trip(server: RestServer, builder: PromptBuilder) -> None:
    text = "Hello, omni world!"
    r = post(server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert r["tokens"] == list(builder.processor.tokenizer(text)["input_ids"]) and r["count"] == len(r["tokens"])
    assert r["token_strs"] == builder.processor.tokenizer.convert_ids_to_tokens(r["tokens"])
    back = post(server, "/detokenize", {"model": "tiny-omni", "tokens": r["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}


@pytest.mark.parametrize(("path", "body", "status", "needle"), [
    ("/tokenize", {}, 400, "give exactly one of messages"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, 400, "exactly one"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "add_special_tokens": True}, 400,
     "applies to prompt only"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"messages": [{"role": "assistant", "content": "a"}]}, 400, "at least one user message"),
    ("/tokenize", {"prompt": "a", "model": "gpt-4"}, 404, "gpt-4"),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens[1]: 1000000000 is not a token id"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens[0]"),
    ("/detokenize", {}, 400, "tokens"),
])
def test_bad_bodies(server: RestServer, path: str, body: dict, status: int, needle: str) -> None:
    r = post(server, path, body)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]


def test_model_cards_carry_max_model_len(server: RestServer, rest_server: RestServer) -> None:
    (card,) = httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"]
    assert card["id"] == "tiny-omni" and card["max_model_len"] == 512
    assert httpx.get(f"{server.base_url}/v1/models/tiny-omni", timeout=10).json()["max_model_len"] == 512
    assert "max_model_len" not in httpx.get(f"{rest_server.base_url}/v1/models", timeout=10).json()["data"][0]


def test_not_json_and_version(server: RestServer) -> None:
    r = httpx.post(f"{server.base_url}/tokenize", content=b"{nope", timeout=10)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert httpx.get(f"{server.base_url}/version", timeout=10).json() == {"version": VERSION}


def test_key_needed_except_for_version(shared_pipeline: ScriptedPipeline, builder: PromptBuilder,
                                       rest_server: RestServer) -> None:
    app = create_app(shared_pipeline, served_model_names=("tiny-omni",), prompts=builder, api_keys=(KEY,))
    with RestServer(app) as locked:
        for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
            assert post(locked, path, body).status_code == 401
            assert post(locked, path, body, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert httpx.get(f"{locked.base_url}/version", timeout=10).status_code == 200
    assert post(rest_server, "/tokenize", {"prompt": "a"}).status_code == 404  # an app without a prompt builder


def test_a_requests_own_chat_template(server: RestServer, shared_pipeline: ScriptedPipeline,
                                      builder: PromptBuilder) -> None:
    """vLLM's `chat_template` field: refused (400 naming the flag) unless the server trusts request templates;
    then /tokenize gives the ids of transformers' rendering with it."""
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    body = {"messages": [{"role": "user", "content": "hi there"}], "chat_template": template}
    r = post(server, "/tokenize", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
    assert "--trust-request-chat-template" in r.json()["error"]["message"]
    trusting = PromptBuilder(builder.processor, max_model_len=512, trust_request_template=True)
    with RestServer(create_app(shared_pipeline, served_model_names=("tiny-omni",), prompts=trusting)) as s:
        r = post(s, "/tokenize", body)
        assert r.status_code == 200, r.text
        text = builder.processor.tokenizer.apply_chat_template([{"role": "user", "content": "hi there"}],
                                                               tokenize=False, chat_template=template)
        assert text == "[user] hi there\n" and r.json()["tokens"] == builder.processor.tokenizer(text)["input_ids"]
        assert post(s, "/tokenize", {**body, "chat_template": ""}).status_code == 400
