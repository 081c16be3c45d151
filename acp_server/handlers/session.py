"""``session/new``, ``session/list``, ``session/close``, ``session/set_mode`` and ``session/cancel``."""

from __future__ import annotations

import datetime
import os
from typing import Any

from ..errors import InvalidParamsError, SessionNotFoundError
from ..types.acp import (
    CancelParams,
    CloseSessionParams,
    ListSessionsParams,
    ListSessionsResult,
    NewSessionParams,
    NewSessionResult,
    SessionInfo,
    SessionMode,
    SessionModeState,
    SetSessionModeParams,
)
from .context import ConnContext
from .meta import meta_client_id

__all__ = ["cancel", "close", "list_sessions", "new", "set_mode", "MODES"]

#: The modes the echo agent offers.
MODES = [SessionMode(id="default", name="Echo", description="Echo every prompt back word by word")]
_PAGE = 100


def _modes(current: str) -> SessionModeState:
    return SessionModeState(current_mode_id=current, available_modes=MODES)


def new(ctx: ConnContext, params: NewSessionParams) -> NewSessionResult:
    if not os.path.isabs(params.cwd):
        raise InvalidParamsError(path="cwd", detail=f"must be an absolute path; got {params.cwd!r}")
    session, client_id = ctx.bridge.new_session(
        params.cwd, params.mcp_servers, ctx.peer, meta_client_id(params.meta)
    )
    return NewSessionResult(session_id=session.session_id, modes=_modes(session.mode_id), meta={"clientId": client_id})


def list_sessions(ctx: ConnContext, params: ListSessionsParams) -> ListSessionsResult:
    start = 0
    if params.cursor is not None:
        if not params.cursor.isdigit():
            raise InvalidParamsError(path="cursor", detail="not a cursor this server issued")
        start = int(params.cursor)
    sessions = ctx.bridge.list_sessions(params.cwd)
    page = sessions[start : start + _PAGE]
    infos = [
        SessionInfo(
            session_id=s.session_id,
            cwd=s.cwd,
            title=s.title,
            updated_at=datetime.datetime.fromtimestamp(s.updated_ms / 1000, datetime.UTC).isoformat(),
        )
        for s in page
    ]
    more = start + _PAGE < len(sessions)
    return ListSessionsResult(sessions=infos, next_cursor=str(start + _PAGE) if more else None)


def close(ctx: ConnContext, params: CloseSessionParams) -> dict[str, Any]:
    bridge = ctx.bridge
    session = bridge.get(params.session_id)
    bridge.resolve_client(session, ctx.peer, meta_client_id(params.meta))
    bridge.close_session(session)
    return {}


def set_mode(ctx: ConnContext, params: SetSessionModeParams) -> dict[str, Any]:
    session = ctx.bridge.get(params.session_id)
    if params.mode_id not in {m.id for m in MODES}:
        known = ", ".join(m.id for m in MODES)
        raise InvalidParamsError(path="modeId", detail=f"unknown mode {params.mode_id!r}; this session offers: {known}")
    session.mode_id = params.mode_id
    return {}


def cancel(ctx: ConnContext, params: CancelParams) -> None:
    """A notification: the session's running prompt and queued ones end with ``cancelled``."""
    try:
        ctx.bridge.cancel_session(params.session_id, ctx.peer, meta_client_id(params.meta))
    except SessionNotFoundError:
        pass  # nothing to cancel; notifications are never answered
