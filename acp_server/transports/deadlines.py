"""One timer for every connection of a trio run: a deadline heap served by one task.

A socket's first-message and idle timeouts each need one wake-up per timeout period, and nothing per
message read. A task (or a cancel scope) per connection sleeping for it costs ~2.5 KB of memory per
connection; here a pending deadline is one heap entry, and one task (a trio system task, started with
the first deadline of the run) sleeps until the earliest one and runs the callbacks that are due.

Callbacks run synchronously in that task, in deadline order; one that raises is logged and the others
still run. A callback that wants a later wake-up (an idle connection that read something meanwhile)
asks for a new deadline; one that is no longer wanted (the connection closed) is cancelled, and its
entry leaves the heap when its time comes or when cancelled entries are the majority.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from collections.abc import Callable

import trio

__all__ = ["Deadline", "Deadlines", "deadlines"]

log = logging.getLogger("acp_server.connection")

#: below this many entries cancelled ones are never swept out early (they leave at their time)
_SWEEP_MIN = 1024


class Deadline:
    """One pending wake-up; :meth:`cancel` makes it a no-op."""

    __slots__ = ("callback",)

    def __init__(self, callback: Callable[[], None]) -> None:
        self.callback: Callable[[], None] | None = callback

    def cancel(self) -> None:
        """Do not run the callback (nothing if it ran already)."""
        self.callback = None


class Deadlines:
    """A heap of deadlines (trio time) and the loop that runs them: see the module docstring."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Deadline]] = []
        self._seq = itertools.count()
        self._scope: trio.CancelScope | None = None  # the loop's sleep, whose deadline is the earliest one

    def __len__(self) -> int:
        return len(self._heap)

    def at(self, when: float, callback: Callable[[], None]) -> Deadline:
        """Run ``callback()`` once at trio time ``when`` (or soon after), unless cancelled first."""
        entry = Deadline(callback)
        heap = self._heap
        heapq.heappush(heap, (when, next(self._seq), entry))
        scope = self._scope
        if scope is not None and when < scope.deadline:
            scope.deadline = when
        if len(heap) >= _SWEEP_MIN and len(heap) & (_SWEEP_MIN - 1) == 0:
            self._sweep()
        return entry

    def _sweep(self) -> None:
        """Drop cancelled entries when they are most of the heap (many connections came and went)."""
        heap = self._heap
        live = [item for item in heap if item[2].callback is not None]
        if 2 * len(live) < len(heap):
            heapq.heapify(live)
            heap[:] = live

    async def run(self) -> None:
        """Run the callbacks as they fall due, forever."""
        heap = self._heap
        while True:
            now = trio.current_time()
            while heap and heap[0][0] <= now:
                entry = heapq.heappop(heap)[2]
                callback = entry.callback
                if callback is not None:
                    entry.callback = None
                    try:
                        callback()
                    except Exception:
                        log.exception("a connection's timeout callback failed")
            with trio.CancelScope(deadline=heap[0][0] if heap else math.inf) as scope:
                self._scope = scope
                await trio.sleep_forever()
            self._scope = None


_RUN_DEADLINES: trio.lowlevel.RunVar[Deadlines] = trio.lowlevel.RunVar("acp_server_deadlines")


def deadlines() -> Deadlines:
    """The deadlines of the current trio run; the first call starts their loop as a system task."""
    try:
        return _RUN_DEADLINES.get()
    except LookupError:
        timer = Deadlines()
        _RUN_DEADLINES.set(timer)
        trio.lowlevel.spawn_system_task(timer.run, name="acp_server connection deadlines")
        return timer
