"""The database schema, as numbered migrations recorded in ``schema_migrations``.

A migration is applied once, in one transaction with its row in ``schema_migrations``. A database
whose highest recorded version is newer than :data:`SCHEMA_VERSION` was written by a newer
acp-server: opening it is refused rather than guessed at.
"""

from __future__ import annotations

import sqlite3
import time

__all__ = ["MIGRATIONS", "SCHEMA_VERSION", "StoreVersionError", "migrate"]


class StoreVersionError(RuntimeError):
    """The database comes from a newer acp-server (its schema version is above ours)."""


#: version -> the statements that bring a database from version - 1 to it
MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: (
        # last_chunk: the newest transcript chunk of the session (the chunks of a session are a chain)
        """CREATE TABLE sessions (
            id TEXT PRIMARY KEY,
            cwd TEXT NOT NULL,
            backend TEXT NOT NULL,
            title TEXT,
            created_ms INTEGER NOT NULL,
            updated_ms INTEGER NOT NULL,
            mcp_servers TEXT NOT NULL,
            backend_state TEXT,
            last_chunk INTEGER
        )""",
        # A chunk: the events one write round added to one session: at this version a JSON array of
        # [eventId, method or null, body] (method null: a session/update, body the update); from
        # version 3 on MessagePack (see below). Appended
        # in seq order and chained per session by prev, so that no index is scattered over the
        # sessions written in a round (a (session, event) key costs ~3x more per event).
        """CREATE TABLE chunks (
            seq INTEGER PRIMARY KEY,
            session_id TEXT NOT NULL,
            prev INTEGER,
            first_id INTEGER NOT NULL,
            last_id INTEGER NOT NULL,
            body BLOB NOT NULL
        )""",
        # outcome NULL: admitted, not finished; else the stop reason or the error kind
        """CREATE TABLE prompts (
            seq INTEGER PRIMARY KEY,
            prompt_id TEXT NOT NULL,
            session_id TEXT NOT NULL,
            admitted_ms INTEGER NOT NULL,
            outcome TEXT,
            terminal_ms INTEGER
        )""",
        "CREATE INDEX prompts_unfinished ON prompts (outcome) WHERE outcome IS NULL",
    ),
    # A session belongs to the tenant that created it; older sessions to "default".
    2: ("ALTER TABLE sessions ADD COLUMN tenant TEXT NOT NULL DEFAULT 'default'",),
    # The chain heads (sessions.last_chunk) are written every so many rounds, not in every
    # round: store_meta's heads_upto is the last chunk they account for, and the chunks after it
    # (few) are read at startup to bring the heads up to date. written_ms: when the chunk was written
    # (a session's updatedAt after a restart).
    # log: rounds made durable as the server sent them (MessagePack ops, see store/records.py), applied
    # to the tables above later and in bulk by the writer (and at startup), then deleted. Chunks
    # written from here on hold MessagePack [eventId, method, body JSON, ...] (see
    # writer.chunk_events), older ones stay JSON.
    3: (
        "CREATE TABLE log (seq INTEGER PRIMARY KEY, written_ms INTEGER NOT NULL, ops BLOB NOT NULL)",
        "ALTER TABLE chunks ADD COLUMN written_ms INTEGER",
        "CREATE TABLE store_meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL)",
        "INSERT INTO store_meta SELECT 'heads_upto', COALESCE(MAX(seq), 0) FROM chunks",
    ),
}

SCHEMA_VERSION = max(MIGRATIONS)


def migrate(db: sqlite3.Connection, path: str) -> int:
    """Bring ``db`` (opened with ``isolation_level=None``) to :data:`SCHEMA_VERSION`; returns the version it had.

    Raises:
        StoreVersionError: the database is newer than this acp-server.
    """
    db.execute(
        "CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, applied_ms INTEGER NOT NULL)"
    )
    (found,) = db.execute("SELECT COALESCE(MAX(version), 0) FROM schema_migrations").fetchone()
    if found > SCHEMA_VERSION:
        raise StoreVersionError(
            f"the database {path} has schema version {found}, newer than this acp-server's {SCHEMA_VERSION}; "
            "upgrade acp-server, or use another --state-dir"
        )
    for version in range(found + 1, SCHEMA_VERSION + 1):
        db.execute("BEGIN IMMEDIATE")  # the connection is in autocommit mode: DDL joins the transaction
        try:
            for statement in MIGRATIONS[version]:
                db.execute(statement)
            db.execute("INSERT INTO schema_migrations VALUES (?, ?)", (version, int(time.time() * 1000)))
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
    return int(found)
