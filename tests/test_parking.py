"""``acp_server.parking.ParkingSpot``: one task parked until a callback wakes it."""

from __future__ import annotations

import outcome
import pytest
import trio
import trio.testing

from acp_server.parking import ParkingSpot


async def test_wake_returns_its_value_to_the_parked_task() -> None:
    spot = ParkingSpot()
    got: list[object] = []

    async def waiter() -> None:
        got.append(await spot.park())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        assert spot.parked and spot.task is not None
        assert spot.wake(outcome.Value("go"))
        assert not spot.parked
        assert not spot.wake(outcome.Value("again")), "nobody is parked any more"
    assert got == ["go"]


async def test_wake_without_a_value_returns_none_and_an_error_is_raised() -> None:
    spot = ParkingSpot()
    got: list[object] = []

    async def waiter() -> None:
        got.append(await spot.park())
        with pytest.raises(KeyError):
            await spot.park()
        got.append("raised")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        spot.wake()
        await trio.testing.wait_all_tasks_blocked()
        spot.wake(outcome.Error(KeyError("x")))
    assert got == [None, "raised"]


async def test_waking_nobody_is_a_no_op() -> None:
    assert not ParkingSpot().wake()


async def test_a_cancelled_wait_runs_its_abort_hook_and_leaves_the_spot_free() -> None:
    spot = ParkingSpot()
    aborted: list[str] = []
    with trio.move_on_after(0.01) as scope:
        await spot.park(lambda: aborted.append("left"))
    assert scope.cancelled_caught and aborted == ["left"]
    assert not spot.parked and not spot.wake()


async def test_a_wake_that_came_first_does_not_run_the_abort_hook() -> None:
    spot = ParkingSpot()
    aborted: list[str] = []

    async def waiter() -> None:
        await spot.park(lambda: aborted.append("left"))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        spot.wake()
        nursery.cancel_scope.cancel()  # after the wake: the task is rescheduled already
    assert aborted == []


async def test_one_task_at_a_time() -> None:
    spot = ParkingSpot()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(spot.park)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(RuntimeError, match="already parked"):
            await spot.park()
        spot.wake()
