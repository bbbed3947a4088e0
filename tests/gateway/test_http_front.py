"""The HTTP front options (gateway/http_front.py) on an in-process app: CORS answers a browser's preflight
before the API-key check and puts its headers on a 401 too; origins not listed get none; without
--allowed-origins there is no CORS at all; X-Request-Id is echoed (or made) on every response, streamed
ones included; the flag combinations that cannot work are refused with the flag named. TLS runs in real
gateway processes: tests/e2e/test_http_front_e2e.py."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest
from gateway_harness import RestServer, ScriptedPipeline

from gateway.http_front import HttpFront, check_front_args, parse_list
from gateway.rest import create_app

ORIGIN = "https://app.example"
KEY = "sk-front"
CHAT = {"model": "tiny-omni", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def front_rest(shared_pipeline: ScriptedPipeline) -> Iterator[RestServer]:
    front = HttpFront(allowed_origins=(ORIGIN,), request_id_headers=True)
    with RestServer(create_app(shared_pipeline, served_model_names=("tiny-omni",), api_keys=(KEY,),
                               front=front)) as server:
        yield server


def _args(**over: object) -> SimpleNamespace:
    base = dict(allowed_origins=None, allowed_methods=None, allowed_headers=None, allow_credentials=False,
                ssl_keyfile=None, ssl_certfile=None, ssl_ca_certs=None, ssl_cert_reqs=0, uvicorn_log_level="info",
                enable_request_id_headers=False, disable_uvicorn_access_log=False, root_path=None, uds=None)
    return SimpleNamespace(**{**base, **over})


def test_parse_list_json_or_commas() -> None:
    assert parse_list(None, "--x") is None
    assert parse_list('["https://a.example", " b "]', "--x") == ("https://a.example", "b")
    assert parse_list("a, b,,", "--x") == ("a", "b")
    for bad, why in (("[1]", "must hold strings"), ('["a"', "not a JSON list"), (" , ", "is empty"), ("[]", "is empty")):
        with pytest.raises(ValueError, match=why):
            parse_list(bad, "--x")


@pytest.mark.parametrize(("over", "why"), [
    ({"allowed_methods": "GET"}, "--allowed-methods has no effect without --allowed-origins"),
    ({"allow_credentials": True}, "--allow-credentials has no effect without"),
    ({"allowed_origins": "*", "allow_credentials": True}, "list the origins instead"),
    ({"ssl_keyfile": "k.pem"}, "go together"),
    ({"ssl_cert_reqs": 2}, "need --ssl-keyfile and --ssl-certfile"),
    ({"ssl_keyfile": "k", "ssl_certfile": "c", "ssl_cert_reqs": 2}, "needs --ssl-ca-certs"),
    ({"ssl_keyfile": "k", "ssl_certfile": "c", "ssl_cert_reqs": 3}, "must be 0"),
    ({"uvicorn_log_level": "loud"}, "--uvicorn-log-level must be one of"),
])
def test_combinations_that_cannot_work(over: dict, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        check_front_args(_args(**over))


def test_defaults_install_nothing_and_keep_the_access_log() -> None:
    front = HttpFront.from_args(_args())
    assert front == HttpFront() and front.describe() is None and front.grpc_credentials() is None
    assert front.uvicorn_kwargs() == {"log_level": "info", "access_log": True, "log_config": None, "uds": None}
    assert HttpFront.from_args(_args(disable_uvicorn_access_log=True)).uvicorn_kwargs()["access_log"] is False


def test_preflight_is_answered_before_the_key_check(front_rest: RestServer) -> None:
    r = httpx.options(f"{front_rest.base_url}/v1/chat/completions", timeout=10, headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()


def test_cors_headers_on_answers_and_on_401(front_rest: RestServer, pipeline: ScriptedPipeline) -> None:
    url = f"{front_rest.base_url}/v1/chat/completions"
    refused = httpx.post(url, json=CHAT, headers={"Origin": ORIGIN}, timeout=10)
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ORIGIN
    ok = httpx.post(url, json=CHAT, headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"}, timeout=10)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.post(url, json=CHAT, headers={"Origin": "https://evil.example", "Authorization": f"Bearer {KEY}"},
                       timeout=10)
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers  # the browser blocks it
    preflight = httpx.options(url, headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
                              timeout=10)
    assert preflight.status_code == 400 and "access-control-allow-origin" not in preflight.headers


def test_no_cors_without_allowed_origins(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    url = f"{rest_server.base_url}/v1/chat/completions"
    r = httpx.post(url, json=CHAT, headers={"Origin": ORIGIN}, timeout=10)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    preflight = httpx.options(url, headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}, timeout=10)
    assert preflight.status_code == 405 and "access-control-allow-origin" not in preflight.headers
    assert "x-request-id" not in httpx.get(f"{rest_server.base_url}/v1/models", timeout=10).headers  # without the flag


def test_request_id_header_echoed_or_made(front_rest: RestServer, pipeline: ScriptedPipeline) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    base = front_rest.base_url
    assert httpx.get(f"{base}/health", headers={"X-Request-Id": "abc-1"}, timeout=10).headers["x-request-id"] == "abc-1"
    made = {httpx.get(f"{base}/v1/models", headers=auth, timeout=10).headers["x-request-id"] for _ in range(2)}
    assert len(made) == 2 and all(len(m) == 32 for m in made)  # a fresh one each time
    assert httpx.post(f"{base}/v1/chat/completions", json=CHAT, timeout=10).headers["x-request-id"]  # the 401 too
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**CHAT, "stream": True},
                      headers={**auth, "X-Request-Id": "stream-7"}, timeout=10) as r:
        body = r.read().decode()
        assert r.status_code == 200 and r.headers["x-request-id"] == "chatcmpl-stream-7"  # the chat's own id
    assert body.rstrip().endswith("data: [DONE]") and '"id":"chatcmpl-stream-7"' in body


def test_x_request_id_names_the_chat_completion(rest_server: RestServer, pipeline: ScriptedPipeline) -> None:
    """Flag or not, a client's X-Request-Id becomes the request's id (what every stage logs), and bad ids are 400s."""
    url = f"{rest_server.base_url}/v1/chat/completions"
    r = httpx.post(url, json=CHAT, headers={"X-Request-Id": "trace-9"}, timeout=10)
    assert r.status_code == 200 and r.json()["id"] == "chatcmpl-trace-9" and r.headers["x-request-id"] == "chatcmpl-trace-9"
    assert pipeline.requests[-1].request_id == "chatcmpl-trace-9"
    plain = httpx.post(url, json=CHAT, timeout=10)
    assert plain.headers["x-request-id"] == plain.json()["id"] and len(plain.json()["id"]) == len("chatcmpl-") + 32
    for bad, why in (("has space", "only printable ASCII"), ("x" * 257, "at most 256 characters")):
        r = httpx.post(url, json=CHAT, headers={"X-Request-Id": bad}, timeout=10)
        assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "X-Request-Id"
