"""The host id: which processes can share memory with each other.

Role: two stages may exchange shared-memory (or CUDA IPC) references only when they see the same
`/dev/shm`. The id is a random UUID kept in `/dev/shm/omnimesh-host-id`, created once by whichever process
comes first (atomically: written to a private file, then hard-linked into place), so every process of
one shared-memory namespace reads the same id, and two containers with private `/dev/shm` get different
ids even on one machine. Without a `/dev/shm` (not Linux) each process gets its own id: nothing is shared.

Data flow: stages report `host_id()` in their Info; the gateway compares producer and consumer ids per
edge to pick the transport; a consumer refuses references whose id is not its own.
"""

from __future__ import annotations

import functools
import os
import time
import uuid
from pathlib import Path

SHM_DIR = Path(os.environ.get("OMNIMESH_SHM_DIR", "/dev/shm"))
ID_FILE = "omnimesh-host-id"


def shm_available() -> bool:
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


@functools.cache
def host_id() -> str:
    if not shm_available():
        return f"private-{uuid.uuid4().hex}"
    path = SHM_DIR / ID_FILE
    for _ in range(100):
        try:
            text = path.read_text().strip()
        except FileNotFoundError:
            text = ""
        if text:
            return text
        if not path.exists():
            tmp = SHM_DIR / f"{ID_FILE}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
            tmp.write_text(uuid.uuid4().hex)
            try:
                os.link(tmp, path)  # atomic: exactly one process's id wins
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
        time.sleep(0.01)
    raise RuntimeError(f"{path} exists but stays empty; remove it")
