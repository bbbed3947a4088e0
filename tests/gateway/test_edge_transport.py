"""The gateway's per-edge transport choice at connect time, from each stage's Info (host id + --transport):
co-located CPU stages hand off through shm, the vocoder's pcm too when the gateway shares the host; a stage
on another host falls back to gRPC under `auto`; a forced `shm` across hosts stops the gateway with the fix."""

from __future__ import annotations

import pytest

from gateway.pipeline import StagePipeline
from omnimesh.transport.host_id import host_id
from omnimesh.transport.stage_client import StageClient
from omnimesh.v1 import stage_pb2

STAGES = ("encoder", "thinker", "talker", "vocoder")


async def _choose(infos: dict[str, stage_pb2.StageInfo]) -> dict[str, str]:
    clients = {name: StageClient(name, "127.0.0.1:9") for name in STAGES}  # never dialled
    try:
        pipe = StagePipeline(clients, lambda request: None, served_models=("m",))  # type: ignore[arg-type,return-value]
        pipe._choose_transports(infos)
        return pipe.output_transport
    finally:
        for c in clients.values():
            await c.close()


def _info(host: str, transport: str = "auto", device: str = "cpu") -> stage_pb2.StageInfo:
    return stage_pb2.StageInfo(host_id=host, transport=transport, device=device)


async def test_colocated_stages_use_shm_and_a_remote_one_grpc() -> None:
    own = host_id()  # the gateway process's own
    infos = {name: _info(own) for name in STAGES}
    assert await _choose(infos) == dict.fromkeys(STAGES, "shm")
    infos["talker"] = _info("another-host")  # thinker -> talker and talker -> vocoder cross hosts
    assert await _choose(infos) == {"encoder": "shm", "thinker": "grpc", "talker": "grpc", "vocoder": "shm"}


async def test_forced_shm_across_hosts_stops_the_gateway() -> None:
    own = host_id()  # the gateway process's own
    infos = {name: _info(own) for name in STAGES}
    infos["thinker"] = _info(own, transport="shm")
    infos["talker"] = _info("another-host")
    with pytest.raises(RuntimeError, match=r"stage thinker is set to --transport shm, but its consumer talker"):
        await _choose(infos)
