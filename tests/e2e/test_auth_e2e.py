"""`--api-key` in a real gateway process: a second `omnimesh gateway` on the shared mesh's stages, its key
given the way the launcher gives it (the OMNIMESH_API_KEY environment variable, off the command line).
Without the key /v1 is a 401 and the gRPC Omni service UNAUTHENTICATED; with it the answer is the same
text the open gateway gives; /health and /metrics need none; the start-up log says a key is required."""

from __future__ import annotations

import grpc
import httpx
import pytest
from mesh_harness import start_gateway

from gateway.auth import ENV_VAR
from omnimesh.v1 import omni_pb2, omni_pb2_grpc

KEY = "sk-e2e-test"
BODY = {"model": "tiny-qwen3-omni", "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "max_tokens": 8, "temperature": 0}


def test_gateway_with_an_api_key(mesh, tiny_model_dir, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(ENV_VAR, KEY)
    proc, url = start_gateway(tiny_model_dir, mesh.stages)
    try:
        proc.wait_for_line(r"an API key is required", timeout_s=30)
        assert KEY not in " ".join(proc.argv)
        r = httpx.post(f"{url}/v1/chat/completions", json=BODY, timeout=60)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        ok = httpx.post(f"{url}/v1/chat/completions", json=BODY, headers={"Authorization": f"Bearer {KEY}"},
                        timeout=60)
        open_answer = httpx.post(f"{mesh.rest}/v1/chat/completions", json=BODY, timeout=60)
        assert ok.status_code == 200 and open_answer.status_code == 200, (ok.text, open_answer.text)
        assert ok.json()["choices"][0]["message"]["content"] == open_answer.json()["choices"][0]["message"]["content"]
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        assert httpx.get(f"{url}/metrics", timeout=30).status_code == 200
        grpc_port = proc.argv[proc.argv.index("--grpc-port") + 1]
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch, pytest.raises(grpc.RpcError) as err:
            omni_pb2_grpc.OmniStub(ch).ListModels(omni_pb2.ListModelsRequest(), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        assert proc.stop() == 0, proc.output()
