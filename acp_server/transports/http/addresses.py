"""Where an HTTP request comes from: the one place the listener reads a client's address.

Authentication counts failures per source address and audits it; both ask :func:`client_address`.
Behind a reverse proxy the peer is the proxy: :class:`ForwardedFor` (the listener puts it in front of
the app when ``--trusted-proxy`` is given) rewrites a request's ``client`` and ``scheme`` from
``X-Forwarded-For`` and ``X-Forwarded-Proto`` when, and only when, the peer is a trusted proxy, so that
:func:`client_address`, the ``Origin`` check and everything after them see the client, not the proxy.
The peer as the socket saw it stays in the scope under :data:`PEER_KEY`.
"""

from __future__ import annotations

from typing import Any

from ...auth.http_rules import TrustedProxies
from .rules import header

__all__ = ["PEER_KEY", "ForwardedFor", "client_address", "forwarded_scope"]

#: The scope key holding the socket's peer ``(host, port)`` once :class:`ForwardedFor` rewrote ``client``.
PEER_KEY = "acp_server.peer"

_WS_SCHEMES = {"http": "ws", "https": "wss"}


def client_address(scope: dict[str, Any]) -> str | None:
    """The IP address of the client behind an ASGI ``scope`` (``http`` or ``websocket``).

    Returns:
        the client's address (``scope["client"]``, which :class:`ForwardedFor` set from a trusted
        proxy's ``X-Forwarded-For``), or ``None`` when it has none (a Unix socket): such a peer is
        local, and local peers are never counted as failing.
    """
    client = scope.get("client")
    if not client:
        return None
    host = client[0]
    return str(host) if host else None


def forwarded_scope(scope: dict[str, Any], proxies: TrustedProxies) -> dict[str, Any]:
    """``scope`` as the client made the request: from a trusted proxy, its forwarded address and scheme.

    From any other peer (and for a peer without an address) the scope is returned unchanged: the
    headers are anyone's to write.
    """
    peer = scope.get("client")
    if not peer or not peer[0] or not proxies.networks:
        return scope
    kind = scope.get("type")
    scheme = str(scope.get("scheme", "http"))
    plain = {"ws": "http", "wss": "https"}.get(scheme, scheme)
    headers = scope.get("headers", [])
    forwarded_for = [v.decode("latin-1") for k, v in headers if k == b"x-forwarded-for"] or None
    forwarded_proto = header(headers, b"x-forwarded-proto")
    view = proxies.client(
        str(peer[0]), scheme=plain, forwarded_for=forwarded_for, forwarded_proto=forwarded_proto
    )
    if view.address == peer[0] and view.scheme == plain:
        return scope
    out = dict(scope)
    out[PEER_KEY] = peer
    out["client"] = (view.address, 0 if view.address != peer[0] else peer[1])
    out["scheme"] = _WS_SCHEMES[view.scheme] if kind == "websocket" else view.scheme
    return out


class ForwardedFor:
    """ASGI middleware: hand ``app`` the :func:`forwarded_scope` of each request.

    Args:
        app: the listener's application.
        proxies: the ``--trusted-proxy`` networks.
    """

    def __init__(self, app: Any, proxies: TrustedProxies) -> None:
        self.app = app
        self.proxies = proxies

    def inline_request(self, method: bytes, path: bytes) -> bool:
        """The wrapped app's answer (see :meth:`~.app.AcpHttpApp.inline_request`)."""
        inline = getattr(self.app, "inline_request", None)
        return bool(inline(method, path)) if inline is not None else False

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") in ("http", "websocket"):
            scope = forwarded_scope(scope, self.proxies)
        await self.app(scope, receive, send)
