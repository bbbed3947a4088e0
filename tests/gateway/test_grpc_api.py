"""The gRPC front end through a real `grpc.aio` server on 127.0.0.1: Generate's stream, its errors,
ListModels, health and reflection. The pipeline is the scripted double from `gateway_harness`."""

from __future__ import annotations

import io
import time
import wave

import grpc
import numpy as np
import pytest
from gateway_harness import SAMPLE_RATE, GrpcServer, ScriptedPipeline, stage_down, tone
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from PIL import Image

from gateway.events import AudioPart, Finished, ImagePart, SamplingOverrides, TextDelta
from gateway.grpc_api import refresh_health
from omnimesh.v1 import omni_pb2, omni_pb2_grpc, stage_pb2

INVALID_ARGUMENT, NOT_FOUND, UNAVAILABLE, INTERNAL = 3, 5, 14, 13


def hello(**kw: object) -> omni_pb2.GenerateRequest:
    msg = omni_pb2.ChatMessage(role="user", content=[omni_pb2.ContentPart(text="hi")])
    return omni_pb2.GenerateRequest(**{"model": "tiny-omni", "messages": [msg], **kw})  # type: ignore[arg-type]


def generate(server: GrpcServer, request: omni_pb2.GenerateRequest) -> list[omni_pb2.GenerateResponse]:
    with grpc.insecure_channel(server.target) as ch:
        return list(omni_pb2_grpc.OmniStub(ch).Generate(request, timeout=10))


def test_generate_streams_text_audio_and_done(grpc_server: GrpcServer, pipeline: ScriptedPipeline) -> None:
    out = generate(grpc_server, hello())  # empty modalities = text + audio
    kinds = [r.WhichOneof("kind") for r in out]
    assert kinds == ["text_delta", "text_delta", "audio", "audio", "done"]
    assert "".join(r.text_delta for r in out[:2]) == "Hello world"
    chunks = [r.audio for r in out[2:4]]
    assert [c.seq for c in chunks] == [0, 1] and {c.sample_rate for c in chunks} == {SAMPLE_RATE}
    pcm = np.frombuffer(b"".join(c.pcm16 for c in chunks), "<i2") / 32767.0
    np.testing.assert_allclose(pcm, tone(0.2), atol=1.0 / 32767)
    done = out[-1].done
    assert done.finish_reason == "stop" and (done.usage.prompt_tokens, done.usage.completion_tokens) == (7, 2)
    req = pipeline.requests[-1]
    assert req.modalities == ("text", "audio") and req.voice == "Ethan" and req.request_id.startswith("omni-")
    assert pipeline.closed == [req.request_id]


def test_generate_text_only_sampling_and_media(grpc_server: GrpcServer, pipeline: ScriptedPipeline) -> None:
    wav = io.BytesIO()
    with wave.open(wav, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(8000)
        w.writeframes((tone(0.25, rate=8000) * 32767).astype("<i2").tobytes())
    png = io.BytesIO()
    Image.new("L", (20, 10), 128).save(png, format="PNG")
    msg = omni_pb2.ChatMessage(role="user", content=[
        omni_pb2.ContentPart(text="listen"), omni_pb2.ContentPart(audio_wav=wav.getvalue()),
        omni_pb2.ContentPart(image=png.getvalue())])
    req = omni_pb2.GenerateRequest(
        messages=[msg], modalities=["text"], request_id="rid-1",
        sampling=stage_pb2.SamplingParams(temperature=0.0, seed=5),
        stage_params={"talker": stage_pb2.SamplingParams(top_k=10, max_tokens=200)})
    out = generate(grpc_server, req)
    assert [r.WhichOneof("kind") for r in out] == ["text_delta", "text_delta", "done"]
    got = pipeline.requests[-1]
    assert got.request_id == "rid-1" and got.modalities == ("text",) and got.voice is None
    assert got.sampling == SamplingOverrides(temperature=0.0, seed=5)
    assert got.stage_params == {"talker": SamplingOverrides(top_k=10, max_tokens=200)}
    _, audio, image = got.messages[0].content
    assert isinstance(audio, AudioPart) and audio.sample_rate == 16_000 and audio.waveform.shape == (4000,)
    assert isinstance(image, ImagePart) and image.image.mode == "RGB"


@pytest.mark.parametrize(("request_kw", "code", "needle"), [
    ({"model": "gpt-4o"}, NOT_FOUND, "gpt-4o"),
    ({"voice": "alloy"}, INVALID_ARGUMENT, "unknown voice 'alloy'"),
    ({"modalities": ["video"]}, INVALID_ARGUMENT, "modalities"),
    ({"sampling": stage_pb2.SamplingParams(temperature=5.0)}, INVALID_ARGUMENT, "sampling.temperature"),
    ({"sampling": stage_pb2.SamplingParams(stop_token_ids=[-1])}, INVALID_ARGUMENT, "sampling.stop_token_ids[0]"),
    ({"stage_params": {"vocoder": stage_pb2.SamplingParams()}}, INVALID_ARGUMENT, "unknown stage 'vocoder'"),
    ({"stage_params": {"talker": stage_pb2.SamplingParams(logprobs=1)}}, INVALID_ARGUMENT,
     "stage_params.talker.logprobs: applies to the thinker's text tokens only"),
    ({"sampling": stage_pb2.SamplingParams(logprobs=21)}, INVALID_ARGUMENT, "sampling.logprobs: must be in [0, 20] alternatives per token (--max-logprobs)"),
])
def test_generate_validation_errors(grpc_server: GrpcServer, pipeline: ScriptedPipeline, request_kw: dict,
                                    code: int, needle: str) -> None:
    out = generate(grpc_server, hello(**request_kw))
    assert len(out) == 1 and out[0].WhichOneof("kind") == "error"
    assert out[0].error.code == code and needle in out[0].error.message
    assert pipeline.requests == []


@pytest.mark.parametrize(("message", "needle"), [
    (omni_pb2.ChatMessage(role="user", content=[omni_pb2.ContentPart(audio_wav=b"not a wav")]), "not a WAV"),
    (omni_pb2.ChatMessage(role="user", content=[omni_pb2.ContentPart(image=b"not an image")]), "decode the image"),
    (omni_pb2.ChatMessage(role="robot", content=[omni_pb2.ContentPart(text="x")]), "messages[0].role"),
    (omni_pb2.ChatMessage(role="user", content=[omni_pb2.ContentPart()]), "empty content part"),
    # --limit-mm-per-prompt '{"audio": 2, "video": 1}' (the harness's), checked before decoding
    (omni_pb2.ChatMessage(role="user", content=[omni_pb2.ContentPart(audio_wav=b"not a wav")] * 3),
     "request has 3 audio parts; at most 2"),
    (omni_pb2.ChatMessage(role="user", content=[omni_pb2.ContentPart(video=b"not a video")] * 2),
     "request has 2 video parts; at most 1 may be given in one request (--limit-mm-per-prompt)"),
])
def test_generate_bad_messages(grpc_server: GrpcServer, pipeline: ScriptedPipeline, message: omni_pb2.ChatMessage,
                               needle: str) -> None:
    out = generate(grpc_server, omni_pb2.GenerateRequest(messages=[message]))
    assert [r.WhichOneof("kind") for r in out] == ["error"]
    assert out[0].error.code == INVALID_ARGUMENT and needle in out[0].error.message


def test_generate_pipeline_errors_travel_in_the_stream(grpc_server: GrpcServer, pipeline: ScriptedPipeline) -> None:
    pipeline.script = lambda req: [TextDelta("Hel"), stage_down("vocoder")]
    out = generate(grpc_server, hello())
    assert [r.WhichOneof("kind") for r in out] == ["text_delta", "error"]
    assert out[1].error.code == UNAVAILABLE and "vocoder" in out[1].error.message
    pipeline.script = lambda req: [RuntimeError("boom")]
    out = generate(grpc_server, hello())
    assert out[-1].error.code == INTERNAL and "boom" in out[-1].error.message
    pipeline.script = lambda req: [TextDelta("a")]  # ends without Finished: an error, not silence
    out = generate(grpc_server, hello())
    assert out[-1].error.code == INTERNAL and "without a Finished" in out[-1].error.message


def test_list_models_health_and_reflection(grpc_server: GrpcServer, pipeline: ScriptedPipeline) -> None:
    with grpc.insecure_channel(grpc_server.target) as ch:
        assert list(omni_pb2_grpc.OmniStub(ch).ListModels(omni_pb2.ListModelsRequest(), timeout=10).models) == [
            "tiny-omni"]
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "omnimesh.v1.Omni"):
            resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        answers = list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                 timeout=10))
        names = {s.name for s in answers[0].list_services_response.service}
        assert {"omnimesh.v1.Omni", "grpc.health.v1.Health"} <= names
        pipeline.stages["thinker"] = False
        assert grpc_server.call(refresh_health(grpc_server.health, pipeline)) is False
        resp = health.Check(health_pb2.HealthCheckRequest(service="omnimesh.v1.Omni"), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
        pipeline.stages["thinker"] = True
        assert grpc_server.call(refresh_health(grpc_server.health, pipeline)) is True


def test_client_cancel_closes_the_pipeline_request(grpc_server: GrpcServer, pipeline: ScriptedPipeline) -> None:
    pipeline.script = lambda req: [TextDelta("x")] * 200 + [Finished("stop", 1, 200)]
    pipeline.event_delay_s = 0.02
    with grpc.insecure_channel(grpc_server.target) as ch:
        call = omni_pb2_grpc.OmniStub(ch).Generate(hello(), timeout=10)
        assert next(call).text_delta == "x"
        call.cancel()
        deadline = time.monotonic() + 5
        while not pipeline.closed and time.monotonic() < deadline:
            time.sleep(0.02)
    assert pipeline.closed == [pipeline.requests[-1].request_id]


def test_a_request_protobuf_cannot_parse_is_invalid_argument(grpc_server: GrpcServer,
                                                             pipeline: ScriptedPipeline) -> None:
    """Corrupt wire bytes, or a string field that is not UTF-8, were grpcio's UNKNOWN "Unexpected <class
    DecodeError>" (a crash, to read it); now INVALID_ARGUMENT naming the message type, and nothing runs."""
    good = hello().SerializeToString()
    assert good.startswith(b"\x0a\x09tiny-omni")  # model: field 1, length 9
    not_utf8 = b"\x0a\x09tiny-\xff\xfeni" + good[11:]
    truncated = good[:-3]  # the last message field ends short
    before = len(pipeline.requests)
    with grpc.insecure_channel(grpc_server.target) as ch:
        for method, data in [("Generate", not_utf8), ("Generate", truncated), ("ListModels", b"\xff\xff\xff")]:
            call = ch.unary_stream if method == "Generate" else ch.unary_unary
            rpc = call(f"/omnimesh.v1.Omni/{method}", request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.RpcError) as e:
                result = rpc(data, timeout=10)
                list(result) if method == "Generate" else result
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, e.value.details())
            request_type = "Generate" if method == "Generate" else "ListModels"
            assert f"not a valid omnimesh.v1.{request_type}Request" in (e.value.details() or "")
        assert generate(grpc_server, hello())[-1].WhichOneof("kind") == "done"  # it serves on
    assert len(pipeline.requests) == before + 1
