"""Stored responses (gateway/response_store.py, `--responses-store-memory`):

- the store: the least recently used dropped once the sizes pass the budget, a lookup counts as a use, one
  response larger than the budget is not kept, delete frees its bytes;
- through a REST server (scripted pipeline) and the `openai` client: an answer is kept (`store: true`) unless
  the request says `store: false`; `previous_response_id` continues its conversation (the earlier input and
  answer, not its instructions); a function call's output answers a call the stored answer made; a streamed
  answer is kept too; GET, DELETE and input_items (newest first by default, paged); unknown ids are 404s;
- background responses: answered "queued" at once, polled to their end (completed, failed with the error,
  cancelled while running: the run stops), the `openai` client's create / retrieve / cancel; background needs
  the store and `store`, and is not streamed here; only a background response is cancelled;
- its size on /metrics; the flag is checked and reaches the gateway. Without it: tests/gateway/test_responses.py (a 400 naming it)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from gateway_harness import RestServer, ScriptedPipeline, stage_down

from gateway.events import ChatRequest, Event, Finished, TextDelta, TextPart, ToolCall
from gateway.openai_schema import ContentPart, Message
from gateway.response_store import ResponseStore, StoredResponse
from gateway.rest import create_app
from omnimesh.config.serve_args import ServeArgs

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


def _stored(text: str) -> StoredResponse:
    return StoredResponse({"id": text}, [], [Message(role="user", content=[ContentPart(type="text", text=text)])],
                          conversation_bytes=len(text))


def test_the_least_recently_used_go_first() -> None:
    a, b, c = _stored("a" * 100), _stored("b" * 100), _stored("c" * 100)
    store = ResponseStore(a.size + b.size + 10)
    assert store.put("a", a) and store.put("b", b) and store.used == a.size + b.size
    assert store.get("a") is a  # now the most recent
    assert store.put("c", c) and store.get("b") is None and store.get("a") is a and len(store) == 2
    assert not store.put("big", _stored("x" * 10_000)) and store.get("big") is None
    assert store.delete("a") and not store.delete("a") and store.used == c.size
    assert c.call_ids() == set()
    with pytest.raises(ValueError, match="at least 1 byte"):
        ResponseStore(0)


def _script(request: ChatRequest) -> list[Event]:
    last = request.messages[-1]
    if last.role == "tool":
        return [TextDelta("It rains."), Finished("stop", 30, 3)]
    if any(isinstance(p, TextPart) and "weather" in p.text for p in last.content):
        return [TextDelta(CALL), Finished("stop", 20, 15)]
    return [TextDelta("Hello world"), Finished("stop", 7, 2)]


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[RestServer, ScriptedPipeline]]:
    pipeline = ScriptedPipeline()
    app = create_app(pipeline, served_model_names=("tiny-omni",), auto_tool_choice=True,
                     responses_store=ResponseStore(1 << 20))
    with RestServer(app) as server:
        yield server, pipeline


def _post(server: RestServer, **body) -> dict:
    r = httpx.post(f"{server.base_url}/v1/responses", json={"model": "tiny-omni", **body}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_conversation_continues_from_a_stored_response(served) -> None:
    server, pipeline = served
    pipeline.script = _script
    first = _post(server, input="Hi", instructions="Be brief.")
    assert first["store"] is True and first["previous_response_id"] is None
    assert httpx.get(f"{server.base_url}/v1/responses/{first['id']}", timeout=10).json() == first
    second = _post(server, input=[{"role": "user", "content": "And then?"}], previous_response_id=first["id"],
                   instructions="Be long.")
    assert second["previous_response_id"] == first["id"]
    assert [(m.role, m.content) for m in pipeline.requests[-1].messages] == [
        ("system", (TextPart("Be long."),)), ("user", (TextPart("Hi"),)), ("assistant", (TextPart("Hello world"),)),
        ("user", (TextPart("And then?"),))]  # the first instructions are not carried over (OpenAI's rule)
    third = _post(server, input="More?", previous_response_id=second["id"])  # the chain goes on
    assert [m.role for m in pipeline.requests[-1].messages] == ["user", "assistant", "user", "assistant", "user"]
    assert third["store"] is True
    unkept = _post(server, input="Hi", store=False)
    assert unkept["store"] is False
    assert httpx.get(f"{server.base_url}/v1/responses/{unkept['id']}", timeout=10).status_code == 404
    gone = httpx.post(f"{server.base_url}/v1/responses", timeout=10,
                      json={"model": "tiny-omni", "input": "x", "previous_response_id": unkept["id"]})
    assert gone.status_code == 400 and gone.json()["error"]["param"] == "previous_response_id"


def test_a_stored_call_is_answered_by_its_output(served) -> None:
    server, pipeline = served
    pipeline.script = _script
    asked = _post(server, input="What is the weather in Oslo?", tools=[WEATHER])
    [call] = asked["output"]
    assert call["type"] == "function_call"
    answer = _post(server, previous_response_id=asked["id"], tools=[WEATHER],
                   input=[{"type": "function_call_output", "call_id": call["call_id"], "output": "rain"}])
    assert answer["output"][0]["content"][0]["text"] == "It rains."
    user, assistant, tool = pipeline.requests[-1].messages
    assert assistant.tool_calls == (ToolCall(call["call_id"], "get_weather", call["arguments"]),)
    assert tool.role == "tool" and tool.tool_call_id == call["call_id"]


def test_streamed_answers_are_kept_and_the_client_reads_them(served) -> None:
    server, pipeline = served
    pipeline.script = _script
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x")
    events = list(client.responses.create(model="tiny-omni", input="Hi", stream=True))
    done = events[-1].response  # type: ignore[union-attr]
    assert done.store is True and client.responses.retrieve(done.id).output_text == "Hello world"
    follow = client.responses.create(model="tiny-omni", input="And then?", previous_response_id=done.id)
    assert follow.previous_response_id == done.id and [m.role for m in pipeline.requests[-1].messages] == [
        "user", "assistant", "user"]
    items = client.responses.input_items.list(follow.id)
    assert [i.role for i in items.data] == ["user"] and items.data[0].id.startswith("msg_")  # type: ignore[union-attr]
    client.responses.delete(follow.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(follow.id)
    assert httpx.delete(f"{server.base_url}/v1/responses/{follow.id}", timeout=10).status_code == 404


def test_input_items_are_paged(served) -> None:
    server, pipeline = served
    pipeline.script = _script
    items = [{"type": "message", "role": "user", "content": f"turn {k}", "id": f"msg_{k}"} for k in range(5)]
    kept = _post(server, input=items)
    url = f"{server.base_url}/v1/responses/{kept['id']}/input_items"
    page = httpx.get(url, params={"limit": 2}, timeout=10).json()
    assert [i["id"] for i in page["data"]] == ["msg_4", "msg_3"] and page["has_more"] is True
    rest = httpx.get(url, params={"limit": 10, "after": page["last_id"], "order": "desc"}, timeout=10).json()
    assert [i["id"] for i in rest["data"]] == ["msg_2", "msg_1", "msg_0"] and rest["has_more"] is False
    asc = httpx.get(url, params={"order": "asc", "limit": 1}, timeout=10).json()
    assert asc["first_id"] == "msg_0"
    assert httpx.get(url, params={"limit": 0}, timeout=10).status_code == 400
    missing = httpx.get(url, params={"after": "msg_nope"}, timeout=10)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "after"
    assert httpx.get(f"{server.base_url}/v1/responses/resp_none/input_items", timeout=10).status_code == 404


def test_the_store_is_on_metrics(served) -> None:
    server, pipeline = served
    pipeline.script = _script
    _post(server, input="Hi")
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    series = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("omnimesh:responses_store")}
    assert series["omnimesh:responses_stored"] >= 1 and series["omnimesh:responses_store_capacity_bytes"] == 1 << 20
    assert 0 < series["omnimesh:responses_store_bytes"] <= 1 << 20


def test_the_flag_is_checked_and_reaches_the_gateway(tmp_path: Path) -> None:
    from omnimesh.launcher import MeshLauncher

    with pytest.raises(ValueError, match="--responses-store-memory"):
        ServeArgs(responses_store_memory="lots")
    argv = MeshLauncher(ServeArgs(responses_store_memory="64MiB"), tmp_path)._gateway_argv({})
    assert argv[argv.index("--responses-store-memory") + 1] == "64MiB"


def _poll(server: RestServer, response_id: str, until: tuple[str, ...] = ("completed", "incomplete", "failed",
                                                                       "cancelled")) -> dict:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        body = httpx.get(f"{server.base_url}/v1/responses/{response_id}", timeout=10).json()
        if body["status"] in until:
            return body
        time.sleep(0.05)
    raise AssertionError(f"{response_id} still {body['status']}")


def test_background_responses_run_on_and_are_polled(served) -> None:
    server, pipeline = served
    pipeline.script = _script
    pipeline.event_delay_s = 0.2
    try:
        queued = _post(server, input="Hi", background=True)
        assert queued["status"] == "queued" and queued["background"] is True and queued["output"] == []
        done = _poll(server, queued["id"])
        assert done["status"] == "completed" and done["output"][0]["content"][0]["text"] == "Hello world"
        assert done["usage"]["output_tokens"] == 2
        # cancelled while it runs: the run stops in the stages, the response says so
        running = _post(server, input="Hi", background=True)
        _poll(server, running["id"], until=("in_progress",))
        cancelled = httpx.post(f"{server.base_url}/v1/responses/{running['id']}/cancel", timeout=10).json()
        assert cancelled["status"] == "cancelled" and running["id"] in pipeline.closed
        again = httpx.post(f"{server.base_url}/v1/responses/{running['id']}/cancel", timeout=10).json()
        assert again["status"] == "cancelled"  # it ended: answered as it is
    finally:
        pipeline.event_delay_s = 0.0
    # a failure is the stored response's error
    pipeline.script = lambda request: [stage_down()]
    failed = _poll(server, _post(server, input="Hi", background=True)["id"])
    assert failed["status"] == "failed" and "talker" in failed["error"]["message"]
    # the openai client: create, retrieve, cancel
    pipeline.script = _script
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x")
    started = client.responses.create(model="tiny-omni", input="Hi", background=True)
    assert _poll(server, started.id)["status"] == "completed"
    assert client.responses.retrieve(started.id).output_text == "Hello world"
    assert client.responses.cancel(started.id).status == "completed"


@pytest.mark.parametrize(("body", "param"), [
    ({"background": True, "stream": True}, "stream"),
    ({"background": True, "store": False}, "store"),
])
def test_background_mistakes(served, body: dict, param: str) -> None:
    server, pipeline = served
    r = httpx.post(f"{server.base_url}/v1/responses", json={"model": "tiny-omni", "input": "Hi", **body}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_only_background_responses_are_cancelled(served) -> None:
    server, pipeline = served
    pipeline.script = _script
    plain = _post(server, input="Hi")
    r = httpx.post(f"{server.base_url}/v1/responses/{plain['id']}/cancel", timeout=10)
    assert r.status_code == 400 and "background" in r.json()["error"]["message"]
    assert httpx.post(f"{server.base_url}/v1/responses/resp_none/cancel", timeout=10).status_code == 404


async def test_stopping_the_gateway_cancels_background_responses() -> None:
    """On shutdown (`app.state.responses.close()`, gateway/server.py) a background response still running ends
    "cancelled", its run stopped in the pipeline, instead of a task left pending."""
    pipeline = ScriptedPipeline()
    pipeline.script = _script
    pipeline.event_delay_s = 5.0
    app = create_app(pipeline, served_model_names=("tiny-omni",), responses_store=ResponseStore(1 << 20))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
        queued = (await client.post("/v1/responses", json={"model": "tiny-omni", "input": "Hi",
                                                           "background": True})).json()
        assert queued["status"] == "queued"
        await app.state.responses.close()
        stopped = (await client.get(f"/v1/responses/{queued['id']}")).json()
    assert stopped["status"] == "cancelled" and queued["id"] in pipeline.closed
