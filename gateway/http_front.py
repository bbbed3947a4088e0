"""The gateway's HTTP(S) front options, as vLLM's server flags: CORS, TLS, access log, X-Request-Id.

Data flow: the gateway's `ServeArgs` -> `HttpFront.from_args` (every value checked, files loaded once,
so a wrong path or a key that does not match its certificate stops start-up with the flag named) ->
- `install(app)`: `RootPathMiddleware` (with `--root-path`: the path prefix of a proxy in front, as vLLM's
  FastAPI root_path: requests are routed with or without it, and the paths the gateway names carry it),
  `RequestIdMiddleware` (with `--enable-request-id-headers`) and Starlette's
  `CORSMiddleware` (with `--allowed-origins`) around the app; CORS is the outermost layer, so a browser's
  preflight `OPTIONS` is answered before the API-key check (it carries no key) and a 401 still carries
  the CORS headers the browser needs to read it;
- `uvicorn_kwargs()`: TLS (`--ssl-keyfile` / `--ssl-certfile`, client certificates checked against
  `--ssl-ca-certs` as `--ssl-cert-reqs` says), the access log (one line per request, on unless
  `--disable-uvicorn-access-log`), `--uvicorn-log-level` and `--uds` (the REST API on a Unix domain socket
  instead of --host:--port);
- `grpc_credentials()`: the same key and certificate for the gRPC Omni front (a client certificate is
  required there only with `--ssl-cert-reqs 2`: gRPC has no "optional").
Without any of these flags nothing is installed: no CORS headers (browsers on another origin are
refused, the safe default; vLLM answers every origin), plain HTTP, the access log on.
"""

from __future__ import annotations

import json
import os
import ssl
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from omnimesh.server.grpc_server import listen_address

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
CERT_REQS = {0: "none", 1: "optional", 2: "required"}  # ssl.CERT_NONE / CERT_OPTIONAL / CERT_REQUIRED
REQUEST_ID_HEADER = b"x-request-id"
UDS_PATH_MAX = 107  # sockaddr_un.sun_path (108 bytes on Linux) less its terminating NUL


def parse_list(text: str | None, flag: str) -> tuple[str, ...] | None:
    """A JSON list of strings (vLLM's form: '["https://a.example"]') or comma-separated values; None: not given."""
    if text is None:
        return None
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            value = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{flag}: not a JSON list ({exc.msg}); give e.g. '[\"https://app.example\"]' "
                             f"or comma-separated values") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{flag}: the JSON list must hold strings, got {stripped!r}")
        items = tuple(v.strip() for v in value if v.strip())
    else:
        items = tuple(v.strip() for v in stripped.split(",") if v.strip())
    if not items:
        raise ValueError(f"{flag} is empty; leave the flag out instead")
    return items


def check_front_args(args: Any) -> None:
    """The combinations that cannot work, named before anything starts (ServeArgs.__post_init__)."""
    origins = parse_list(args.allowed_origins, "--allowed-origins")
    parse_list(args.allowed_methods, "--allowed-methods")
    parse_list(args.allowed_headers, "--allowed-headers")
    if origins is None:
        for flag, given in (("--allowed-methods", args.allowed_methods is not None),
                            ("--allowed-headers", args.allowed_headers is not None),
                            ("--allow-credentials", args.allow_credentials)):
            if given:
                raise ValueError(f"{flag} has no effect without --allowed-origins (the origins browsers may call from)")
    elif args.allow_credentials and "*" in origins:
        raise ValueError("--allow-credentials with --allowed-origins '*' would let every web page use a visitor's "
                         "credentials; list the origins instead")
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together (the private key and its certificate chain)")
    if args.ssl_keyfile is None and (args.ssl_ca_certs is not None or args.ssl_cert_reqs):
        raise ValueError("--ssl-ca-certs / --ssl-cert-reqs need --ssl-keyfile and --ssl-certfile (TLS on)")
    if args.ssl_cert_reqs not in CERT_REQS:
        raise ValueError(f"--ssl-cert-reqs must be 0 (no client certificate), 1 (optional) or 2 (required), "
                         f"got {args.ssl_cert_reqs}")
    if args.ssl_cert_reqs and args.ssl_ca_certs is None:
        raise ValueError("--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs (the CAs client certificates are checked against)")
    if args.uvicorn_log_level not in UVICORN_LOG_LEVELS:
        raise ValueError(f"--uvicorn-log-level must be one of {', '.join(UVICORN_LOG_LEVELS)}, got {args.uvicorn_log_level!r}")
    root = args.root_path
    if root is not None and (not root.startswith("/") or root.endswith("/") or any(c in root for c in "?#% ")):
        raise ValueError(f"--root-path must be a URL path that starts with / and does not end with one, e.g. /omni; "
                         f"got {root!r}")
    if args.uds is not None:
        folder = Path(args.uds).parent
        if not args.uds.strip() or not os.path.isdir(folder):
            raise ValueError(f"--uds {args.uds!r}: its folder {str(folder)!r} does not exist")
        if len(os.fsencode(args.uds)) > UDS_PATH_MAX:
            raise ValueError(f"--uds {args.uds!r}: a Unix socket path holds at most {UDS_PATH_MAX} bytes; pick a "
                             f"shorter one")


def _read(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read it ({exc.strerror})") from None


@dataclass(frozen=True, slots=True)
class Tls:
    keyfile: str
    certfile: str
    ca_certs: str | None
    cert_reqs: int
    key_pem: bytes
    cert_pem: bytes
    ca_pem: bytes | None

    @classmethod
    def load(cls, keyfile: str, certfile: str, ca_certs: str | None, cert_reqs: int) -> Tls:
        key, cert = _read(keyfile, "--ssl-keyfile"), _read(certfile, "--ssl-certfile")
        ca = None if ca_certs is None else _read(ca_certs, "--ssl-ca-certs")
        probe = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)  # what uvicorn will do, done now to name the flag
        try:
            probe.load_cert_chain(certfile, keyfile)
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(f"--ssl-certfile {certfile} / --ssl-keyfile {keyfile}: not a matching PEM certificate "
                             f"and private key ({exc})") from None
        if ca_certs is not None:
            try:
                probe.load_verify_locations(ca_certs)
            except (ssl.SSLError, OSError) as exc:
                raise ValueError(f"--ssl-ca-certs {ca_certs}: not PEM CA certificates ({exc})") from None
        return cls(keyfile, certfile, ca_certs, cert_reqs, key, cert, ca)


@dataclass(frozen=True, slots=True)
class HttpFront:
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    request_id_headers: bool = False
    access_log: bool = True
    uvicorn_log_level: str = "info"
    tls: Tls | None = None
    root_path: str = ""
    uds: str | None = None

    @classmethod
    def from_args(cls, args: Any) -> HttpFront:
        check_front_args(args)
        tls = None
        if args.ssl_keyfile is not None:
            tls = Tls.load(args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs, args.ssl_cert_reqs)
        return cls(allowed_origins=parse_list(args.allowed_origins, "--allowed-origins") or (),
                   allowed_methods=parse_list(args.allowed_methods, "--allowed-methods") or ("*",),
                   allowed_headers=parse_list(args.allowed_headers, "--allowed-headers") or ("*",),
                   allow_credentials=args.allow_credentials, request_id_headers=args.enable_request_id_headers,
                   access_log=not args.disable_uvicorn_access_log, uvicorn_log_level=args.uvicorn_log_level, tls=tls,
                   root_path=args.root_path or "", uds=args.uds)

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    def rest_url(self, host: str, port: int) -> str:
        """Where the REST API answers, for the start-up lines: scheme://host:port/v1, or its Unix socket (--uds)."""
        if self.uds is not None:
            return f"{self.scheme} over unix:{self.uds}, /v1"
        return f"{self.scheme}://{listen_address(host, port)}/v1"

    def install(self, app: Any) -> None:
        """Call after every other middleware: the last one added is the outermost."""
        from starlette.middleware.cors import CORSMiddleware

        if self.root_path:
            app.add_middleware(RootPathMiddleware, root_path=self.root_path)
        if self.request_id_headers:
            app.add_middleware(RequestIdMiddleware)
        if self.allowed_origins:
            app.add_middleware(CORSMiddleware, allow_origins=list(self.allowed_origins),
                               allow_methods=list(self.allowed_methods), allow_headers=list(self.allowed_headers),
                               allow_credentials=self.allow_credentials)

    def uvicorn_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"log_level": self.uvicorn_log_level, "access_log": self.access_log,
                                  "log_config": None,  # records go to the process's logging set-up (our format)
                                  "uds": self.uds}
        if self.tls:
            kwargs.update(ssl_keyfile=self.tls.keyfile, ssl_certfile=self.tls.certfile,
                          ssl_ca_certs=self.tls.ca_certs, ssl_cert_reqs=self.tls.cert_reqs)
        return kwargs

    def grpc_credentials(self) -> grpc.ServerCredentials | None:
        if self.tls is None:
            return None
        required = self.tls.cert_reqs == ssl.CERT_REQUIRED
        return grpc.ssl_server_credentials([(self.tls.key_pem, self.tls.cert_pem)],
                                           root_certificates=self.tls.ca_pem if required else None,
                                           require_client_auth=required)

    def describe(self) -> str | None:
        """The start-up log line, or None when every option is at its default."""
        parts = []
        if self.tls:
            parts.append(f"TLS on REST and gRPC (client certificates: {CERT_REQS[self.tls.cert_reqs]})")
        if self.allowed_origins:
            parts.append(f"CORS for {', '.join(self.allowed_origins)}"
                         + (" with credentials" if self.allow_credentials else ""))
        if self.request_id_headers:
            parts.append("X-Request-Id on every response")
        if not self.access_log:
            parts.append("no access log")
        if self.root_path:
            parts.append(f"served under {self.root_path} too (--root-path)")
        if self.uds is not None:
            parts.append(f"REST on the Unix socket {self.uds} (--uds)")
        return "gateway: " + "; ".join(parts) if parts else None


Send = Callable[[dict[str, Any]], Awaitable[None]]


class RootPathMiddleware:
    """ASGI (vLLM's --root-path, its FastAPI root_path): the scope's root_path is the proxy's prefix, so Starlette
    routes `/omni/v1/...` (a proxy that passes the path on) and `/v1/...` (one that strips it) alike, and a
    request's URL names the prefix."""

    def __init__(self, app: Any, root_path: str) -> None:
        self.app, self.root_path = app, root_path

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict]], send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            scope = {**scope, "root_path": self.root_path}
        await self.app(scope, receive, send)


class RequestIdMiddleware:
    """ASGI (vLLM's --enable-request-id-headers): every HTTP response carries `X-Request-Id`, the request's
    own when it sent one, else a fresh one. A chat completion sets its own (always, flag or not): its
    request id, `chatcmpl-<the client's id>`, as the stages and their logs know it; that one is kept."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict]], send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == REQUEST_ID_HEADER), None)
        rid = given if given else uuid.uuid4().hex.encode()

        async def send_with_id(message: dict[str, Any]) -> None:
            headers = message.get("headers", ())
            if message["type"] == "http.response.start" and not any(k == REQUEST_ID_HEADER for k, _ in headers):
                message = {**message, "headers": [*headers, (REQUEST_ID_HEADER, rid)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
