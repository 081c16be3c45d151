"""The SQLite side of the store: :class:`StoreWriter` applies rounds of ops (see :mod:`.records`) in one
transaction each.

The store's writer process (:mod:`.writer_process`) runs one to make the server's rounds durable; the
server runs one in-process at startup (migrations, marking unfinished prompts ``server_restarted``,
loading the session index) and at shutdown once that process has ended. No trio here.
"""

from __future__ import annotations

import collections
import functools
import logging
import pathlib
import sqlite3
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from .records import (
    ADMITS,
    DELETE,
    EVENTS,
    READ,
    SERVER_RESTARTED,
    SESSION,
    SETTLES,
    TURN_STATE,
    StoredSession,
    decode_ops,
    encode_ops,
)
from .schema import migrate

__all__ = ["ReadEvent", "StoreWriter", "applied_copy", "chunk_events"]

log = logging.getLogger("acp_server.store.writer")

_json = msgspec.json.Encoder().encode
_decode_chunk = msgspec.json.Decoder(list[tuple[int, str | None, msgspec.Raw]]).decode

#: one read's answer: (event id, method or None, the body as JSON)
ReadEvent = tuple[int, str | None, bytes]

_SAVE_SESSION = (
    "INSERT OR REPLACE INTO sessions (id, cwd, backend, title, created_ms, updated_ms, mcp_servers, backend_state,"
    " tenant, last_chunk) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)

#: rows per multi-row statement: a few statements of fixed sizes (their texts stay in the connection's
#: statement cache) instead of one call per row. 64 rows of at most 5 parameters stay far below
#: SQLite's 999-variable floor of old builds.
_BATCH_SIZES = (64, 16, 4, 1)


def _now_ms() -> int:
    return int(time.time() * 1000)


def _in_batches(
    db: sqlite3.Connection, sql: Callable[[int], str], width: int, flat: list[Any], prefix: Sequence[Any] = ()
) -> None:
    """Run ``sql(n)`` over ``flat`` (rows of ``width`` values, one after the other), ``n`` rows at a time
    from :data:`_BATCH_SIZES`; every statement's parameters start with ``prefix``."""
    start, left = 0, len(flat) // width
    for size in _BATCH_SIZES:
        while left >= size:
            end = start + size * width
            db.execute(sql(size), [*prefix, *flat[start:end]])
            start = end
            left -= size


def _rows(n: int, width: int, template: str, first: int) -> str:
    """``n`` rows of ``template``, whose ``{}`` take the parameters from number ``first`` on, ``width`` per row."""
    return ", ".join(
        template.format(*(f"?{first + row * width + col}" for col in range(width))) for row in range(n)
    )


@functools.cache
def _insert_chunks_sql(n: int) -> str:
    """Params: now, then (seq, session id, prev, first id, last id, body) n times."""
    return "INSERT INTO chunks (seq, session_id, prev, first_id, last_id, body, written_ms) VALUES " + _rows(
        n, 6, "({}, {}, {}, {}, {}, {}, ?1)", 2
    )


@functools.cache
def _set_heads_sql(n: int) -> str:
    """Params: (session id, chunk) n times (numbered: each session id serves the CASE and the IN)."""
    return (
        "UPDATE sessions SET last_chunk = CASE id" + "".join(f" WHEN ?{2 * i + 1} THEN ?{2 * i + 2}" for i in range(n))
        + " END WHERE id IN (" + ", ".join(f"?{1 + 2 * i}" for i in range(n)) + ")"
    )


@functools.cache
def _prompts_sql(n: int) -> str:
    """Params: (seq, prompt id, session id, admitted ms, outcome, terminal ms) n times."""
    return "INSERT OR IGNORE INTO prompts VALUES " + ", ".join(["(?, ?, ?, ?, ?, ?)"] * n)


@functools.cache
def _settle_sql(n: int) -> str:
    """Params: the outcome, its time, then n prompt numbers."""
    return (
        "UPDATE prompts SET outcome = ?, terminal_ms = ? WHERE outcome IS NULL AND seq IN ("
        + ", ".join(["?"] * n) + ")"
    )


@functools.cache
def _log_sql(n: int) -> str:
    """Params: now, then (seq, ops) n times."""
    return "INSERT INTO log (seq, ops, written_ms) VALUES " + _rows(n, 2, "({}, {}, ?1)", 2)


def chunk_events(body: bytes) -> list[ReadEvent]:
    """The entries of a stored chunk, as (event id, method or None, body JSON).

    A chunk is MessagePack ``[event_id, method, body_json, ...]`` (schema v3 on: the writer stores the
    entries as the server sent them, without re-encoding each one); chunks of older versions are the
    JSON array ``[[eventId, method, body], ...]``, told apart by their first byte.
    """
    if body[:1] == b"[":
        return [(event_id, method, bytes(raw)) for event_id, method, raw in _decode_chunk(body)]
    flat = decode_ops(body)
    return [(flat[i], flat[i + 1], flat[i + 2]) for i in range(0, len(flat), 3)]


class _Batch:
    """The records of one or more rounds, merged by table until a barrier: a session's events in one
    chunk, and a prompt admitted and settled in the batch in one row."""

    __slots__ = ("events", "now", "prompts", "settles")

    def __init__(self) -> None:
        #: when the round being added became durable
        self.now = 0
        self.events: dict[str, list[Any]] = {}
        #: seq -> the prompts row (seq, prompt id, session id, admitted, outcome, terminal)
        self.prompts: dict[int, list[Any]] = {}
        #: seq -> (outcome, terminal ms): prompts admitted before the batch
        self.settles: dict[int, tuple[str, int]] = {}

    def add_events(self, events: dict[str, list[Any]]) -> None:
        mine = self.events
        for sid, entries in events.items():
            found = mine.get(sid)
            if found is None:
                mine[sid] = entries
            else:
                found += entries

    def add_admits(self, flat: list[Any]) -> None:
        prompts, now = self.prompts, self.now
        for i in range(0, len(flat), 3):
            prompts.setdefault(flat[i], [flat[i], flat[i + 1], flat[i + 2], now, None, None])

    def add_settles(self, flat: list[Any]) -> None:
        prompts, settles, now = self.prompts, self.settles, self.now
        for i in range(0, len(flat), 2):
            seq = flat[i]
            row = prompts.get(seq)
            if row is not None:
                if row[4] is None:  # the first outcome wins
                    row[4] = flat[i + 1]
                    row[5] = now
            elif seq not in settles:
                settles[seq] = (flat[i + 1], now)


class StoreWriter:
    """Sessions, transcripts and prompt outcomes in one SQLite database (WAL mode).

    A session's transcript is stored as *chunks*: the events one round added to it, in one MessagePack
    array (see :func:`chunk_events`).
    Chunks are appended in ``seq`` order and chained per session by ``prev``, so that a round writes
    at the end of the table instead of all over an index by session. The chain heads live here, in
    memory; they are written to ``sessions.last_chunk`` every :attr:`HEADS_EVERY` rounds (with
    ``store_meta.heads_upto``, the last chunk they account for) and :meth:`reload` rebuilds them from
    that and the chunks after it, at startup and after a rolled-back transaction.
    """

    #: rounds between two writes of the chain heads
    HEADS_EVERY = 64

    def __init__(
        self, path: pathlib.Path | str, db: sqlite3.Connection | None = None, *, autocheckpoint: bool = True
    ) -> None:
        self.path = pathlib.Path(path)
        if db is None:
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable against a process crash
            db.execute("PRAGMA busy_timeout=10000")  # another writer's transaction (ours, ending) finishes
            if not autocheckpoint:
                db.execute("PRAGMA wal_autocheckpoint=0")  # a Checkpointer's job
        except BaseException:
            db.close()
            raise
        self.db: sqlite3.Connection | None = db
        #: transactions committed by :meth:`apply` (tests check grouping with it)
        self.transactions = 0
        # each session's newest chunk, the heads changed since they were last written, the last chunk
        self._heads: dict[str, int] = {}
        self._dirty: set[str] = set()
        self._chunk_seq = 0
        self._rounds = 0
        self._stale = True
        # the logged rounds not yet applied: (log row, when written, encoded ops), oldest first
        self._pending: collections.deque[tuple[int, int, bytes]] = collections.deque()
        self._log_seq = 0

    def _conn(self) -> sqlite3.Connection:
        if self.db is None:
            raise sqlite3.ProgrammingError("the session store is closed")
        return self.db

    def close(self) -> None:
        """Write the chain heads (if they changed) and close the database."""
        if self.db is not None:
            try:
                if self._dirty and not self._stale:
                    self.db.execute("BEGIN")
                    self._save_heads(self.db)
                    self.db.execute("COMMIT")
            except sqlite3.Error:
                log.exception("the session store could not write its chain heads (rebuilt at the next start)")
            finally:
                self.db.close()
                self.db = None

    # --- startup -----------------------------------------------------------------------------------

    def migrate(self) -> int:
        """Bring the schema up to date; returns the version the database had."""
        return migrate(self._conn(), str(self.path))

    def reload(self) -> None:
        """Read the state kept here from disk again: the chain heads (the written ones, then the chunks
        after them) and the logged rounds not yet applied."""
        db = self._conn()
        heads = {sid: head for sid, head in db.execute("SELECT id, last_chunk FROM sessions") if head is not None}
        row = db.execute("SELECT value FROM store_meta WHERE key = 'heads_upto'").fetchone()
        dirty = set()
        for seq, sid in db.execute("SELECT seq, session_id FROM chunks WHERE seq > ? ORDER BY seq", (row[0] if row else 0,)):
            heads[sid] = seq
            dirty.add(sid)
        (self._chunk_seq,) = db.execute("SELECT COALESCE(MAX(seq), 0) FROM chunks").fetchone()
        self._heads, self._dirty, self._stale, self._rounds = heads, dirty, False, 0
        self._load_log(db)

    def _save_heads(self, db: sqlite3.Connection) -> None:
        """Write the changed chain heads and what they account for (inside the caller's transaction)."""
        heads = self._heads
        _in_batches(db, _set_heads_sql, 2, [v for sid in self._dirty if sid in heads for v in (sid, heads[sid])])
        db.execute("INSERT OR REPLACE INTO store_meta VALUES ('heads_upto', ?)", (self._chunk_seq,))
        self._dirty = set()
        self._rounds = 0

    def mark_restarted(self) -> list[tuple[str, str]]:
        """Give every prompt without a terminal outcome ``server_restarted``, noted in its session's
        transcript as a failed turn; returns them as (session id, prompt id). Writes the chain heads."""
        db = self._conn()
        self.reload()
        self.compact()  # what the last run logged
        now = _now_ms()
        marked: list[tuple[str, str]] = []
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
                body = _json({"promptId": prompt_id, "state": "failed", "reason": SERVER_RESTARTED, "at": now})
                event_id = self._last_event_id(db, session_id) + 1
                batch = _Batch()
                batch.now = now
                batch.add_events({session_id: [event_id, TURN_STATE, body]})
                self._write(db, batch)
                marked.append((session_id, prompt_id))
            self._save_heads(db)
        except BaseException:
            db.execute("ROLLBACK")
            self._stale = True
            raise
        db.execute("COMMIT")
        if rows:
            log.warning("%d prompt(s) were unfinished when the server stopped: marked server_restarted", len(rows))
        return marked

    def _last_event_id(self, db: sqlite3.Connection, session_id: str) -> int:
        head = self._heads.get(session_id)
        if head is None:
            return 0
        row = db.execute("SELECT last_id FROM chunks WHERE seq = ?", (head,)).fetchone()
        return int(row[0]) if row else 0

    def load_index(self) -> tuple[dict[str, StoredSession], int]:
        """Every stored session's metadata (in creation order), and the highest prompt number seen
        (after :meth:`mark_restarted`, which writes the chain heads this reads)."""
        db = self._conn()
        index: dict[str, StoredSession] = {}
        for sid, cwd, backend, title, created, updated, mcp, state, tenant, last_id, written in db.execute(
            "SELECT s.id, s.cwd, s.backend, s.title, s.created_ms, s.updated_ms, s.mcp_servers, s.backend_state,"
            " s.tenant, c.last_id, c.written_ms FROM sessions s LEFT JOIN chunks c ON c.seq = s.last_chunk"
            " ORDER BY s.created_ms, s.rowid"
        ):
            index[sid] = StoredSession(
                sid, cwd, backend, created, max(updated, written or 0), msgspec.json.decode(mcp), title,
                (last_id or 0) + 1, msgspec.json.decode(state) if state else None, tenant,
            )
        (max_seq,) = db.execute("SELECT COALESCE(MAX(seq), 0) FROM prompts").fetchone()
        return index, int(max_seq)

    # --- rounds ------------------------------------------------------------------------------------

    # --- the log ----------------------------------------------------------------------------------

    @property
    def logged(self) -> int:
        """Rounds in the log, not yet applied to the tables."""
        return len(self._pending)

    def log(self, payloads: list[bytes]) -> None:
        """Make rounds (their encoded ops) durable in one transaction, as they are: one row each at the
        end of the ``log`` table. :meth:`compact` applies them to the tables later, in bulk."""
        db = self._conn()
        now = _now_ms()
        # each round its own row number: compact() deletes the log up to the last round it applied
        numbered = [(self._log_seq + i, payload) for i, payload in enumerate(payloads, start=1)]
        rows = [v for row in numbered for v in row]
        db.execute("BEGIN")
        try:
            _in_batches(db, _log_sql, 2, rows, (now,))
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        self._log_seq += len(numbered)
        self._pending.extend((seq, now, payload) for seq, payload in numbered)
        self.transactions += 1

    def compact(self, limit: int | None = None) -> int:
        """Apply the oldest ``limit`` logged rounds (default: all) to the tables and delete them from the
        log, in one transaction; returns how many. On an ``sqlite3.Error`` they stay logged."""
        if self._stale:
            self.reload()
        pending = self._pending
        count = len(pending) if limit is None else min(limit, len(pending))
        if not count:
            return 0
        rounds = [pending[i] for i in range(count)]
        self._transaction([(ms, decode_ops(payload)) for _, ms, payload in rounds], upto_log=rounds[-1][0])
        for _ in range(count):
            pending.popleft()
        return count

    def _load_log(self, db: sqlite3.Connection) -> None:
        self._pending = collections.deque(db.execute("SELECT seq, written_ms, ops FROM log ORDER BY seq"))
        (self._log_seq,) = db.execute("SELECT COALESCE(MAX(seq), 0) FROM log").fetchone()

    # --- rounds ------------------------------------------------------------------------------------

    def apply(self, ops: Sequence[Sequence[Any]]) -> list[tuple[int, list[ReadEvent]]]:
        """Apply ``ops`` (see :mod:`.records`) to the tables in one transaction, after everything logged;
        returns the answers of its reads as (read id, events).

        Raises:
            sqlite3.Error: the transaction was rolled back (the chain heads are read again from disk).
        """
        self.compact()
        return self._transaction([(_now_ms(), ops)])

    def _transaction(self, rounds: list[tuple[int, Sequence[Sequence[Any]]]], upto_log: int = 0) -> list[tuple[int, list[ReadEvent]]]:
        """Apply rounds of ops, each with the time it became durable, in one transaction; with
        ``upto_log``, delete the log up to that row in it."""
        db = self._conn()
        if self._stale:
            self.reload()
        batch = _Batch()
        reads: list[tuple[int, list[ReadEvent]]] = []
        db.execute("BEGIN")
        try:
            for ms, ops in rounds:
                batch.now = ms
                for op in ops:
                    kind = op[0]
                    if kind == EVENTS:
                        batch.add_events(op[1])
                    elif kind == ADMITS:
                        batch.add_admits(op[1])
                    elif kind == SETTLES:
                        batch.add_settles(op[1])
                    else:
                        self._write(db, batch)
                        if kind == SESSION:
                            db.execute(_SAVE_SESSION, (*op[1:], self._heads.get(op[1])))
                        elif kind == DELETE:
                            self._delete(db, op[1])
                        elif kind == READ:
                            _, read_id, sid, after, upto = op
                            reads.append((read_id, self._read(db, sid, after, upto)))
                        else:
                            raise ValueError(f"unknown store op {kind!r}")
            self._write(db, batch)
            if upto_log:
                db.execute("DELETE FROM log WHERE seq <= ?", (upto_log,))
            self._rounds += len(rounds)
            if self._rounds >= self.HEADS_EVERY and self._dirty:
                self._save_heads(db)
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:  # some errors (a full disk) end the transaction themselves
                db.execute("ROLLBACK")
            self._stale = True  # the chains on disk are as before the round: read their heads again
            raise
        self.transactions += 1
        return reads

    def _write(self, db: sqlite3.Connection, batch: _Batch) -> None:
        """Write what ``batch`` gathered since the last barrier."""
        if batch.events:
            flat: list[Any] = []
            seq = self._chunk_seq
            heads = self._heads
            for sid, entries in batch.events.items():
                seq += 1
                flat += (seq, sid, heads.get(sid), entries[0], entries[-3], encode_ops(entries))
                heads[sid] = seq
            self._dirty.update(batch.events)
            self._chunk_seq = seq
            _in_batches(db, _insert_chunks_sql, 6, flat, (batch.now,))
            batch.events = {}
        if batch.prompts:
            _in_batches(db, _prompts_sql, 6, [v for row in batch.prompts.values() for v in row])
            batch.prompts = {}
        if batch.settles:
            by_outcome: dict[tuple[str, int], list[int]] = {}
            for seq, (outcome, ms) in batch.settles.items():
                by_outcome.setdefault((outcome, ms), []).append(seq)
            for (outcome, ms), seqs in by_outcome.items():
                _in_batches(db, _settle_sql, 1, seqs, (outcome, ms))
            batch.settles = {}

    def _chain(self, db: sqlite3.Connection, session_id: str, after: int) -> list[tuple[int, bytes]]:
        """The session's chunks (seq, body) that may hold events after ``after``, newest first."""
        out = []
        seq = self._heads.get(session_id)
        while seq is not None:
            row = db.execute("SELECT prev, last_id, body FROM chunks WHERE seq = ?", (seq,)).fetchone()
            if row is None or row[1] <= after:
                break
            out.append((seq, row[2]))
            if row[0] is not None and row[0] >= seq:  # chunks only chain to older ones: never loop
                log.error("the transcript chain of session %s is broken at chunk %d", session_id, seq)
                break
            seq = row[0]
        return out

    def _read(self, db: sqlite3.Connection, session_id: str, after: int, upto: int) -> list[ReadEvent]:
        found: list[ReadEvent] = []
        for _, body in reversed(self._chain(db, session_id, after)):
            found.extend(entry for entry in chunk_events(body) if after < entry[0] <= upto)
        return found

    def _delete(self, db: sqlite3.Connection, session_id: str) -> None:
        db.executemany("DELETE FROM chunks WHERE seq = ?", [(seq,) for seq, _ in self._chain(db, session_id, 0)])
        self._heads.pop(session_id, None)
        self._dirty.discard(session_id)
        db.execute("DELETE FROM sessions WHERE id = ?", (session_id,))
        # its prompts' outcome records stay (no per-session index on them: it would cost every admission)


def applied_copy(path: pathlib.Path | str) -> sqlite3.Connection:
    """A private in-memory copy of the database at ``path``, its log applied to the tables: the
    records as the next start sees them, taken without writing to the database (inspection, tests)."""
    copy = sqlite3.connect(":memory:", isolation_level=None)
    source = sqlite3.connect(path)
    try:
        source.backup(copy)
    finally:
        source.close()
    writer = StoreWriter(path, copy)
    writer.reload()
    writer.compact()
    return copy
