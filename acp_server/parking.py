"""One task parked until a callback wakes it: trio's ``wait_task_rescheduled`` with its bookkeeping.

The bridge's session runners, the connection shell's writer and the admission policy's waiting-room
tickets each park one task and wake it from synchronous code. An ``Event`` per wait costs an object
and a wakeup list; a :class:`ParkingSpot` is reused for every wait of its owner.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import outcome
import trio
from trio.lowlevel import Abort, RaiseCancelT, Task

__all__ = ["ParkingSpot"]


class ParkingSpot:
    """Where one task waits for :meth:`wake` (or its cancellation).

    Attributes:
        task: the parked task, ``None`` while nobody waits.
    """

    __slots__ = ("_on_abort", "task")

    def __init__(self) -> None:
        self.task: Task | None = None
        self._on_abort: Callable[[], None] | None = None

    @property
    def parked(self) -> bool:
        """A task waits here."""
        return self.task is not None

    async def park(self, on_abort: Callable[[], None] | None = None) -> Any:
        """Wait until :meth:`wake` and return the value it was given.

        Args:
            on_abort: called if the wait is cancelled while still parked (before that, nothing woke it).

        Raises:
            trio.Cancelled: cancelled while parked; a wake that came first wins instead.
            RuntimeError: a task already waits here.
        """
        if self.task is not None:
            raise RuntimeError("a task is already parked here")
        self.task = trio.lowlevel.current_task()
        self._on_abort = on_abort
        return await trio.lowlevel.wait_task_rescheduled(self._abort)

    def _abort(self, _: RaiseCancelT) -> Abort:
        self.task = None
        on_abort, self._on_abort = self._on_abort, None
        if on_abort is not None:
            on_abort()
        return Abort.SUCCEEDED

    def wake(self, result: outcome.Outcome[Any] | None = None) -> bool:
        """Resume the parked task with ``result`` (a fresh ``Value`` to return or ``Error`` to raise;
        default: return ``None``).

        Returns:
            Whether a task was parked (waking nobody is a no-op).
        """
        task = self.task
        if task is None:
            return False
        self.task = None
        self._on_abort = None
        if result is None:
            trio.lowlevel.reschedule(task)
        else:
            trio.lowlevel.reschedule(task, result)
        return True
