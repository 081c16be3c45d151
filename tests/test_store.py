"""The SQLite session store alone and under the bridge: migrations, the newer-version refusal, the lock,
records grouped into transactions, admission committed before the prompt runs, the outcome committed
before the answer, and unfinished prompts marked ``server_restarted`` at the next open."""

from __future__ import annotations

import os
import pathlib
import sqlite3
from typing import Any

import msgspec
import pytest
import trio
import trio.testing

from acp_server.backends import BaseBackend, Turn
from acp_server.server import Server
from acp_server.store import (
    DB_NAME,
    SCHEMA_VERSION,
    SERVER_RESTARTED,
    TURN_STATE,
    SessionStore,
    StateDirLocked,
    StoredSession,
    StoreVersionError,
)
from acp_server.types.acp import StopReason

from .helpers import connect, rows_of, stored_events


def rows(directory: pathlib.Path, query: str, *args: Any) -> list[tuple[Any, ...]]:
    """What is durable, read by a connection of our own (a copy of the database with its log applied,
    as another process, or the next start, would see it)."""
    return rows_of(directory, query, *args)


def meta(session_id: str) -> StoredSession:
    return StoredSession(session_id, "/tmp", "echo", 1, 1, [{"name": "m"}], "t")


def test_fresh_database_is_migrated_to_the_current_version(tmp_path: pathlib.Path) -> None:
    """A new directory gets the database, WAL mode and one migrations row per version."""
    store = SessionStore(tmp_path / "state")
    index, max_seq = store.open()
    store.close()
    assert (index, max_seq) == ({}, 0)
    directory = tmp_path / "state"
    assert [v for (v,) in rows(directory, "SELECT version FROM schema_migrations")] == list(
        range(1, SCHEMA_VERSION + 1)
    )
    db = sqlite3.connect(directory / DB_NAME)
    try:
        assert db.execute("PRAGMA journal_mode").fetchall() == [("wal",)]
    finally:
        db.close()
    # opening again applies nothing twice
    store = SessionStore(directory)
    store.open()
    store.close()
    assert len(rows(directory, "SELECT version FROM schema_migrations")) == SCHEMA_VERSION


def test_newer_database_is_refused(tmp_path: pathlib.Path) -> None:
    """A database whose schema is newer than ours is a clear error, not a guess."""
    store = SessionStore(tmp_path)
    store.open()
    store.close()
    db = sqlite3.connect(tmp_path / DB_NAME)
    db.execute("INSERT INTO schema_migrations VALUES (?, 0)", (SCHEMA_VERSION + 1,))
    db.commit()
    db.close()
    with pytest.raises(StoreVersionError, match=f"schema version {SCHEMA_VERSION + 1}, newer"):
        SessionStore(tmp_path).open()
    # the failed open released the lock: a second attempt fails on the version again, not on the lock
    with pytest.raises(StoreVersionError):
        SessionStore(tmp_path).open()


def test_second_store_on_a_directory_is_refused_naming_the_owner(tmp_path: pathlib.Path) -> None:
    """The lock file holds the owner's pid; a second opener is told who owns it and what to do."""
    first = SessionStore(tmp_path)
    first.open()
    try:
        with pytest.raises(StateDirLocked) as info:
            SessionStore(tmp_path).open()
        assert info.value.owner_pid == os.getpid()
        message = str(info.value)
        assert f"pid {os.getpid()}" in message
        assert "--state-dir" in message and "--ephemeral" in message and "acp-server connect" in message
    finally:
        first.close()
    SessionStore(tmp_path).open()  # released on close


async def test_records_of_one_round_share_one_transaction(tmp_path: pathlib.Path) -> None:
    """Everything enqueued while the writer is busy is written in one transaction, in order."""
    store = SessionStore(tmp_path)
    store.open()
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        store.save_session(meta("s1"))
        for event_id in range(1, 501):
            store.add_event("s1", event_id, {"sessionUpdate": "agent_message_chunk", "n": event_id})
        op = store.admit(1, "prompt_1", "s1")
        assert store.committed < op  # enqueueing never waits
        await store.wait_committed(op)
        assert store.transactions == 1
        events = await store.read_events("s1", 10, 12)
        assert [(e.event_id, msgspec.json.decode(e.body)["n"]) for e in events] == [(11, 11), (12, 12)]
        nursery.cancel_scope.cancel()
    store.close()
    assert [e for _, e, _, _ in stored_events(tmp_path, "s1")] == list(range(1, 501))
    assert rows(tmp_path, "SELECT COUNT(*) FROM chunks") == [(1,)]  # one session, one round: one chunk


async def test_unfinished_prompts_are_marked_server_restarted_once(tmp_path: pathlib.Path) -> None:
    """An admitted prompt with no outcome gets server_restarted and a turn_state event at the next open;
    a prompt that had its outcome keeps it, and a third open marks nothing again."""
    store = SessionStore(tmp_path)
    store.open()
    store.save_session(meta("s1"))
    store.add_event("s1", 1, {"sessionUpdate": "user_message_chunk"})
    store.admit(1, "prompt_1", "s1")
    store.settle(1, "end_turn")
    store.admit(2, "prompt_2", "s1")
    store.add_event("s1", 2, {"sessionUpdate": "agent_message_chunk"})
    store.flush_sync()
    store._writer.close()  # type: ignore[union-attr]  # dies without a clean close: nothing more written
    store._writer = None
    store.close()

    again = SessionStore(tmp_path)
    index, max_seq = again.open()
    again.close()
    assert again.restarted == [("s1", "prompt_2")]
    assert max_seq == 2
    assert index["s1"].next_event_id == 4  # the turn_state event took id 3
    assert rows(tmp_path, "SELECT prompt_id, outcome FROM prompts ORDER BY seq") == [
        ("prompt_1", "end_turn"),
        ("prompt_2", SERVER_RESTARTED),
    ]
    assert [(e, m) for _, e, m, _ in stored_events(tmp_path, "s1")] == [(1, None), (2, None), (3, TURN_STATE)]
    note = stored_events(tmp_path, "s1")[2][3]
    assert note["promptId"] == "prompt_2" and note["state"] == "failed" and note["reason"] == SERVER_RESTARTED

    third = SessionStore(tmp_path)
    third.open()
    third.close()
    assert third.restarted == []
    assert [m for _, _, m, _ in stored_events(tmp_path)].count(TURN_STATE) == 1


class _Probe(BaseBackend):
    """Reads the database from inside a prompt: is this prompt's admission record committed?"""

    name = "echo"

    def __init__(self, directory: pathlib.Path) -> None:
        self.directory = directory
        self.seen: list[list[tuple[Any, ...]]] = []

    async def prompt(self, turn: Turn) -> StopReason:
        self.seen.append(rows(self.directory, "SELECT prompt_id, outcome FROM prompts ORDER BY seq"))
        await trio.lowlevel.checkpoint()
        return "end_turn"


async def test_admission_committed_before_run_and_outcome_before_answer(tmp_path: pathlib.Path) -> None:
    """The backend runs a prompt only once its admission record is on disk, and the client gets the
    answer only once the terminal record is (both read by an independent connection)."""
    probe = _Probe(tmp_path)
    server = Server(backend=probe, store=SessionStore(tmp_path))
    async with trio.open_nursery() as nursery:
        await nursery.start(server.bridge.run)
        client = await connect(server, nursery)
        session_id, _ = await client.new_session()
        for n in (1, 2):
            result = await client.prompt(session_id, f"p{n}")
            assert result["stopReason"] == "end_turn"
            on_disk = rows(tmp_path, "SELECT prompt_id, outcome FROM prompts ORDER BY seq")
            assert on_disk[-1] == (result["_meta"]["promptId"], "end_turn")
        assert probe.seen[0] == [("prompt_1", None)]
        assert probe.seen[1] == [("prompt_1", "end_turn"), ("prompt_2", None)]
        nursery.cancel_scope.cancel()
    assert server.store is not None
    server.store.close()


async def test_a_settled_prompt_waiting_for_its_commit_frees_its_connection_slot(tmp_path: pathlib.Path) -> None:
    """With --max-inflight-requests 1, a prompt whose outcome is known but not yet committed no longer
    counts as running on its connection: the next request starts while the answer waits (the writer
    is stopped), and the answer still goes out once the commit comes; shutdown waits for it."""
    import signal

    from acp_server.admission import Limits

    from .fakes import FakeBackend, send_prompt

    backend = FakeBackend()
    backend.hold("a")
    store = SessionStore(tmp_path)
    server = Server(Limits(max_inflight_requests=1), backend, store=store)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.bridge.run)
        client = await connect(server, nursery)
        s1, _ = await client.new_session()
        s2, _ = await client.new_session()
        first = await send_prompt(client, nursery, s1, "a")
        await backend.started("a")
        second = await send_prompt(client, nursery, s2, "b")
        await trio.testing.wait_all_tasks_blocked()
        assert server.bridge.statistics().admitted_total == 1, "b waits unstarted behind a"

        assert store._process is not None
        writer_pid = store._process.pid
        os.kill(writer_pid, signal.SIGSTOP)  # no commit until SIGCONT
        try:
            backend.release("a")
            await trio.testing.wait_all_tasks_blocked()
            assert server.bridge.statistics().admitted_total == 2, "b started while a's answer waits"
            assert not first.done.is_set(), "a's answer waits for its outcome's commit"
            assert [c.text for c in backend.calls_of("b")] == [], "b waits for its own admission's commit"
        finally:
            os.kill(writer_pid, signal.SIGCONT)
        with trio.fail_after(10):
            assert (await first.wait())["result"]["stopReason"] == "end_turn"
            assert (await second.wait())["result"]["stopReason"] == "end_turn"
        nursery.cancel_scope.cancel()
    store.close()
