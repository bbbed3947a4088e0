"""The committed protobuf / gRPC code must be exactly what grpcio-tools generates from protos/."""

from pathlib import Path

from omnimesh.protogen import REPO, generate


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    fresh = generate(tmp_path)
    assert fresh, "protoc wrote nothing"
    committed_dir = REPO / "omnimesh" / "v1"
    for path in fresh:
        committed = committed_dir / path.name
        assert committed.exists(), f"{path.name} is generated but not committed; run python -m omnimesh.protogen"
        assert committed.read_bytes() == path.read_bytes(), f"{path.name} is stale; run python -m omnimesh.protogen"
    stale = {p.name for p in committed_dir.glob("*_pb2*.py*")} - {p.name for p in fresh}
    assert not stale, f"committed files no .proto generates any more: {sorted(stale)}"
