"""The gateway's own authentication on NDJSON connections (``--auth-tokens``).

With tokens configured, a TCP or TLS connection proves a token before anything but ``initialize`` and
``authenticate``: ``initialize`` lists the auth method ``acp-server-token`` first, the client calls
``authenticate {methodId: "acp-server-token", _meta: {token: SECRET}}``, and until then every other
method gets ``auth_required`` (:class:`~acp_server.errors.TokenRequiredError`), the same error a failed
``authenticate`` gets. The token's tenant becomes the connection's. Unix-socket and stdio peers are the
owner's and skip all of this. :func:`gated` wraps the method table once, so a server without tokens
pays nothing. :func:`credentials_upkeep` reloads tokens and certificates on SIGHUP and evicts the
connections whose token is gone, changed or expired (:func:`evict_revoked`).
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import trio

from ..auth import TOKEN_METHOD_ID
from ..errors import InvalidParamsError, RateLimitedError, TokenRequiredError
from ..jsonrpc import Connection, Method
from ..types.acp import AuthenticateParams
from .context import ConnContext

if TYPE_CHECKING:
    from ..auth.tls import ServerTls
    from ..server import Server

__all__ = [
    "OPEN_METHODS",
    "TOKEN_AUTH_METHOD",
    "authenticate_token",
    "credentials_upkeep",
    "evict_revoked",
    "gated",
    "reload_credentials",
    "token_required",
]

log = logging.getLogger("acp_server.auth")

#: How often connections are checked for tokens that expired (evicted within this much of the instant).
EXPIRY_CHECK_S = 0.5

#: What ``initialize`` lists first in ``authMethods`` when a connection must prove a token.
TOKEN_AUTH_METHOD: dict[str, Any] = {
    "id": TOKEN_METHOD_ID,
    "name": "acp-server token",
    "description": 'A token from "acp-server token add": authenticate with _meta.token set to its secret',
}
#: Methods an unauthenticated connection may call.
OPEN_METHODS = frozenset({"initialize", "authenticate"})
#: Methods that need the ``admin`` or ``metrics`` scope.
SCRAPE_METHODS = frozenset({"_acp_server/stats", "_acp_server/stats/subscribe"})
#: Methods the request rate does not count: they only free capacity.
UNMETERED_METHODS = frozenset({"session/cancel"})
_DETAIL = 'send authenticate with methodId "acp-server-token" and _meta.token set to the secret of your token'


def token_required(detail: str = _DETAIL) -> TokenRequiredError:
    """The one ``auth_required`` of the gateway (identical for every failure but the request id)."""
    return TokenRequiredError(method_id=TOKEN_METHOD_ID, detail=detail)


def _guard(name: str, method: Method) -> Method:
    handler = method.handler
    scrape = name in SCRAPE_METHODS
    metered = name not in UNMETERED_METHODS

    def run(ctx: ConnContext, params: Any) -> Any:
        identity = ctx.identity
        if identity is None:
            raise token_required()
        if scrape and not identity.may_scrape:
            raise token_required(f"{name} needs a token with the admin or metrics scope")
        auth = ctx.server.auth
        if metered and auth is not None and not ctx.peer_info.metered:
            wait = auth.throttle(identity)
            if wait:
                raise RateLimitedError(reason="request_rate", retry_after_ms=wait)
        return handler(ctx, params)

    return method._replace(handler=run)


def gated(table: Mapping[str, Method]) -> dict[str, Method]:
    """The method table with every method but :data:`OPEN_METHODS` behind the token check."""
    return {name: m if name in OPEN_METHODS else _guard(name, m) for name, m in table.items()}


def authenticate_token(ctx: ConnContext, params: AuthenticateParams) -> Any:
    """``authenticate`` with ``acp-server-token``: bind the connection to the token's identity and tenant.

    Raises:
        RateLimitedError: the address failed too often this minute (the secret was not checked).
        TokenRequiredError: missing, malformed, unknown or expired secret (always the same error).
        InvalidParamsError: ``initialize`` named another tenant and the token is not ``admin``.
    """
    auth = ctx.server.auth
    assert auth is not None
    secret = (params.meta or {}).get("token")
    info = ctx.peer_info
    outcome = auth.check(secret, source=info.address, transport=info.transport)
    if outcome.retry_after_ms:
        raise RateLimitedError(reason="auth_failures", retry_after_ms=outcome.retry_after_ms)
    identity = outcome.identity
    if identity is None:
        raise token_required()
    tenant = identity.tenant or "default"
    named = ctx.tenant_named
    if named is not None and named != tenant:
        if not identity.admin:
            raise InvalidParamsError(
                path="_meta.tenantId",
                detail=f"initialize named tenant {named!r}, but this token acts for {tenant!r} "
                "(only an admin token may name another tenant)",
            )
        auth.audit.admin_act(token_id=identity.token_id, action="act_for_tenant", tenant=named)
        tenant = named
    current = ctx.identity
    if current is not None and current.token_id is not None and tenant != ctx.tenant:
        raise InvalidParamsError(
            path="_meta.token", detail=f"this connection is already authenticated as tenant {ctx.tenant!r}"
        )
    ctx.identity = identity
    ctx.tenant = tenant
    return {}


def evict_revoked(server: Server) -> int:
    """Send ``_acp_server/evicted`` (``reason: "token_revoked"``) to every connection whose token no
    longer holds, and close it (an SSE stream gets ``client_evicted`` with that reason, then ends);
    returns how many. Their admitted prompts end as on any disconnect."""
    auth = server.auth
    if auth is None:
        return 0
    gone: dict[str, list[Any]] = {}
    for shell in server.connections:
        ctx = shell.ctx
        identity = ctx.identity if isinstance(ctx, ConnContext) else None
        if identity is not None and identity.token_id is not None and not auth.valid(identity):
            gone.setdefault(identity.token_id, []).append(shell)
    for stream in list(auth.streams):  # HTTP's event streams
        identity = stream.identity
        if identity.token_id is not None and not auth.valid(identity):
            gone.setdefault(identity.token_id, []).append(stream)
    for token_id, shells in gone.items():
        for shell in shells:
            if shell in auth.streams:
                auth.streams.discard(shell)
                shell.evict("token_revoked")
                continue
            shell.ctx.identity = None  # what is still in flight from it meets auth_required
            shell.send(Connection.send_notification("_acp_server/evicted", {"reason": "token_revoked"}))
            shell.close()
        if auth.store.get(token_id) is None:
            auth.audit.token_revoked(token_id=token_id, evicted=len(shells))
        else:
            auth.audit.token_expired(token_id=token_id, evicted=len(shells))
    return sum(len(s) for s in gone.values())


def reload_credentials(server: Server, tls: ServerTls | None = None) -> None:
    """Take the tokens file and the certificates again (each keeps what it has if its files cannot be
    used), then evict the connections whose token no longer holds."""
    if tls is not None:
        error = tls.reload()
        if error is not None:
            log.error("TLS certificates not reloaded (the current ones stay): %s", error)
    if server.auth is not None:
        result = server.auth.reload()
        if result.error is not None:
            log.error("tokens file not reloaded (the tokens in force stay): %s", result.error)
        evict_revoked(server)


async def credentials_upkeep(
    server: Server, tls: ServerTls | None, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Reload tokens and certificates on SIGHUP; evict connections of expired tokens as they expire.

    Started with ``nursery.start``: the SIGHUP handler is in place before it reports started, so a
    SIGHUP sent once the listeners are announced reloads instead of ending the process.
    """

    async def on_hangup(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with trio.open_signal_receiver(signal.SIGHUP) as signals:
            task_status.started()
            async for _ in signals:
                log.info("SIGHUP: reloading the tokens file and the certificates")
                reload_credentials(server, tls)

    async with trio.open_nursery() as nursery:
        await nursery.start(on_hangup)
        task_status.started()
        while server.auth is not None:
            await trio.sleep(EXPIRY_CHECK_S)
            evict_revoked(server)
