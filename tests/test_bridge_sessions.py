"""``acp_server.bridge.sessions.SessionTable``: building, counting and restoring sessions."""

from __future__ import annotations

import logging
import pathlib
from collections.abc import Callable
from typing import Any

import pytest
import trio

from acp_server.admission import Limits
from acp_server.bridge import SessionBridge
from acp_server.errors import SessionLimitExceededError
from acp_server.store import SessionStore

from .fakes import FakeBackend, FakePeer, hang_guard, open_session


async def test_build_gives_fresh_ids_unless_told_one() -> None:
    from acp_server.bridge.sessions import SessionTable

    backend = FakeBackend()
    a, b = SessionTable.build(backend, "/a", [], "t"), SessionTable.build(backend, "/b", [], "t")
    assert a.session_id != b.session_id and a.session_id.startswith("sess_")
    given = SessionTable.build(backend, "/c", [], "t", session_id="sess_given", created_ms=5)
    assert (given.session_id, given.created_ms, given.updated_ms, given.tenant) == ("sess_given", 5, 5, "t")


class _Restorable(FakeBackend):
    """A backend that keeps state per session and is told about restored ones."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.restored: list[tuple[str, str, Any]] = []

    def session_state(self, session_id: str) -> dict[str, Any]:
        return {"agentSessionId": f"agent-{session_id}"}

    def restore_session(
        self, session_id: str, cwd: str, mcp_servers: list[dict[str, Any]], emit: Callable[[Any], None], state: Any
    ) -> None:
        self.restored.append((session_id, cwd, state))
        emit({"sessionUpdate": "current_mode_update", "currentModeId": "restored"})


async def _stored_session(directory: pathlib.Path, backend: FakeBackend) -> str:
    store = SessionStore(directory)
    stored, seq = store.open()
    bridge = SessionBridge(backend, store=store, stored=stored, prompt_seq=seq)
    try:
        async with hang_guard(), trio.open_nursery() as nursery:
            await nursery.start(bridge.run)
            session, _ = await open_session(bridge, FakePeer(), "/work")
            nursery.cancel_scope.cancel()
    finally:
        store.close()
    return session.session_id


async def test_a_restored_session_tells_its_backend_its_stored_state(tmp_path: pathlib.Path) -> None:
    sid = await _stored_session(tmp_path, _Restorable("agent"))
    backend = _Restorable("agent")
    store = SessionStore(tmp_path)
    stored, seq = store.open()
    bridge = SessionBridge(backend, store=store, stored=stored, prompt_seq=seq)
    try:
        async with hang_guard(), trio.open_nursery() as nursery:
            await nursery.start(bridge.run)
            session = bridge.get(sid)
            assert backend.restored == [(sid, "/work", {"agentSessionId": f"agent-{sid}"})]
            assert session.history[-1][1] == {"sessionUpdate": "current_mode_update", "currentModeId": "restored"}
            nursery.cancel_scope.cancel()
    finally:
        store.close()


async def test_a_session_whose_backend_is_gone_is_restored_on_the_default(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    sid = await _stored_session(tmp_path, FakeBackend("old"))
    new = FakeBackend("new")
    store = SessionStore(tmp_path)
    stored, seq = store.open()
    bridge = SessionBridge(new, store=store, stored=stored, prompt_seq=seq)
    try:
        async with hang_guard(), trio.open_nursery() as nursery:
            await nursery.start(bridge.run)
            with caplog.at_level(logging.WARNING, logger="acp_server.bridge"):
                assert bridge.get(sid).backend is new
            assert "which is gone: using new" in caplog.text
            nursery.cancel_scope.cancel()
    finally:
        store.close()


async def test_restore_counts_against_max_sessions(tmp_path: pathlib.Path) -> None:
    sid = await _stored_session(tmp_path, FakeBackend())
    store = SessionStore(tmp_path)
    stored, seq = store.open()
    bridge = SessionBridge(FakeBackend(), Limits(max_sessions=1), store=store, stored=stored, prompt_seq=seq)
    try:
        async with hang_guard(), trio.open_nursery() as nursery:
            await nursery.start(bridge.run)
            await open_session(bridge, None)
            with pytest.raises(SessionLimitExceededError):
                bridge.get(sid)
            assert sid not in bridge.sessions and sid in bridge.stored
            nursery.cancel_scope.cancel()
    finally:
        store.close()
