"""The durable session store, trio side: records queued without waiting, written by the writer process.

The event loop never touches the disk. Callers *enqueue* records synchronously (no ``await``); at each
turn of the event loop :meth:`SessionStore.run` takes what was queued as one *round*, sends it to the
writer process (:mod:`.writer_process`) as one frame, and runs the callbacks that waited for it once the
writer reports its commit, in enqueue order. Rounds that reach the writer while it commits an earlier
one go in one transaction together, so a burst of prompts over many sessions costs one transaction,
not one per record, and one pipe write each way.

Ordering guarantees the bridge builds on:

- :meth:`SessionStore.admit` returns an op number; :meth:`SessionStore.when_committed` runs a callback
  once that record is committed (a parked session runner wakes from it), :meth:`SessionStore.wait_committed`
  waits for it.
- ``generation`` changes exactly when a round takes the queue: a callback registered with
  :meth:`SessionStore.after_round` runs after the commit that covers every record enqueued under the
  generation it was registered in, those enqueued after it included (the bridge sends a round's
  updates and answers its settled prompts from it).
- :meth:`SessionStore.after_commit` and the callback of :meth:`SessionStore.settle` run once everything
  enqueued before them is committed.
"""

from __future__ import annotations

import collections
import logging
import os
import pathlib
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import trio

from .lock import StateLock
from .records import (
    ADMITS,
    DELETE,
    EVENTS,
    READ,
    READS,
    SESSION,
    SETTLES,
    FrameReader,
    StoredEvent,
    StoredSession,
    encode_round,
)
from .writer import ReadEvent, StoreWriter

__all__ = ["DB_NAME", "SessionStore", "StoreWriterError", "default_state_dir"]

log = logging.getLogger("acp_server.store")

DB_NAME = "sessions.db"
#: how long a stopping server waits for its writer process to write what it was sent
STOP_TIMEOUT_S = 30.0
_WRITER_MAIN = "import sys; from acp_server.store.writer_process import main; sys.exit(main(sys.argv[1:]))"
_encode = msgspec.json.Encoder().encode


class StoreWriterError(RuntimeError):
    """The writer process ended while the server ran (killed, or a bug): what it confirmed is on disk,
    nothing else is known, so the server stops rather than go on without durability."""


def default_state_dir() -> pathlib.Path:
    """``$XDG_STATE_HOME/acp-server``, else ``~/.local/state/acp-server``."""
    base = os.environ.get("XDG_STATE_HOME")
    root = pathlib.Path(base) if base else pathlib.Path.home() / ".local" / "state"
    return root / "acp-server"


def _run_callbacks(callbacks: list[Callable[[], None]]) -> None:
    for callback in callbacks:
        try:
            callback()
        except Exception:
            log.exception("a store commit callback failed")


@dataclass(slots=True, eq=False)
class _Round:
    """One frame's worth of ops sent to the writer, and what runs once they are committed."""

    round_id: int
    #: the op number of its last op: :attr:`SessionStore.committed` once it is done
    upto: int
    callbacks: list[Callable[[], None]]


class SessionStore:
    """Sessions, transcripts and prompt outcomes in ``DIR/sessions.db``.

    Args:
        directory: the state directory (created if missing); ``lock``: take its lock file (one server
            per directory).

    Call :meth:`open` (synchronous, at startup) then run :meth:`run` in a nursery. Without ``run``
    (tests, shutdown) :meth:`flush_sync` writes the queue in-process.
    """

    def __init__(self, directory: pathlib.Path | str, *, lock: bool = True) -> None:
        self.directory = pathlib.Path(directory)
        self.path = self.directory / DB_NAME
        self._lock = StateLock(self.directory) if lock else None
        #: the in-process writer: startup, flush_sync, and what is left once the process ended
        self._writer: StoreWriter | None = None
        # The queue (trio thread only), not yet taken by a round: the ops before the last barrier, then
        # the records since, grouped by table as the writer inserts them (see .records); and the
        # callbacks due once all of it is committed.
        self._ops: list[tuple[Any, ...]] = []
        self._events: dict[str, list[Any]] = {}
        self._admits: list[Any] = []
        self._settles: list[Any] = []
        self._queued = False
        #: a read is queued: its round is applied at once, not only logged
        self._reading = False
        self._callbacks: list[Callable[[], None]] = []
        self._op_seq = 0
        self.committed = 0
        #: incremented each time a round takes the queued records (see :meth:`after_round`)
        self.generation = 0
        # set by the first op queued after a take: ``run`` takes the queue at its next turn
        self._wake = trio.Event()
        #: the rounds sent and not yet reported committed, oldest first
        self._rounds: collections.deque[_Round] = collections.deque()
        self._round_id = 0
        #: read id -> the list its answer goes in
        self._reads: dict[int, list[StoredEvent]] = {}
        self._read_seq = 0
        self._frames = FrameReader()
        self._process: trio.Process | None = None
        self._stopping = False
        self.running = False
        self._transactions = 0
        #: prompts found unfinished at :meth:`open`: (session id, prompt id)
        self.restarted: list[tuple[str, str]] = []

    @property
    def transactions(self) -> int:
        """Transactions committed, by the writer process and in-process (tests check grouping with it)."""
        return self._transactions + (self._writer.transactions if self._writer is not None else 0)

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
            self._writer = StoreWriter(self.path)
            self._writer.migrate()
            self.restarted = self._writer.mark_restarted()
            return self._writer.load_index()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Write what is still queued, close the database, release the lock."""
        if self._writer is not None:
            try:
                self.flush_sync()
            except sqlite3.Error:
                log.exception("the session store could not write its last records")
            self._writer.close()
            self._writer = None
        if self._lock is not None:
            self._lock.release()

    # --- enqueueing (synchronous, never blocks) ---------------------------------------------------

    def _queue(self) -> None:
        self._queued = True
        self._wake.set()  # run takes the queue at its next turn

    def _barrier(self, op: tuple[Any, ...]) -> int:
        """Queue an op that the records queued before it must precede."""
        self._close_group()
        self._ops.append(op)
        self._op_seq += 1
        if not self._queued:
            self._queue()
        return self._op_seq

    def _close_group(self) -> None:
        if self._events:
            self._ops.append((EVENTS, self._events))
            self._events = {}
        if self._admits:
            self._ops.append((ADMITS, self._admits))
            self._admits = []
        if self._settles:
            self._ops.append((SETTLES, self._settles))
            self._settles = []

    def save_session(self, meta: StoredSession) -> None:
        """Create or replace the session's row."""
        self._barrier((SESSION, meta.session_id, meta.cwd, meta.backend, meta.title, meta.created_ms,
                       meta.updated_ms, _encode(meta.mcp_servers),
                       _encode(meta.backend_state) if meta.backend_state is not None else None, meta.tenant))

    def delete_session(self, session_id: str) -> None:
        self._barrier((DELETE, session_id))

    # The three records of the hot path (several per prompt) are appended where the writer wants them.

    def add_event(self, session_id: str, event_id: int, update: Any, method: str | None = None) -> None:
        """Append one transcript entry; ``update`` is its JSON (bytes or ``msgspec.Raw``), or anything
        msgspec encodes.

        Raises:
            TypeError: msgspec cannot encode ``update`` (nothing is queued).
        """
        if isinstance(update, bytes):
            body = update
        elif isinstance(update, msgspec.Raw):
            body = bytes(update)
        else:
            body = _encode(update)  # a prompt's own text, unsent (no other connection): encoded here
        entries = self._events.get(session_id)
        if entries is None:
            self._events[session_id] = [event_id, method, body]
        else:
            entries += (event_id, method, body)
        self._op_seq += 1
        if not self._queued:
            self._queue()

    def admit(self, seq: int, prompt_id: str, session_id: str) -> int:
        """Record an admitted prompt; returns the op number to :meth:`wait_committed` on."""
        self._admits += (seq, prompt_id, session_id)
        self._op_seq += 1
        if not self._queued:
            self._queue()
        return self._op_seq

    def settle(self, seq: int, outcome: str, callback: Callable[[], None] | None = None) -> None:
        """Record a prompt's terminal outcome (the first one wins); ``callback`` runs once it is committed."""
        self._settles += (seq, outcome)
        self._op_seq += 1
        if callback is not None:
            self._callbacks.append(callback)
        if not self._queued:
            self._queue()

    def after_commit(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` (in the trio thread, never from inside this call) once everything enqueued so
        far is committed."""
        if self._queued:
            self._callbacks.append(callback)
        elif self._rounds:
            self._rounds[-1].callbacks.append(callback)  # everything not yet committed is in that round
        else:
            self._callbacks.append(callback)
            self._wake.set()

    def after_round(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once everything enqueued until the next round is taken is committed: also
        the records enqueued after this call, under the same :attr:`generation`."""
        self._callbacks.append(callback)
        self._wake.set()

    def when_committed(self, op: int, callback: Callable[[], None]) -> None:
        """Run ``callback`` (in the trio thread, never from inside this call) once op number ``op`` is
        committed; ``op`` must not be committed yet."""
        for job in self._rounds:  # a handful at most: the rounds sent and not yet reported
            if op <= job.upto:
                job.callbacks.append(callback)
                return
        self._callbacks.append(callback)  # ``op`` is queued: its round takes this callback too
        self._wake.set()

    async def wait_committed(self, op: int) -> None:
        """Return once op number ``op`` is committed."""
        if self.committed >= op:
            return
        done = trio.Event()
        self.when_committed(op, done.set)
        await done.wait()

    async def read_events(self, session_id: str, after: int, upto: int) -> list[StoredEvent]:
        """The transcript entries with ``after < eventId <= upto``, in order (read after every earlier write)."""
        self._read_seq += 1
        box: list[StoredEvent] = []
        self._reads[self._read_seq] = box
        op = self._barrier((READ, self._read_seq, session_id, after, upto))
        self._reading = True
        await self.wait_committed(op)
        return box

    # --- the writer process ------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the writer process and send it a round at each turn of the event loop. When cancelled,
        send it what is still queued and wait (shielded, up to :data:`STOP_TIMEOUT_S`) until it wrote
        everything and exited; then run the callbacks.

        Raises:
            StoreWriterError: the writer process ended on its own (a failing ``sqlite3`` call does not
                end it: that transaction's records are lost, logged, and the callbacks run).
        """
        if self._writer is None:
            raise RuntimeError("SessionStore.run() before open()")
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        process = await trio.lowlevel.open_process(
            [sys.executable, "-c", _WRITER_MAIN, "--db", str(self.path), "--log-level", str(level)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            # The writer holds the directory's lock too: after a kill -9 of this server, the next one
            # waits for the writer to write what it was sent (see StateLock.acquire).
            pass_fds=(self._lock.fd,) if self._lock is not None and self._lock.fd is not None else (),
        )
        self._process = process
        self._stopping = False
        self.running = True
        task_status.started()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._receive)
                while True:
                    await self._wake.wait()
                    self._wake = trio.Event()
                    frame = self._take()
                    if frame is not None:
                        await self._send(frame)
        finally:
            self.running = False
            with trio.CancelScope(shield=True, deadline=trio.current_time() + STOP_TIMEOUT_S) as stop:
                await self._stop(process)
            if stop.cancelled_caught:
                log.error("the store writer (pid %d) did not finish within %.0f s: killed", process.pid, STOP_TIMEOUT_S)
                process.kill()
                with trio.CancelScope(shield=True):
                    await process.wait()
            self._process = None
            if self._rounds:
                log.error(
                    "the store writer exited (code %s) without confirming %d round(s): their records may be lost",
                    process.returncode, len(self._rounds),
                )
                self._rounds.clear()
            assert self._writer is not None
            try:
                self._writer.reload()  # the process moved the transcript chains on
            except sqlite3.Error:
                log.exception("the session store could not read its chain heads")
            try:
                self.flush_sync()  # what the last callbacks queued
            except sqlite3.Error:
                log.exception("the session store could not write its last records")

    async def _send(self, frame: bytes) -> None:
        assert self._process is not None and self._process.stdin is not None
        try:
            # Shielded: a round taken is in flight (its callbacks wait for it), so it must reach the
            # writer whole; a cancel waits for the pipe (the writer drains it) and then stops run().
            with trio.CancelScope(shield=True):
                await self._process.stdin.send_all(frame)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise StoreWriterError(f"the store writer (pid {self._process.pid}) stopped reading") from exc

    async def _receive(self) -> None:
        """Read the writer's reports until it ends: at end of input while stopping, else an error."""
        assert self._process is not None and self._process.stdout is not None
        stdout = self._process.stdout
        while True:
            data = await stdout.receive_some(1 << 16)
            if not data:
                if self._stopping:
                    return
                code = await self._process.wait()
                raise StoreWriterError(f"the store writer (pid {self._process.pid}) exited with code {code}")
            for upto_round, error, reads in self._frames.feed(data):
                self._finish(upto_round, error, reads)

    async def _stop(self, process: trio.Process) -> None:
        """The queue as a last round, then end of input: the writer applies everything and exits."""
        self._stopping = True
        frame = self._take()
        assert process.stdin is not None
        try:
            if frame is not None:
                await process.stdin.send_all(frame)
            await process.stdin.aclose()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # it is gone: what it confirmed is all there is
        await self._receive()
        await process.wait()

    def _take_ops(self) -> tuple[list[tuple[Any, ...]], list[Callable[[], None]]]:
        self._close_group()
        if self._process is None:
            self._reading = False  # flush_sync applies everything at once
        ops, self._ops = self._ops, []
        callbacks, self._callbacks = self._callbacks, []
        self._queued = False
        self.generation += 1
        return ops, callbacks

    def _take(self) -> bytes | None:
        """Take the queue: a frame for the writer, or with no ops and nothing in flight run its callbacks."""
        ops, callbacks = self._take_ops()
        if ops:
            self._round_id += 1
            self._rounds.append(_Round(self._round_id, self._op_seq, callbacks))
            flags = READS if self._reading else 0
            self._reading = False
            return encode_round(self._round_id, flags, ops)
        if self._rounds:
            self._rounds[-1].callbacks.extend(callbacks)
        else:
            _run_callbacks(callbacks)  # nothing in flight, nothing queued: all is committed
        return None

    def _finish(self, upto_round: int, error: str | None, reads: list[tuple[int, list[ReadEvent]]]) -> None:
        """The writer committed every round up to ``upto_round`` (or lost them, ``error``): answer the
        reads, then run the rounds' callbacks in order."""
        self._deliver(reads)
        if error is not None:
            log.error("the session store could not write the records of round(s) up to %d: %s", upto_round, error)
        else:
            self._transactions += 1
        while self._rounds and self._rounds[0].round_id <= upto_round:
            job = self._rounds.popleft()
            self.committed = job.upto
            _run_callbacks(job.callbacks)

    def _deliver(self, reads: list[tuple[int, list[ReadEvent]]]) -> None:
        for read_id, events in reads:
            box = self._reads.pop(read_id, None)
            if box is not None:
                box.extend(StoredEvent(event_id, method, msgspec.Raw(body)) for event_id, method, body in events)

    def flush_sync(self) -> None:
        """Apply everything queued now, in-process and blocking (tests, and shutdown without the writer).

        Raises:
            sqlite3.Error: the transaction was rolled back; its records and callbacks are dropped.
        """
        if self._process is not None:
            raise RuntimeError("flush_sync() while the writer process runs: the store's run() task owns the database")
        if self._writer is None:
            raise RuntimeError("flush_sync() on a closed session store")
        ops, callbacks = self._take_ops()
        if ops:
            self._deliver(self._writer.apply(ops))
        self.committed = self._op_seq
        _run_callbacks(callbacks)
