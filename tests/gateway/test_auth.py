"""`--api-key` at the gateway (gateway/auth.py): REST /v1 routes and the gRPC Omni service answer 401 /
UNAUTHENTICATED without `Bearer <key>`, before the pipeline sees anything; every configured key works (key
rotation); /health, /metrics, gRPC health and reflection stay open; streaming passes through the
middleware untouched; the flag wins over $OMNIMESH_API_KEY; the launcher passes the key in the gateway's
environment, never on its command line."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import httpx
import openai
import pytest
from gateway_harness import GrpcServer, RestServer, ScriptedPipeline
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.auth import ENV_VAR, check_bearer, parse_api_keys
from gateway.rest import create_app
from omnimesh.v1 import omni_pb2, omni_pb2_grpc

KEYS = ("sk-old", "sk-new")
USER_HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def locked_rest(shared_pipeline: ScriptedPipeline) -> Iterator[RestServer]:
    with RestServer(create_app(shared_pipeline, served_model_names=("tiny-omni",), api_keys=KEYS)) as server:
        yield server


@pytest.fixture(scope="module")
def locked_grpc(shared_pipeline: ScriptedPipeline) -> Iterator[GrpcServer]:
    with GrpcServer(shared_pipeline, api_keys=KEYS) as server:
        yield server


def test_parse_keys_flag_env_and_rotation() -> None:
    assert parse_api_keys(None, {}) == ()
    assert parse_api_keys(None, {ENV_VAR: "k1"}) == ("k1",)
    assert parse_api_keys("flag", {ENV_VAR: "env"}) == ("flag",)  # the flag wins
    assert parse_api_keys(" a , b ,", {}) == ("a", "b")
    assert parse_api_keys("", {ENV_VAR: "env"}) == ()  # an explicit empty flag: no key
    with pytest.raises(ValueError, match="holds no key"):
        parse_api_keys(" , ", {})


@pytest.mark.parametrize(("header", "why"), [
    (None, "missing API key"), ("", "missing API key"), ("sk-old", "missing API key"), ("Basic sk-old", "missing"),
    ("Bearer ", "missing API key"), ("Bearer sk-ol", "invalid API key"), ("Bearer sk-old2", "invalid API key"),
    ("Bearer sk-old", None), ("bearer  sk-new ", None),
])
def test_check_bearer(header: str | None, why: str | None) -> None:
    got = check_bearer(header, KEYS)
    assert (got is None) if why is None else (got is not None and why in got)


def test_rest_needs_a_key_on_v1_only(locked_rest: RestServer, pipeline: ScriptedPipeline) -> None:
    url = f"{locked_rest.base_url}/v1/chat/completions"
    for headers, needle in (({}, "missing API key"), ({"Authorization": "Bearer nope"}, "invalid API key")):
        r = httpx.post(url, json={"messages": USER_HI}, headers=headers, timeout=10)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json() == {"error": {"message": r.json()["error"]["message"], "type": "invalid_request_error",
                                      "param": None, "code": "invalid_api_key"}} and needle in r.text
        assert httpx.get(f"{locked_rest.base_url}/v1/models", headers=headers, timeout=10).status_code == 401
        for path, body in (("/v1/responses", {"input": "hi"}), ("/v1/audio/speech", {"input": "hi"}),
                           ("/invocations", {"messages": USER_HI})):
            assert httpx.post(f"{locked_rest.base_url}{path}", json=body, headers=headers,
                              timeout=10).status_code == 401, path
    assert pipeline.requests == []  # refused before the pipeline saw anything
    for key in KEYS:
        r = httpx.post(url, json={"messages": USER_HI}, headers={"Authorization": f"Bearer {key}"}, timeout=10)
        assert r.status_code == 200, r.text
    assert len(pipeline.requests) == 2
    for path in ("/health", "/metrics", "/ping", "/load"):  # outside /v1: open, as vLLM's
        assert httpx.get(f"{locked_rest.base_url}{path}", timeout=10).status_code == 200, path


def test_openai_client_with_and_without_the_key(locked_rest: RestServer, pipeline: ScriptedPipeline) -> None:
    def client(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{locked_rest.base_url}/v1", api_key=key, max_retries=0)

    with pytest.raises(openai.AuthenticationError, match="invalid API key"):
        client("sk-wrong").chat.completions.create(model="tiny-omni", messages=USER_HI)  # type: ignore[arg-type]
    stream = client("sk-new").chat.completions.create(model="tiny-omni", messages=USER_HI, stream=True)  # type: ignore[arg-type]
    chunks = list(stream)
    assert chunks and chunks[-1].choices[0].finish_reason is not None  # the SSE stream passes untouched
    assert [m.id for m in client("sk-old").models.list()] == ["tiny-omni"]


def _generate(server: GrpcServer, metadata: tuple = ()) -> list[omni_pb2.GenerateResponse]:
    msg = omni_pb2.ChatMessage(role="user", content=[omni_pb2.ContentPart(text="hi")])
    req = omni_pb2.GenerateRequest(model="tiny-omni", messages=[msg], modalities=["text"])
    with grpc.insecure_channel(server.target) as ch:
        return list(omni_pb2_grpc.OmniStub(ch).Generate(req, timeout=10, metadata=metadata))


def test_grpc_needs_a_key_for_omni_only(locked_grpc: GrpcServer, pipeline: ScriptedPipeline) -> None:
    for metadata, needle in (((), "missing API key"), ((("authorization", "Bearer nope"),), "invalid API key")):
        with pytest.raises(grpc.RpcError) as err:
            _generate(locked_grpc, metadata)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and needle in err.value.details()
        with grpc.insecure_channel(locked_grpc.target) as ch, pytest.raises(grpc.RpcError) as err:
            omni_pb2_grpc.OmniStub(ch).ListModels(omni_pb2.ListModelsRequest(), timeout=10, metadata=metadata)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert pipeline.requests == []
    out = _generate(locked_grpc, (("authorization", "Bearer sk-new"),))
    assert out[-1].WhichOneof("kind") == "done" and len(pipeline.requests) == 1
    with grpc.insecure_channel(locked_grpc.target) as ch:  # probes need no key
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_gateway_with_an_empty_env_key_exits_at_once(tmp_path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A $OMNIMESH_API_KEY of only commas is an error exit before any model file is read or stage dialled
    (tmp_path holds no model at all)."""
    from gateway.server import run_gateway
    from omnimesh.config.serve_args import ServeArgs

    monkeypatch.setenv(ENV_VAR, " , ")
    assert run_gateway(ServeArgs(), tmp_path, {"thinker": "127.0.0.1:1"}) == 1
    assert "holds no key" in capsys.readouterr().out


def test_launcher_hands_the_key_over_in_the_environment(tmp_path) -> None:
    from omnimesh.config.serve_args import ServeArgs
    from omnimesh.launcher import MeshLauncher

    launcher = MeshLauncher(ServeArgs(api_key="sk-secret"), tmp_path)
    argv = launcher._gateway_argv({"encoder": "127.0.0.1:1"})
    assert not any("sk-secret" in a for a in argv) and "--api-key" not in argv
    assert launcher._gateway_env() == {ENV_VAR: "sk-secret"}
    assert MeshLauncher(ServeArgs(), tmp_path)._gateway_env() is None
    with pytest.raises(ValueError, match="holds no key"):
        ServeArgs(api_key=",")
