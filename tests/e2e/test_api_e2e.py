"""The public APIs of a real `omnimesh serve` (the shared `mesh`), as clients see them: the official
`openai` client (non-streaming, streaming, wav / pcm16), `/v1/models`, `/health`, `/metrics`, the gRPC
client API (`omnimesh.v1.Omni`, health, reflection) and the error paths, each with its HTTP status and
OpenAI's error shape. Every call is bounded by a timeout; the last test checks the mesh still serves."""

from __future__ import annotations

import base64
import io
import json
import re
import socket
import time
import wave
from urllib.parse import urlsplit

import grpc
import httpx
import numpy as np
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from reference import png_bytes

from omnimesh.v1 import omni_pb2, omni_pb2_grpc, stage_pb2

MODEL = "tiny-qwen3-omni"
VOICES = ("ethan", "aiden", "chelsie")
PROMPT = "Tell me about the sea."
MAX_TOKENS = 12
TALKER_MAX = 40
TIMEOUT_S = 60.0
STAGE_PARAMS = {"talker": {"max_tokens": TALKER_MAX}}
OPENAI_ERROR_KEYS = {"message", "type", "param", "code"}


# ---------------------------------------------------------------------------------------------- helpers
def _client(mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.rest + "/v1", api_key="x", timeout=TIMEOUT_S, max_retries=0)


def _openai_kwargs() -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "modalities": ["text", "audio"],
            "audio": {"voice": "ethan", "format": "wav"}, "max_tokens": MAX_TOKENS, "temperature": 0,
            "extra_body": {"stage_params": STAGE_PARAMS}}


def _body(prompt: str = PROMPT, **over) -> dict:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "modalities": ["text", "audio"],
        "audio": {"voice": "ethan", "format": "wav"},
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stage_params": STAGE_PARAMS,
    }
    body.update(over)
    return body


def _post(mesh, body=None, *, content: bytes | None = None, headers: dict | None = None) -> httpx.Response:
    url = f"{mesh.rest}/v1/chat/completions"
    if content is not None:
        return httpx.post(url, content=content, headers=headers or {"content-type": "application/json"},
                          timeout=TIMEOUT_S)
    return httpx.post(url, json=body, timeout=TIMEOUT_S)


def _wav_samples(data: bytes) -> np.ndarray:
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2), \
            f"want 24 kHz mono 16-bit, got {w.getframerate()} Hz, {w.getnchannels()} ch, {w.getsampwidth()} bytes"
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")


# The vocoder decodes whatever codes have arrived when it steps, so chunk boundaries (and with them the last
# float bits) depend on timing; after pcm16 rounding two runs of one greedy request may differ by an LSB.
# The parity test's bound (1e-4 before quantisation -> <= 4 LSB) is used; the sample count must be exact.
PCM16_TOLERANCE = 4


def _assert_same_audio(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape, f"audio length differs: {got.shape} vs {want.shape}"
    diff = np.abs(got.astype(np.int32) - want.astype(np.int32))
    assert diff.max(initial=0) <= PCM16_TOLERANCE, f"audio differs by up to {diff.max()} LSB"


def _openai_error(r: httpx.Response, status: int) -> dict:
    """Assert `r` is an OpenAI-shaped error with HTTP `status`; return its `error` object."""
    assert r.status_code == status, f"want {status}, got {r.status_code}: {r.text}"
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == OPENAI_ERROR_KEYS, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    return err


def _counter(metrics_text: str, name: str, **labels: str) -> float:
    """The value of one Prometheus sample (0 when the series does not exist yet)."""
    for line in metrics_text.splitlines():
        if line.startswith(name + " ") and not labels:
            return float(line.rsplit(" ", 1)[1])
        if not line.startswith(name + "{"):
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', line[len(name):line.index("}") + 1]))
        if got == labels:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _quiet_metrics(mesh) -> str:
    """/metrics once no chat request is in flight (a finished stream settles its counters just after
    `[DONE]`), bounded."""
    deadline = time.monotonic() + 5.0
    while True:
        text = httpx.get(f"{mesh.rest}/metrics", timeout=TIMEOUT_S).text
        if _counter(text, "omnimesh:requests_running") == 0 or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


# ------------------------------------------------------------------------------------------- openai client
def test_openai_client_non_streaming_text_and_wav(mesh):
    client = _client(mesh)
    kwargs = _openai_kwargs()
    first = client.chat.completions.create(**kwargs)
    second = client.chat.completions.create(**kwargs)

    msg = first.choices[0].message
    assert msg.role == "assistant"
    assert msg.content, "greedy text must not be empty"
    assert second.choices[0].message.content == msg.content, "two identical greedy calls must agree"
    assert first.choices[0].finish_reason in ("stop", "length")
    assert first.usage.completion_tokens > 0 and first.usage.prompt_tokens > 0
    assert first.model == MODEL and first.object == "chat.completion"

    assert msg.audio is not None and msg.audio.id
    assert msg.audio.transcript == msg.content
    pcm = _wav_samples(base64.b64decode(msg.audio.data))
    assert pcm.size > 0 and np.abs(pcm).max() > 0, "the WAV must carry audible samples"
    _assert_same_audio(_wav_samples(base64.b64decode(second.choices[0].message.audio.data)), pcm)


def test_openai_client_streaming_matches_non_streaming(mesh):
    client = _client(mesh)
    common = _openai_kwargs()
    whole = client.chat.completions.create(**common)
    whole_pcm = _wav_samples(base64.b64decode(whole.choices[0].message.audio.data))

    text, audio, finish, ids, transcript = [], [], [], set(), []
    stream = client.chat.completions.create(stream=True, **common)
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        ids.add(chunk.id)
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        if delta.content:
            text.append(delta.content)
        extra = getattr(delta, "audio", None) or (delta.model_extra or {}).get("audio")
        if extra:
            extra = extra if isinstance(extra, dict) else extra.model_dump()
            if extra.get("data"):
                audio.append(np.frombuffer(base64.b64decode(extra["data"]), dtype="<i2"))
            if extra.get("transcript"):  # what is spoken, as OpenAI streams it beside the audio
                transcript.append(extra["transcript"])
        finish.append(choice.finish_reason)

    assert len(ids) == 1, f"every chunk of one completion carries the same id, got {ids}"
    assert "".join(text) == whole.choices[0].message.content
    assert "".join(transcript) == whole.choices[0].message.audio.transcript == whole.choices[0].message.content
    assert audio, "audio deltas must be streamed"
    assert finish[-1] in ("stop", "length"), f"the final chunk must set finish_reason, got {finish[-3:]}"
    assert all(f is None for f in finish[:-1]), "only the final chunk may set finish_reason"
    # streamed pcm16 chunks are the non-streaming WAV's samples
    _assert_same_audio(np.concatenate(audio), whole_pcm)


def test_pcm16_format_is_raw_samples_of_the_wav(mesh):
    wav = _post(mesh, _body())
    raw = _post(mesh, _body(audio={"voice": "ethan", "format": "pcm16"}))
    assert wav.status_code == 200 and raw.status_code == 200, (wav.text, raw.text)
    wav_pcm = _wav_samples(base64.b64decode(wav.json()["choices"][0]["message"]["audio"]["data"]))
    raw_bytes = base64.b64decode(raw.json()["choices"][0]["message"]["audio"]["data"])
    assert raw_bytes[:4] != b"RIFF", "pcm16 must be raw samples, not a WAV file"
    assert len(raw_bytes) % 2 == 0
    _assert_same_audio(np.frombuffer(raw_bytes, dtype="<i2"), wav_pcm)
    assert raw.json()["choices"][0]["message"]["content"] == wav.json()["choices"][0]["message"]["content"]


# ------------------------------------------------------------------------------ models / health / metrics
def test_models_lists_the_folder_name(mesh):
    r = httpx.get(f"{mesh.rest}/v1/models", timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [MODEL]
    assert all(m["object"] == "model" for m in body["data"])
    assert [m.id for m in _client(mesh).models.list()] == [MODEL]
    assert _client(mesh).models.retrieve(MODEL).id == MODEL


def test_health_reports_every_stage(mesh):
    r = httpx.get(f"{mesh.rest}/health", timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "ok" and body["down"] == []
    assert body["stages"] == {name: True for name in ("encoder", "thinker", "talker", "vocoder")}


def test_metrics_count_requests(mesh):
    before = httpx.get(f"{mesh.rest}/metrics", timeout=TIMEOUT_S)
    assert before.status_code == 200
    assert before.headers["content-type"].startswith("text/plain"), before.headers
    assert re.search(r"^# TYPE omnimesh:\S+ ", before.text, re.MULTILINE), "Prometheus text with omnimesh: metrics"
    quiet = _quiet_metrics(mesh)
    n0 = _counter(quiet, "omnimesh:requests_total", endpoint="chat", status="200")
    tokens0 = _counter(quiet, "omnimesh:generation_tokens_total")

    r = _post(mesh, _body(modalities=["text"], audio=None))
    assert r.status_code == 200, r.text
    bad = _post(mesh, _body(model="no-such-model"))
    assert bad.status_code == 404

    after = httpx.get(f"{mesh.rest}/metrics", timeout=TIMEOUT_S).text
    assert _counter(after, "omnimesh:requests_total", endpoint="chat", status="200") == n0 + 1
    assert _counter(after, "omnimesh:requests_total", endpoint="chat", status="404") >= 1
    assert _counter(after, "omnimesh:generation_tokens_total") == tokens0 + r.json()["usage"]["completion_tokens"]
    assert "omnimesh:requests_running" in after
    # every stage's series carry vLLM's model_name label: the name clients use
    names = set(re.findall(r'^omnimesh:\S+\{[^}]*model_name="([^"]+)"', after, re.MULTILINE))
    assert names == {MODEL}, names


# --------------------------------------------------------------------------------------------- gRPC API
def _grpc_request(prompt: str = PROMPT, *, model: str = MODEL, modalities=("text", "audio")) -> omni_pb2.GenerateRequest:
    return omni_pb2.GenerateRequest(
        model=model,
        messages=[omni_pb2.ChatMessage(role="user", content=[omni_pb2.ContentPart(text=prompt)])],
        modalities=list(modalities), voice="ethan",
        sampling=stage_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
        stage_params={"talker": stage_pb2.SamplingParams(max_tokens=TALKER_MAX)},
    )


def _long_grpc_request() -> omni_pb2.GenerateRequest:
    """A request that runs ~1.3 s here (1500 thinker tokens), so that one sent while it streams surely finds it
    still running, even on a loaded machine: a short one can be done before a second one's channel is up."""
    req = _grpc_request()
    req.sampling.max_tokens, req.sampling.ignore_eos = 1500, True
    return req


def test_grpc_generate_matches_rest(mesh):
    rest = _post(mesh, _body())
    assert rest.status_code == 200, rest.text
    rest_msg = rest.json()["choices"][0]["message"]
    rest_pcm = _wav_samples(base64.b64decode(rest_msg["audio"]["data"]))

    with grpc.insecure_channel(mesh.grpc) as ch:
        responses = list(omni_pb2_grpc.OmniStub(ch).Generate(_grpc_request(), timeout=TIMEOUT_S))
    kinds = [r.WhichOneof("kind") for r in responses]
    assert kinds[-1] == "done", kinds
    assert "error" not in kinds, [r.error for r in responses if r.WhichOneof("kind") == "error"]
    assert kinds.count("done") == 1
    text = "".join(r.text_delta for r in responses if r.WhichOneof("kind") == "text_delta")
    assert text == rest_msg["content"]
    chunks = [r.audio for r in responses if r.WhichOneof("kind") == "audio"]
    assert chunks, "audio chunks expected"
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert {c.sample_rate for c in chunks} == {24000}
    pcm = np.concatenate([np.frombuffer(c.pcm16, dtype="<i2") for c in chunks])
    _assert_same_audio(pcm, rest_pcm)
    done = responses[-1].done
    assert done.finish_reason in ("stop", "length")
    assert done.usage.completion_tokens == rest.json()["usage"]["completion_tokens"]


def test_grpc_text_only_has_no_audio(mesh):
    with grpc.insecure_channel(mesh.grpc) as ch:
        responses = list(omni_pb2_grpc.OmniStub(ch).Generate(_grpc_request(modalities=("text",)), timeout=TIMEOUT_S))
    kinds = [r.WhichOneof("kind") for r in responses]
    assert kinds[-1] == "done" and "audio" not in kinds and "text_delta" in kinds, kinds


def test_grpc_list_models_health_reflection(mesh):
    with grpc.insecure_channel(mesh.grpc) as ch:
        models = omni_pb2_grpc.OmniStub(ch).ListModels(omni_pb2.ListModelsRequest(), timeout=TIMEOUT_S)
        assert list(models.models) == [MODEL]

        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "omnimesh.v1.Omni"):
            resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING, service

        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        answers = list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                 timeout=TIMEOUT_S))
        names = {s.name for a in answers for s in a.list_services_response.service}
        assert {"omnimesh.v1.Omni", "grpc.health.v1.Health"} <= names, names
        # reflection also serves the Omni service's descriptor (what grpcurl needs)
        files = list(refl.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol="omnimesh.v1.Omni")]),
            timeout=TIMEOUT_S))
        assert files and files[0].file_descriptor_response.file_descriptor_proto, files


def test_grpc_unknown_model_is_not_found_in_stream(mesh):
    with grpc.insecure_channel(mesh.grpc) as ch:
        responses = list(omni_pb2_grpc.OmniStub(ch).Generate(_grpc_request(model="no-such-model"),
                                                             timeout=TIMEOUT_S))
    assert [r.WhichOneof("kind") for r in responses] == ["error"]
    err = responses[0].error
    assert err.code == grpc.StatusCode.NOT_FOUND.value[0] == 5
    assert "no-such-model" in err.message and MODEL in err.message


def test_grpc_unknown_voice_is_invalid_argument(mesh):
    req = _grpc_request()
    req.voice = "nobody"
    with grpc.insecure_channel(mesh.grpc) as ch:
        responses = list(omni_pb2_grpc.OmniStub(ch).Generate(req, timeout=TIMEOUT_S))
    assert [r.WhichOneof("kind") for r in responses] == ["error"]
    assert responses[0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert all(v in responses[0].error.message.lower() for v in VOICES), responses[0].error.message


def test_grpc_duplicate_request_id_in_flight_is_already_exists(mesh):
    """A second request under the id of one still running is refused before it reaches a stage; the first
    one's answer is untouched (equal to the same request run alone), and the id is free again after it."""
    def run(req: omni_pb2.GenerateRequest) -> list[omni_pb2.GenerateResponse]:
        with grpc.insecure_channel(mesh.grpc) as ch:
            return list(omni_pb2_grpc.OmniStub(ch).Generate(req, timeout=TIMEOUT_S))

    def answer(responses: list[omni_pb2.GenerateResponse]) -> tuple[str, bytes, omni_pb2.GenerateResponse]:
        """text, pcm and done: how the deltas were cut depends on timing, what they carry does not"""
        text = "".join(r.text_delta for r in responses if r.WhichOneof("kind") == "text_delta")
        pcm = b"".join(r.audio.pcm16 for r in responses if r.WhichOneof("kind") == "audio")
        return text, pcm, responses[-1]

    alone = answer(run(_long_grpc_request()))  # the answer without a collision (greedy: the same every time)
    req = _long_grpc_request()
    req.request_id = "client-id-7"
    with grpc.insecure_channel(mesh.grpc) as ch:
        first = omni_pb2_grpc.OmniStub(ch).Generate(req, timeout=TIMEOUT_S)
        head = next(first)  # the first request is in flight once its first message is out
        second = run(req)
        rest = list(first)
    assert [r.WhichOneof("kind") for r in second] == ["error"], second
    assert second[0].error.code == grpc.StatusCode.ALREADY_EXISTS.value[0]
    assert "client-id-7" in second[0].error.message and "in flight" in second[0].error.message
    assert answer([head, *rest]) == alone
    assert answer(run(req)) == alone


def test_an_id_another_gateway_runs_is_refused_by_the_stage(mesh, tiny_model_dir):
    """Two gateways over one set of stages: the second one's request under an id the first has in flight is
    refused by the stage (ALREADY_EXISTS, 409 in REST), hands back no frames under that id (they are the first
    one's), and leaves the first one's request whole."""
    import asyncio

    from gateway.events import ChatMessage, ChatRequest, PipelineError, SamplingOverrides, TextPart
    from gateway.pipeline import StagePipeline
    from gateway.prompt import PromptBuilder
    from omnimesh.transport.stage_client import StageClient

    async def both() -> tuple[list, list, PipelineError | None]:
        clients = {name: StageClient(name, addr) for name, addr in mesh.stages.items()}
        try:
            pipe = StagePipeline(clients, PromptBuilder(tiny_model_dir, max_model_len=4096), served_models=("tiny",))
            await pipe.connect(timeout_s=30)  # before the first request starts: it is surely in flight below
            released: list[str] = []
            pipe._release = lambda rid, stages: released.append(rid)  # type: ignore[method-assign]
            chat = ChatRequest(request_id="shared-id", model="tiny", modalities=("text", "audio"), voice="ethan",
                               messages=(ChatMessage("user", (TextPart(PROMPT),)),),
                               sampling=SamplingOverrides(temperature=0.0, max_tokens=MAX_TOKENS))
            async with grpc.aio.insecure_channel(mesh.grpc) as ch:
                stub = omni_pb2_grpc.OmniStub(ch)
                alone = [r async for r in stub.Generate(_long_grpc_request(), timeout=TIMEOUT_S)]
                req = _long_grpc_request()
                req.request_id = "shared-id"
                first = stub.Generate(req, timeout=TIMEOUT_S)
                got = [await first.read()]  # its first text: every stage has it open (or about to)
                err = None
                try:
                    async for _ in pipe.run(chat):
                        pass
                except PipelineError as e:
                    err = e
                while (r := await first.read()) is not grpc.aio.EOF:
                    got.append(r)
            assert released == [], "the refused request handed back frames of an id that is not its own"
            return alone, got, err
        finally:
            for c in clients.values():
                await c.close()

    alone, got, err = asyncio.run(both())
    assert err is not None and err.grpc_code == grpc.StatusCode.ALREADY_EXISTS.value[0] and err.http_status == 409
    assert "shared-id" in err.message and "already running" in err.message
    assert got[-1].WhichOneof("kind") == "done"
    assert "".join(r.text_delta for r in got) == "".join(r.text_delta for r in alone)
    assert b"".join(r.audio.pcm16 for r in got) == b"".join(r.audio.pcm16 for r in alone)


@pytest.mark.parametrize(("rid", "needle"), [("r" * 257, "at most 256 characters"),
                                              ("two words", "printable ASCII"), ("a\nb", "printable ASCII")])
def test_grpc_bad_request_id_is_invalid_argument(mesh, rid, needle):
    req = _grpc_request()
    req.request_id = rid
    with grpc.insecure_channel(mesh.grpc) as ch:
        responses = list(omni_pb2_grpc.OmniStub(ch).Generate(req, timeout=TIMEOUT_S))
    assert [r.WhichOneof("kind") for r in responses] == ["error"]
    assert responses[0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert needle in responses[0].error.message


# ------------------------------------------------------------------------------------------- error paths
def test_malformed_json_is_400(mesh):
    err = _openai_error(_post(mesh, content=b'{"model": "tiny-qwen3-omni", "messages": ['), 400)
    assert err["type"] == "invalid_request_error"
    assert "JSON" in err["message"]


def test_body_must_be_an_object(mesh):
    err = _openai_error(_post(mesh, content=b"[1, 2, 3]"), 400)
    assert "object" in err["message"]


def test_missing_messages_is_400(mesh):
    body = _body()
    del body["messages"]
    err = _openai_error(_post(mesh, body), 400)
    assert err["param"] == "messages" and "messages" in err["message"]


@pytest.mark.parametrize("field,value,param", [
    ("max_tokens", "ten", "max_tokens"),
    ("messages", 5, "messages"),
    ("temperature", "hot", "temperature"),
    ("stream", "yes", "stream"),
    ("stage_params", {"talker": {"max_tokens": "many"}}, "stage_params.talker.max_tokens"),
])
def test_wrong_types_are_400(mesh, field, value, param):
    err = _openai_error(_post(mesh, _body(**{field: value})), 400)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert param in err["message"]


def test_out_of_range_sampling_is_400(mesh):
    err = _openai_error(_post(mesh, _body(temperature=5)), 400)
    assert err["param"] == "temperature" and "[0, 2]" in err["message"]


def test_unknown_model_is_404(mesh):
    err = _openai_error(_post(mesh, _body(model="gpt-4o")), 404)
    assert err["type"] == "not_found_error" and err["param"] == "model"
    assert "gpt-4o" in err["message"] and MODEL in err["message"]
    # the openai client raises its NotFoundError for it
    with pytest.raises(openai.NotFoundError):
        _client(mesh).chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])


def test_unknown_voice_is_400_listing_the_voices(mesh):
    err = _openai_error(_post(mesh, _body(audio={"voice": "darth", "format": "wav"})), 400)
    assert err["param"] == "audio.voice"
    assert "darth" in err["message"]
    assert all(v in err["message"].lower() for v in VOICES), err["message"]


def test_unknown_voice_streaming_is_400_before_the_stream(mesh):
    with httpx.stream("POST", f"{mesh.rest}/v1/chat/completions",
                      json=_body(stream=True, audio={"voice": "darth", "format": "wav"}), timeout=TIMEOUT_S) as r:
        r.read()
    _openai_error(r, 400)


def test_declared_oversize_body_is_413(mesh):
    """A Content-Length over the limit is refused before the body is read (raw socket: we never send it)."""
    u = urlsplit(mesh.rest)
    with socket.create_connection((u.hostname, u.port), timeout=TIMEOUT_S) as s:
        s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {200 * 1024 * 1024}\r\nConnection: close\r\n\r\n{{".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"413", head
    err = json.loads(payload)["error"]
    assert set(err) == OPENAI_ERROR_KEYS and str(200 * 1024 * 1024) in err["message"], err


def test_streamed_oversize_body_is_413(mesh):
    """Without a Content-Length (chunked upload) the limit is enforced while reading."""
    block = b" " * (1024 * 1024)

    def body():
        yield b'{"model": "tiny-qwen3-omni", "messages": [], "pad": "'
        for _ in range(65):  # 65 MiB > the 64 MiB default limit
            yield block
        yield b'"}'

    try:
        r = httpx.post(f"{mesh.rest}/v1/chat/completions", content=body(),
                       headers={"content-type": "application/json"}, timeout=TIMEOUT_S)
    except (httpx.WriteError, httpx.RemoteProtocolError, httpx.ReadError):
        pytest.skip("the server closed the upload before the client read the answer (allowed by HTTP)")
    err = _openai_error(r, 413)
    assert "limit" in err["message"]


def test_prompt_longer_than_max_model_len_is_400(mesh):
    err = _openai_error(_post(mesh, _body("sea " * 5000)), 400)
    m = re.search(r"the prompt is (\d+) tokens", err["message"])
    assert m and int(m.group(1)) > 4096, err["message"]
    assert "4096" in err["message"], err["message"]
    # and the streaming variant answers the same status before any event
    with httpx.stream("POST", f"{mesh.rest}/v1/chat/completions", json=_body("sea " * 5000, stream=True),
                      timeout=TIMEOUT_S) as r:
        r.read()
    _openai_error(r, 400)


def test_max_tokens_beyond_the_context_is_400(mesh):
    err = _openai_error(_post(mesh, _body(max_tokens=10_000)), 400)
    assert err["param"] == "max_tokens" and "10000" in err["message"] and "4096" in err["message"], err


def _image_body(url: str) -> dict:
    return _body(modalities=["text"], audio=None,
                 messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                        {"type": "text", "text": "What is this?"}]}])


def test_remote_image_url_not_allowed_is_400(mesh):
    # this mesh allows no media domains, so any http(s) URL is refused, without fetching it
    err = _openai_error(_post(mesh, _image_body("http://example.com/cat.png")), 400)
    assert err["param"] == "messages[0].content[0].image_url.url"
    assert "allowed media domains" in err["message"] and "disabled" in err["message"], err["message"]


def test_file_url_is_400(mesh):
    err = _openai_error(_post(mesh, _image_body("file:///etc/passwd")), 400)
    assert err["param"] == "messages[0].content[0].image_url.url"
    assert "'file:'" in err["message"] and "not allowed" in err["message"], err["message"]


def test_inline_image_is_accepted(mesh):
    url = "data:image/png;base64," + base64.b64encode(png_bytes(32)).decode()
    r = _post(mesh, _image_body(url))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]


def test_n_choices_are_seeded_runs(mesh):
    """OpenAI's `n`: choice i is the run a single request with seed + i gives (text and audio), the usage counts
    the prompt once and every choice's tokens; streamed, each choice's chunks carry its index and its own end."""
    body = _body(n=2, temperature=0.9, seed=5, max_tokens=MAX_TOKENS)
    r = _post(mesh, body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    alone = [_post(mesh, _body(temperature=0.9, seed=5 + i, max_tokens=MAX_TOKENS)).json() for i in range(2)]
    for choice, single in zip(choices, alone, strict=True):
        assert choice["message"]["content"] == single["choices"][0]["message"]["content"]
        _assert_same_audio(_wav_samples(base64.b64decode(choice["message"]["audio"]["data"])),
                           _wav_samples(base64.b64decode(single["choices"][0]["message"]["audio"]["data"])))
    assert choices[0]["message"]["audio"]["id"] != choices[1]["message"]["audio"]["id"]
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == alone[0]["usage"]["prompt_tokens"]
    assert usage["completion_tokens"] == sum(a["usage"]["completion_tokens"] for a in alone)
    texts, ends = {0: "", 1: ""}, {}
    text_only = {**body, "modalities": ["text"], "audio": None, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{mesh.rest}/v1/chat/completions", json=text_only, timeout=TIMEOUT_S) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: "):])
                for c in chunk["choices"]:
                    texts[c["index"]] += c["delta"].get("content") or ""
                    if c.get("finish_reason"):
                        ends[c["index"]] = c["finish_reason"]
                if chunk.get("usage"):
                    assert chunk["usage"]["completion_tokens"] == usage["completion_tokens"]
    assert texts == {i: c["message"]["content"] for i, c in enumerate(choices)} and set(ends) == {0, 1}


def test_priority_needs_the_priority_policy(mesh):
    """This mesh schedules fcfs: a request priority is refused by the thinker, as vLLM refuses it, naming the flag."""
    err = _openai_error(_post(mesh, _body(priority=2)), 400)
    assert "priority 2 needs --scheduling-policy priority" in err["message"], err
    assert _post(mesh, _body(priority=0, modalities=["text"], audio=None)).status_code == 200


def test_a_requests_processor_settings(mesh, tiny_model_dir):
    """mm_processor_kwargs per request (vLLM's): max_pixels lowers an image's vision tokens exactly as a server
    started with that setting would; a bad value is a 400 naming the field."""
    from gateway.prompt import PromptBuilder
    from reference import chat_request

    png = png_bytes(128)
    body = _image_body("data:image/png;base64," + base64.b64encode(png).decode())
    r = _post(mesh, {**body, "mm_processor_kwargs": {"max_pixels": 4096}})
    assert r.status_code == 200, r.text
    req = chat_request("What is this?", None, png, max_tokens=1, talker_max=1, modalities=("text",))
    want = PromptBuilder(tiny_model_dir, max_model_len=4096, processor_kwargs={"max_pixels": 4096})(req)
    assert r.json()["usage"]["prompt_tokens"] == want.input_ids.numel()
    assert r.json()["usage"]["prompt_tokens"] < _post(mesh, body).json()["usage"]["prompt_tokens"]
    err = _openai_error(_post(mesh, {**body, "mm_processor_kwargs": {"max_pixels": 0}}), 400)
    assert err["param"] == "mm_processor_kwargs" and "must be positive" in err["message"]


def test_unknown_route_is_openai_shaped_404(mesh):
    r = httpx.get(f"{mesh.rest}/v1/nothing-here", timeout=TIMEOUT_S)
    _openai_error(r, 404)


def test_mesh_still_serves_after_errors(mesh):
    """Runs after the error tests (file order): nothing crashed, nothing is left running."""
    r = _post(mesh, _body())
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]
    assert httpx.get(f"{mesh.rest}/health", timeout=TIMEOUT_S).status_code == 200
    assert _counter(_quiet_metrics(mesh), "omnimesh:requests_running") == 0, "no request may be left in flight"
    assert mesh.proc.proc.poll() is None, mesh.proc.output()
