"""``acp-server serve`` has trio run the tasks woken together in the order they were woken (see
``cli.tune_scheduler``): the session whose prompt was read first is answered first, every pass."""

from __future__ import annotations

import pytest
import trio
import trio._core._run

from acp_server.cli import tune_scheduler

_TASKS = 8
_PASSES = 40


def _orders() -> list[list[int]]:
    """Each pass's order of running for 8 parked tasks woken in the order 0..7 by one task."""
    orders: list[list[int]] = []

    async def main() -> None:
        parked: dict[int, trio.lowlevel.Task] = {}
        ran: list[int] = []

        async def worker(i: int) -> None:
            while True:
                parked[i] = trio.lowlevel.current_task()
                await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.SUCCEEDED)
                ran.append(i)

        async with trio.open_nursery() as nursery:
            for i in range(_TASKS):
                nursery.start_soon(worker, i)
            for _ in range(_PASSES):
                while len(parked) < _TASKS:
                    await trio.lowlevel.checkpoint()
                ran.clear()
                woken = [parked.pop(i) for i in range(_TASKS)]
                for task in woken:  # one after the other, as the reader hands prompts to runners
                    trio.lowlevel.reschedule(task)
                while len(ran) < _TASKS:
                    await trio.lowlevel.checkpoint()
                orders.append(list(ran))
            nursery.cancel_scope.cancel()

    trio.run(main)
    return orders


@pytest.fixture(autouse=True)
def _as_served(monkeypatch: pytest.MonkeyPatch) -> None:
    # Importing Hypothesis (pytest-trio does) puts trio in a mode that sorts and shuffles every batch;
    # a server runs without it.
    monkeypatch.setattr(trio._core._run, "_ALLOW_DETERMINISTIC_SCHEDULING", False)


def test_tasks_woken_together_run_in_the_order_they_were_woken() -> None:
    draw = trio._core._run._r
    try:
        tune_scheduler()
        assert _orders() == [list(range(_TASKS))] * _PASSES
    finally:
        vars(draw).pop("random", None)  # trio's own draw again for the other tests


def test_without_it_trio_reverses_some_batches() -> None:
    # What tune_scheduler is for: trio's default runs a batch in either order (one in 2**39 runs of
    # this test sees a single order 40 times).
    assert "random" not in vars(trio._core._run._r)
    assert len({tuple(order) for order in _orders()}) == 2
