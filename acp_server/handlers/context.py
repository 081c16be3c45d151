"""What a handler knows about the connection it serves and the server behind it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import trio

from ..auth.identity import OWNER, Identity
from ..auth.peers import PeerInfo
from ..backends.base import ClientGoneError, ClientRequestError
from ..jsonrpc import HandlerContext
from ..types.acp import ClientCapabilities

if TYPE_CHECKING:
    from ..bridge import Peer, SessionBridge
    from ..server import Server

__all__ = ["ConnChannel", "ConnContext"]

#: a connection's transport until the shell says where it comes from (frozen: one for all)
_STREAM_PEER = PeerInfo("stream", trusted=True)


class ConnContext(HandlerContext):
    """Per-connection state the handlers read and write (never session state: that is the bridge's).

    Attributes:
        server: the server instance (bridge, limits, version).
        peer: this connection, as the bridge addresses it.
        initialized: ``initialize`` has succeeded on this connection.
        client_capabilities: what the client advertised at ``initialize``.
        tenant: the tenant named at ``initialize`` (``default`` when none): the sessions it may see.
        cancelled: set by the shell while running the synchronous part of a request that
            ``$/cancel_request`` already cancelled (only for methods that see cancels).
        identity: who the connection proved to be (``None``: a token is still to be proved; the owner's
            identity on Unix sockets, stdio, and every connection when no tokens are configured).
        peer_info: the transport and address the connection came from.
        tenant_named: the ``_meta.tenantId`` ``initialize`` named (``None``: none).
    """

    __slots__ = (
        "_channel",
        "cancelled",
        "client_capabilities",
        "client_info",
        "identity",
        "initialized",
        "peer",
        "peer_info",
        "server",
        "tenant",
        "tenant_named",
    )

    def __init__(self, server: Server, peer: Peer) -> None:
        self.server = server
        self.peer = peer
        self.initialized = False
        self.cancelled = False
        self.client_capabilities = ClientCapabilities()
        self.client_info: Any = None
        #: the tenant this connection acts for (``initialize`` ``_meta.tenantId``); sessions are per tenant
        self.tenant = "default"
        self.tenant_named: str | None = None
        self.identity: Identity | None = OWNER
        self.peer_info = _STREAM_PEER
        self._channel: ConnChannel | None = None

    @property
    def bridge(self) -> SessionBridge:
        return self.server.bridge

    def channel(self) -> ConnChannel:
        """This connection as a backend may address it (one object per connection: it holds nothing else)."""
        channel = self._channel
        if channel is None:
            channel = self._channel = ConnChannel(self)
        return channel


class ConnChannel:
    """This connection as a backend may address it: its capabilities and a way to ask it things."""

    __slots__ = ("_ctx",)

    def __init__(self, ctx: ConnContext) -> None:
        self._ctx = ctx

    @property
    def capabilities(self) -> ClientCapabilities:
        return self._ctx.client_capabilities

    async def request(self, method: str, params: Any) -> Any:
        try:
            response = await self._ctx.peer.request(method, params)
        except (trio.EndOfChannel, trio.BrokenResourceError, trio.ClosedResourceError):
            raise ClientGoneError(f"the client left before answering {method}") from None
        if response.error is not None:
            raise ClientRequestError(response.error)
        return response.result
