"""Each stage's own gRPC API (`omnimesh.v1.Stage/Process`, what a gateway, or anyone on the network in a
docker-compose or Kubernetes deployment, calls) against mutated streams: every request is answered, with a
named error for a mistake, and the stage serves on. Seeded, so a failure replays.

Data flow: a recording proxy sits between a second gateway and the shared mesh's stages and keeps each
stream the gateway sends (real requests: speech out, audio and an image in) -> the streams are mutated
(tensor dtypes, shapes, bytes and values; sampling fields, options, deadlines, transports; messages dropped,
repeated or reordered; stale shared-memory and CUDA IPC references) and sent to the stages directly -> each
stream must end within its timeout, its error (if any) must not be INTERNAL / UNKNOWN (a crash in the stage),
and every stage must still answer an untouched stream. This found a NaN deadline that stopped a stage's
engine loop for good (its health still SERVING) and NaN embeddings that failed as INTERNAL."""

from __future__ import annotations

import base64
import random
import time
import uuid
from concurrent import futures
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from mesh_harness import free_port, start_gateway
from reference import png_bytes, sine_wav

from omnimesh.v1 import stage_pb2, stage_pb2_grpc, tensor_pb2

MODEL = "tiny-qwen3-omni"
STREAMS = 300
TIMEOUT_S = 30.0
CODES = {code.value[0]: code.name for code in grpc.StatusCode}
UNLIMITED = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


def _recording_proxy(targets: dict[str, str]) -> tuple[list[grpc.Server], dict[str, str], dict[str, list]]:
    """One gRPC server per stage forwarding every call to it, keeping each Process stream's requests."""
    servers, addresses, recorded = [], {}, {name: [] for name in targets}
    for name, target in targets.items():
        channel = grpc.insecure_channel(target, options=UNLIMITED)

        class Forward(grpc.GenericRpcHandler):
            def __init__(self, name: str, channel: grpc.Channel):
                self.name, self.channel = name, channel

            def service(self, details: Any) -> Any:
                if details.method.endswith("/Process"):
                    call, kept = self.channel.stream_stream(details.method), recorded[self.name]

                    def process(requests: Any, context: Any) -> Any:
                        stream: list[bytes] = []
                        kept.append(stream)
                        kept_requests = (stream.append(r) or r for r in requests)
                        yield from call(kept_requests, metadata=context.invocation_metadata())
                    return grpc.stream_stream_rpc_method_handler(process)
                unary = self.channel.unary_unary(details.method)
                return grpc.unary_unary_rpc_method_handler(
                    lambda request, context: unary(request, metadata=context.invocation_metadata()))

        server = grpc.server(futures.ThreadPoolExecutor(8), options=UNLIMITED)
        server.add_generic_rpc_handlers([Forward(name, channel)])
        port = free_port()
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        servers.append(server)
        addresses[name] = f"127.0.0.1:{port}"
    return servers, addresses, recorded


@pytest.fixture(scope="module")
def recorded(tiny_model_dir, mesh) -> dict[str, list[list[stage_pb2.StageRequest]]]:
    servers, addresses, streams = _recording_proxy(mesh.stages)
    gateway, url = start_gateway(tiny_model_dir, addresses)
    try:
        clip = base64.b64encode(sine_wav(0.5, rate=16_000)).decode()
        image = "data:image/png;base64," + base64.b64encode(png_bytes(32)).decode()
        spoken = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "modalities": ["text", "audio"],
                  "stage_params": {"talker": {"max_tokens": 30}}}
        media = [{"type": "text", "text": "what"}, {"type": "image_url", "image_url": {"url": image}},
                 {"type": "input_audio", "input_audio": {"data": clip, "format": "wav"}}]
        heard = {"messages": [{"role": "user", "content": media}], "max_tokens": 4, "logprobs": True, "top_logprobs": 2}
        for body in (spoken, heard):
            r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, **body}, timeout=TIMEOUT_S)
            assert r.status_code == 200, r.text
    finally:
        gateway.stop()
        for server in servers:
            server.stop(0)
    out = {name: [[stage_pb2.StageRequest.FromString(b) for b in s] for s in kept if s]
           for name, kept in streams.items()}
    assert all(out.values()), {name: len(s) for name, s in out.items()}
    return out


def _mutate_tensor(t: tensor_pb2.TensorFrame, rng: random.Random) -> None:
    roll = rng.random()
    if roll < 0.15:
        t.dtype = rng.choice(["float32", "int64", "int8", "bool", "foo", "", "complex64", "float64", "bfloat16"])
    elif roll < 0.3:
        shape = list(t.shape)
        if shape and rng.random() < 0.7:
            shape[rng.randrange(len(shape))] = rng.choice([0, 1, -1, 3, 2**40])
        else:
            shape = rng.choice([[], [0], [1, 1, 1, 1], [2**31], [-3, 2]])
        del t.shape[:]
        t.shape.extend(shape)
    elif roll < 0.45 and t.WhichOneof("payload") == "data":
        t.data = rng.choice([t.data[:len(t.data) // 2], t.data + b"\0" * 8, b"", t.data[:-1]])
    elif roll < 0.65 and t.WhichOneof("payload") == "data" and t.dtype in ("int64", "float32") and t.data:
        values = np.frombuffer(t.data, dtype=np.int64 if t.dtype == "int64" else np.float32).copy()
        at = rng.randrange(values.size) if values.size else 0
        if values.size:
            values[at] = rng.choice([-1, 2**40, 10**6, -2**63]) if t.dtype == "int64" else rng.choice(
                [np.nan, np.inf, 1e38])
            t.data = values.tobytes()
    elif roll < 0.75:
        t.name = rng.choice(["input_ids", "codes", "audio_embeds", "pixel_values", "bogus", "", "prompt_embeds"])
    elif roll < 0.85:
        t.shm.CopyFrom(tensor_pb2.ShmRef(host_id="x", region=rng.choice(["", "omnimesh-nope", "../etc"]),
                                         slot=rng.randrange(10**6), generation=3, offset=rng.choice([0, 2**62]),
                                         nbytes=rng.choice([0, 8, 2**62])))
    else:
        t.cuda_ipc.CopyFrom(tensor_pb2.CudaIpcRef(host_id="x", region="r", slot=1, device=rng.choice([0, -1, 99]),
                                                  handle=b"\0" * 10, nbytes=8))


def _mutate_open(o: stage_pb2.Open, rng: random.Random) -> None:
    roll = rng.random()
    if roll < 0.5:
        field = rng.choice(["temperature", "top_p", "repetition_penalty", "presence_penalty", "min_p", "top_k", "seed",
                            "max_tokens", "min_tokens", "logprobs", "prompt_logprobs"])
        whole = field in ("top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs")
        setattr(o.sampling, field, rng.choice([-1, 0, 21, 2**31 - 1]) if whole else
                rng.choice([-1.0, 0.0, float("nan"), float("inf"), 1e30]))
    elif roll < 0.6:
        o.sampling.stop_token_ids.append(rng.choice([-1, 2**40, 5]))
    elif roll < 0.7:
        o.sampling.logit_bias[rng.choice([-1, 2**40, 3])] = rng.choice([1e9, float("nan"), 1.0])
    elif roll < 0.8:
        key = rng.choice([*o.options, "speaker", "chunk_schedule", "talker_inputs", "eager_tokens", "zzz"])
        o.options[key] = rng.choice(["", "x", "-5", "0", "0,-1", "99999999999", "nobody", "5,25,abc"])
    elif roll < 0.9:
        o.transport = rng.choice(["", "grpc", "shm", "cuda-ipc", "bogus"])
    else:
        o.deadline_unix_s = rng.choice([1.0, time.time() - 5, float("nan"), float("inf"), 1e300])


def _mutated(stream: list[stage_pb2.StageRequest], rng: random.Random) -> list[stage_pb2.StageRequest]:
    out = _fresh(stream)
    for _ in range(rng.randint(1, 3)):
        roll = rng.random()
        chunks = [m.chunk for m in out if m.WhichOneof("kind") == "chunk"]
        opens = [m.open for m in out if m.WhichOneof("kind") == "open"]
        if roll < 0.4 and any(c.tensors for c in chunks):
            _mutate_tensor(rng.choice([t for c in chunks for t in c.tensors]), rng)
        elif roll < 0.65 and opens:
            _mutate_open(opens[0], rng)
        elif roll < 0.7 and len(out) > 1:
            del out[rng.randrange(len(out))]
        elif roll < 0.75:
            again = stage_pb2.StageRequest.FromString(rng.choice(out).SerializeToString())
            out.insert(rng.randrange(len(out) + 1), again)
        elif roll < 0.8:
            rng.shuffle(out)
        elif roll < 0.9 and chunks:
            chunk = rng.choice(chunks)
            chunk.seq, chunk.final, chunk.more = rng.choice([0, 5, 2**63]), rng.random() < 0.5, rng.random() < 0.3
        elif roll < 0.95:
            out.append(stage_pb2.StageRequest(cancel=stage_pb2.Cancel(reason="fuzz")))
        else:
            out.insert(0, stage_pb2.StageRequest())  # a message of no kind
    return out


def _fresh(stream: list[stage_pb2.StageRequest]) -> list[stage_pb2.StageRequest]:
    """A copy with a new request id and a deadline from now."""
    out = [stage_pb2.StageRequest.FromString(m.SerializeToString()) for m in stream]
    for m in out:
        if m.WhichOneof("kind") == "open":
            m.open.request_id, m.open.deadline_unix_s = f"fuzz-{uuid.uuid4().hex}", time.time() + TIMEOUT_S
    return out


def _answer(stub: stage_pb2_grpc.StageStub, stream: list[stage_pb2.StageRequest]) -> tuple[str, list[str]]:
    """How the call ended (a gRPC status name, or "ended") and the kinds of what came back (errors with code)."""
    got: list[str] = []
    try:
        for r in stub.Process(iter(stream), timeout=TIMEOUT_S):
            kind = r.WhichOneof("kind")
            got.append(f"error {CODES.get(r.error.code, r.error.code)} {r.error.message}" if kind == "error" else kind)
        return "ended", got
    except grpc.RpcError as e:
        return e.code().name, got


def _serves(stubs: dict[str, stage_pb2_grpc.StageStub], recorded: dict[str, list]) -> None:
    for name, streams in recorded.items():
        ended, got = _answer(stubs[name], _fresh(streams[0]))
        assert ended == "ended" and got[-1:] == ["done"], (name, ended, got[-3:])


@pytest.mark.parametrize("seed", [1, 2])
def test_mutated_stage_streams_are_answered_and_the_stages_serve_on(mesh, recorded, seed: int) -> None:
    rng = random.Random(seed)
    channels = {name: grpc.insecure_channel(address, options=UNLIMITED) for name, address in mesh.stages.items()}
    stubs = {name: stage_pb2_grpc.StageStub(channel) for name, channel in channels.items()}
    try:
        _serves(stubs, recorded)
        for i in range(STREAMS):
            name = rng.choice(sorted(recorded))
            stream = _mutated(rng.choice(recorded[name]), rng)
            ended, got = _answer(stubs[name], stream)
            crash = ended in ("UNKNOWN", "INTERNAL", "DEADLINE_EXCEEDED", "UNAVAILABLE") or any(
                g.startswith(("error INTERNAL", "error UNKNOWN")) for g in got) or (ended == "ended" and not got)
            assert not crash, (i, name, ended, got[-3:], [str(m)[:400] for m in stream])
            if i % 30 == 29:
                _serves(stubs, recorded)
        _serves(stubs, recorded)
    finally:
        for channel in channels.values():
            channel.close()
