"""Our extension methods, under ``_acp_server/``: capabilities, stats, heartbeat, detach, fork."""

from __future__ import annotations

from typing import Any

from ..backends import EchoBackend
from ..types.acp import SessionIdParams
from ..types.ext import BackendCapability, CapabilitiesResult
from .context import ConnContext
from .meta import meta_client_id

__all__ = ["capabilities", "detach", "fork", "heartbeat", "stats", "stats_subscribe", "stats_unsubscribe"]


def capabilities(ctx: ConnContext, params: None) -> CapabilitiesResult:
    bridge = ctx.bridge
    backends = {}
    for name, backend in bridge.backends.items():
        pool = bridge.capacity.pool(name)
        backends[name] = BackendCapability(
            kind=getattr(backend, "kind", "echo" if isinstance(backend, EchoBackend) else "acp"),
            max_active=pool.limits.max_active if pool else None,
            max_waiting=pool.limits.max_waiting if pool else None,
        )
    return CapabilitiesResult(
        limits=ctx.server.limits_capability(), backends=backends, default_backend=bridge.default_backend
    )


def stats(ctx: ConnContext, params: None) -> dict[str, Any]:
    """Everything the Prometheus endpoint shows, as one document (see ``Server.stats_snapshot``)."""
    return ctx.server.stats_snapshot()


def stats_subscribe(ctx: ConnContext, params: None) -> dict[str, Any]:
    """Send this connection ``_acp_server/stats/snapshot`` (the ``_acp_server/stats`` document) now and
    then once a second, until ``_acp_server/stats/unsubscribe`` or the connection closes."""
    feed = ctx.server.stats_feed
    feed.subscribe(ctx.peer)
    ctx.peer.send(feed.encode())
    return {"intervalMs": round(feed.interval_s * 1000)}


def stats_unsubscribe(ctx: ConnContext, params: None) -> dict[str, Any]:
    """Stop this connection's snapshots; ``subscribed`` says whether it had any."""
    return {"subscribed": ctx.server.stats_feed.unsubscribe(ctx.peer)}


def heartbeat(ctx: ConnContext, params: SessionIdParams) -> dict[str, Any]:
    bridge = ctx.bridge
    session = bridge.get(params.session_id, ctx.tenant)
    client_id = bridge.resolve_client(session, ctx.peer, meta_client_id(params.meta))
    out: dict[str, Any] = {"sessionId": session.session_id, "lastSeenAt": bridge.heartbeat(session, client_id)}
    if client_id is not None:
        out["clientId"] = client_id
    return out


def detach(ctx: ConnContext, params: SessionIdParams) -> dict[str, Any]:
    bridge = ctx.bridge
    session = bridge.get(params.session_id, ctx.tenant)
    client_id = bridge.resolve_client(session, ctx.peer, meta_client_id(params.meta))
    bridge.release_client(session, ctx.peer, client_id)
    return {}


async def _fork_result(ctx: ConnContext, ticket: Any) -> dict[str, Any]:
    session, client_id = await ctx.bridge.fork_outcome(ticket)
    return {"sessionId": session.session_id, "_meta": {"clientId": client_id}}


def fork(ctx: ConnContext, params: SessionIdParams) -> Any:
    ticket = ctx.bridge.admit_fork(params.session_id, ctx.peer, meta_client_id(params.meta), ctx.tenant)
    return _fork_result(ctx, ticket)
