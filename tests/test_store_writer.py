"""The store's writer thread: rounds taken in the trio thread, those queued behind a busy thread
applied in one transaction, waiters woken by the commit of their own round (not the next one),
callbacks in enqueue order, a failed round that leaves the transcript chains whole, and a shutdown
that writes everything queued."""

from __future__ import annotations

import functools
import pathlib
import sqlite3
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import trio
import trio.testing

from acp_server.store import SessionStore, StoredSession

from .helpers import stored_events

GATE_TIMEOUT_S = 10.0


class Gate:
    """Holds each round of ``store`` in the writer thread until the test lets it through."""

    def __init__(self, store: SessionStore) -> None:
        self.entered = threading.Semaphore(0)
        self.passes = threading.Semaphore(0)
        self.rounds: list[int] = []
        apply = store._apply

        def gated(ops: list[tuple[Any, ...]]) -> None:
            self.rounds.append(len(ops))
            self.entered.release()
            if not self.passes.acquire(timeout=GATE_TIMEOUT_S):
                raise RuntimeError("the test never let the round through")
            apply(ops)

        store._apply = gated  # type: ignore[method-assign]

    async def wait_entered(self) -> None:
        """Until a round is held in the thread."""
        if not await trio.to_thread.run_sync(self.entered.acquire, True, GATE_TIMEOUT_S):
            raise AssertionError("no round reached the writer thread")

    def release(self) -> None:
        self.passes.release()


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


async def test_waiters_wake_on_their_own_round_and_queued_rounds_share_a_transaction(store: SessionStore) -> None:
    """An op taken by the round in the thread is committed by that round: its waiter wakes then. Rounds
    taken meanwhile (one per event-loop turn) queue behind it and go in one transaction together."""
    gate = Gate(store)
    before = store.transactions
    order: list[str] = []

    async def waiter(op: int, name: str) -> None:
        await store.wait_committed(op)
        order.append(name)

    with trio.fail_after(GATE_TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(store.run)
            first = store.admit(1, "prompt_1", "s1")
            await gate.wait_entered()  # round 1 (the admission) is held in the thread
            generation = store.generation
            second = store.admit(2, "prompt_2", "s1")
            store.after_commit(lambda: order.append("after second"))
            assert store.generation == generation  # queued, not taken yet
            nursery.start_soon(waiter, first, "first")
            nursery.start_soon(waiter, second, "second")
            await trio.testing.wait_all_tasks_blocked()
            assert store.generation == generation + 1  # taken, behind round 1
            third = store.admit(3, "prompt_3", "s1")
            nursery.start_soon(waiter, third, "third")
            await trio.testing.wait_all_tasks_blocked()
            assert store.generation == generation + 2
            assert order == [] and store.committed < first
            gate.release()
            await gate.wait_entered()  # rounds 2 and 3, merged
            await trio.testing.wait_all_tasks_blocked()
            assert order == ["first"] and store.committed == first
            gate.release()
            await store.wait_committed(third)
            await trio.testing.wait_all_tasks_blocked()
            # the callback runs inside the commit report; the waiting tasks wake after it, in any order
            assert order[:2] == ["first", "after second"] and sorted(order[2:]) == ["second", "third"]
            assert gate.rounds == [1, 2] and store.transactions == before + 2
            nursery.cancel_scope.cancel()


async def test_callbacks_run_in_enqueue_order_after_their_records(store: SessionStore, tmp_path: pathlib.Path) -> None:
    """Each callback sees its own records on disk (read by another connection), callbacks of later
    rounds run later, and after_commit with nothing pending still runs, but never inside the call."""
    seen: list[tuple[int, int]] = []

    def check(n: int) -> None:
        db = sqlite3.connect(tmp_path / "sessions.db")
        try:
            (count,) = db.execute("SELECT COUNT(*) FROM prompts").fetchone()
        finally:
            db.close()
        seen.append((n, count))

    with trio.fail_after(GATE_TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(store.run)
            for n in range(1, 31):
                store.admit(n, f"prompt_{n}", "s1")
                store.add_event("s1", n, event(n))
                store.after_commit(functools.partial(check, n))
                if n % 7 == 0:
                    await trio.lowlevel.checkpoint()  # let some rounds go between
            await store.wait_committed(store.admit(31, "prompt_31", "s1"))
            idle = trio.Event()
            store.after_commit(idle.set)
            assert not idle.is_set()  # deferred, even with nothing to write
            await idle.wait()
            nursery.cancel_scope.cancel()
    assert [n for n, _ in seen] == list(range(1, 31))
    assert all(count >= n for n, count in seen)
    assert [e for _, e, _, _ in stored_events(tmp_path, "s1")] == list(range(1, 31))


async def test_shutdown_finishes_the_round_in_flight_then_writes_the_queue(
    store: SessionStore, tmp_path: pathlib.Path
) -> None:
    """Cancelling run() with a round in the thread and more queued: both are written, every callback
    runs once in order, and the thread is gone."""
    gate = Gate(store)
    ran: list[int] = []
    with trio.fail_after(GATE_TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(store.run)
            store.add_event("s1", 1, event(1))
            store.settle(1, "end_turn", lambda: ran.append(1))
            await gate.wait_entered()
            store.add_event("s1", 2, event(2))
            store.settle(2, "end_turn", lambda: ran.append(2))
            gate.release()  # round 1 commits; round 2, if taken before the cancel, goes through too
            gate.release()
            nursery.cancel_scope.cancel()
    assert ran == [1, 2]
    assert not any(t.name == "acp-server store writer" for t in threading.enumerate())
    assert [e for _, e, _, _ in stored_events(tmp_path, "s1")] == [1, 2]
    assert store.committed == store._op_seq


async def test_a_failing_write_is_logged_and_the_store_goes_on(
    store: SessionStore, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An sqlite3 error loses that round's records (logged) but neither its callbacks nor later rounds."""
    apply = store._apply
    calls = 0

    def flaky(ops: list[tuple[Any, ...]]) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise sqlite3.OperationalError("disk I/O error")
        apply(ops)

    store._apply = flaky  # type: ignore[method-assign]
    ran: list[str] = []
    with trio.fail_after(GATE_TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(store.run)
            store.add_event("s1", 1, event(1))
            store.settle(1, "end_turn", lambda: ran.append("lost"))
            await store.wait_committed(store._op_seq)
            store.add_event("s1", 2, event(2))
            await store.wait_committed(store._op_seq)
            nursery.cancel_scope.cancel()
    assert ran == ["lost"]
    assert "could not write 2 record(s)" in caplog.text
    assert [e for _, e, _, _ in stored_events(tmp_path, "s1")] == [2]


async def test_an_unexpected_writer_error_is_raised_by_run(store: SessionStore) -> None:
    """A bug in the writer thread (not an sqlite3 error) ends run() with it instead of being swallowed."""
    store.add_event("s1", 1, object())  # msgspec cannot encode it
    with trio.fail_after(GATE_TIMEOUT_S), pytest.RaisesGroup(pytest.RaisesExc(TypeError, match="Encoding objects")):
        async with trio.open_nursery() as nursery:
            await nursery.start(store.run)
            await trio.sleep_forever()
    store._ops.clear()  # the fixture's close() would fail on it again


async def test_a_rolled_back_round_leaves_the_transcript_chains_whole(store: SessionStore, tmp_path: pathlib.Path) -> None:
    """A round that fails after its chunks were inserted rolls them back, and the store forgets them
    too: later events chain onto what is on disk, so replay gives every committed event of the session
    and none of another's."""
    store.save_session(StoredSession("s2", "/tmp", "echo", 1, 1))
    store.add_event("s1", 1, event(1))
    store.admit(1, "prompt_1", "s1")
    store.flush_sync()
    db = store._db
    assert db is not None
    # the round's last statement (the outcome) fails, after its chunks and heads were written
    db.execute("CREATE TEMP TRIGGER fail BEFORE UPDATE ON prompts BEGIN SELECT RAISE(ABORT, 'boom'); END")
    store.add_event("s1", 2, event(2))
    store.add_event("s2", 1, event(1))
    store.settle(1, "end_turn")
    with pytest.raises(sqlite3.IntegrityError, match="boom"):
        store.flush_sync()
    db.execute("DROP TRIGGER fail")
    store.add_event("s2", 2, event(2))  # would take the chunk number the lost s1 chunk had
    store.add_event("s1", 3, event(3))
    store.flush_sync()
    with trio.fail_after(GATE_TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(store.run)
            s1 = [e.event_id for e in await store.read_events("s1", 0, 10)]
            s2 = [e.event_id for e in await store.read_events("s2", 0, 10)]
            nursery.cancel_scope.cancel()
    assert (s1, s2) == ([1, 3], [2])
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
    db = sqlite3.connect(tmp_path / "sessions.db")
    try:
        prompts = db.execute("SELECT seq, prompt_id, session_id, outcome FROM prompts ORDER BY seq").fetchall()
        heads = dict(db.execute("SELECT id, last_chunk FROM sessions").fetchall())
        chunks = db.execute("SELECT seq, session_id FROM chunks").fetchall()
    finally:
        db.close()
    assert prompts == [
        (n, f"prompt_{n}", sessions[n - 1], "end_turn" if n % 3 else "cancelled") for n in range(1, 151)
    ]
    assert {sid: seq for seq, sid in chunks if sid in heads and sid != "s1"} == {sid: heads[sid] for sid in sessions}
    assert [(e, body["n"]) for _, e, _, body in stored_events(tmp_path, "m149")] == [(1, 150), (2, -150)]
