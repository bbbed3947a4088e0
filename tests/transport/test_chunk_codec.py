"""Inline gRPC parts: a tensor larger than piece_bytes is split into pieces (one per part, more=True on all
but the last) and reassembled equal; every malformed frame — a piece out of order, a missing piece, a piece
whose dtype/shape differs, a byte count mismatch, an unknown dtype, a duplicate tensor name — is a FrameError
that names the request and the tensor. Also the encoder's own argument checks."""

from __future__ import annotations

import pytest
import torch
from transport_testlib import make_tensor, over_wire

from omnimesh.transport.chunk_codec import ChunkAssembler, ChunkEncoder
from omnimesh.transport.frames import FrameError, StageChunk
from omnimesh.v1 import stage_pb2, tensor_pb2

RID = "req-codec-42"
PIECE = 4096


def _encode(tensors: dict[str, torch.Tensor], piece: int = PIECE, **kw) -> list[stage_pb2.Chunk]:
    return [over_wire(p) for p in ChunkEncoder("grpc", None, RID, piece_bytes=piece).parts(StageChunk(tensors=tensors, **kw))]


def _assemble(parts: list[stage_pb2.Chunk]) -> StageChunk | None:
    asm = ChunkAssembler(None, RID)
    out = None
    for i, part in enumerate(parts):
        out = asm.add(part)
        assert (out is None) == (i < len(parts) - 1)
    return out


def _raises(parts: list[stage_pb2.Chunk], name: str, match: str) -> FrameError:
    with pytest.raises(FrameError, match=match) as info:
        _assemble(parts)
    assert RID in str(info.value) and repr(name) in str(info.value), str(info.value)
    return info.value


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16], ids=str)
def test_split_and_reassembled(dtype: torch.dtype) -> None:
    big = make_tensor(dtype, (37, 301), seed=1)  # > 2 pieces even for 1-byte dtypes; not a multiple of them
    small = make_tensor(dtype, (3,), seed=2)
    nbytes = big.numel() * big.element_size()
    parts = _encode({"big": big, "small": small, "empty": make_tensor(dtype, (0, 4), 3)}, text="hi", seq=9,
                    final=True)
    pieces = [f for p in parts for f in p.tensors if f.name == "big"]
    assert len(pieces) == -(-nbytes // PIECE) > 1
    assert [f.piece_offset for f in pieces] == list(range(0, nbytes, PIECE))
    assert [p.more for p in parts] == [True] * (len(parts) - 1) + [False]
    assert [p.final for p in parts] == [False] * (len(parts) - 1) + [True]
    assert all(p.seq == 9 for p in parts)
    assert all(sum(len(f.data) for f in p.tensors) <= PIECE for p in parts)
    chunk = _assemble(parts)
    assert chunk is not None and chunk.text == "hi" and chunk.final and chunk.seq == 9
    assert torch.equal(chunk.tensors["big"], big) and torch.equal(chunk.tensors["small"], small)
    assert chunk.tensors["empty"].shape == (0, 4) and chunk.tensors["empty"].dtype == dtype


def test_small_chunk_is_one_part_and_assembler_is_reusable() -> None:
    asm = ChunkAssembler(None, RID)
    for seq in range(3):
        t = torch.full((5,), float(seq))
        parts = _encode({"x": t}, seq=seq, text=f"s{seq}")
        assert len(parts) == 1 and not parts[0].more
        chunk = asm.add(parts[0])
        assert chunk is not None and chunk.seq == seq and chunk.text == f"s{seq}" and torch.equal(chunk.tensors["x"], t)


def _big_parts() -> list[stage_pb2.Chunk]:
    parts = _encode({"audio_embeds": torch.randn(4000)})  # 16000 bytes: 4 pieces
    assert len(parts) == 4
    return parts


def test_piece_out_of_order() -> None:
    parts = _big_parts()
    parts[1], parts[2] = parts[2], parts[1]
    _raises(parts, "audio_embeds", "does not continue")


def test_missing_piece_in_the_middle() -> None:
    parts = _big_parts()
    del parts[2]
    _raises(parts, "audio_embeds", "does not continue")


def test_chunk_ends_before_its_last_piece() -> None:
    parts = _big_parts()[:-1]
    parts[-1].more = False
    _raises(parts, "audio_embeds", "ended after 12288 of 16000 bytes")


def test_first_piece_missing() -> None:
    _raises(_big_parts()[1:], "audio_embeds", "starts at byte 4096")


def test_piece_with_other_dtype() -> None:
    parts = _big_parts()
    parts[1].tensors[0].dtype = "int32"  # same item size: only the header check can catch it
    _raises(parts, "audio_embeds", "a piece says int32")


def test_piece_with_other_shape() -> None:
    parts = _big_parts()
    parts[2].tensors[0].shape[:] = [2, 2000]
    _raises(parts, "audio_embeds", r"a piece says float32 \[2, 2000\]")


def test_last_piece_too_long() -> None:
    parts = _big_parts()
    parts[-1].tensors[0].data += b"\0" * 8
    _raises(parts, "audio_embeds", "does not continue")


def test_whole_frame_byte_count_mismatch() -> None:
    for data in (b"\0" * 12, b"\0" * 20):  # shorter (then the chunk ends) and longer than 4 x float32
        part = stage_pb2.Chunk(tensors=[tensor_pb2.TensorFrame(name="codes", dtype="float32", shape=[4], data=data)])
        _raises([part], "codes", "12 of 16 bytes|20 bytes do not match")


def test_unknown_dtype() -> None:
    part = stage_pb2.Chunk(tensors=[tensor_pb2.TensorFrame(name="codes", dtype="complex32", shape=[1], data=b"1234")])
    _raises([part], "codes", "unknown dtype 'complex32'")


def test_negative_dimension() -> None:
    part = stage_pb2.Chunk(tensors=[tensor_pb2.TensorFrame(name="codes", dtype="int8", shape=[-1], data=b"")])
    _raises([part], "codes", "negative dimension")


def test_duplicate_tensor_name() -> None:
    frame = tensor_pb2.TensorFrame(name="pcm", dtype="int16", shape=[2], data=b"\1\0\2\0")
    _raises([stage_pb2.Chunk(tensors=[frame, frame])], "pcm", "appears twice")
    _raises([stage_pb2.Chunk(tensors=[frame], more=True), stage_pb2.Chunk(tensors=[frame])], "pcm", "appears twice")


def test_reference_without_a_reader() -> None:
    frame = tensor_pb2.TensorFrame(name="hidden", dtype="float32", shape=[4],
                                   shm=tensor_pb2.ShmRef(host_id="h", region="omnimesh-rgn-x", nbytes=16))
    _raises([stage_pb2.Chunk(tensors=[frame])], "hidden", "inline frames only")


def test_encoder_checks() -> None:
    with pytest.raises(ValueError, match="transport must be one of"):
        ChunkEncoder("tcp")
    with pytest.raises(ValueError, match="needs shared memory"):
        ChunkEncoder("shm", None, RID)
    with pytest.raises(FrameError, match="'z'.*complex64"):
        ChunkEncoder("grpc", None, RID).parts(StageChunk(tensors={"z": torch.zeros(2, dtype=torch.complex64)}))


def test_logprobs_travel_with_the_chunk_they_belong_to() -> None:
    """The thinker's logprob entries ride on the chunk's first part, like its text, whatever it is split into."""
    entries = [stage_pb2.TokenLogprob(token_id=7, token=b"\xe4\xb8", logprob=-0.5,
                                      top=[stage_pb2.TopLogprob(token_id=7, token=b"\xe4\xb8", logprob=-0.5)]),
               stage_pb2.TokenLogprob(token_id=9, token=b"\x96", logprob=-9999.0)]
    parts = _encode({"token_embeds": make_tensor(torch.float32, (4096,), 0)}, text="\u4e16", logprobs=entries)
    assert len(parts) > 1 and list(parts[0].logprobs) == entries and not any(p.logprobs for p in parts[1:])
    out = _assemble(parts)
    assert out is not None and out.text == "\u4e16" and out.logprobs == entries
    assert _assemble(_encode({"token_ids": torch.tensor([1])})).logprobs == []  # none asked, none sent
