"""gateway/rest_socket.py: the REST front's socket, bound before anything serves. A TCP port in use and a
--uds path that is a plain file or a live server's socket are errors naming the flag; an earlier run's stale
socket file is replaced; `omnimesh serve` checks the gateway's ports before any stage starts (exit 2 at once)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gateway.rest_socket import check_free, rest_socket
from omnimesh.proc_utils import free_port
from omnimesh.server.grpc_server import BindError

REPO = Path(__file__).resolve().parents[2]


def test_a_port_in_use_names_the_flag() -> None:
    held = rest_socket("127.0.0.1", 0)
    port = held.getsockname()[1]
    try:
        with pytest.raises(BindError, match=rf"--port {port}: cannot listen on 127.0.0.1:{port} \(Address already in "
                                            r"use\); another server may hold it: stop it or pick another --port"):
            rest_socket("127.0.0.1", port)
        with pytest.raises(BindError, match=rf"--grpc-port {port}: cannot listen"):
            check_free("127.0.0.1", free_port(), port)
        with pytest.raises(BindError, match=rf"--port {port}:"):
            check_free("127.0.0.1", port, free_port())
    finally:
        held.close()
    rest_socket("127.0.0.1", port).close()  # free again


def test_unix_socket_paths(tmp_path: Path) -> None:
    plain = tmp_path / "file"
    plain.write_text("x")
    with pytest.raises(BindError, match="the path exists and is not a socket"):
        rest_socket("", 0, str(plain))
    path = str(tmp_path / "gw.sock")
    live = rest_socket("", 0, path)
    try:
        with pytest.raises(BindError, match="another server listens on it"):
            rest_socket("", 0, path)
    finally:
        live.close()
    again = rest_socket("", 0, path)  # the file the closed one left: stale, replaced
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(path)
    client.close()
    again.close()
    check_free("127.0.0.1", free_port(), free_port(), path)
    assert not Path(path).exists()  # the check leaves nothing behind
    with pytest.raises(BindError, match="cannot listen on it"):
        rest_socket("", 0, str(tmp_path / "missing" / "gw.sock"))


def test_serve_stops_at_once_when_the_gateways_port_is_taken() -> None:
    held = rest_socket("127.0.0.1", 0)
    port = held.getsockname()[1]
    try:
        started = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "omnimesh.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                              "--device", "cpu"], cwd=REPO, capture_output=True, text=True, timeout=120)
    finally:
        held.close()
    assert out.returncode == 2 and f"--port {port}: cannot listen on 127.0.0.1:{port}" in out.stderr, out.stderr
    assert "stage" not in out.stdout + out.stderr.split("error:")[0] and time.monotonic() - started < 60


def test_a_stage_on_a_taken_port_stops_before_it_loads() -> None:
    held = rest_socket("127.0.0.1", 0)
    port = held.getsockname()[1]
    try:
        out = subprocess.run([sys.executable, "-m", "omnimesh.cli", "stage", "thinker", "--port", str(port),
                              "--device", "cpu"], cwd=REPO, capture_output=True, text=True, timeout=120)
    finally:
        held.close()
    assert out.returncode == 2 and f"--port {port}: cannot listen on 127.0.0.1:{port}" in out.stderr, out.stderr
    assert "parameters" not in out.stderr  # no rank loaded its layers


def test_a_second_grpc_server_on_a_port_is_refused_not_shared() -> None:
    """gRPC's default SO_REUSEPORT would let both listen and split the connections between them."""
    import asyncio

    from omnimesh.server.grpc_server import bind, make_server

    async def main() -> None:
        first, _ = make_server(["omnimesh.v1.Stage"])
        port = bind(first, "127.0.0.1", 0)
        await first.start()
        try:
            second, _ = make_server(["omnimesh.v1.Stage"])
            with pytest.raises(BindError, match=rf"cannot listen on 127.0.0.1:{port}.*pick another with --grpc-port"):
                bind(second, "127.0.0.1", port, flag="--grpc-port")
        finally:
            await first.stop(None)

    asyncio.run(main())
