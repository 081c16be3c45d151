"""``session/new``, ``session/load``, ``session/resume``, ``session/list``, ``session/close``,
``session/delete``, ``session/set_mode`` and ``session/cancel``."""

from __future__ import annotations

import datetime
import os
import re
from collections.abc import Coroutine
from typing import Any

import msgspec

from ..backends import Backend
from ..bridge import Session
from ..errors import InvalidParamsError, SessionNotFoundError
from ..logtext import clip
from ..types.acp import (
    INT64_MAX,
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
_CURSOR = re.compile(r"[0-9]{1,18}")


def _modes(current: str) -> SessionModeState:
    return SessionModeState(current_mode_id=current, available_modes=MODES)


def new(ctx: ConnContext, params: NewSessionParams) -> Coroutine[Any, Any, dict[str, Any]]:
    _check_cwd(params.cwd)
    _check_dirs(params)
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
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= INT64_MAX:
        raise InvalidParamsError(
            path="_meta.afterEventId", detail=f"must be an integer from 0 to {INT64_MAX}; got {clip(value)}"
        )
    return value


#: The longest path accepted as a working directory (Linux's PATH_MAX, terminator excluded).
MAX_PATH_CHARS = 4095


def _check_path(path: str, field: str) -> None:
    if len(path) > MAX_PATH_CHARS:
        raise InvalidParamsError(path=field, detail=f"must be at most {MAX_PATH_CHARS} characters; got {len(path)}")
    if "\x00" in path:
        raise InvalidParamsError(path=field, detail=f"must not contain a NUL character; got {clip(repr(path))}")


def _check_cwd(cwd: str) -> None:
    _check_path(cwd, "cwd")
    if not os.path.isabs(cwd):
        raise InvalidParamsError(path="cwd", detail=f"must be an absolute path; got {clip(repr(cwd))}")


def _check_dirs(params: NewSessionParams) -> None:
    for i, directory in enumerate(params.additional_directories):
        _check_path(directory, f"additionalDirectories[{i}]")


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
        # ours are short strings of ASCII digits (str.isdigit also takes "²" and "٣", int() not all of them)
        if not _CURSOR.fullmatch(params.cursor):
            raise InvalidParamsError(path="cursor", detail=f"not a cursor this server issued: {clip(repr(params.cursor))}")
        start = int(params.cursor)
    if params.cwd is not None:
        _check_path(params.cwd, "cwd")
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
        raise InvalidParamsError(path="modeId", detail=f"unknown mode {clip(repr(params.mode_id))}; this session offers: {known}")
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
