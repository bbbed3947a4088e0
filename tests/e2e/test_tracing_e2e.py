"""OpenTelemetry traces from the shared mesh (started with `--otlp-traces-endpoint` pointing at `traces`, an
OTLP/gRPC receiver in this process): one request is one trace — the gateway's `llm_request` span under the
client's W3C traceparent (REST header or gRPC metadata), and under it one span from each stage the request
went through, written by that stage's process from its own timestamps, with tokens that agree with the
response's usage. Without a traceparent the gateway's span is the root; a refused request's span says why."""

from __future__ import annotations

import base64
import secrets
import time

import grpc
import httpx
from reference import sine_wav

from omnimesh.v1 import omni_pb2, omni_pb2_grpc, stage_pb2

MODEL = "tiny-qwen3-omni"
STAGES = ("encoder", "thinker", "talker", "vocoder")
SLACK_NS = 50_000_000  # the processes' clocks are one clock here; spans are rounded to wall time from monotonic


def _traceparent() -> tuple[str, str, str]:
    trace, span = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace}-{span}-01", trace, span


def _chat(mesh, headers: dict[str, str] | None = None, **extra) -> dict:
    body = {"model": MODEL, "temperature": 0, "max_tokens": 6, "modalities": ["text", "audio"],
            "stage_params": {"talker": {"max_tokens": 20}},
            "messages": [{"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": base64.b64encode(sine_wav(0.5)).decode(),
                                                        "format": "wav"}},
                {"type": "text", "text": "What do you hear?"}]}], **extra}
    r = httpx.post(f"{mesh.rest}/v1/chat/completions", json=body, headers=headers or {}, timeout=120)
    return {"status": r.status_code, **r.json()}


def test_one_trace_from_the_client_through_every_stage(mesh, traces):
    header, trace, client_span = _traceparent()
    answer = _chat(mesh, {"traceparent": header})
    assert answer["status"] == 200, answer
    spans = traces.wait(trace, {"llm_request", *(f"{s}_request" for s in STAGES)})
    root = spans["llm_request"]
    assert (root.service, root.parent_id) == ("omnimesh-gateway", client_span)
    usage = answer["usage"]
    a = root.attributes
    assert a["gen_ai.request.id"] == answer["id"] and a["gen_ai.response.model"] == MODEL
    assert (a["gen_ai.usage.prompt_tokens"], a["gen_ai.usage.completion_tokens"]) == \
        (usage["prompt_tokens"], usage["completion_tokens"])
    assert a["omnimesh.modalities"] == "text,audio" and a["gen_ai.request.max_tokens"] == 6
    assert 0 < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    assert 0 < a["omnimesh.latency.time_to_first_audio"] <= a["gen_ai.latency.e2e"]
    assert a["omnimesh.audio_seconds"] > 0 and {"first_text", "first_audio"} <= set(root.events)
    assert not root.error
    for stage in STAGES:
        span = spans[f"{stage}_request"]
        assert (span.service, span.parent_id) == (f"omnimesh-{stage}", root.span_id), stage
        assert span.attributes["gen_ai.request.id"] == answer["id"] and span.attributes["omnimesh.stage"] == stage
        assert root.start_ns - SLACK_NS <= span.start_ns <= span.end_ns <= root.end_ns + SLACK_NS, stage
        assert "first_output" in span.events and not span.error, stage
        assert span.attributes["omnimesh.finish_reason"] in ("stop", "length"), stage
    thinker = spans["thinker_request"].attributes
    assert (thinker["gen_ai.usage.prompt_tokens"], thinker["gen_ai.usage.completion_tokens"]) == \
        (usage["prompt_tokens"], usage["completion_tokens"])
    assert 0 < thinker["gen_ai.latency.time_to_first_token"] <= thinker["gen_ai.latency.e2e"]
    assert thinker["omnimesh.finish_reason"] == answer["choices"][0]["finish_reason"] == a["omnimesh.finish_reason"]


def test_grpc_metadata_and_untraced_requests(mesh, traces):
    header, trace, client_span = _traceparent()
    request = omni_pb2.GenerateRequest(
        model=MODEL, modalities=["text"], sampling=stage_pb2.SamplingParams(temperature=0.0, max_tokens=4),
        messages=[omni_pb2.ChatMessage(role="user", content=[omni_pb2.ContentPart(text="hello")])])
    with grpc.insecure_channel(mesh.grpc) as ch:
        out = list(omni_pb2_grpc.OmniStub(ch).Generate(request, metadata=(("traceparent", header),), timeout=60))
    assert out[-1].WhichOneof("kind") == "done"
    spans = traces.wait(trace, {"llm_request", "thinker_request"})
    assert spans["llm_request"].parent_id == client_span
    assert spans["thinker_request"].parent_id == spans["llm_request"].span_id
    assert "talker_request" not in spans and "encoder_request" not in spans  # text in, text out

    untraced = _chat(mesh, modalities=["text"])  # no traceparent: the gateway's span starts the trace
    root = _gateway_span(traces, untraced["id"])
    assert root.parent_id == ""
    stages = traces.wait(root.trace_id, {"encoder_request", "thinker_request"})
    assert stages["thinker_request"].parent_id == root.span_id


def test_a_refused_request_says_why(mesh, traces):
    header, trace, _ = _traceparent()
    answer = _chat(mesh, {"traceparent": header}, stop_token_ids=[10**9])  # outside the vocabulary: the thinker's 400
    assert answer["status"] == 400, answer
    root = traces.wait(trace, {"llm_request"})["llm_request"]
    assert root.error and root.attributes["http.response.status_code"] == 400


def _gateway_span(traces, request_id: str, timeout_s: float = 20.0):
    """The one `llm_request` span of `request_id`, once it arrived."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [s for s in list(traces.spans)
                 if s.name == "llm_request" and s.attributes.get("gen_ai.request.id") == request_id]
        if found:
            assert len(found) == 1, found
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no llm_request span names request {request_id}")


def test_a_realtime_session_traces_each_response_under_its_handshake(mesh, traces):
    import json

    from mesh_harness import REALTIME_BETA
    from websockets.sync.client import connect

    header, trace, client_span = _traceparent()
    url = mesh.rest.replace("http://", "ws://") + f"/v1/realtime?model={MODEL}"
    with connect(url, additional_headers={"traceparent": header, **REALTIME_BETA}, open_timeout=30) as ws:
        ws.send(json.dumps({"type": "session.update", "session": {"modalities": ["text"], "temperature": 0,
                                                                  "max_response_output_tokens": 4}}))
        ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello"}]}}))
        ws.send(json.dumps({"type": "response.create"}))
        while (event := json.loads(ws.recv(timeout=60)))["type"] != "response.done":
            assert event["type"] != "error", event
    spans = traces.wait(trace, {"llm_request", "thinker_request"})
    assert spans["llm_request"].parent_id == client_span
    assert spans["thinker_request"].parent_id == spans["llm_request"].span_id
