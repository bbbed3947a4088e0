"""The gateway's HTTP front flags in real `omnimesh gateway` processes on the shared mesh's stages:
- TLS (`--ssl-keyfile` / `--ssl-certfile`): REST over https answers what the plain mesh answers, gRPC over
  TLS lists the model, plaintext is refused on both ports; the access log has the request's line; a client's
  X-Request-Id names its chat, and a second request under an id in flight is a 409;
- mutual TLS (`--ssl-ca-certs`, `--ssl-cert-reqs 2`): only a client with a trusted certificate gets
  through, on REST and gRPC; a client's X-Request-Id names the chat and `--enable-request-id-headers` gives every response one; `--disable-uvicorn-access-log`
  leaves the line out;
- the launcher's readiness probe (`omnimesh serve`) reaches both gateways, and plain http does not;
- certificate files that do not load stop start-up with the flag named (exit 1), and `Tls.load` says why;
- `--uds` and `--root-path` (vLLM's): the REST API on a Unix socket only (no TCP port), answering under the
  proxy's prefix and without it alike, the API key still required under the prefix, the prefix in the paths
  errors name; the launcher's probe finds it on the socket, and the socket file is gone after a stop. That
  gateway also serves two names (`--served-model-name omni omni-alias`, vLLM's): both listed and answered;
- a gateway whose REST port is taken exits 1 naming the flag, and never says it listens.
"""

from __future__ import annotations

import ssl
import time
from pathlib import Path

import grpc
import httpx
import pytest
from mesh_harness import START_TIMEOUT_S, Proc, free_port, start_gateway
from tls_certs import Certs, make_certs

from gateway.http_front import Tls
from omnimesh.cli import main
from omnimesh.config.serve_args import ServeArgs
from omnimesh.launcher import MeshLauncher, _port_open
from omnimesh.v1 import omni_pb2, omni_pb2_grpc

BODY = {"model": "tiny-qwen3-omni", "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "max_tokens": 8, "temperature": 0}
ACCESS_LINE = r'"POST /v1/chat/completions HTTP/1\.1" 200'


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("tls"))


def _trusting(certs: Certs, client_cert: bool = False) -> ssl.SSLContext:
    """A client context that trusts the server's certificate (and presents the client's)."""
    ctx = ssl.create_default_context(cafile=str(certs.server_crt))
    if client_cert:
        ctx.load_cert_chain(str(certs.client_crt), str(certs.client_key))
    return ctx


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _grpc_port(proc: Proc) -> str:
    return proc.argv[proc.argv.index("--grpc-port") + 1]


def _list_models(channel: grpc.Channel) -> list[str]:
    resp = omni_pb2_grpc.OmniStub(channel).ListModels(omni_pb2.ListModelsRequest(), timeout=30)
    return list(resp.models)


def _probe(certs: Certs, port: int, **tls: object) -> bool:
    args = ServeArgs(host="127.0.0.1", port=port, **tls)  # type: ignore[arg-type]
    probe, _what = MeshLauncher(args, Path("unused"))._gateway_probe()
    return probe()


def test_tls_gateway(mesh, tiny_model_dir, certs: Certs) -> None:
    tls = ("--ssl-keyfile", str(certs.server_key), "--ssl-certfile", str(certs.server_crt))
    trust = _trusting(certs)
    proc, url = start_gateway(tiny_model_dir, mesh.stages, *tls, verify=trust)
    try:
        assert url.startswith("https://")
        proc.wait_for_line(r"gateway: TLS on REST and gRPC \(client certificates: none\)", timeout_s=30)
        r = httpx.post(f"{url}/v1/chat/completions", json=BODY, verify=trust, timeout=60)
        plain = httpx.post(f"{mesh.rest}/v1/chat/completions", json=BODY, timeout=60)
        assert r.status_code == 200 and plain.status_code == 200, (r.text, plain.text)
        assert r.json()["choices"][0]["message"]["content"] == plain.json()["choices"][0]["message"]["content"]
        proc.wait_for_line(ACCESS_LINE, timeout_s=10)
        same = {"X-Request-Id": "dup-1"}
        with httpx.Client(verify=trust, timeout=60) as http, \
                http.stream("POST", f"{url}/v1/chat/completions", headers=same,
                            json={**BODY, "stream": True, "max_tokens": 2000, "min_tokens": 2000}) as first:
            assert first.status_code == 200 and first.headers["x-request-id"] == "chatcmpl-dup-1"
            second = http.post(f"{url}/v1/chat/completions", json=BODY, headers=same)  # the first is still running
            assert second.status_code == 409 and second.json()["error"]["param"] == "request_id", second.text
        # leaving the block closed the first stream, which cancels it: its id is free again (within moments)
        deadline = time.monotonic() + 10
        while (again := httpx.post(f"{url}/v1/chat/completions", json=BODY, headers=same, verify=trust,
                                   timeout=60)).status_code == 409 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert again.status_code == 200 and again.json()["id"] == "chatcmpl-dup-1", again.text
        with pytest.raises(httpx.HTTPError):  # plaintext on the TLS port
            httpx.get(url.replace("https://", "http://") + "/health", timeout=10)
        with pytest.raises(httpx.HTTPError):  # a certificate the client does not trust
            httpx.get(f"{url}/health", timeout=10)
        target = f"127.0.0.1:{_grpc_port(proc)}"
        creds = grpc.ssl_channel_credentials(root_certificates=certs.server_crt.read_bytes())
        with grpc.secure_channel(target, creds) as ch:
            assert _list_models(ch) == ["tiny-qwen3-omni"]
        with grpc.insecure_channel(target) as ch, pytest.raises(grpc.RpcError) as err:
            _list_models(ch)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        tls_args = {"ssl_keyfile": str(certs.server_key), "ssl_certfile": str(certs.server_crt)}
        assert _probe(certs, _port(url), **tls_args)
        assert not _probe(certs, _port(url))  # the plain-http probe does not mistake it for ready
    finally:
        assert proc.stop() == 0, proc.output()


def test_mutual_tls_gateway(mesh, tiny_model_dir, certs: Certs) -> None:
    client = {"verify": _trusting(certs, client_cert=True)}
    proc, url = start_gateway(
        tiny_model_dir, mesh.stages, "--ssl-keyfile", str(certs.server_key), "--ssl-certfile", str(certs.server_crt),
        "--ssl-ca-certs", str(certs.client_crt), "--ssl-cert-reqs", "2", "--enable-request-id-headers",
        "--disable-uvicorn-access-log", **client)
    try:
        proc.wait_for_line(r"client certificates: required\); X-Request-Id on every response; no access log",
                           timeout_s=30)
        r = httpx.post(f"{url}/v1/chat/completions", json=BODY, headers={"X-Request-Id": "trace-42"}, timeout=60,
                       **client)  # type: ignore[arg-type]
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == "chatcmpl-trace-42" == r.json()["id"]
        fresh = httpx.get(f"{url}/v1/models", timeout=30, **client).headers["x-request-id"]  # type: ignore[arg-type]
        assert len(fresh) == 32 and int(fresh, 16) >= 0
        with pytest.raises(httpx.HTTPError):  # no client certificate
            httpx.get(f"{url}/health", verify=_trusting(certs), timeout=10)
        target = f"127.0.0.1:{_grpc_port(proc)}"
        root = certs.server_crt.read_bytes()
        with_cert = grpc.ssl_channel_credentials(root, certs.client_key.read_bytes(), certs.client_crt.read_bytes())
        with grpc.secure_channel(target, with_cert) as ch:
            assert _list_models(ch) == ["tiny-qwen3-omni"]
        with grpc.secure_channel(target, grpc.ssl_channel_credentials(root)) as ch, pytest.raises(grpc.RpcError):
            _list_models(ch)
        mtls = {"ssl_keyfile": str(certs.server_key), "ssl_certfile": str(certs.server_crt),
                "ssl_ca_certs": str(certs.client_crt), "ssl_cert_reqs": 2}
        assert _probe(certs, _port(url), **mtls)  # the port, since /health needs a client certificate
        time.sleep(0.5)  # the log pump is a thread; the TLS test saw its line well within this
        assert not any("POST /v1/chat/completions" in line for line in proc.lines), proc.output()
    finally:
        assert proc.stop() == 0, proc.output()


def test_certificate_files_that_do_not_load(certs: Certs, tmp_path: Path, tiny_model_dir, capsys) -> None:
    with pytest.raises(ValueError, match=r"--ssl-keyfile .*missing.key: cannot read it"):
        Tls.load(str(tmp_path / "missing.key"), str(certs.server_crt), None, 0)
    with pytest.raises(ValueError, match="not a matching PEM certificate and private key"):
        Tls.load(str(certs.stray_key), str(certs.server_crt), None, 0)
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(ValueError, match=r"--ssl-ca-certs .*junk.pem: not PEM CA certificates"):
        Tls.load(str(certs.server_key), str(certs.server_crt), str(junk), 2)
    loaded = Tls.load(str(certs.server_key), str(certs.server_crt), str(certs.client_crt), 2)
    assert loaded.cert_pem == certs.server_crt.read_bytes() and loaded.ca_pem == certs.client_crt.read_bytes()
    proc = Proc(["gateway", "--model", str(tiny_model_dir), "--host", "127.0.0.1", "--port", "1", "--stages",
                 "thinker=127.0.0.1:1", "--ssl-keyfile", str(certs.stray_key), "--ssl-certfile", str(certs.server_crt)])
    assert proc.proc.wait(timeout=60) == 1
    proc.wait_for_line(r"omnimesh gateway: error: --ssl-certfile .* not a matching PEM", timeout_s=5)
    # `omnimesh serve` reads them before any stage starts loading: exit 2 here, in this process (a mesh
    # started instead would not return until stopped)
    assert main(["serve", str(tiny_model_dir), "--host", "127.0.0.1", "--port", str(free_port()), "--grpc-port",
                 str(free_port()), "--ssl-keyfile", str(certs.stray_key), "--ssl-certfile", str(certs.server_crt)]) == 2
    assert "--ssl-certfile" in (err := capsys.readouterr().err) and "not a matching PEM" in err, err


def test_unix_socket_gateway_under_a_root_path(mesh, tiny_model_dir, tmp_path: Path) -> None:
    sock, port = tmp_path / "gw.sock", free_port()
    proc = Proc(["gateway", "--model", str(tiny_model_dir), "--host", "127.0.0.1", "--port", str(port),
                 "--grpc-port", str(free_port()), "--stages", ",".join(f"{k}={v}" for k, v in mesh.stages.items()),
                 "--uds", str(sock), "--root-path", "/omni", "--api-key", "k1",
                 "--served-model-name", "omni", "omni-alias"])
    key = {"Authorization": "Bearer k1"}
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://gw", timeout=60) as http:
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:
                assert proc.proc.poll() is None and time.monotonic() < deadline, proc.output()
                try:
                    if http.get("/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.2)
            proc.wait_for_line(r"gateway: served under /omni too \(--root-path\); REST on the Unix socket "
                               rf"{sock} \(--uds\)", timeout_s=10)
            proc.wait_for_line(rf"listening: REST http over unix:{sock}, /v1 , gRPC", timeout_s=10)
            plain = httpx.post(f"{mesh.rest}/v1/chat/completions", json=BODY, timeout=60).json()
            for path, name in (("/omni/v1/chat/completions", "omni"), ("/v1/chat/completions", "omni-alias")):
                r = http.post(path, json={**BODY, "model": name}, headers=key)  # the proxy passes the prefix, or strips it
                assert r.status_code == 200, (path, r.text)
                assert r.json()["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
                assert r.json()["model"] == name
            models = http.get("/v1/models", headers=key).json()["data"]
            assert [m["id"] for m in models] == ["omni", "omni-alias"]
            other = http.post("/v1/chat/completions", json=BODY, headers=key)  # "tiny-qwen3-omni": not served here
            assert other.status_code == 404 and "omni-alias" in other.json()["error"]["message"], other.text
            assert http.post("/omni/v1/chat/completions", json=BODY).status_code == 401  # the key, under the prefix too
            assert http.get("/omni/v1/models").status_code == 401
            missing = http.get("/omni/v1/nothing", headers=key)
            assert missing.status_code == 404 and "GET /omni/v1/nothing" in missing.json()["error"]["message"]
            assert http.get("/omni/health").status_code == 200
        assert not _port_open("127.0.0.1", port)  # REST is on the socket only
        args = ServeArgs(uds=str(sock), root_path="/omni")
        probe, what = MeshLauncher(args, Path("unused"))._gateway_probe()
        assert probe() and what == f"GET http://localhost/health over {sock}"
    finally:
        assert proc.stop() == 0, proc.output()
    assert not sock.exists()


def test_serve_hands_the_gateway_its_socket_and_prefix(tmp_path: Path) -> None:
    argv = MeshLauncher(ServeArgs(uds=str(tmp_path / "gw.sock"), root_path="/omni"), tmp_path)._gateway_argv({})
    assert argv[argv.index("--uds") + 1] == str(tmp_path / "gw.sock") and argv[argv.index("--root-path") + 1] == "/omni"


def test_a_gateway_on_a_taken_port_says_which_and_serves_nothing(mesh, tiny_model_dir) -> None:
    from gateway.rest_socket import rest_socket

    # (one start: the gRPC port's error, naming --grpc-port, is tests/gateway/test_rest_socket.py's)
    held = rest_socket("127.0.0.1", 0)
    port = held.getsockname()[1]
    stages = ",".join(f"{k}={v}" for k, v in mesh.stages.items())
    try:
        proc = Proc(["gateway", "--model", str(tiny_model_dir), "--host", "127.0.0.1", "--port", str(port),
                     "--grpc-port", str(free_port()), "--stages", stages])
        assert proc.proc.wait(timeout=120) == 2, proc.output()  # checked before it dials its stages
        proc.wait_for_line(rf"omnimesh: error: --port {port}: cannot listen", timeout_s=5)
        assert not any("listening" in line for line in proc.lines), proc.output()
    finally:
        held.close()
