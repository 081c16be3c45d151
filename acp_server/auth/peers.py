"""Where a connection comes from: :class:`PeerInfo`, and :func:`describe_stream` for an accepted stream.

Unix sockets are the owner's (trusted as :data:`~acp_server.auth.identity.OWNER`); TCP and TLS peers
must prove a token when tokens are configured. Every server asks this (its connection statistics count
connections by transport), so it is apart from the token checks of :mod:`.gate`, which load only with
``--auth-tokens``.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

if TYPE_CHECKING:
    from .identity import Identity

__all__ = ["PeerInfo", "describe_stream"]


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """Where a connection comes from.

    Attributes:
        transport: ``tcp``, ``tls``, ``unix``, ``stdio``, ``http``, ``ws`` or ``stream`` (anything else:
            memory, pipes).
        address: the peer's IP address (``None`` when it has none).
        trusted: the peer is the server's owner (Unix socket, stdio): no token is asked.
        identity: the token the transport itself checked (HTTP's bearer), or ``None``: the connection
            proves one with ``authenticate``.
        tenant: the tenant that ``identity`` acts for.
        metered: the transport counts each request against the token's rate itself (HTTP POSTs).
    """

    transport: str
    address: str | None = None
    trusted: bool = False
    identity: Identity | None = None
    tenant: str | None = None
    metered: bool = False


def describe_stream(stream: trio.abc.Stream) -> PeerInfo:
    """The transport and peer address of an accepted stream (a TLS stream is seen through; a stream
    that knows its own, an HTTP connection's, tells it as ``peer_info``)."""
    known = getattr(stream, "peer_info", None)
    if isinstance(known, PeerInfo):
        return known
    transport = "tcp"
    inner: Any = stream
    if isinstance(stream, trio.SSLStream):
        transport, inner = "tls", stream.transport_stream
    sock = getattr(inner, "socket", None)
    if not isinstance(inner, trio.SocketStream) or sock is None:
        return PeerInfo("stream")
    if sock.family == socket.AF_UNIX:
        return PeerInfo("unix", trusted=True)
    try:
        address = str(sock.getpeername()[0])
    except OSError:
        address = None
    return PeerInfo(transport, address)
