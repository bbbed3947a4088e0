"""gateway/rest_socket.py: the REST front's socket, bound before anything serves. A TCP port in use and a
--uds path that is a plain file or a live server's socket are errors naming the flag; an earlier run's stale
socket file is replaced; `omnimesh serve` checks the gateway's ports before any stage starts (exit 2 at once), and a
stage its host and port; a port outside 0-65535 or a host that is not this machine's is an error, not a traceback;
an IPv6 host is written [v6]:PORT wherever an address is formed."""

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
    # port 0 (any free one) too: the host is checked before the weights load, not by gRPC's bind after them
    out = subprocess.run([sys.executable, "-m", "omnimesh.cli", "stage", "encoder", "--host", "no-such-host.invalid",
                          "--port", "0", "--device", "cpu"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "cannot listen on host 'no-such-host.invalid'" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "loaded" not in out.stderr


def test_a_gateway_on_a_taken_port_stops_before_it_waits_for_its_stages(capsys) -> None:
    """`omnimesh gateway` alone checks its ports first (it learnt of a taken --port only after waiting for its
    stages, up to --stage-start-timeout: 600 s by default)."""
    from omnimesh.cli import main

    held, spare = rest_socket("127.0.0.1", 0), rest_socket("127.0.0.1", 0)
    port, free = held.getsockname()[1], spare.getsockname()[1]
    spare.close()
    try:
        for flag in ("--port", "--grpc-port"):
            other = "--grpc-port" if flag == "--port" else "--port"
            started = time.monotonic()
            assert main(["gateway", "--host", "127.0.0.1", flag, str(port), other, str(free),
                         "--stages", "thinker=127.0.0.1:9"]) == 2
            assert f"{flag} {port}: cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
            assert time.monotonic() - started < 10
    finally:
        held.close()


def test_serve_checks_the_stage_ports_its_base_port_fixes(capsys) -> None:
    """A taken port among --stage-base-port's: exit 2 naming that flag before any stage loads (the stage failed
    after loading, naming a --port the user never gave)."""
    from omnimesh.cli import main

    spare = [rest_socket("127.0.0.1", 0) for _ in range(3)]
    gateway_port, grpc_port, base = (sock.getsockname()[1] for sock in spare)
    for sock in spare[:2]:
        sock.close()
    held = spare[2]  # the first stage's port
    try:
        assert main(["serve", "--port", str(gateway_port), "--grpc-port", str(grpc_port),
                     "--stage-base-port", str(base)]) == 2
        err = capsys.readouterr().err
        assert f"--stage-base-port {base}: port {base} (of the stages' {base}-{base + 3}) cannot be listened on" in err
    finally:
        held.close()


def test_a_port_out_of_range_or_a_host_not_here_is_refused() -> None:
    for port in (-1, 65536, 99999):
        with pytest.raises(BindError, match=rf"--port {port}: a port is a number in 0-65535 \(0: any free one\)"):
            rest_socket("127.0.0.1", port)
    for host in ("no-such-host.invalid", "192.0.2.1"):  # not resolvable; TEST-NET-1, no address of this host
        with pytest.raises(BindError, match=rf"cannot listen on host '{host}' \(.*\): give an address of this "
                                            r"machine, or 0.0.0.0 / :: for all of them"):
            rest_socket(host, 0)


def test_an_ipv6_host_is_bracketed_where_an_address_is_written() -> None:
    from omnimesh.config.serve_args import ServeArgs
    from omnimesh.launcher import MeshLauncher
    from omnimesh.server.grpc_server import listen_address

    assert listen_address("::1", 5) == "[::1]:5" and listen_address("[::1]", 5) == "[::1]:5"
    assert listen_address("127.0.0.1", 5) == "127.0.0.1:5" and listen_address("omni.local", 5) == "omni.local:5"
    _probe, what = MeshLauncher(ServeArgs(host="::1", port=8123), Path("unused"))._gateway_probe()
    assert what == "GET http://[::1]:8123/health"


def test_a_grpc_server_listens_on_ipv6_loopback() -> None:
    import asyncio

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from omnimesh.server.grpc_server import bind, listen_address, make_server

    try:
        socket.socket(socket.AF_INET6).bind(("::1", 0))
    except OSError:
        pytest.skip("this host has no IPv6 loopback")

    async def main() -> None:
        server, health = make_server(["omnimesh.v1.Stage"])
        port = bind(server, "::1", 0)
        await server.start()
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        try:
            async with grpc.aio.insecure_channel(listen_address("::1", port)) as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await server.stop(None)

    asyncio.run(main())


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
