"""ACP on the web: the RFD's remote transport (Streamable HTTP and WebSocket) at ``/acp``.

Server side: :func:`serve_http` runs the ASGI app (:class:`AcpHttpApp`) under hypercorn's trio
worker; each connection is a :class:`MessagePeer` served by the same per-connection shell as a socket.
The client side (a byte stream of NDJSON over ``http://.../acp`` or ``ws://.../acp``) is
:mod:`acp_server.client.remote`, which loads no server code.

Importing this package loads hypercorn: the server imports it only when ``--http-listen`` is given.
"""

from __future__ import annotations

from .app import AcpHttpApp, HttpLimits
from .listener import HttpOptions, serve_http
from .peer import MessagePeer

__all__ = ["AcpHttpApp", "HttpLimits", "HttpOptions", "MessagePeer", "serve_http"]
