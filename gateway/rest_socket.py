"""The REST front's listening socket, bound before anything is served, with errors that name the flag.

Data flow: --host/--port (TCP, IPv6 when the host has a colon) or --uds (a Unix socket; a stale socket file
from an earlier run is replaced, any other file refused) -> a bound, listening socket -> uvicorn serves on
it (`Server.serve(sockets=...)`), so "listening" is printed only once it is true, and a port in use is
`BindError` ("--port 8000: ... already in use"), not uvicorn's exit 3 after the gRPC front already started.
`omnimesh serve` calls `check_free` on the gateway's ports before any stage loads (a taken port stops the
mesh at once instead of after minutes of loading).
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat

from omnimesh.server.grpc_server import BindError, bound_socket, check_port

BACKLOG = 2048  # uvicorn's default


def rest_socket(host: str, port: int, uds: str | None = None) -> socket.socket:
    """A listening socket for the REST API; BindError naming --port / --uds when it cannot be had."""
    if uds is not None:
        return _unix_socket(uds)
    sock = bound_socket(host, port, "--port")
    sock.listen(BACKLOG)
    return sock


def _unix_socket(path: str) -> socket.socket:
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            raise BindError(f"--uds {path}: the path exists and is not a socket; remove it or pick another path")
        if _answers(path):
            raise BindError(f"--uds {path}: another server listens on it; stop it or pick another path")
        os.unlink(path)  # an earlier run's socket file
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, 0o666)  # as uvicorn leaves it: any local user may connect (the API key still applies)
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise BindError(f"--uds {path}: cannot listen on it ({exc.strerror})") from None
    return sock


def _answers(path: str) -> bool:
    """Whether a server accepts connections on the Unix socket `path`."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


def check_free(host: str, port: int, grpc_port: int, uds: str | None = None) -> None:
    """BindError when the gateway could not listen where the flags say (checked, then let go)."""
    rest_socket(host, port, uds).close()
    if uds is not None:
        with contextlib.suppress(OSError):
            os.unlink(uds)
    check_port(host, grpc_port, "--grpc-port")
