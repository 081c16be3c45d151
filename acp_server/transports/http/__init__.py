"""ACP on the web: the RFD's remote transport (Streamable HTTP and WebSocket) at ``/acp``.

Server side: :func:`serve_http` runs the ASGI app (:class:`AcpHttpApp`) under hypercorn's trio
worker; each connection is a :class:`MessagePeer` served by the same per-connection shell as a socket.
The client side (a byte stream of NDJSON over ``http://.../acp`` or ``ws://.../acp``) is
:mod:`acp_server.client.remote`, which loads no server code.

Only :func:`serve_http` loads hypercorn, on first use (the server asks for it only when
``--http-listen`` is given); the rest imports nothing beyond trio and msgspec.
"""

from __future__ import annotations

from typing import Any

from .app import AcpHttpApp, HttpLimits, HttpOptions
from .peer import MessagePeer

__all__ = ["AcpHttpApp", "HttpLimits", "HttpOptions", "MessagePeer", "serve_http"]


def __getattr__(name: str) -> Any:
    if name == "serve_http":
        from .listener import serve_http

        return serve_http
    raise AttributeError(name)
