"""Self-signed certificates for TLS tests, made with the `openssl` command line (no Python dependency).

`make_certs(dir)` -> Certs: a server key + certificate for 127.0.0.1 / localhost, a client key +
certificate (the server trusts it as its own CA under mutual TLS), and a key that matches neither."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Certs:
    server_key: Path
    server_crt: Path
    client_key: Path
    client_crt: Path
    stray_key: Path  # a valid key that belongs to no certificate here


def _self_signed(key: Path, crt: Path, cn: str, san: str | None) -> None:
    cmd = ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
           "-keyout", str(key), "-out", str(crt), "-days", "2", "-subj", f"/CN={cn}"]
    if san:
        cmd += ["-addext", f"subjectAltName={san}"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


def make_certs(out: Path) -> Certs:
    if shutil.which("openssl") is None:
        raise RuntimeError("the TLS tests need the openssl command (apt install openssl)")
    c = Certs(out / "server.key", out / "server.crt", out / "client.key", out / "client.crt", out / "stray.key")
    _self_signed(c.server_key, c.server_crt, "localhost", "IP:127.0.0.1,DNS:localhost")
    _self_signed(c.client_key, c.client_crt, "omnimesh-test-client", None)
    subprocess.run(["openssl", "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-out", str(c.stray_key)], check=True, capture_output=True, timeout=30)
    return c
