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


def test_trios_pass_gets_two_argument_min_and_max_that_answer_as_the_builtins() -> None:
    """tune_scheduler gives trio's run loop and epoll manager a Python ``min``/``max`` of two arguments
    (the builtins parse an iterable and keywords at every pass); they answer as the builtins do."""
    import math

    import trio._core._io_epoll

    from acp_server import cli

    tune_scheduler()
    assert trio._core._run.min is cli._min2 and trio._core._run.max is cli._max2  # type: ignore[attr-defined]
    assert trio._core._io_epoll.max is cli._max2  # type: ignore[attr-defined]
    one, other = 1.0, 1  # equal: the first one comes back, as from the builtins
    values = [0, -1, 2.5, math.inf, -math.inf, math.nan, one, other, 86400.0]
    for a in values:
        for b in values:
            assert repr(cli._min2(a, b)) == repr(min(a, b)) and type(cli._min2(a, b)) is type(min(a, b))
            assert repr(cli._max2(a, b)) == repr(max(a, b)) and type(cli._max2(a, b)) is type(max(a, b))
    # the scheduler still runs (every pass calls them)
    assert _orders() == [list(range(_TASKS))] * _PASSES


def test_min_and_max_are_replaced_only_where_every_call_has_two_positional_arguments() -> None:
    import dis

    from acp_server import cli

    def one(xs: list[int]) -> int:
        return max(xs)

    def keyword(a: int, b: int) -> int:
        return max(a, b, key=abs)

    def three(a: int, b: int, c: int) -> int:
        return min(a, b, c)

    def branch(a: int, b: int) -> int:
        return max(a if a else b, 0)

    def star(xs: list[int]) -> int:
        return max(*xs)

    def alias(a: int, b: int) -> int:
        m = max
        return m(a, b)

    def nested(a: float, b: float) -> float:
        return min(max(0, a), b)

    for refused in (one, keyword, three, branch, star, alias):
        assert not cli._called_with_two(refused.__code__, dis), refused.__name__
    assert cli._called_with_two(nested.__code__, dis)


def test_the_check_disassembles_only_code_that_names_min_or_max(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start-up cost: disassembling all 108 code objects of trio's two modules took ~19 ms of every
    ``serve``; only those whose ``co_names`` hold ``min`` or ``max`` can load them, the rest are skipped."""
    import sys

    from acp_server import cli

    disassembled: list[object] = []
    real = cli._instructions

    def counted(code: object, dis: object) -> list[tuple[str, int, int | None]]:
        disassembled.append(code)
        return real(code, dis)

    monkeypatch.setattr(cli, "_instructions", counted)
    for name in cli._MIN_MAX_MODULES:  # a check of its own, as at start-up (undone at teardown)
        for builtin in ("min", "max"):
            monkeypatch.delattr(sys.modules[name], builtin, raising=False)
    cli._two_argument_min_max()
    assert trio._core._run.min is cli._min2 and trio._core._run.max is cli._max2  # type: ignore[attr-defined]
    names = [getattr(code, "co_names", ()) for code in disassembled]
    assert names and all("min" in n or "max" in n for n in names)
    assert len(disassembled) < len(cli._codes(trio._core._run))


def test_the_lean_decoder_lists_what_dis_lists() -> None:
    """``cli._instructions`` reads bytecode with ``dis``'s own decoder: the same instructions as
    ``dis.get_instructions``, for every code object of trio's two modules and of this test."""
    import dis

    import trio._core._io_epoll

    from acp_server import cli

    codes = [*cli._codes(trio._core._run), *cli._codes(trio._core._io_epoll)]
    codes += [test_min_and_max_are_replaced_only_where_every_call_has_two_positional_arguments.__code__]
    assert len(codes) > 100
    for code in codes:
        assert cli._instructions(code, dis) == [(i.opname, i.opcode, i.arg) for i in dis.get_instructions(code)]
