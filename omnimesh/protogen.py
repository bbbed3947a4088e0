"""Regenerates the protobuf / gRPC Python code in `omnimesh/v1/` from `protos/omnimesh/v1/*.proto`.

The generated modules are committed; `tests/test_protogen.py` regenerates them into a temporary folder
and fails when they differ from the committed ones. Run after editing a .proto:

    python -m omnimesh.protogen
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "protos"
PROTO_FILES = ("tensor.proto", "stage.proto", "omni.proto")


def generate(out_root: Path) -> list[Path]:
    """Write `omnimesh/v1/*_pb2{,_grpc}.py(i)` under `out_root`; return the files written."""
    import grpc_tools
    from grpc_tools import protoc  # test/dev dependency only

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    out_root.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[str(PROTO_ROOT / "omnimesh" / "v1" / name) for name in PROTO_FILES],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted((out_root / "omnimesh" / "v1").glob("*_pb2*.py*"))


def main() -> int:
    written = generate(REPO)
    print("\n".join(str(p.relative_to(REPO)) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
