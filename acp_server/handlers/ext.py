"""Our extension methods, under ``_acp_server/``: capabilities, stats, heartbeat, detach, fork."""

from __future__ import annotations

from typing import Any

import msgspec

from ..types.acp import SessionIdParams
from ..types.ext import CapabilitiesResult
from .context import ConnContext
from .meta import meta_client_id

__all__ = ["capabilities", "detach", "fork", "heartbeat", "stats"]


def capabilities(ctx: ConnContext, params: None) -> CapabilitiesResult:
    return CapabilitiesResult(limits=ctx.server.limits_capability())


def stats(ctx: ConnContext, params: None) -> dict[str, Any]:
    return {"bridge": msgspec.to_builtins(ctx.bridge.statistics())}


def heartbeat(ctx: ConnContext, params: SessionIdParams) -> dict[str, Any]:
    bridge = ctx.bridge
    session = bridge.get(params.session_id)
    client_id = bridge.resolve_client(session, ctx.peer, meta_client_id(params.meta))
    out: dict[str, Any] = {"sessionId": session.session_id, "lastSeenAt": bridge.heartbeat(session, client_id)}
    if client_id is not None:
        out["clientId"] = client_id
    return out


def detach(ctx: ConnContext, params: SessionIdParams) -> dict[str, Any]:
    bridge = ctx.bridge
    session = bridge.get(params.session_id)
    client_id = bridge.resolve_client(session, ctx.peer, meta_client_id(params.meta))
    bridge.detach(session, ctx.peer, client_id)
    return {}


async def _fork_result(ctx: ConnContext, ticket: Any) -> dict[str, Any]:
    session, client_id = await ctx.bridge.fork_outcome(ticket)
    return {"sessionId": session.session_id, "_meta": {"clientId": client_id}}


def fork(ctx: ConnContext, params: SessionIdParams) -> Any:
    ticket = ctx.bridge.admit_fork(params.session_id, ctx.peer, meta_client_id(params.meta))
    return _fork_result(ctx, ticket)
