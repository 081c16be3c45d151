"""The durable session store: one SQLite database (WAL mode) written by one writer thread.

The event loop never touches the disk. Callers *enqueue* records synchronously (no ``await``); a
round takes everything queued since the last one and applies it in one transaction in the store's
own thread, then the callbacks that waited for that commit run in the trio thread, in enqueue order.
So a burst of prompts over many sessions costs one transaction, not one per record.

The thread is the store's own, not ``trio.to_thread``: ``run`` takes the queue at each turn of the
event loop and hands it over without waiting for the round before it (rounds queued meanwhile go in
one transaction), and the thread reports each commit through trio's entry queue. A pooled
``to_thread`` call per round cost three scheduling hops, each a full pass of a busy event loop (rounds
took ~12 ms for ~1.6 ms of SQLite). Rows go in a few multi-row statements, not ``executemany``: each
``sqlite3`` call gives up the GIL and takes it back, and the event loop pays for every handover.

Ordering guarantees the bridge builds on:

- :meth:`SessionStore.admit` returns an op number; :meth:`SessionStore.wait_committed` returns once
  that record is committed, and :meth:`SessionStore.after_commit` runs a callback once everything
  enqueued before it is.
- :meth:`SessionStore.settle` takes a callback run after the terminal record is committed (the bridge
  answers the prompt from it).
- ``generation`` changes exactly when a round takes the queue: callbacks registered under one
  generation run after the same commit, which also covers every record enqueued under it.
"""

from __future__ import annotations

import collections
import datetime
import functools
import logging
import os
import pathlib
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

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

_R = TypeVar("_R")
_encode = msgspec.json.Encoder().encode
_decode_chunk = msgspec.json.Decoder(list[tuple[int, str | None, msgspec.Raw]]).decode

_SAVE_SESSION = (
    "INSERT OR REPLACE INTO sessions (id, cwd, backend, title, created_ms, updated_ms, mcp_servers, backend_state,"
    " tenant, last_chunk) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)

# op kinds
_SESSION, _EVENT, _ADMIT, _SETTLE, _DELETE, _READ, _TITLE = range(7)


def default_state_dir() -> pathlib.Path:
    """``$XDG_STATE_HOME/acp-server``, else ``~/.local/state/acp-server``."""
    base = os.environ.get("XDG_STATE_HOME")
    root = pathlib.Path(base) if base else pathlib.Path.home() / ".local" / "state"
    return root / "acp-server"


def _now_ms() -> int:
    return int(time.time() * 1000)


#: rows per multi-row statement. Each ``sqlite3`` call lets go of the GIL and takes it back, so one
#: call per row (``executemany``) has the event loop and this thread hand the GIL to each other
#: hundreds of times a round; a few statements of fixed sizes (their texts stay in the connection's
#: statement cache) make that a handful. 64 rows x 6 columns stays far below SQLite's 999-variable
#: floor of old builds.
_BATCH_SIZES = (64, 32, 16, 8, 4, 2, 1)


def _in_batches(
    db: sqlite3.Connection, sql: Callable[[int], str], rows: list[_R], params: Callable[[list[_R]], list[Any]]
) -> None:
    """Run ``sql(n)`` with ``params(rows[i:i + n])`` over all ``rows``, ``n`` from :data:`_BATCH_SIZES`."""
    start, left = 0, len(rows)
    for size in _BATCH_SIZES:
        while left >= size:
            db.execute(sql(size), params(rows[start : start + size]))
            start += size
            left -= size


@functools.cache
def _insert_chunks_sql(n: int) -> str:
    return "INSERT INTO chunks VALUES " + ", ".join(["(?, ?, ?, ?, ?, ?)"] * n)


@functools.cache
def _set_heads_sql(n: int) -> str:
    """Params: now, then (session id, chunk) n times, then the n session ids."""
    return (
        "UPDATE sessions SET updated_ms = ?, last_chunk = CASE id" + " WHEN ? THEN ?" * n
        + " END WHERE id IN (" + ", ".join(["?"] * n) + ")"
    )


@functools.cache
def _admit_sql(n: int) -> str:
    return "INSERT OR IGNORE INTO prompts VALUES " + ", ".join(["(?, ?, ?, ?, NULL, NULL)"] * n)


@functools.cache
def _settle_sql(n: int) -> str:
    """Params: the outcome, now, then n prompt numbers."""
    return (
        "UPDATE prompts SET outcome = ?, terminal_ms = ? WHERE outcome IS NULL AND seq IN ("
        + ", ".join(["?"] * n) + ")"
    )


def _run_callbacks(callbacks: list[Callable[[], None]]) -> None:
    for callback in callbacks:
        try:
            callback()
        except Exception:
            log.exception("a store commit callback failed")


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
    #: the tenant that created the session (``initialize`` ``_meta.tenantId``)
    tenant: str = "default"


@dataclass(slots=True, frozen=True)
class StoredEvent:
    """One transcript entry: ``method`` None for a ``session/update`` (``body``: the update), else an
    extension notification (``body``: its params without sessionId and _meta)."""

    event_id: int
    method: str | None
    body: msgspec.Raw


@dataclass(slots=True, eq=False)
class _Round:
    """One transaction's worth of ops, and what runs once it is committed."""

    ops: list[tuple[Any, ...]]
    #: the op number of its last op: :attr:`SessionStore.committed` once it is done
    upto: int
    callbacks: list[Callable[[], None]]
    #: set by the writer thread once its transaction ended (committed or rolled back)
    done: bool = False
    #: an unexpected error of the writer thread (not an sqlite3.Error), re-raised by ``run``
    error: BaseException | None = None


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
        # the queue (trio thread only): ops not yet taken by a round, and the callbacks due after them
        self._ops: list[tuple[Any, ...]] = []
        self._callbacks: list[Callable[[], None]] = []
        self._op_seq = 0
        self.committed = 0
        #: incremented each time a round takes the queued records: callbacks registered under one
        #: generation all run after the same commit
        self.generation = 0
        # set by the first op queued after a take: ``run`` takes the queue at its next turn
        self._wake = trio.Event()
        #: the rounds taken and not yet reported committed, oldest first (trio thread only)
        self._rounds: collections.deque[_Round] = collections.deque()
        #: rounds handed to the writer thread (None: stop)
        self._jobs: queue.SimpleQueue[_Round | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._failure: BaseException | None = None
        self.running = False
        #: number of transactions committed by the writer (tests check grouping with it)
        self.transactions = 0
        #: prompts found unfinished at :meth:`open`: (session id, prompt id)
        self.restarted: list[tuple[str, str]] = []
        # the writer thread's own state: each session's newest chunk, and the last chunk number
        self._heads: dict[str, int] = {}
        self._chunk_seq = 0
        # the heads a round changed (their values before it): put back if its transaction rolls back
        self._undo: dict[str, int | None] = {}

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
                body = {"promptId": prompt_id, "state": "failed", "reason": SERVER_RESTARTED, "at": now}
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
        for sid, cwd, backend, title, created, updated, mcp, state, tenant, last_id in db.execute(
            "SELECT s.id, s.cwd, s.backend, s.title, s.created_ms, s.updated_ms, s.mcp_servers, s.backend_state,"
            " s.tenant, c.last_id FROM sessions s LEFT JOIN chunks c ON c.seq = s.last_chunk"
            " ORDER BY s.created_ms, s.rowid"
        ):
            index[sid] = StoredSession(
                sid, cwd, backend, created, updated, msgspec.json.decode(mcp), title,
                (last_id or 0) + 1, msgspec.json.decode(state) if state else None, tenant,
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
                   _encode(meta.backend_state) if meta.backend_state is not None else None, meta.tenant))

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
        """Run ``callback`` (in the trio thread, never from inside this call) once everything enqueued so
        far is committed."""
        if self._ops:
            self._callbacks.append(callback)
        elif self._rounds:
            self._rounds[-1].callbacks.append(callback)  # everything not yet committed is in that round
        else:
            self._callbacks.append(callback)
            self._wake.set()

    async def wait_committed(self, op: int) -> None:
        """Return once op number ``op`` is committed."""
        if self.committed >= op:
            return
        done = trio.Event()
        for job in self._rounds:  # a handful at most: the rounds taken and not yet reported
            if op <= job.upto:
                job.callbacks.append(done.set)
                break
        else:
            self._callbacks.append(done.set)  # ``op`` is queued: its round takes this callback too
        await done.wait()

    async def read_events(self, session_id: str, after: int, upto: int) -> list[StoredEvent]:
        """The transcript entries with ``after < eventId <= upto``, in order (read after every earlier write)."""
        box: list[StoredEvent] = []
        op = self._put((_READ, session_id, after, upto, box))
        await self.wait_committed(op)
        return box

    # --- the writer --------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the writer thread and feed it rounds; when cancelled, let it finish what it was given,
        write what is still queued (synchronously) and run the callbacks.

        Raises:
            Exception: an unexpected error of the writer thread (a failing ``sqlite3`` call is logged
                instead, and the round's records are lost).
        """
        self._token = trio.lowlevel.current_trio_token()
        thread = threading.Thread(target=self._writer, name="acp-server store writer", daemon=True)
        thread.start()
        self._thread = thread
        self.running = True
        task_status.started()
        try:
            while True:
                await self._wake.wait()
                self._wake = trio.Event()
                if self._failure is not None:
                    failure, self._failure = self._failure, None
                    raise failure
                self._take()
        finally:
            self.running = False
            self._jobs.put(None)
            thread.join()  # blocks the loop for what the thread was given (ms), as the final flush does
            self._thread = None
            while self._rounds and self._rounds[0].done:
                self._finish([self._rounds[0]])  # their reports may still sit in trio's entry queue
            try:
                self.flush_sync()
            except sqlite3.Error:
                log.exception("the session store could not write its last records")

    def _take(self) -> None:
        """Take the queue (trio thread): hand its ops to the writer thread, or with no ops and nothing in
        flight run its callbacks."""
        ops, self._ops = self._ops, []
        callbacks, self._callbacks = self._callbacks, []
        self.generation += 1
        if ops:
            job = _Round(ops, self._op_seq, callbacks)
            self._rounds.append(job)
            self._jobs.put(job)
        elif self._rounds:
            self._rounds[-1].callbacks.extend(callbacks)
        else:
            _run_callbacks(callbacks)  # nothing in flight, nothing queued: all is committed

    def _writer(self) -> None:
        """The writer thread: the rounds queued since its last transaction go in one, then a report to
        the trio thread."""
        token = self._token
        assert token is not None
        stop = False
        while not stop:
            jobs = [self._jobs.get()]
            while True:
                try:
                    jobs.append(self._jobs.get_nowait())
                except queue.Empty:
                    break
            if jobs[-1] is None:
                jobs.pop()
                stop = True
            if not jobs:
                continue
            rounds = cast(list[_Round], jobs)
            ops = rounds[0].ops if len(rounds) == 1 else [op for job in rounds for op in job.ops]
            try:
                self._apply(ops)
            except sqlite3.Error:
                log.exception("the session store could not write %d record(s)", len(ops))
            except BaseException as exc:  # re-raised by ``run`` in the trio thread
                for job in rounds:
                    job.error = exc
            for job in rounds:
                job.done = True
            try:
                token.run_sync_soon(self._finish, rounds)
            except trio.RunFinishedError:
                return

    def _finish(self, rounds: list[_Round]) -> None:
        """Rounds are committed (trio thread): run their callbacks, in order. A round whose transaction
        failed unexpectedly runs none: ``run`` raises its error."""
        for job in rounds:
            if not self._rounds or self._rounds[0] is not job:
                continue  # ``run`` finished it already while stopping
            self._rounds.popleft()
            if job.error is not None:
                if self._failure is None:
                    self._failure = job.error
                self._wake.set()
                continue
            self.committed = job.upto
            _run_callbacks(job.callbacks)

    def flush_sync(self) -> None:
        """Apply everything queued now, blocking (tests, and shutdown without a running writer)."""
        if self._thread is not None:
            raise RuntimeError("flush_sync() while the writer thread runs: the store's run() task owns the database")
        ops, self._ops = self._ops, []
        callbacks, self._callbacks = self._callbacks, []
        self.generation += 1
        if ops:
            self._apply(ops)
        self.committed = self._op_seq
        _run_callbacks(callbacks)

    def _apply(self, ops: list[tuple[Any, ...]]) -> None:
        """One transaction for a round of ops (runs in a worker thread).

        Between barriers (a session row, a delete, a read) each session's events become one chunk and
        each table's rows go in a few multi-row statements (:func:`_in_batches`), admissions before
        outcomes: the tables are independent, so only the order within a table, and around barriers,
        matters.
        """
        db = self._db
        if db is None:
            raise sqlite3.ProgrammingError("the session store is closed")
        now = _now_ms()
        events: dict[str, list[tuple[int, str | None, Any]]] = {}
        admits: list[tuple[Any, ...]] = []
        #: prompt number -> outcome, the first one of the round (the first one wins, as on disk)
        settles: dict[int, str] = {}

        def write() -> None:
            if events:
                self._write_chunks(db, events, now)
                events.clear()
            if admits:
                _in_batches(db, _admit_sql, admits, lambda rows: [v for row in rows for v in row])
                admits.clear()
            if settles:
                by_outcome: dict[str, list[int]] = {}
                for seq, outcome in settles.items():
                    by_outcome.setdefault(outcome, []).append(seq)
                for outcome, seqs in by_outcome.items():
                    _in_batches(db, _settle_sql, seqs, [outcome, now].__add__)
                settles.clear()

        self._undo.clear()
        chunk_seq = self._chunk_seq
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
                    settles.setdefault(op[1], op[2])
                else:
                    write()
                    if kind == _SESSION:
                        db.execute(_SAVE_SESSION, (*op[1:], self._heads.get(op[1])))
                    elif kind == _TITLE:
                        db.execute("UPDATE sessions SET title = ? WHERE id = ?", (op[2], op[1]))
                    elif kind == _DELETE:
                        self._delete(db, op[1])
                    elif kind == _READ:
                        _, sid, after, upto, box = op
                        box.extend(self._read(db, sid, after, upto))
            write()
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:  # some errors (a full disk) end the transaction themselves
                db.execute("ROLLBACK")
            # the chains on disk are as before the round: so must be their heads here
            for sid, head in self._undo.items():
                if head is None:
                    self._heads.pop(sid, None)
                else:
                    self._heads[sid] = head
            self._chunk_seq = chunk_seq
            raise
        self.transactions += 1

    def _write_chunks(
        self, db: sqlite3.Connection, events: dict[str, list[tuple[int, str | None, Any]]], now: int
    ) -> None:
        rows = []
        heads: list[tuple[str, int]] = []
        seq = self._chunk_seq
        undo = self._undo
        for sid, entries in events.items():
            seq += 1
            head = self._heads.get(sid)
            if sid not in undo:
                undo[sid] = head
            rows.append((seq, sid, head, entries[0][0], entries[-1][0], _encode(entries)))
            self._heads[sid] = seq
            heads.append((sid, seq))
        self._chunk_seq = seq
        _in_batches(db, _insert_chunks_sql, rows, lambda rows: [v for row in rows for v in row])
        _in_batches(
            db, _set_heads_sql, heads,
            lambda heads: [now, *(v for head in heads for v in head), *(sid for sid, _ in heads)],
        )

    def _chain(self, db: sqlite3.Connection, session_id: str, after: int) -> list[tuple[int, int, bytes]]:
        """The session's chunks (seq, first id, body) that may hold events after ``after``, newest first."""
        out = []
        seq = self._heads.get(session_id)
        while seq is not None:
            row = db.execute("SELECT prev, first_id, last_id, body FROM chunks WHERE seq = ?", (seq,)).fetchone()
            if row is None or row[2] <= after:
                break
            out.append((seq, row[1], row[3]))
            if row[0] is not None and row[0] >= seq:  # chunks only chain to older ones: never loop
                log.error("the transcript chain of session %s is broken at chunk %d", session_id, seq)
                break
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
        head = self._heads.pop(session_id, None)
        if session_id not in self._undo:
            self._undo[session_id] = head
        db.execute("DELETE FROM sessions WHERE id = ?", (session_id,))
        # its prompts' outcome records stay (no per-session index on them: it would cost every admission)
