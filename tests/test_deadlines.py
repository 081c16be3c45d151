"""The shared timer of a run's connections: callbacks in deadline order, at their time, cancellable; a
deadline earlier than the one slept for wakes the loop; a failing callback does not stop the others;
cancelled entries are swept out once they are most of the heap."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from acp_server.transports import deadlines as deadlines_mod
from acp_server.transports.deadlines import Deadlines, deadlines


async def test_callbacks_run_at_their_time_in_order_and_cancelled_ones_do_not(
    autojump_clock: trio.testing.MockClock,
) -> None:
    timer = deadlines()
    assert deadlines() is timer, "one timer per run"
    start = trio.current_time()
    ran: list[tuple[str, float]] = []

    def note(name: str) -> None:
        ran.append((name, trio.current_time() - start))

    timer.at(start + 30, lambda: note("late"))
    timer.at(start + 10, lambda: note("early"))
    gone = timer.at(start + 20, lambda: note("cancelled"))
    gone.cancel()
    await trio.sleep(5)
    assert ran == []
    # Earlier than what the loop sleeps for: it must wake up for it.
    timer.at(trio.current_time() + 1, lambda: note("sooner"))
    await trio.sleep(40)
    assert [name for name, _ in ran] == ["sooner", "early", "late"]
    assert [round(at) for _, at in ran] == [6, 10, 30]
    assert len(timer) == 0


async def test_a_failing_callback_is_logged_and_the_others_still_run(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    timer = deadlines()
    ran: list[int] = []

    def boom() -> None:
        raise RuntimeError("defect")

    now = trio.current_time()
    timer.at(now + 1, boom)
    timer.at(now + 1, lambda: ran.append(1))
    timer.at(now + 2, lambda: ran.append(2))
    await trio.sleep(3)
    assert ran == [1, 2]
    assert "timeout callback failed" in caplog.text


async def test_a_callback_may_ask_for_its_next_wake_up(autojump_clock: trio.testing.MockClock) -> None:
    timer = deadlines()
    times: list[float] = []
    start = trio.current_time()

    def again() -> None:
        times.append(trio.current_time() - start)
        if len(times) < 3:
            timer.at(trio.current_time() + 5, again)

    timer.at(start + 5, again)
    await trio.sleep(60)
    assert [round(t) for t in times] == [5, 10, 15]


def test_cancelled_entries_are_swept_once_they_are_most_of_the_heap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deadlines_mod, "_SWEEP_MIN", 8)
    timer = Deadlines()  # not run: only its heap is looked at
    kept = [timer.at(100.0 + i, lambda: None) for i in range(2)]
    for i in range(5):
        timer.at(float(i), lambda: None).cancel()
    assert len(timer) == 7
    timer.at(50.0, lambda: None)  # the 8th entry: 3 live of 8, the cancelled ones go
    assert len(timer) == 3
    assert all(entry.callback is not None for entry in kept)
