"""Schema migrations of the session store: a database written by an older acp-server is brought up to
date in place and keeps its sessions (issue G's ``tenant`` column arrives with version 2); one written
by a newer acp-server is refused untouched."""

from __future__ import annotations

import pathlib
import sqlite3
from typing import Any

import pytest

from acp_server.store import (
    DB_NAME,
    SCHEMA_VERSION,
    SERVER_RESTARTED,
    SessionStore,
    StoredSession,
    StoreVersionError,
)

from .helpers import stored_events

# The schema as acp-server wrote it at version 1, frozen here: a later edit of MIGRATIONS[1] must not
# make this test build what the current code expects instead of what is on users' disks.
V1_DDL = (
    """CREATE TABLE sessions (
        id TEXT PRIMARY KEY, cwd TEXT NOT NULL, backend TEXT NOT NULL, title TEXT,
        created_ms INTEGER NOT NULL, updated_ms INTEGER NOT NULL, mcp_servers TEXT NOT NULL,
        backend_state TEXT, last_chunk INTEGER
    )""",
    """CREATE TABLE chunks (
        seq INTEGER PRIMARY KEY, session_id TEXT NOT NULL, prev INTEGER,
        first_id INTEGER NOT NULL, last_id INTEGER NOT NULL, body BLOB NOT NULL
    )""",
    """CREATE TABLE prompts (
        seq INTEGER PRIMARY KEY, prompt_id TEXT NOT NULL, session_id TEXT NOT NULL,
        admitted_ms INTEGER NOT NULL, outcome TEXT, terminal_ms INTEGER
    )""",
    "CREATE INDEX prompts_unfinished ON prompts (outcome) WHERE outcome IS NULL",
    "CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, applied_ms INTEGER NOT NULL)",
    "INSERT INTO schema_migrations VALUES (1, 0)",
)


def rows(directory: pathlib.Path, query: str, *args: Any) -> list[tuple[Any, ...]]:
    db = sqlite3.connect(directory / DB_NAME)
    try:
        return db.execute(query, args).fetchall()
    finally:
        db.close()


def make_v1_database(directory: pathlib.Path) -> None:
    """A version-1 database with two sessions (one with a two-event transcript) and an unfinished prompt."""
    db = sqlite3.connect(directory / DB_NAME)
    try:
        for statement in V1_DDL:
            db.execute(statement)
        db.execute(
            "INSERT INTO sessions VALUES ('sess_a', '/a', 'echo', 'first', 10, 20, '[{\"name\":\"m\"}]', NULL, 1)"
        )
        db.execute("INSERT INTO sessions VALUES ('sess_b', '/b', 'echo', NULL, 11, 11, '[]', '{\"k\":1}', NULL)")
        db.execute(
            "INSERT INTO chunks VALUES (1, 'sess_a', NULL, 1, 2, ?)",
            (b'[[1,null,{"sessionUpdate":"user_message_chunk"}],[2,null,{"sessionUpdate":"agent_message_chunk"}]]',),
        )
        db.execute("INSERT INTO prompts VALUES (7, 'prompt_7', 'sess_a', 15, NULL, NULL)")
        db.commit()
    finally:
        db.close()


def test_version_1_database_is_migrated_and_its_sessions_get_the_default_tenant(tmp_path: pathlib.Path) -> None:
    """Opening a v1 database applies version 2 once; sessions come back whole, tenant "default"."""
    make_v1_database(tmp_path)
    store = SessionStore(tmp_path)
    index, max_seq = store.open()
    store.close()
    assert [v for (v,) in rows(tmp_path, "SELECT version FROM schema_migrations ORDER BY version")] == list(
        range(1, SCHEMA_VERSION + 1)
    )
    assert list(index) == ["sess_a", "sess_b"]
    a, b = index["sess_a"], index["sess_b"]
    assert (a.tenant, b.tenant) == ("default", "default")
    assert (a.cwd, a.backend, a.title, a.created_ms, a.mcp_servers) == ("/a", "echo", "first", 10, [{"name": "m"}])
    assert b.backend_state == {"k": 1} and b.next_event_id == 1
    # the migrated database still works as before: the unfinished prompt got its outcome and its note
    assert max_seq == 7 and store.restarted == [("sess_a", "prompt_7")]
    assert a.next_event_id == 4  # events 1, 2, then the turn_state note as 3
    assert [e for _, e, _, _ in stored_events(tmp_path, "sess_a")] == [1, 2, 3]
    assert rows(tmp_path, "SELECT outcome FROM prompts") == [(SERVER_RESTARTED,)]
    assert rows(tmp_path, "SELECT tenant FROM sessions ORDER BY id") == [("default",), ("default",)]

    again = SessionStore(tmp_path)  # a second open applies nothing twice
    again.open()
    again.close()
    assert len(rows(tmp_path, "SELECT version FROM schema_migrations")) == SCHEMA_VERSION


def test_tenant_is_stored_and_read_back(tmp_path: pathlib.Path) -> None:
    """A session saved with tenant "acme" reloads with "acme", also after its row is re-saved."""
    store = SessionStore(tmp_path)
    store.open()
    acme = StoredSession("sess_acme", "/w", "echo", 1, 2, [], "t", 1, None, "acme")
    store.save_session(acme)
    store.save_session(StoredSession("sess_plain", "/w", "echo", 1, 2))
    store.add_event("sess_acme", 1, {"sessionUpdate": "agent_message_chunk"})
    acme.title = "renamed"
    store.save_session(acme)  # INSERT OR REPLACE keeps the tenant and the transcript head
    store.close()

    index, _ = _open_index(tmp_path)
    assert index["sess_acme"].tenant == "acme"
    assert index["sess_acme"].title == "renamed" and index["sess_acme"].next_event_id == 2
    assert index["sess_plain"].tenant == "default"


def _open_index(directory: pathlib.Path) -> tuple[dict[str, StoredSession], int]:
    store = SessionStore(directory)
    try:
        return store.open()
    finally:
        store.close()


def test_newer_database_is_refused_untouched(tmp_path: pathlib.Path) -> None:
    """A database one version ahead is refused naming both versions, and nothing is written to it."""
    make_v1_database(tmp_path)
    db = sqlite3.connect(tmp_path / DB_NAME)
    db.execute("INSERT INTO schema_migrations VALUES (?, 0)", (SCHEMA_VERSION + 1,))
    db.commit()
    db.close()
    with pytest.raises(StoreVersionError, match=f"schema version {SCHEMA_VERSION + 1}, newer than .* {SCHEMA_VERSION};"):
        SessionStore(tmp_path).open()
    # neither migrated (no tenant column) nor marked (the unfinished prompt is still unfinished)
    assert "tenant" not in [name for _, name, *_ in rows(tmp_path, "PRAGMA table_info(sessions)")]
    assert rows(tmp_path, "SELECT outcome FROM prompts") == [(None,)]
