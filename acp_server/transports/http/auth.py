"""Who an HTTP request is: the listener's credential check, first of its checks, and the caller it grants.

With ``--auth-tokens``, every request (``/acp`` POST, GET and DELETE, the WebSocket handshake, the REST
routes, their SSE streams, ``GET /health?deep=1``) proves a token before anything else is looked at:
``Authorization: Bearer <secret>``, or, for a browser's WebSocket, the subprotocols ``acp.v1`` and
``acp-bearer.<base64url(secret)>`` (answered with ``acp.v1``). A missing, malformed, wrong or expired
credential gets one 401 (:class:`~acp_server.errors.UnauthorizedError`), the same bytes whatever was
wrong; an address past its failed authentications for the minute gets 429 ``rate_limited`` unchecked
(the count is the one the NDJSON ``authenticate`` uses). Open without a token: ``GET``/``HEAD
/health`` (liveness, nothing about sessions), the console's static files (``GET /``,
``/console/*``: no data; the page's WebSocket proves a token), and CORS preflights (``OPTIONS``).

The caller's tenant is its token's. An ``admin`` token may act for another tenant: on the REST routes
with the ``X-Acp-Tenant`` header (each such request audited), on ``/acp`` with ``initialize``
``_meta.tenantId`` as over NDJSON. Each request counts against its token's ``--rate-limit-rps``
(429 ``rate_limited`` with ``Retry-After``), but cancellations (``POST /session/:id/cancel``,
``session/cancel`` and ``$/cancel_request`` on ``/acp``) and the client's own JSON-RPC answers.

Audit: every failure and refusal is a line, as over NDJSON; a success (``auth_ok``) is one line per
token, address and transport a minute (HTTP authenticates each request, and one line each would
flood the log with what the first one says).
"""

from __future__ import annotations

import math
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from ...auth.gate import Authenticator, PeerInfo
from ...auth.http_rules import UNAUTHORIZED_BODY, UNAUTHORIZED_HEADERS
from ...auth.tokens import OWNER, Identity
from ...errors import (
    AcpError,
    InsufficientScopeError,
    InvalidParamsError,
    RateLimitedError,
)
from ...handlers.meta import MAX_TENANT_ID
from .addresses import client_address
from .rules import HEALTH_PATH, error_body, header

__all__ = [
    "OWNER_CALLER",
    "TENANT_HEADER",
    "UNMETERED_METHODS",
    "HttpCaller",
    "HttpGuard",
    "HttpRefusal",
    "current_caller",
]

#: The header an ``admin`` token names the tenant it acts for with, on the REST routes.
TENANT_HEADER = b"x-acp-tenant"
#: ``/acp`` messages the request rate does not count: they only free capacity.
UNMETERED_METHODS = frozenset({"session/cancel", "$/cancel_request"})
_CANCEL_ROUTE = re.compile(r"^/session/[^/]+/cancel$")
_SCRAPE_SCOPES = ["admin", "metrics"]
#: Seconds between two ``auth_ok`` audit lines of one token, address and transport.
AUDIT_OK_EVERY_S = 60.0
#: the most owner callers :class:`HttpGuard` keeps made (cleared when full)
_OWNERS_KEPT = 1024


@dataclass(frozen=True, slots=True)
class HttpCaller:
    """Who one HTTP request (or WebSocket) is, as the guard granted it.

    Attributes:
        identity: the token's identity (:data:`~acp_server.auth.tokens.OWNER` when no tokens are configured).
        tenant: the tenant it acts for: the token's, or the one an admin named.
        source: the client's address (:func:`~.addresses.client_address`).
        transport: ``http`` or ``ws``.
        subprotocol: the WebSocket subprotocol to answer with (``acp.v1``) or ``None``.
    """

    identity: Identity
    tenant: str
    source: str | None = None
    transport: str = "http"
    subprotocol: str | None = None

    def peer_info(self, *, metered: bool) -> PeerInfo:
        """How the connection shell sees an ``/acp`` connection opened by this caller.

        ``metered``: the HTTP layer counts each message against the rate itself (HTTP POSTs; a
        WebSocket's frames are counted by the handlers' gate).
        """
        return PeerInfo(
            self.transport, self.source, identity=self.identity, tenant=self.tenant, metered=metered
        )


#: A request's caller when no tokens are configured: the owner, tenant ``default``.
OWNER_CALLER = HttpCaller(OWNER, "default")
#: The caller of the request this task serves (set by the ASGI app from :meth:`HttpGuard.admit`).
current_caller: ContextVar[HttpCaller] = ContextVar("acp_server_http_caller", default=OWNER_CALLER)


@dataclass(frozen=True, slots=True)
class HttpRefusal:
    """An answer that ends a request before it is routed: status, headers and the error body."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


def _refusal(exc: AcpError, status: int, extra: list[tuple[bytes, bytes]] | None = None) -> HttpRefusal:
    headers = [(b"content-type", b"application/json"), (b"cache-control", b"no-store"), *(extra or [])]
    return HttpRefusal(status, headers, error_body(exc))


def _retry_after(retry_after_ms: int) -> tuple[bytes, bytes]:
    return (b"retry-after", str(max(1, math.ceil(retry_after_ms / 1000))).encode())


#: The one 401: every credential failure answers these same bytes.
UNAUTHORIZED = HttpRefusal(401, list(UNAUTHORIZED_HEADERS), UNAUTHORIZED_BODY)


def _all_values(headers: list[tuple[bytes, bytes]], name: bytes) -> list[str]:
    return [value.decode("latin-1") for key, value in headers if key == name]


def _open_route(scope: dict[str, Any]) -> bool:
    """Whether a request needs no token: liveness, the console's static files, CORS preflights."""
    if scope["type"] != "http":
        return False
    path: str = scope["path"]
    method: str = scope["method"]
    if method == "OPTIONS":
        return True
    if path == HEALTH_PATH:
        return b"deep=1" not in scope.get("query_string", b"")
    return path == "/" or path.startswith("/console/")


def _metered_later(scope: dict[str, Any]) -> bool:
    """Whether the request is counted after routing, or not at all (``/acp`` POSTs, cancellations)."""
    if scope["type"] != "http":
        return False
    method, path = scope["method"], scope["path"]
    return method == "POST" and (path == "/acp" or bool(_CANCEL_ROUTE.match(path)))


class HttpGuard:
    """The HTTP listener's credential, tenant and rate checks (see the module docstring).

    Args:
        auth: the server's authenticator (``None``: no tokens; every caller is the owner, tenant
            ``default`` or, on the REST routes, the one ``X-Acp-Tenant`` names).
        trusted: the listener is a Unix socket (mode 0600): its peers are the owner, as on NDJSON's.
        clock: the monotonic clock of the audit's once-a-minute successes.
    """

    def __init__(
        self, auth: Authenticator | None, *, trusted: bool = False, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.auth = None if trusted else auth
        self._clock = clock
        #: (token id, address, transport) -> when its last ``auth_ok`` line was written
        self._audited: OrderedDict[tuple[str, str | None, str], float] = OrderedDict()
        #: the owner's callers by tenant, address, transport and subprotocol (frozen: shared by requests)
        self._owners: dict[tuple[str, str | None, str, str | None], HttpCaller] = {}

    def admit(self, scope: dict[str, Any]) -> HttpCaller | HttpRefusal:
        """The caller of an ``http`` or ``websocket`` scope, or the answer that refuses it."""
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        transport = "ws" if scope["type"] == "websocket" else "http"
        source = client_address(scope)
        if self.auth is not None and _open_route(scope):
            return HttpCaller(_ANONYMOUS, "default", source, transport)
        proved = (OWNER, None) if self.auth is None else self.credentials(scope)  # (credentials' own answer without tokens)
        if isinstance(proved, HttpRefusal):
            return proved
        identity, subprotocol = proved
        tenant = identity.tenant or "default"
        named = header(headers, TENANT_HEADER)
        if named is not None and scope["path"] != "/acp":
            refused = self._name_tenant(identity, tenant, named.strip(), scope)
            if isinstance(refused, HttpRefusal):
                return refused
            tenant = refused
        if scope["path"] == HEALTH_PATH and not identity.may_scrape:
            return _refusal(InsufficientScopeError(scopes=_SCRAPE_SCOPES), 403)
        if identity is OWNER:  # (no tokens: the same few callers again and again, made once each)
            caller = self.owner(tenant, source, transport, subprotocol)
        else:
            caller = HttpCaller(identity, tenant, source, transport, subprotocol)
        if self.auth is not None and not _metered_later(scope):  # (without tokens nothing is metered)
            refusal = self.meter(caller)
            if refusal is not None:
                return refusal
        return caller

    def owner(self, tenant: str, source: str | None, transport: str = "http", subprotocol: str | None = None) -> HttpCaller:
        """The owner's caller (what :meth:`admit` grants without tokens) for ``tenant`` from ``source``:
        the same few again and again, made once each."""
        key = (tenant, source, transport, subprotocol)
        caller = self._owners.get(key)
        if caller is None:
            if len(self._owners) >= _OWNERS_KEPT:
                self._owners.clear()
            caller = self._owners[key] = HttpCaller(OWNER, tenant, source, transport, subprotocol)
        return caller

    def credentials(self, scope: dict[str, Any]) -> tuple[Identity, str | None] | HttpRefusal:
        """The identity a request's credentials prove, with the WebSocket subprotocol to answer (the
        owner's without tokens), or the one 401 (429 for an address past its failures)."""
        auth = self.auth
        if auth is None:
            return OWNER, None
        websocket = scope["type"] == "websocket"
        authorization = _all_values(scope["headers"], b"authorization")
        protocols = list(scope.get("subprotocols") or ()) if websocket else None
        source = client_address(scope)
        transport = "ws" if websocket else "http"
        outcome, subprotocol = auth.check_http(
            authorization=authorization or None, ws_protocols=protocols, source=source, transport=transport,
            audit_ok=False,
        )
        if outcome.retry_after_ms:
            limited = RateLimitedError(reason="auth_failures", retry_after_ms=outcome.retry_after_ms)
            return _refusal(limited, 429, [_retry_after(outcome.retry_after_ms)])
        identity = outcome.identity
        if identity is None:
            return UNAUTHORIZED
        self._audit_ok(auth, identity, source, transport)
        return identity, subprotocol

    def _audit_ok(self, auth: Authenticator, identity: Identity, source: str | None, transport: str) -> None:
        key = (identity.token_id or "", source, transport)
        now = self._clock()
        last = self._audited.get(key)
        if last is not None and now - last < AUDIT_OK_EVERY_S:
            return
        self._audited[key] = now
        self._audited.move_to_end(key)
        while len(self._audited) > 4096:
            self._audited.popitem(last=False)
        auth.audit.auth_ok(token_id=key[0], tenant=identity.tenant or "", transport=transport, source=source)

    def _name_tenant(self, identity: Identity, own: str, named: str, scope: dict[str, Any]) -> str | HttpRefusal:
        if not named or len(named) > MAX_TENANT_ID or not named.isprintable():
            bad = InvalidParamsError(path="X-Acp-Tenant", detail=f"must be 1 to {MAX_TENANT_ID} printable characters")
            return _refusal(bad, 400)
        if named == own:
            return named
        if not identity.admin:
            refused = InvalidParamsError(
                path="X-Acp-Tenant",
                detail=f"this token acts for tenant {own!r}; only an admin token may name another tenant",
            )
            return _refusal(refused, 400)
        if self.auth is not None and identity.token_id is not None:
            self.auth.audit.admin_act(
                token_id=identity.token_id,
                action="act_for_tenant",
                target=f"{scope.get('method', 'GET')} {scope['path'][:256]}",
                tenant=named,
            )
        return named

    def meter(self, caller: HttpCaller, method: str | None = "") -> HttpRefusal | None:
        """Count one request of ``caller`` against its token's rate (``method``: the ``/acp`` message's;
        ``None``, a JSON-RPC answer, and cancellations are not counted). ``None``: it may proceed."""
        if self.auth is None or method is None or method in UNMETERED_METHODS:
            return None
        wait = self.auth.throttle(caller.identity)
        if not wait:
            return None
        return _refusal(RateLimitedError(reason="request_rate", retry_after_ms=wait), 429, [_retry_after(wait)])

    def scrape(self, scope: dict[str, Any]) -> HttpRefusal | None:
        """The metrics endpoint's check: a token with the ``admin`` or ``metrics`` scope, counted
        against its rate; ``None``: serve the request."""
        proved = self.credentials(scope)
        if isinstance(proved, HttpRefusal):
            return proved
        identity = proved[0]
        if not identity.may_scrape:
            return _refusal(InsufficientScopeError(scopes=_SCRAPE_SCOPES), 403)
        return self.meter(HttpCaller(identity, identity.tenant or "default"))


#: The caller of a route open without a token (it may read nothing a token guards).
_ANONYMOUS = Identity(token_id=None, tenant="default", scopes=frozenset())
