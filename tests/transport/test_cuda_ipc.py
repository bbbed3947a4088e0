"""CUDA IPC hand-off.

On a GPU (marked `gpu`, skipped without CUDA): a CUDA tensor exported with `CudaIpcExporter.publish` is
opened by a spawned child with `import_tensor`; the child sees the expected values, writes into the tensor
and the parent sees the write (one device memory, no copy); while the child holds it the slot is kept,
after the child drops it the exporter's sweep frees it. The encoder sends CUDA tensors as IPC handles in
cuda-ipc mode and through the host arena in shm mode.

Without a GPU: exporting a CPU tensor is refused; in cuda-ipc mode CPU tensors travel by shm; an IPC frame
that does not match its header, is stale, or whose handle cannot be opened is a FrameError naming the
tensor and request, and its slot goes back to the exporter (never stranded); a stage's /metrics shows the
exported tensors held for consumers (slots, bytes) and those taken back unreleased, once it exported one.
(`encode_handle` and `decode_handle` need CUDA tensors: they are covered by the GPU test only.)"""

from __future__ import annotations

import gc
import multiprocessing as mp

import pytest
import torch
from transport_testlib import TAG, over_wire

from omnimesh.transport.chunk_codec import ChunkAssembler
from omnimesh.transport.cuda_ipc import CudaIpcExporter
from omnimesh.transport.frames import FrameError, StageChunk
from omnimesh.transport.shm_region import RegionReader
from omnimesh.v1 import stage_pb2, tensor_pb2

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture()
def exporter():
    exp = CudaIpcExporter(f"{TAG}-x", max_slots=8)
    yield exp
    exp.close()


def _ipc_child(conn, ref_bytes: bytes, expected: list[float]) -> None:
    """The consumer process: open the handle, check, write, report; drop the tensor when told."""
    import gc

    import torch

    from omnimesh.transport.cuda_ipc import import_tensor
    from omnimesh.transport.shm_region import RegionReader
    from omnimesh.v1 import tensor_pb2

    try:
        ref = tensor_pb2.CudaIpcRef.FromString(ref_bytes)
        t = import_tensor(RegionReader(), ref, "tensor 'x' of request req-gpu")
        ok = bool(t.is_cuda and torch.equal(t.cpu(), torch.tensor(expected, dtype=t.dtype)))
        t.mul_(-1)  # write into the producer's device memory
        torch.cuda.synchronize()
        conn.send(("read", ok))
        conn.recv()  # the parent has looked at its tensor
        del t
        gc.collect()
        torch.cuda.synchronize()
        conn.send(("dropped", True))
        conn.recv()
    except BaseException as exc:  # report instead of leaving the parent waiting
        conn.send(("error", repr(exc)))


def _recv(conn, proc, timeout: float = 120.0):
    assert conn.poll(timeout), f"child silent (alive={proc.is_alive()}, exit={proc.exitcode})"
    msg = conn.recv()
    assert msg[0] != "error", msg[1]
    return msg


@pytest.mark.gpu
@needs_cuda
def test_cuda_tensor_shared_between_processes(exporter) -> None:
    ctx = mp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    sent = torch.arange(1, 17, dtype=torch.float32, device="cuda")
    expected = sent.tolist()
    ref = exporter.publish(sent, "req-gpu")
    assert ref is not None and ref.nbytes == 64 and exporter.live_slots == 1
    proc = ctx.Process(target=_ipc_child, args=(child_conn, ref.SerializeToString(), expected), daemon=True)
    proc.start()
    try:
        assert _recv(parent_conn, proc) == ("read", True)
        torch.cuda.synchronize()
        assert sent.tolist() == [-v for v in expected]  # the child's write is in our memory: no copy was made
        assert exporter.sweep(deep=True) == 0 and exporter.live_slots == 1  # held by a live consumer
        parent_conn.send("drop")
        assert _recv(parent_conn, proc) == ("dropped", True)
        assert exporter.sweep() == 1 and exporter.live_slots == 0
        parent_conn.send("bye")
        proc.join(60)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)


@pytest.mark.gpu
@needs_cuda
def test_encoder_sends_cuda_tensors_by_handle(make_transport) -> None:
    producer = make_transport("gpu-enc", preference="cuda-ipc")
    x = torch.randn(4, 4, device="cuda")
    parts = producer.encoder("cuda-ipc", "req-e").parts(StageChunk(tensors={"x": x, "y": torch.ones(3)}))
    assert [f.WhichOneof("payload") for f in parts[0].tensors] == ["cuda_ipc", "shm"]
    got = _scrape(producer)
    assert (got["omnimesh:cuda_ipc_slots_in_use"], got["omnimesh:cuda_ipc_held_bytes"]) == (1, 64)
    assert producer.release("req-e") == 2
    # shm mode: the CUDA tensor is copied to the host arena, and comes back equal
    parts = producer.encoder("shm", "req-s").parts(StageChunk(tensors={"x": x}))
    assert parts[0].tensors[0].WhichOneof("payload") == "shm"
    chunk = ChunkAssembler(RegionReader(), "req-s").add(over_wire(parts[0]))
    assert chunk is not None and torch.equal(chunk.tensors["x"], x.cpu())


def test_exporting_a_cpu_tensor_is_refused(exporter) -> None:
    with pytest.raises(ValueError, match="needs a CUDA tensor, got one on cpu"):
        exporter.publish(torch.ones(2), "req-cpu")
    assert exporter.live_slots == 0


def test_cpu_tensors_travel_by_shm_in_cuda_ipc_mode(make_transport) -> None:
    producer = make_transport("ipc-cpu", preference="cuda-ipc")
    sent = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    parts = producer.encoder("cuda-ipc", "req-c").parts(StageChunk(tensors={"codes": sent}))
    assert parts[0].tensors[0].WhichOneof("payload") == "shm"
    chunk = ChunkAssembler(RegionReader(), "req-c").add(over_wire(parts[0]))
    assert chunk is not None and torch.equal(chunk.tensors["codes"], sent)


def _scrape(transport) -> dict[str, float]:
    """The transport's series by name, as a stage's Metrics RPC renders them."""
    from prometheus_client import CollectorRegistry, generate_latest

    from omnimesh.transport.transport_metrics import register_transport_metrics

    registry = CollectorRegistry()
    register_transport_metrics(registry, transport, {"stage": "encoder"})
    return {line.split("{")[0]: float(line.rsplit(" ", 1)[1])
            for line in generate_latest(registry).decode().splitlines() if line.startswith("omnimesh:")}


def test_the_metrics_show_exported_tensors_held_and_reclaimed(make_transport) -> None:
    producer = make_transport("ipc-metrics", preference="cuda-ipc")
    assert not any(name.startswith("omnimesh:cuda_ipc") for name in _scrape(producer))  # none exported yet
    producer._ipc = CudaIpcExporter(producer.tag, max_slots=8)  # as its first publish_ipc makes it
    for nbytes in (64, 4096):  # published by hand: no CUDA here
        producer.ipc._publish(producer.ipc._take_slot(), "req-m", 0, nbytes, 0.0)
    got = _scrape(producer)
    assert (got["omnimesh:cuda_ipc_slots_in_use"], got["omnimesh:cuda_ipc_held_bytes"]) == (2, 4160)
    assert got["omnimesh:cuda_ipc_reclaimed_total"] == 0
    assert producer.release("req-m") == 2  # the caller dropped the frames undelivered
    got = _scrape(producer)
    assert (got["omnimesh:cuda_ipc_slots_in_use"], got["omnimesh:cuda_ipc_held_bytes"]) == (0, 0)
    assert got["omnimesh:cuda_ipc_reclaimed_total"] == 2


def _ipc_part(exporter: CudaIpcExporter, handle: bytes, nbytes: int = 16, shape=(4,)) -> stage_pb2.Chunk:
    """An IPC frame for a slot published by hand (no CUDA here: the handle is whatever the test says)."""
    slot = exporter._take_slot()
    assert slot is not None
    generation = exporter._publish(slot, "req-ipc", 0, nbytes, 0.0)
    ref = tensor_pb2.CudaIpcRef(host_id=exporter.host_id, region=exporter.name, slot=slot, generation=generation,
                                device=0, handle=handle, nbytes=nbytes)
    return stage_pb2.Chunk(tensors=[tensor_pb2.TensorFrame(name="hidden", dtype="float32", shape=list(shape),
                                                           cuda_ipc=ref)])


def test_unopenable_handle_is_a_frame_error_and_frees_the_slot(exporter) -> None:
    part = _ipc_part(exporter, b"{not json")
    with pytest.raises(FrameError, match="tensor 'hidden' of request req-ipc"):
        ChunkAssembler(RegionReader(), "req-ipc").add(part)
    gc.collect()
    assert exporter.sweep() == 1 and exporter.live_slots == 0  # claimed, then released on the failure


def test_ipc_frame_not_matching_its_header(exporter) -> None:
    part = _ipc_part(exporter, b"{}", nbytes=16, shape=(5,))
    with pytest.raises(FrameError, match=r"tensor 'hidden' of request req-ipc: the IPC handle covers 16 bytes"):
        ChunkAssembler(RegionReader(), "req-ipc").add(part)
    exporter.end_request("req-ipc", cancelled=True)
    assert exporter.sweep(deep=True) == 0 and exporter.live_slots == 0


def test_stale_ipc_reference_is_refused(exporter) -> None:
    part = _ipc_part(exporter, b"{}")
    exporter.end_request("req-ipc", cancelled=True)
    with pytest.raises(FrameError, match="released, cancelled or expired"):
        ChunkAssembler(RegionReader(), "req-ipc").add(part)
    assert exporter.live_slots == 0
