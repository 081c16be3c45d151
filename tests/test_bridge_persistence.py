"""``acp_server.bridge.persistence``: the null implementation (``--ephemeral``) and the store's."""

from __future__ import annotations

import pathlib

import pytest
import trio

from acp_server.bridge.persistence import NullPersistence, StorePersistence
from acp_server.bridge.sessions import SessionTable
from acp_server.store import SessionStore, StoredEvent

from .fakes import FakeBackend


async def test_null_persistence_records_nothing_and_has_nothing_to_wait_for() -> None:
    null = NullPersistence()
    session = SessionTable.build(FakeBackend(), "/tmp", [], "default")
    null.save_session(session)
    null.add_event(session.session_id, 1, b"{}")
    null.copy_transcript(session)
    null.unload(session)
    assert null.stored == {} and not null.forget(session.session_id)
    assert (null.committed, null.generation, null.durable) == (0, 0, False)
    with pytest.raises(AssertionError):
        null.when_committed(1, lambda: None)
    with pytest.raises(AssertionError):
        null.after_round(lambda: None)
    with pytest.raises(AssertionError):
        await null.read_transcript(session.session_id, 1)
    async with trio.open_nursery() as nursery:
        await nursery.start(null.run)  # nothing to run: started at once


async def test_null_persistence_lists_the_live_sessions_by_cwd_and_tenant() -> None:
    backend = FakeBackend()
    live = {
        s.session_id: s
        for s in (
            SessionTable.build(backend, "/a", [], "t1"),
            SessionTable.build(backend, "/b", [], "t1"),
            SessionTable.build(backend, "/a", [], "t2"),
        )
    }
    listed = NullPersistence().list_sessions
    assert len(listed(live, None, None)) == 3
    assert [(s.cwd, s.tenant) for s in listed(live, "/a", None)] == [("/a", "t1"), ("/a", "t2")]
    assert [(s.cwd, s.tenant) for s in listed(live, None, "t1")] == [("/a", "t1"), ("/b", "t1")]


async def test_store_persistence_indexes_copies_and_forgets(tmp_path: pathlib.Path) -> None:
    store = SessionStore(tmp_path)
    stored, _ = store.open()
    persistence = StorePersistence(store, stored)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(persistence.run)
            await nursery.start(persistence.run)  # running already: returns at once
            source = SessionTable.build(FakeBackend(), "/w", [{"name": "m"}], "acme")
            source.history = [(1, {"sessionUpdate": "agent_message_chunk"}),
                              (2, StoredEvent(2, "_acp_server/turn_state", b'{"state":"completed"}'))]
            source.next_event_id = 3
            persistence.save_session(source)
            persistence.copy_transcript(source)
            assert persistence.stored[source.session_id].tenant == "acme"
            events = await persistence.read_transcript(source.session_id, 2)
            assert [(e.event_id, e.method) for e in events] == [(1, None), (2, "_acp_server/turn_state")]
            source.title = "named"
            persistence.unload(source)
            assert persistence.stored[source.session_id].title == "named"
            assert persistence.stored[source.session_id].next_event_id == 3
            assert [s.session_id for s in persistence.list_sessions({}, "/w", "acme")] == [source.session_id]
            assert persistence.list_sessions({}, "/w", "other") == []
            assert persistence.forget(source.session_id) and not persistence.forget(source.session_id)
            nursery.cancel_scope.cancel()
    finally:
        store.close()
