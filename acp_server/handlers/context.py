"""What a handler knows about the connection it serves and the server behind it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..jsonrpc import HandlerContext
from ..types.acp import ClientCapabilities

if TYPE_CHECKING:
    from ..bridge import Peer, SessionBridge
    from ..server import Server

__all__ = ["ConnContext"]


class ConnContext(HandlerContext):
    """Per-connection state the handlers read and write (never session state: that is the bridge's).

    Attributes:
        server: the server instance (bridge, limits, version).
        peer: this connection, as the bridge addresses it.
        initialized: ``initialize`` has succeeded on this connection.
        client_capabilities: what the client advertised at ``initialize``.
        cancelled: set by the shell while running the synchronous part of a request that
            ``$/cancel_request`` already cancelled (only for methods that see cancels).
    """

    __slots__ = ("cancelled", "client_capabilities", "client_info", "initialized", "peer", "server")

    def __init__(self, server: Server, peer: Peer) -> None:
        self.server = server
        self.peer = peer
        self.initialized = False
        self.cancelled = False
        self.client_capabilities = ClientCapabilities()
        self.client_info: Any = None

    @property
    def bridge(self) -> SessionBridge:
        return self.server.bridge
