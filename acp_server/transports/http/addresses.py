"""Where an HTTP request comes from: the one place the listener reads a client's address.

Authentication counts failures per source address and audits it; both ask :func:`client_address`,
so that honouring a reverse proxy's ``X-Forwarded-For`` (``--trusted-proxy``) is a change here alone.
"""

from __future__ import annotations

from typing import Any

__all__ = ["client_address"]


def client_address(scope: dict[str, Any]) -> str | None:
    """The IP address of the client behind an ASGI ``scope`` (``http`` or ``websocket``).

    Returns:
        the peer's address as the server saw it (``scope["client"]``), or ``None`` when it has none
        (a Unix socket): such a peer is local, and local peers are never counted as failing.
    """
    client = scope.get("client")
    if not client:
        return None
    host = client[0]
    return str(host) if host else None
