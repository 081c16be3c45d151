"""The store's writer: rounds logged as they arrive (those that arrive together in one transaction) and
applied to the tables in slices; reads applied at once; the writer process run by SessionStore.run
(waiters woken by their own round, callbacks in enqueue order, a shutdown that writes everything, a
failing write that is logged, a writer that dies ending run()); a rolled-back transaction that leaves
the chains whole; the log of a killed writer applied at the next open; the checkpointer; the wait for
a dead owner's writer on the lock."""

from __future__ import annotations

import functools
import os
import pathlib
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import trio
import trio.testing

from acp_server.store import SessionStore, StateDirLocked, StateLock, StoredSession, StoreWriterError
from acp_server.store.records import (
    ADMITS,
    EVENTS,
    READ,
    READS,
    SESSION,
    SETTLES,
    FrameReader,
    encode_ops,
    encode_round,
)
from acp_server.store.writer import StoreWriter
from acp_server.store.writer_process import Checkpointer, serve

from .helpers import rows_of, stored_events

TIMEOUT_S = 20.0


@pytest.fixture
def store(tmp_path: pathlib.Path) -> Iterator[SessionStore]:
    store = SessionStore(tmp_path)
    store.open()
    store.save_session(StoredSession("s1", "/tmp", "echo", 1, 1))
    store.flush_sync()
    yield store
    store.close()


def event(n: int) -> dict[str, Any]:
    return {"sessionUpdate": "agent_message_chunk", "n": n}


def body(n: int) -> bytes:
    return msgspec.json.encode(event(n))


def session_op(sid: str) -> tuple[Any, ...]:
    return (SESSION, sid, "/tmp", "echo", None, 1, 1, b"[]", None, "default")


def one_prompt(seq: int, sid: str, first_event: int) -> list[tuple[Any, ...]]:
    """A round with one prompt admitted and settled, and two events."""
    return [
        (EVENTS, {sid: [first_event, None, body(first_event), first_event + 1, None, body(first_event + 1)]}),
        (ADMITS, [seq, f"prompt_{seq}", sid]),
        (SETTLES, [seq, "end_turn"]),
    ]


# --- the writer, in-process ---------------------------------------------------------------------------


def writer_on(tmp_path: pathlib.Path) -> StoreWriter:
    writer = StoreWriter(tmp_path / "sessions.db")
    writer.migrate()
    writer.reload()
    writer.apply([session_op("s1"), session_op("s2")])
    return writer


def test_rounds_that_arrive_together_are_logged_in_one_transaction_and_applied_later(tmp_path: pathlib.Path) -> None:
    """serve() logs the rounds waiting in its input as they are (one transaction, one answer naming the
    last round), and applies them to the tables at end of input."""
    writer = writer_on(tmp_path)
    before = writer.transactions
    rfd, feed = os.pipe()
    answers, wfd = os.pipe()
    os.write(feed, b"".join(encode_round(n, 0, one_prompt(n, "s1", 2 * n - 1)) for n in (1, 2, 3)))
    seen: list[tuple[int, int]] = []

    def spy(n: int | None = None) -> int:
        seen.append((writer.logged, writer.transactions))
        return compact(n)

    compact = writer.compact
    writer.compact = spy  # type: ignore[method-assign]
    thread = threading.Thread(target=serve, args=(writer, rfd, wfd))
    thread.start()
    deadline = time.monotonic() + TIMEOUT_S
    reply = b""
    while not reply and time.monotonic() < deadline:
        reply = os.read(answers, 1 << 16)
    assert FrameReader().feed(reply) == [[3, None, []]]
    os.close(feed)  # end of input: apply everything, then return
    thread.join(TIMEOUT_S)
    assert not thread.is_alive()
    assert seen and seen[-1][0] == 3 and seen[-1][1] == before + 1  # three rounds, one log transaction
    assert writer.logged == 0
    prompts = writer.db.execute("SELECT seq, outcome FROM prompts ORDER BY seq").fetchall()  # type: ignore[union-attr]
    assert prompts == [(1, "end_turn"), (2, "end_turn"), (3, "end_turn")]
    assert writer.db.execute("SELECT COUNT(*) FROM log").fetchone() == (0,)  # type: ignore[union-attr]
    writer.close()
    assert [e for _, e, _, _ in stored_events(tmp_path, "s1")] == [1, 2, 3, 4, 5, 6]
    for fd in (rfd, answers, wfd):
        os.close(fd)


def test_a_round_that_reads_is_applied_at_once_after_everything_logged(tmp_path: pathlib.Path) -> None:
    writer = writer_on(tmp_path)
    writer.log([encode_ops(one_prompt(1, "s1", 1))])
    assert writer.logged == 1
    rfd, feed = os.pipe()
    answers, wfd = os.pipe()
    os.write(feed, encode_round(2, READS, [(EVENTS, {"s1": [3, None, body(3)]}), (READ, 7, "s1", 1, 10)]))
    os.close(feed)
    serve(writer, rfd, wfd)
    [answer] = FrameReader().feed(os.read(answers, 1 << 16))
    assert answer[0] == 2 and answer[1] is None
    [(read_id, events)] = answer[2]
    assert read_id == 7 and [(e, m) for e, m, _ in events] == [(2, None), (3, None)]
    assert msgspec.json.decode(events[-1][2]) == event(3)
    writer.close()
    for fd in (rfd, answers, wfd):
        os.close(fd)


def test_compaction_merges_a_prompt_admitted_and_settled_in_its_slice_into_one_row(tmp_path: pathlib.Path) -> None:
    """Logged rounds are applied in slices: a prompt admitted and settled within one becomes one row
    with its outcome; one settled in a later slice is updated; the first outcome wins throughout."""
    writer = writer_on(tmp_path)
    writer.log([encode_ops([(ADMITS, [1, "prompt_1", "s1", 2, "prompt_2", "s2"])])])
    writer.log([encode_ops([(SETTLES, [1, "end_turn", 1, "refusal"])])])
    writer.log([encode_ops([(SETTLES, [2, "cancelled"])])])
    writer.log([encode_ops([(SETTLES, [2, "end_turn"])])])
    assert writer.compact(2) == 2 and writer.logged == 2
    db = writer.db
    assert db is not None
    assert db.execute("SELECT seq, outcome FROM prompts ORDER BY seq").fetchall() == [(1, "end_turn"), (2, None)]
    assert writer.compact() == 2
    assert db.execute("SELECT seq, outcome FROM prompts ORDER BY seq").fetchall() == [(1, "end_turn"), (2, "cancelled")]
    writer.close()


def test_a_slice_of_rounds_logged_together_deletes_only_the_log_rows_it_applied(tmp_path: pathlib.Path) -> None:
    """Rounds logged in one transaction keep a log row each: a compaction slice that applies the first
    two deletes only their rows, so another connection sees every round (in the tables or still in the
    log) and a writer killed right after the slice loses none."""
    writer = writer_on(tmp_path)
    writer.log([encode_ops(one_prompt(n, "s1", 2 * n - 1)) for n in (1, 2, 3)])
    assert writer.compact(2) == 2 and writer.logged == 1
    direct = sqlite3.connect(tmp_path / "sessions.db")
    try:
        assert direct.execute("SELECT seq FROM log").fetchall() == [(3,)]
        assert direct.execute("SELECT seq FROM prompts ORDER BY seq").fetchall() == [(1,), (2,)]
    finally:
        direct.close()
    assert rows_of(tmp_path, "SELECT seq FROM prompts ORDER BY seq") == [(1,), (2,), (3,)]
    assert writer.db is not None
    writer.db.close()  # killed between two slices
    writer.db = None
    store = SessionStore(tmp_path)
    store.open()
    store.close()
    assert rows_of(tmp_path, "SELECT seq, outcome FROM prompts ORDER BY seq") == [(n, "end_turn") for n in (1, 2, 3)]
    assert [e for _, e, _, _ in stored_events(tmp_path, "s1")] == [1, 2, 3, 4, 5, 6]


def test_the_log_of_a_killed_writer_is_applied_at_the_next_open(tmp_path: pathlib.Path) -> None:
    """Logged rounds are durable: a writer that dies before applying them leaves them to the next
    open, which applies them before marking the unfinished prompts server_restarted."""
    writer = writer_on(tmp_path)
    writer.log([encode_ops(one_prompt(1, "s1", 1)), encode_ops([(ADMITS, [2, "prompt_2", "s2"])])])
    assert writer.db is not None
    writer.db.close()  # dies: nothing applied, no heads written
    writer.db = None
    assert rows_of(tmp_path, "SELECT seq, outcome FROM prompts ORDER BY seq") == [(1, "end_turn"), (2, None)]
    store = SessionStore(tmp_path)
    index, max_seq = store.open()
    store.close()
    assert max_seq == 2 and store.restarted == [("s2", "prompt_2")]
    assert index["s1"].next_event_id == 3
    assert rows_of(tmp_path, "SELECT COUNT(*) FROM log") == [(0,)]
    assert rows_of(tmp_path, "SELECT seq, outcome FROM prompts ORDER BY seq") == [(1, "end_turn"), (2, "server_restarted")]


def test_checkpointer_copies_the_wal_beside_the_writer(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "sessions.db"
    writer = StoreWriter(path, autocheckpoint=False)
    writer.migrate()
    writer.reload()
    checkpointer = Checkpointer(path)
    checkpointer.start()
    try:
        for n in range(1, 40):
            writer.log([encode_ops(one_prompt(n, "s1", 2 * n - 1))])
        checkpointer.written()
        probe = sqlite3.connect(path)
        try:
            deadline = time.monotonic() + TIMEOUT_S
            while time.monotonic() < deadline:
                _, frames, copied = probe.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                if checkpointer.checkpoints and frames == copied:
                    break
                time.sleep(0.05)
            assert checkpointer.checkpoints >= 1
        finally:
            probe.close()
    finally:
        checkpointer.stop()
        writer.close()
    assert not checkpointer.is_alive()


# --- the writer process under SessionStore.run ---------------------------------------------------------


async def test_waiters_wake_on_their_own_round_in_order(store: SessionStore, tmp_path: pathlib.Path) -> None:
    """Each callback runs after its own records are durable (read by another connection), in enqueue
    order, never inside the call; after_commit with nothing pending still runs later."""
    seen: list[tuple[int, int]] = []

    def check(n: int) -> None:
        seen.append((n, len(rows_of(tmp_path, "SELECT seq FROM prompts"))))

    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(store.run)
            for n in range(1, 31):
                store.admit(n, f"prompt_{n}", "s1")
                store.add_event("s1", n, event(n))
                store.after_commit(functools.partial(check, n))
                if n % 7 == 0:
                    await trio.lowlevel.checkpoint()  # let some rounds go between
            last = store.admit(31, "prompt_31", "s1")
            assert store.committed < last  # enqueueing never waits
            await store.wait_committed(last)
            assert store.committed >= last
            idle = trio.Event()
            store.after_commit(idle.set)
            assert not idle.is_set()  # deferred, even with nothing to write
            await idle.wait()
            nursery.cancel_scope.cancel()
    assert [n for n, _ in seen] == list(range(1, 31))
    assert all(count >= n for n, count in seen)
    assert [e for _, e, _, _ in stored_events(tmp_path, "s1")] == list(range(1, 31))


def test_after_round_also_covers_records_enqueued_after_it(store: SessionStore) -> None:
    """Registered while a round is in flight and nothing is queued, an after_round callback waits for
    what is enqueued after it under the same generation, where after_commit would run with the round
    in flight (the bridge appends answers to a round's list after registering it)."""
    ran: list[str] = []
    store.admit(1, "prompt_1", "s1")
    assert store._take() is not None  # round 1 in flight, nothing queued
    generation = store.generation
    store.after_commit(lambda: ran.append("after_commit"))
    store.after_round(lambda: ran.append("after_round"))
    store.admit(2, "prompt_2", "s1")  # after both registrations, same generation
    assert store.generation == generation
    assert store._take() is not None  # round 2
    store._finish(1, None, [])
    assert ran == ["after_commit"]
    store._finish(2, None, [])
    assert ran == ["after_commit", "after_round"]


async def test_shutdown_writes_the_queue_and_the_writer_process_ends(store: SessionStore, tmp_path: pathlib.Path) -> None:
    ran: list[int] = []
    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(store.run)
            process = store._process
            assert process is not None
            store.add_event("s1", 1, event(1))
            store.settle(1, "end_turn", lambda: ran.append(1))
            await trio.lowlevel.checkpoint()  # round 1 goes to the writer
            store.add_event("s1", 2, event(2))
            store.settle(2, "end_turn", lambda: ran.append(2))  # still queued when cancelled
            nursery.cancel_scope.cancel()
    assert ran == [1, 2]
    assert process.returncode == 0
    assert store.committed == store._op_seq
    assert [e for _, e, _, _ in stored_events(tmp_path, "s1")] == [1, 2]
    assert rows_of(tmp_path, "SELECT COUNT(*) FROM log") == [(0,)]  # the writer applied its log before exiting


async def test_reads_see_every_earlier_write(store: SessionStore) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(store.run)
            for n in range(1, 6):
                store.add_event("s1", n, event(n))
                await trio.lowlevel.checkpoint()
            events = await store.read_events("s1", 2, 4)
            nursery.cancel_scope.cancel()
    assert [e.event_id for e in events] == [3, 4]
    assert msgspec.json.decode(events[0].body) == event(3)


async def test_a_failing_write_is_logged_and_the_store_goes_on(
    store: SessionStore, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An sqlite3 error in the writer loses that transaction's records (logged by the server) but
    neither its callbacks nor later rounds."""
    db = sqlite3.connect(tmp_path / "sessions.db")
    db.execute("CREATE TRIGGER boom BEFORE INSERT ON log WHEN (SELECT COUNT(*) FROM log) = 0 BEGIN SELECT RAISE(ABORT, 'boom'); END")
    db.close()
    ran: list[str] = []
    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(store.run)
            store.add_event("s1", 1, event(1))
            store.settle(1, "end_turn", lambda: ran.append("lost"))
            await store.wait_committed(store._op_seq)
            db = sqlite3.connect(tmp_path / "sessions.db")
            db.execute("DROP TRIGGER boom")
            db.close()
            store.add_event("s1", 2, event(2))
            await store.wait_committed(store._op_seq)
            nursery.cancel_scope.cancel()
    assert ran == ["lost"]
    assert "could not write the records" in caplog.text and "boom" in caplog.text
    assert [e for _, e, _, _ in stored_events(tmp_path, "s1")] == [2]


async def test_a_writer_that_dies_ends_run_with_an_error(store: SessionStore) -> None:
    with trio.fail_after(TIMEOUT_S), pytest.RaisesGroup(pytest.RaisesExc(StoreWriterError, match="exited with code"), flatten_subgroups=True):
        async with trio.open_nursery() as nursery:
            await nursery.start(store.run)
            assert store._process is not None
            store._process.send_signal(signal.SIGKILL)
            await trio.sleep_forever()


def test_a_rolled_back_transaction_leaves_the_transcript_chains_whole(store: SessionStore, tmp_path: pathlib.Path) -> None:
    """A transaction that fails after its chunks were inserted rolls them back, and the writer forgets
    them too: later events chain onto what is on disk, so replay gives every committed event of the
    session and none of another's."""
    store.save_session(StoredSession("s2", "/tmp", "echo", 1, 1))
    store.add_event("s1", 1, event(1))
    store.admit(1, "prompt_1", "s1")
    store.flush_sync()
    writer = store._writer
    assert writer is not None and writer.db is not None
    # the transaction's last statement (the outcome) fails, after its chunks were written
    writer.db.execute("CREATE TEMP TRIGGER fail BEFORE UPDATE ON prompts BEGIN SELECT RAISE(ABORT, 'boom'); END")
    store.add_event("s1", 2, event(2))
    store.add_event("s2", 1, event(1))
    store.settle(1, "end_turn")
    with pytest.raises(sqlite3.IntegrityError, match="boom"):
        store.flush_sync()
    writer.db.execute("DROP TRIGGER fail")
    store.add_event("s2", 2, event(2))  # would take the chunk number the lost s1 chunk had
    store.add_event("s1", 3, event(3))
    box_s1: list[Any] = []
    box_s2: list[Any] = []
    store._reads[901], store._reads[902] = box_s1, box_s2
    store._barrier((READ, 901, "s1", 0, 10))
    store._barrier((READ, 902, "s2", 0, 10))
    store.flush_sync()
    assert ([e.event_id for e in box_s1], [e.event_id for e in box_s2]) == ([1, 3], [2])
    assert [e for _, e, _, _ in stored_events(tmp_path, "s1")] == [1, 3]


def test_a_large_round_writes_every_row_once(store: SessionStore, tmp_path: pathlib.Path) -> None:
    """Rows of a round go in multi-row statements of fixed sizes: 150 sessions with events, 150
    admissions and their outcomes (two kinds, and a second outcome that must lose) all land, once."""
    sessions = [f"m{n}" for n in range(150)]
    for sid in sessions:
        store.save_session(StoredSession(sid, "/tmp", "echo", 1, 1))
    store.flush_sync()
    for n, sid in enumerate(sessions, start=1):
        store.add_event(sid, 1, event(n))
        store.add_event(sid, 2, event(-n))
        store.admit(n, f"prompt_{n}", sid)
    for n in range(1, 151):
        store.settle(n, "end_turn" if n % 3 else "cancelled")
    store.settle(5, "refusal")  # the first outcome wins, also within one round
    before = store.transactions
    store.flush_sync()
    assert store.transactions == before + 1
    prompts = rows_of(tmp_path, "SELECT seq, prompt_id, session_id, outcome FROM prompts ORDER BY seq")
    assert prompts == [
        (n, f"prompt_{n}", sessions[n - 1], "end_turn" if n % 3 else "cancelled") for n in range(1, 151)
    ]
    assert [(e, body["n"]) for _, e, _, body in stored_events(tmp_path, "m149")] == [(1, 150), (2, -150)]


# --- the lock ----------------------------------------------------------------------------------------

_HOLDER = """
import os, subprocess, sys, pathlib
from acp_server.store import StateLock
lock = StateLock(pathlib.Path(sys.argv[1]))
lock.acquire()
# a "writer" that inherits the lock and outlives us by a moment
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.0)"], pass_fds=(lock.fd,))
os._exit(0)  # dies without releasing (as kill -9 would)
"""


def test_a_dead_owners_writer_is_waited_for_then_the_lock_is_taken(tmp_path: pathlib.Path) -> None:
    subprocess.run([sys.executable, "-c", _HOLDER, str(tmp_path)], check=True, timeout=TIMEOUT_S)
    lock = StateLock(tmp_path)
    started = time.monotonic()
    lock.acquire()
    waited = time.monotonic() - started
    lock.release()
    assert 0.2 < waited < 10.0


def test_a_dead_owners_writer_that_outlasts_the_wait_is_reported(tmp_path: pathlib.Path) -> None:
    subprocess.run([sys.executable, "-c", _HOLDER, str(tmp_path)], check=True, timeout=TIMEOUT_S)
    with pytest.raises(StateDirLocked, match="use another --state-dir"):
        StateLock(tmp_path).acquire(dead_owner_wait_s=0.1)
