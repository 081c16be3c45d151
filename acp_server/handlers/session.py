"""``session/new``, ``session/load``, ``session/resume``, ``session/list``, ``session/close``,
``session/delete``, ``session/set_mode`` and ``session/cancel``."""

from __future__ import annotations

import datetime
import os
from collections.abc import Coroutine
from typing import Any

import msgspec

from ..backends import Backend
from ..bridge import Session
from ..errors import InvalidParamsError, SessionNotFoundError
from ..types.acp import (
    CancelParams,
    CloseSessionParams,
    ListSessionsParams,
    ListSessionsResult,
    LoadSessionParams,
    NewSessionParams,
    SessionInfo,
    SessionMode,
    SessionModeState,
    SetSessionModeParams,
)
from .context import ConnContext
from .meta import meta_client_id, meta_str, passthrough_meta

__all__ = ["cancel", "close", "delete", "list_sessions", "new", "set_mode", "MODES"]

#: The modes the echo agent offers.
MODES = [SessionMode(id="default", name="Echo", description="Echo every prompt back word by word")]
_PAGE = 100


def _modes(current: str) -> SessionModeState:
    return SessionModeState(current_mode_id=current, available_modes=MODES)


def new(ctx: ConnContext, params: NewSessionParams) -> Coroutine[Any, Any, dict[str, Any]]:
    _check_cwd(params.cwd)
    backend = ctx.bridge.backend_named(meta_str(params.meta, "backend"))
    return _open(ctx, params, backend)


async def _open(ctx: ConnContext, params: NewSessionParams, backend: Backend) -> dict[str, Any]:
    session, client_id, setup = await ctx.bridge.open_session(
        params.cwd,
        params.mcp_servers,
        ctx.peer,
        meta_client_id(params.meta),
        backend=backend,
        meta=passthrough_meta(params.meta),
        tenant=ctx.tenant,
    )
    result: dict[str, Any] = {"sessionId": session.session_id}
    result["modes"] = setup.modes if setup.modes is not None else msgspec.to_builtins(_modes(session.mode_id))
    if setup.config_options is not None:
        result["configOptions"] = setup.config_options
    meta = dict(setup.meta or {})
    meta["clientId"] = client_id
    meta["backend"] = backend.name
    result["_meta"] = meta
    return result


def _reattach_result(session: Session, client_id: str) -> dict[str, Any]:
    modes = session.modes if session.modes is not None else msgspec.to_builtins(_modes(session.mode_id))
    return {"modes": modes, "_meta": {"clientId": client_id}}


def _after_event_id(meta: dict[str, Any] | None) -> int | None:
    if not meta or meta.get("afterEventId") is None:
        return None
    value = meta["afterEventId"]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidParamsError(path="_meta.afterEventId", detail=f"must be a non-negative integer; got {value!r}")
    return value


def _check_cwd(cwd: str) -> None:
    if not os.path.isabs(cwd):
        raise InvalidParamsError(path="cwd", detail=f"must be an absolute path; got {cwd!r}")


def load(ctx: ConnContext, params: LoadSessionParams) -> Coroutine[Any, Any, dict[str, Any]]:
    """Replay the transcript (after ``_meta.afterEventId`` if given), then register the caller."""
    _check_cwd(params.cwd)
    session = ctx.bridge.get(params.session_id, ctx.tenant)
    after = _after_event_id(params.meta) or 0
    return _load(ctx, session, after, meta_client_id(params.meta))


async def _load(ctx: ConnContext, session: Session, after: int, requested: str | None) -> dict[str, Any]:
    await ctx.bridge.replay(session, ctx.peer, after)
    return _reattach_result(session, ctx.bridge.register(session, ctx.peer, requested))


def resume(ctx: ConnContext, params: LoadSessionParams) -> Any:
    """Re-register the caller (a fresh client id unless ``_meta.clientId`` is still registered);
    replay only with ``_meta.afterEventId``."""
    _check_cwd(params.cwd)
    session = ctx.bridge.get(params.session_id, ctx.tenant)
    after = _after_event_id(params.meta)
    requested = meta_client_id(params.meta)
    if requested is None or requested not in session.clients:
        ctx.bridge.self_heal_resumes += 1  # a new client id: what the SDK does after invalid_client_id
    if after is None:
        return _reattach_result(session, ctx.bridge.register(session, ctx.peer, requested))
    return _load(ctx, session, after, requested)


def list_sessions(ctx: ConnContext, params: ListSessionsParams) -> ListSessionsResult:
    start = 0
    if params.cursor is not None:
        if not params.cursor.isdigit():
            raise InvalidParamsError(path="cursor", detail="not a cursor this server issued")
        start = int(params.cursor)
    sessions = ctx.bridge.list_sessions(params.cwd, ctx.tenant)
    page = sessions[start : start + _PAGE]
    infos = [
        SessionInfo(
            session_id=s.session_id,
            cwd=s.cwd,
            title=s.title,
            updated_at=datetime.datetime.fromtimestamp(s.updated_ms / 1000, datetime.UTC).isoformat(),
            meta={"pendingCount": getattr(s, "pending_count", 0)},  # a stored (unloaded) session runs nothing
        )
        for s in page
    ]
    more = start + _PAGE < len(sessions)
    return ListSessionsResult(sessions=infos, next_cursor=str(start + _PAGE) if more else None)


def close(ctx: ConnContext, params: CloseSessionParams) -> dict[str, Any]:
    """End the session for every client; with a store it is only unloaded (listed, loadable)."""
    ctx.bridge.close_or_delete(
        params.session_id, ctx.peer, meta_client_id(params.meta), delete=False, tenant=ctx.tenant
    )
    return {}


def delete(ctx: ConnContext, params: CloseSessionParams) -> dict[str, Any]:
    """Close the session and remove it and its transcript from the store."""
    ctx.bridge.close_or_delete(
        params.session_id, ctx.peer, meta_client_id(params.meta), delete=True, tenant=ctx.tenant
    )
    return {}


def set_mode(ctx: ConnContext, params: SetSessionModeParams) -> Coroutine[Any, Any, dict[str, Any]]:
    session = ctx.bridge.get(params.session_id, ctx.tenant)
    ctx.bridge.resolve_client(session, ctx.peer, meta_client_id(params.meta))
    if session.modes is not None:
        offered = [m.get("id") for m in session.modes.get("availableModes", []) if isinstance(m, dict)]
    else:
        offered = [m.id for m in MODES]
    if params.mode_id not in offered:
        known = ", ".join(str(m) for m in offered)
        raise InvalidParamsError(path="modeId", detail=f"unknown mode {params.mode_id!r}; this session offers: {known}")
    return _set_mode(session, params.mode_id)


async def _set_mode(session: Session, mode_id: str) -> dict[str, Any]:
    await session.backend.set_mode(session.session_id, mode_id)
    session.mode_id = mode_id
    return {}


def cancel(ctx: ConnContext, params: CancelParams) -> None:
    """A notification: the session's running prompt and queued ones end with ``cancelled``."""
    try:
        ctx.bridge.cancel_session(params.session_id, ctx.peer, meta_client_id(params.meta), ctx.tenant)
    except SessionNotFoundError:
        pass  # nothing to cancel; notifications are never answered
