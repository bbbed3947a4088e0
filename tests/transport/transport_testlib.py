"""Helpers shared by the transport tests: a tag prefix for every region they create, tensors of each
dtype, the wire round trip of a part, and small child processes that touch a region from outside."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from omnimesh.transport.host_id import SHM_DIR
from omnimesh.transport.shm_region import PREFIX
from omnimesh.v1 import stage_pb2

TAG = "txtest"  # every region these tests create is named omnimesh-rgn-txtest...
REPO = Path(__file__).resolve().parents[2]


def our_region_files() -> list[str]:
    """Region files (and half-built ones) created by these tests that still exist."""
    return sorted(p.name for p in SHM_DIR.iterdir()
                  if p.name.startswith(f"{PREFIX}{TAG}") or p.name.startswith(f".{PREFIX}{TAG}"))


def make_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype == torch.int64:
        return torch.randint(-(2**40), 2**40, shape, generator=g, dtype=torch.int64)
    return torch.randn(shape, generator=g).to(dtype)


def over_wire(part: stage_pb2.Chunk) -> stage_pb2.Chunk:
    """What a gRPC hop does to a part: serialize and parse."""
    return stage_pb2.Chunk.FromString(part.SerializeToString())


def python_child(code: str, *args: object) -> subprocess.Popen[str]:
    """A python child (numpy + omnimesh.transport only, no torch: fast to start) running `code`; its
    argv[1] is the JSON of `args`. stdin/stdout are pipes for a line protocol."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-c", code, json.dumps(args)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)


def read_line(child: subprocess.Popen[str]) -> str:
    assert child.stdout is not None
    line = child.stdout.readline().strip()
    if not line:
        child.kill()
        _out, err = child.communicate(timeout=10)
        raise AssertionError(f"child said nothing; stderr:\n{err}")
    return line
