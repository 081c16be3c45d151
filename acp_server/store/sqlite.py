"""The durable session store: one SQLite database (WAL mode) written by one writer task.

The event loop never touches the disk. Callers *enqueue* records synchronously (no ``await``); the
writer task takes everything queued since its last round, applies it in one transaction in a worker
thread (``trio.to_thread``), then runs the callbacks that waited for that commit, in enqueue order.
So a burst of prompts over many sessions costs one transaction, not one per record.

Ordering guarantees the bridge builds on:

- :meth:`SessionStore.admit` returns an op number; :meth:`SessionStore.wait_committed` returns once
  that record is committed (the runner waits for it before the prompt runs).
- :meth:`SessionStore.settle` takes a callback run after the terminal record is committed (the bridge
  answers the prompt from it).
"""

from __future__ import annotations

import datetime
import logging
import os
import pathlib
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import trio

from .lock import StateLock
from .schema import migrate

__all__ = [
    "DB_NAME",
    "SERVER_RESTARTED",
    "TURN_STATE",
    "SessionStore",
    "StoredEvent",
    "StoredSession",
    "default_state_dir",
    "iso_ms",
]

log = logging.getLogger("acp_server.store")

DB_NAME = "sessions.db"
#: the extension notification marking a prompt the server could not finish
TURN_STATE = "_acp_server/turn_state"
SERVER_RESTARTED = "server_restarted"

_encode = msgspec.json.Encoder().encode
_decode_chunk = msgspec.json.Decoder(list[tuple[int, str | None, msgspec.Raw]]).decode

# op kinds
_SESSION, _EVENT, _ADMIT, _SETTLE, _DELETE, _READ, _TITLE = range(7)


def default_state_dir() -> pathlib.Path:
    """``$XDG_STATE_HOME/acp-server``, else ``~/.local/state/acp-server``."""
    base = os.environ.get("XDG_STATE_HOME")
    root = pathlib.Path(base) if base else pathlib.Path.home() / ".local" / "state"
    return root / "acp-server"


def _now_ms() -> int:
    return int(time.time() * 1000)


def iso_ms(ms: int) -> str:
    return datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC).isoformat()


@dataclass(slots=True)
class StoredSession:
    """A session's metadata, as the in-memory index (loaded at startup) and the ``sessions`` table hold it."""

    session_id: str
    cwd: str
    backend: str
    created_ms: int
    updated_ms: int
    mcp_servers: list[dict[str, Any]] = field(default_factory=list)
    title: str | None = None
    #: the id the next event of the session gets
    next_event_id: int = 1
    #: what a backend needs to re-open the session in its agent (e.g. the agent's own session id)
    backend_state: dict[str, Any] | None = None


@dataclass(slots=True, frozen=True)
class StoredEvent:
    """One transcript entry: ``method`` None for a ``session/update`` (``body``: the update), else an
    extension notification (``body``: its params without sessionId and _meta)."""

    event_id: int
    method: str | None
    body: msgspec.Raw


class SessionStore:
    """Sessions, transcripts and prompt outcomes in ``DIR/sessions.db``.

    Args:
        directory: the state directory (created if missing); ``lock``: take its lock file (one server
            per directory).

    Call :meth:`open` (synchronous, at startup) then run :meth:`run` in a nursery.
    """

    def __init__(self, directory: pathlib.Path | str, *, lock: bool = True) -> None:
        self.directory = pathlib.Path(directory)
        self.path = self.directory / DB_NAME
        self._lock = StateLock(self.directory) if lock else None
        self._db: sqlite3.Connection | None = None
        self._ops: list[tuple[Any, ...]] = []
        self._callbacks: list[Callable[[], None]] = []
        self._op_seq = 0
        self.committed = 0
        #: incremented each time the writer takes the queued records: callbacks registered under one
        #: generation all run after the same commit
        self.generation = 0
        self._wake = trio.Event()
        self._round_done = trio.Event()
        self.running = False
        #: number of transactions committed by the writer (tests check grouping with it)
        self.transactions = 0
        #: prompts found unfinished at :meth:`open`: (session id, prompt id)
        self.restarted: list[tuple[str, str]] = []
        # the writer thread's own state: each session's newest chunk, and the last chunk number
        self._heads: dict[str, int] = {}
        self._chunk_seq = 0

    # --- startup -----------------------------------------------------------------------------------

    def open(self) -> tuple[dict[str, StoredSession], int]:
        """Lock the directory, open and migrate the database, give unfinished prompts their terminal
        outcome ``server_restarted``; returns the session index and the highest prompt number seen.

        Raises:
            StateDirLocked: another server owns the directory.
            StoreVersionError: the database is newer than this acp-server.
        """
        if self._lock is not None:
            self._lock.acquire()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self._db = db
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable against a process crash
            migrate(db, str(self.path))
            self._mark_restarted(db)
            return self._load_index(db)
        except BaseException:
            self.close()
            raise

    def _mark_restarted(self, db: sqlite3.Connection) -> None:
        now = _now_ms()
        self._heads = {sid: head for sid, head in db.execute("SELECT id, last_chunk FROM sessions") if head is not None}
        (self._chunk_seq,) = db.execute("SELECT COALESCE(MAX(seq), 0) FROM chunks").fetchone()
        db.execute("BEGIN IMMEDIATE")
        try:
            rows = db.execute(
                "SELECT seq, prompt_id, session_id FROM prompts WHERE outcome IS NULL ORDER BY seq"
            ).fetchall()
            for seq, prompt_id, session_id in rows:
                db.execute(
                    "UPDATE prompts SET outcome = ?, terminal_ms = ? WHERE seq = ? AND outcome IS NULL",
                    (SERVER_RESTARTED, now, seq),
                )
                if db.execute("SELECT 1 FROM sessions WHERE id = ?", (session_id,)).fetchone() is None:
                    continue  # deleted meanwhile: no transcript to note it in
                body = {"promptId": prompt_id, "state": "failed", "reason": SERVER_RESTARTED, "at": iso_ms(now)}
                event_id = self._last_event_id(db, session_id) + 1
                self._write_chunks(db, {session_id: [(event_id, TURN_STATE, body)]}, now)
                self.restarted.append((session_id, prompt_id))
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
        if rows:
            log.warning("%d prompt(s) were unfinished when the server stopped: marked server_restarted", len(rows))

    def _last_event_id(self, db: sqlite3.Connection, session_id: str) -> int:
        head = self._heads.get(session_id)
        if head is None:
            return 0
        row = db.execute("SELECT last_id FROM chunks WHERE seq = ?", (head,)).fetchone()
        return int(row[0]) if row else 0

    def _load_index(self, db: sqlite3.Connection) -> tuple[dict[str, StoredSession], int]:
        index: dict[str, StoredSession] = {}
        for sid, cwd, backend, title, created, updated, mcp, state, last_id in db.execute(
            "SELECT s.id, s.cwd, s.backend, s.title, s.created_ms, s.updated_ms, s.mcp_servers, s.backend_state,"
            " c.last_id FROM sessions s LEFT JOIN chunks c ON c.seq = s.last_chunk ORDER BY s.created_ms, s.rowid"
        ):
            index[sid] = StoredSession(
                sid, cwd, backend, created, updated, msgspec.json.decode(mcp), title,
                (last_id or 0) + 1, msgspec.json.decode(state) if state else None,
            )
        (max_seq,) = db.execute("SELECT COALESCE(MAX(seq), 0) FROM prompts").fetchone()
        return index, int(max_seq)

    def close(self) -> None:
        """Write what is still queued, close the database, release the lock."""
        if self._db is not None:
            try:
                self.flush_sync()
            except sqlite3.Error:
                log.exception("the session store could not write its last records")
            self._db.close()
            self._db = None
        if self._lock is not None:
            self._lock.release()

    # --- enqueueing (synchronous, never blocks) ---------------------------------------------------

    def _put(self, op: tuple[Any, ...]) -> int:
        self._ops.append(op)
        self._op_seq += 1
        if len(self._ops) == 1:
            self._wake.set()
        return self._op_seq

    def save_session(self, meta: StoredSession) -> None:
        """Create or replace the session's row."""
        self._put((_SESSION, meta.session_id, meta.cwd, meta.backend, meta.title, meta.created_ms,
                   meta.updated_ms, _encode(meta.mcp_servers),
                   _encode(meta.backend_state) if meta.backend_state is not None else None))

    def set_title(self, session_id: str, title: str | None) -> None:
        self._put((_TITLE, session_id, title))

    def add_event(self, session_id: str, event_id: int, update: Any, method: str | None = None) -> None:
        """Append one transcript entry (encoded in the writer's thread)."""
        self._put((_EVENT, session_id, event_id, method, update))

    def admit(self, seq: int, prompt_id: str, session_id: str) -> int:
        """Record an admitted prompt; returns the op number to :meth:`wait_committed` on."""
        return self._put((_ADMIT, seq, prompt_id, session_id))

    def settle(self, seq: int, outcome: str, callback: Callable[[], None] | None = None) -> None:
        """Record a prompt's terminal outcome (the first one wins); ``callback`` runs once it is committed."""
        self._put((_SETTLE, seq, outcome))
        if callback is not None:
            self._callbacks.append(callback)

    def delete_session(self, session_id: str) -> None:
        self._put((_DELETE, session_id))

    def after_commit(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once everything enqueued so far is committed."""
        self._callbacks.append(callback)
        if len(self._ops) == 0:
            self._wake.set()

    async def wait_committed(self, op: int) -> None:
        """Return once op number ``op`` is committed."""
        while self.committed < op:
            await self._round_done.wait()

    async def read_events(self, session_id: str, after: int, upto: int) -> list[StoredEvent]:
        """The transcript entries with ``after < eventId <= upto``, in order (read after every earlier write)."""
        box: list[StoredEvent] = []
        op = self._put((_READ, session_id, after, upto, box))
        await self.wait_committed(op)
        return box

    # --- the writer --------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The writer task: one transaction per round; a final synchronous flush when cancelled."""
        self.running = True
        task_status.started()
        try:
            while True:
                await self._wake.wait()
                self._wake = trio.Event()
                await self._round(in_thread=True)
        finally:
            self.running = False
            with trio.CancelScope(shield=True):
                await self._round(in_thread=False)

    async def _round(self, *, in_thread: bool) -> None:
        ops, self._ops = self._ops, []
        callbacks, self._callbacks = self._callbacks, []
        self.generation += 1
        upto = self._op_seq
        if ops:
            try:
                if in_thread:
                    await trio.to_thread.run_sync(self._apply, ops)
                else:
                    self._apply(ops)
            except sqlite3.Error:
                log.exception("the session store could not write %d record(s)", len(ops))
        self.committed = upto
        done, self._round_done = self._round_done, trio.Event()
        done.set()
        for callback in callbacks:
            try:
                callback()
            except Exception:
                log.exception("a store commit callback failed")

    def flush_sync(self) -> None:
        """Apply everything queued now, blocking (tests, and shutdown without a running writer)."""
        ops, self._ops = self._ops, []
        callbacks, self._callbacks = self._callbacks, []
        self.generation += 1
        if ops:
            self._apply(ops)
        self.committed = self._op_seq
        for callback in callbacks:
            callback()

    def _apply(self, ops: list[tuple[Any, ...]]) -> None:
        """One transaction for a round of ops (runs in a worker thread).

        Between barriers (a session row, a delete, a read) each session's events become one chunk and
        each table's rows go in one ``executemany``, admissions before outcomes: the tables are
        independent, so only the order within a table, and around barriers, matters.
        """
        db = self._db
        if db is None:
            raise sqlite3.ProgrammingError("the session store is closed")
        now = _now_ms()
        events: dict[str, list[tuple[int, str | None, Any]]] = {}
        admits: list[tuple[Any, ...]] = []
        settles: list[tuple[str, int, int]] = []

        def write() -> None:
            if events:
                self._write_chunks(db, events, now)
                events.clear()
            if admits:
                db.executemany("INSERT OR IGNORE INTO prompts VALUES (?, ?, ?, ?, NULL, NULL)", admits)
                admits.clear()
            if settles:
                db.executemany(
                    "UPDATE prompts SET outcome = ?, terminal_ms = ? WHERE seq = ? AND outcome IS NULL", settles
                )
                settles.clear()

        db.execute("BEGIN")
        try:
            for op in ops:
                kind = op[0]
                if kind == _EVENT:
                    entry = (op[2], op[3], op[4])
                    try:
                        events[op[1]].append(entry)
                    except KeyError:
                        events[op[1]] = [entry]
                elif kind == _ADMIT:
                    admits.append((op[1], op[2], op[3], now))
                elif kind == _SETTLE:
                    settles.append((op[2], now, op[1]))
                else:
                    write()
                    if kind == _SESSION:
                        db.execute(
                            "INSERT OR REPLACE INTO sessions VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                            (*op[1:], self._heads.get(op[1])),
                        )
                    elif kind == _TITLE:
                        db.execute("UPDATE sessions SET title = ? WHERE id = ?", (op[2], op[1]))
                    elif kind == _DELETE:
                        self._delete(db, op[1])
                    elif kind == _READ:
                        _, sid, after, upto, box = op
                        box.extend(self._read(db, sid, after, upto))
            write()
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
        self.transactions += 1

    def _write_chunks(
        self, db: sqlite3.Connection, events: dict[str, list[tuple[int, str | None, Any]]], now: int
    ) -> None:
        rows = []
        heads = []
        seq = self._chunk_seq
        for sid, entries in events.items():
            seq += 1
            rows.append((seq, sid, self._heads.get(sid), entries[0][0], entries[-1][0], _encode(entries)))
            self._heads[sid] = seq
            heads.append((now, seq, sid))
        self._chunk_seq = seq
        db.executemany("INSERT INTO chunks VALUES (?, ?, ?, ?, ?, ?)", rows)
        db.executemany("UPDATE sessions SET updated_ms = ?, last_chunk = ? WHERE id = ?", heads)

    def _chain(self, db: sqlite3.Connection, session_id: str, after: int) -> list[tuple[int, int, bytes]]:
        """The session's chunks (seq, first id, body) that may hold events after ``after``, newest first."""
        out = []
        seq = self._heads.get(session_id)
        while seq is not None:
            row = db.execute("SELECT prev, first_id, last_id, body FROM chunks WHERE seq = ?", (seq,)).fetchone()
            if row is None or row[2] <= after:
                break
            out.append((seq, row[1], row[3]))
            seq = row[0]
        return out

    def _read(self, db: sqlite3.Connection, session_id: str, after: int, upto: int) -> list[StoredEvent]:
        found: list[StoredEvent] = []
        for _, _, body in reversed(self._chain(db, session_id, after)):
            found.extend(
                StoredEvent(event_id, method, raw) for event_id, method, raw in _decode_chunk(body) if after < event_id <= upto
            )
        return found

    def _delete(self, db: sqlite3.Connection, session_id: str) -> None:
        db.executemany("DELETE FROM chunks WHERE seq = ?", [(seq,) for seq, _, _ in self._chain(db, session_id, 0)])
        self._heads.pop(session_id, None)
        db.execute("DELETE FROM sessions WHERE id = ?", (session_id,))
        # its prompts' outcome records stay (no per-session index on them: it would cost every admission)
