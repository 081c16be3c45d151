"""Certificates from ``trustme`` for the TLS tests of the HTTP listeners and the SDKs, and a live
server with an ``https://`` listener (and the server's TLS, for reloads)."""

from __future__ import annotations

import pathlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio
import trustme

from acp_server.auth.tls import ServerTls
from acp_server.server import ListenAddress, Server
from acp_server.transports.http import HttpLimits, HttpOptions, serve_http

from .helpers import running_server


@dataclass(frozen=True)
class CertFiles:
    """A server certificate for ``localhost``/``127.0.0.1``, its key, and the CA that signed it."""

    cert: str
    key: str
    ca: str


def write_certs(directory: pathlib.Path, ca: trustme.CA | None = None, name: str = "server") -> CertFiles:
    """Issue a certificate (from ``ca``, else a new CA) and write the three PEM files under ``directory``."""
    ca = ca or trustme.CA()
    issued = ca.issue_cert("localhost", "127.0.0.1")
    cert, key, ca_path = directory / f"{name}.pem", directory / f"{name}.key", directory / f"{name}-ca.pem"
    issued.private_key_and_cert_chain_pem.write_to_path(str(cert))
    issued.private_key_pem.write_to_path(str(key))
    ca.cert_pem.write_to_path(str(ca_path))
    return CertFiles(str(cert), str(key), str(ca_path))


def replace_certs(target: CertFiles, source: CertFiles) -> None:
    """Overwrite ``target``'s certificate and key files with ``source``'s (what an operator does before SIGHUP)."""
    pathlib.Path(target.cert).write_text(pathlib.Path(source.cert).read_text())
    pathlib.Path(target.key).write_text(pathlib.Path(source.key).read_text())


@asynccontextmanager
async def https_server(
    certs: CertFiles, *, handshake_timeout_s: float = 5.0, options: HttpOptions | None = None
) -> AsyncIterator[tuple[Server, trio.Nursery, str, ServerTls]]:
    """A server with an ``https://`` listener on a free loopback port; yields it, its nursery, the
    listener's base URL and the server's TLS."""
    tls = ServerTls(certs.cert, certs.key, handshake_timeout_s=handshake_timeout_s)
    async with running_server() as (server, nursery):
        lim = server.limits
        limits = HttpLimits(max_message_bytes=lim.max_message_bytes, max_outbound_bytes=lim.outbound_bytes)
        opts: Any = options or HttpOptions(limits=limits)
        address = ListenAddress("https", host="127.0.0.1", port=0)
        url = await nursery.start(lambda task_status: serve_http(server.handle_stream, address, opts, tls=tls, task_status=task_status))
        yield server, nursery, url, tls
