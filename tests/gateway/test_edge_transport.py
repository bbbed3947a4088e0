"""The gateway's per-edge transport choice at connect time, from each replica's Info (host id + --transport):
co-located CPU stages hand off through shm, the vocoder's pcm too when the gateway shares the host; a stage
on another host falls back to gRPC under `auto`; a forced `shm` across hosts stops the gateway with the fix.
With replicas the choice is per producer replica and consumer host: one request's talker on this host gets
the thinker's tensors through shm, another's on a second host over gRPC."""

from __future__ import annotations

import pytest

from gateway.pipeline import StagePipeline
from omnimesh.transport.host_id import host_id
from omnimesh.transport.stage_client import StageClient
from omnimesh.v1 import stage_pb2

STAGES = ("encoder", "thinker", "talker", "vocoder")


async def _pipeline(infos: dict[str, list[stage_pb2.StageInfo]]) -> StagePipeline:
    clients = {name: [StageClient(name, f"127.0.0.1:{9 + i}") for i in range(len(infos[name]))]  # never dialled
               for name in STAGES}
    pipe = StagePipeline(clients, lambda request: None, served_models=("m",))  # type: ignore[arg-type,return-value]
    for name, replica_infos in infos.items():
        for replica, info in zip(pipe.stages[name].replicas, replica_infos):
            assert pipe.stages[name].adopt(replica, info)
    return pipe


async def _choose(infos: dict[str, list[stage_pb2.StageInfo]]) -> dict[str, str]:
    pipe = await _pipeline(infos)
    try:
        pipe.mesh.choose_transports()
        return pipe.output_transport
    finally:
        for rs in pipe.stages.values():
            await rs.close()


def _info(stage: str, host: str, transport: str = "auto", device: str = "cpu") -> stage_pb2.StageInfo:
    return stage_pb2.StageInfo(stage=stage, host_id=host, transport=transport, device=device)


async def test_colocated_stages_use_shm_and_a_remote_one_grpc() -> None:
    own = host_id()  # the gateway process's own
    infos = {name: [_info(name, own)] for name in STAGES}
    assert await _choose(infos) == dict.fromkeys(STAGES, "shm")
    infos["talker"] = [_info("talker", "another-host")]  # thinker -> talker and talker -> vocoder cross hosts
    assert await _choose(infos) == {"encoder": "shm", "thinker": "grpc", "talker": "grpc", "vocoder": "shm"}


async def test_forced_shm_across_hosts_stops_the_gateway() -> None:
    own = host_id()  # the gateway process's own
    infos = {name: [_info(name, own)] for name in STAGES}
    infos["thinker"] = [_info("thinker", own, transport="shm")]
    infos["talker"] = [_info("talker", "another-host")]
    with pytest.raises(RuntimeError, match=r"stage thinker is set to --transport shm, but its consumer talker"):
        await _choose(infos)


async def test_replicas_on_two_hosts_choose_per_pair() -> None:
    own = host_id()
    infos = {name: [_info(name, own)] for name in STAGES}
    infos["talker"] = [_info("talker", own), _info("talker", "another-host")]
    pipe = await _pipeline(infos)
    try:
        pipe.mesh.choose_transports()
        # the thinker reaches one talker through shm and the other over gRPC; each talker replica sends to
        # the one vocoder: the local one through shm, the remote one over gRPC
        assert pipe.output_transport == {"encoder": "shm", "thinker": "mixed", "talker": "mixed", "vocoder": "shm"}
        thinker = pipe.stages["thinker"].replicas[0]
        local, remote = pipe.stages["talker"].replicas
        assert pipe.mesh.mode(thinker, local.host, "talker") == "shm"
        assert pipe.mesh.mode(thinker, remote.host, "talker") == "grpc"
        vocoder_host = pipe.stages["vocoder"].replicas[0].host
        assert (pipe.mesh.mode(local, vocoder_host, "vocoder"), pipe.mesh.mode(remote, vocoder_host, "vocoder")) == ("shm", "grpc")
    finally:
        for rs in pipe.stages.values():
            await rs.close()
