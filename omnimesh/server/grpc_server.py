"""A grpc.aio server with what every omnimesh server carries: health, reflection, message limits,
graceful shutdown on SIGTERM / SIGINT.

Used by every stage service and by the gateway's gRPC front. `serve_forever` binds, marks the given
services SERVING, waits for a signal, then marks them NOT_SERVING and stops with a grace period.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
from collections.abc import Callable, Iterable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# every server's: gRPC's default (1) lets a second server bind a port another already listens on, and the kernel
# then splits the connections between them: a stale stage or gateway would silently answer part of the traffic
SERVER_OPTIONS = [("grpc.so_reuseport", 0)]


class BindError(RuntimeError):
    """The port could not be bound (in use, or not allowed)."""


def make_server(
    service_names: Iterable[str], options: list[tuple[str, int]] | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """A grpc.aio server with `grpc.health.v1` and reflection (listing `service_names`) registered."""
    server = grpc.aio.server(options=(options if options is not None else GRPC_OPTIONS) + SERVER_OPTIONS,
                             interceptors=interceptors or None)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    return server, health_servicer


def listen_address(host: str, port: int) -> str:
    """host:port as gRPC reads it: an IPv6 literal in brackets ([::1]:50051)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def bound_socket(host: str, port: int, flag: str) -> socket.socket:
    """A TCP socket bound to host:port (IPv6 when the host has a colon); BindError naming `flag` when it cannot be."""
    if not 0 <= port <= 65535:
        raise BindError(f"{flag} {port}: a port is a number in 0-65535 (0: any free one)")
    host = host.removeprefix("[").removesuffix("]")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
            raise BindError(f"cannot listen on host {host!r} ({exc.strerror}): give an address of this machine, or "
                            f"0.0.0.0 / :: for all of them") from None
        raise BindError(f"{flag} {port}: cannot listen on {host}:{port} ({exc.strerror}); another server may "
                        f"hold it: stop it or pick another {flag}") from None
    return sock


def check_port(host: str, port: int, flag: str) -> None:
    """BindError naming `flag` when host:port cannot be listened on now (checked and let go: a server about to
    spend minutes loading learns it at once)."""
    bound_socket(host, port, flag).close()


def bind(server: grpc.aio.Server, host: str, port: int, credentials: grpc.ServerCredentials | None = None,
         flag: str = "--port") -> int:
    """Listen on host:port, with TLS when `credentials` are given; the port bound (0 is any free one). `flag`:
    the flag that sets the port, for the error."""
    try:
        address = listen_address(host, port)
        bound = server.add_insecure_port(address) if credentials is None else server.add_secure_port(address, credentials)
    except RuntimeError as exc:
        raise BindError(f"cannot listen on {host}:{port}: {exc} (is the port in use? pick another with {flag})") from exc
    if bound == 0:
        raise BindError(f"cannot listen on {host}:{port} (is the port in use? pick another with {flag})")
    return bound


async def serve_forever(
    server: grpc.aio.Server,
    health_servicer: health.aio.HealthServicer,
    service_names: Iterable[str],
    *,
    grace_s: float = 5.0,
    on_stop: Callable[[], object] | None = None,
) -> None:
    await server.start()
    for name in ["", *service_names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down (grace %.1fs)", grace_s)
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace_s)
    if on_stop is not None:
        result = on_stop()
        if asyncio.iscoroutine(result):
            await result
