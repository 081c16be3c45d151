"""What a REST request is to the handlers and the bridge, and what its refusals answer: the caller
as the bridge's ``Peer`` (:class:`RestCaller`, never attached), the handlers' context
(:class:`RestContext`), and the HTTP status and headers of each refusal (:func:`status_of`,
:func:`refusal`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import trio

from ...auth.gate import PeerInfo
from ...errors import (
    AcpError,
    AdmissionDeferredError,
    AgentError,
    BackendUnavailableError,
    CapacityExceededError,
    CapacityUnavailableError,
    DuplicateInFlightError,
    HttpError,
    IdempotencyKeyConflictError,
    InternalError,
    LeaseLostError,
    MessageTooLargeError,
    MethodNotAllowedError,
    PromptQueueFullError,
    RateLimitedError,
    SessionLimitExceededError,
    SessionNotFoundError,
)
from ...handlers import ConnContext
from ...types.acp import ClientCapabilities
from .auth import HttpCaller, current_caller
from .rules import error_body

if TYPE_CHECKING:
    from ...server import Server
    from .rest_permissions import RestChannel

__all__ = ["RestCaller", "RestContext", "http_status", "refusal", "status_of"]

_JSON = (b"content-type", b"application/json")


def status_of(kind: type[AcpError]) -> int:
    """The HTTP status a refusal of class ``kind`` is sent with."""
    if issubclass(kind, HttpError):
        return kind.status
    if issubclass(kind, (PromptQueueFullError, CapacityExceededError, CapacityUnavailableError, SessionLimitExceededError)):
        return 503
    if issubclass(kind, (AdmissionDeferredError, RateLimitedError)):
        return 429
    if issubclass(kind, (IdempotencyKeyConflictError, DuplicateInFlightError)):
        return 409
    if issubclass(kind, (BackendUnavailableError, LeaseLostError)):
        return 503
    if issubclass(kind, AgentError):
        return 502
    if issubclass(kind, SessionNotFoundError):
        return 404
    if issubclass(kind, MessageTooLargeError):
        return 413
    if issubclass(kind, InternalError):
        return 500
    return 400


def http_status(exc: AcpError) -> int:
    """The HTTP status the refusal ``exc`` is sent with."""
    return status_of(type(exc))


def refusal(exc: AcpError, cors: list[tuple[bytes, bytes]]) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """The answer to the refusal ``exc``: its status, its headers (``Retry-After`` when it says when)
    and the error body."""
    headers = [_JSON, *cors]
    if isinstance(exc, MethodNotAllowedError):
        headers.append((b"allow", ", ".join(exc.payload.allowed).encode()))  # type: ignore[attr-defined]
    retry_ms = getattr(exc.payload, "retry_after_ms", None)
    if isinstance(retry_ms, int):
        headers.append((b"retry-after", str(max(1, math.ceil(retry_ms / 1000))).encode()))
    return http_status(exc), headers, error_body(exc)


class RestCaller:
    """A REST request as the bridge's ``Peer``: it registers client ids but is never attached (closed)."""

    peer_id = -1
    closed = True

    def send(self, data: bytes) -> None:
        """Dropped: a REST caller reads events on its SSE subscription."""

    async def send_reliably(self, data: bytes) -> None:
        """Dropped, as :meth:`send`."""

    async def request(self, method: str, params: Any = None) -> Any:
        """Never asked: a REST prompt's questions go through :class:`~.rest_permissions.RestChannel`."""
        raise trio.EndOfChannel


#: a REST request's client capabilities (the defaults) and transport, as ``ConnContext`` starts with them
_NO_CAPABILITIES = ClientCapabilities()
_REST_PEER = PeerInfo("stream", trusted=True)


class RestContext(ConnContext):
    """The handlers' context for one REST request: its caller's identity and tenant, the
    :class:`RestCaller` peer, and a channel that asks the session's SSE subscribers."""

    __slots__ = ("rest_channel",)

    def __init__(
        self, server: Server, peer: RestCaller, rest_channel: RestChannel | None = None, caller: HttpCaller | None = None
    ) -> None:
        # ConnContext's fields, set here (one per request): a REST caller never initializes, so its
        # capabilities are the defaults, one instance for all (nothing writes them)
        self.server = server
        self.peer = peer
        self.cancelled = False
        self.client_capabilities = _NO_CAPABILITIES
        self.client_info = None
        self.tenant_named = None
        self.peer_info = _REST_PEER
        self._channel = None
        if caller is None:
            caller = current_caller.get()
        self.identity = caller.identity
        self.tenant = caller.tenant
        self.initialized = True
        self.rest_channel = rest_channel

    def channel(self) -> Any:
        return self.rest_channel if self.rest_channel is not None else super().channel()
