"""The waiters of one replica: who is tried next when a limit may have room, and how a pass goes.

Both coordinators keep their waiters here. A *pass* tries the waiters in order (rank, then arrival)
and skips every waiter that needs a limit already refused in the same pass, so one freed seat costs one
attempt per distinct refusal, not one per waiter. A pass starts on a wake-up: a release on this replica,
a release announced by another one (pub/sub), a new waiter, or the periodic re-check.

Grant or cancel, as in trio's ``CapacityLimiter``: a waiter cancelled before its grant leaves the queue
holding nothing new; one whose grant is on its way when the cancel comes is left to its lease's release
(the caller releases a cancelled prompt's lease, and a release racing an acquire leaves a tombstone).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Awaitable, Callable, Sequence
from typing import Final

import trio

from .base import CoordinatorUnavailable, Lease, LimitRefused, Option

__all__ = ["PASS_CHUNK", "Waiter", "WaitQueue"]

_WAITING: Final = 0
_GRANTED: Final = 1
_GONE: Final = 2

#: one attempt for a waiter: its lease, its option, the limits it leaves, its place in the queue
Attempt = Callable[[Lease, Option, Sequence[str], tuple[int, int]], Awaitable[None]]

#: Waiters tried at once in a pass (one script call on a shared coordinator).
PASS_CHUNK: Final = 16


class Waiter:
    """One task waiting for ``option`` under ``lease``."""

    __slots__ = ("event", "key", "lease", "leave", "option", "state")

    def __init__(self, key: tuple[int, int], lease: Lease, option: Option, leave: Sequence[str]) -> None:
        self.key = key
        self.lease = lease
        self.option = option
        self.leave = tuple(leave)
        self.state = _WAITING
        self.event = trio.Event()

    def __lt__(self, other: Waiter) -> bool:
        return self.key < other.key


class WaitQueue:
    """The ordered waiters and the wake-up flag of one coordinator."""

    def __init__(self) -> None:
        self._waiters: list[Waiter] = []
        self._seq = itertools.count()
        self._wake = trio.Event()

    def __len__(self) -> int:
        return len(self._waiters)

    def wake(self) -> None:
        """Ask for a pass (idempotent until the pass starts); nothing while nobody waits (a new waiter
        asks for its own)."""
        if self._waiters:
            self._wake.set()

    async def woken(self, timeout_s: float) -> None:
        """Wait for :meth:`wake`, or ``timeout_s`` (the re-check); then clear the flag."""
        with trio.move_on_after(timeout_s):
            await self._wake.wait()
        self._wake = trio.Event()

    async def wait(self, lease: Lease, option: Option, rank: int, leave: Sequence[str]) -> None:
        """Queue and park until a pass grants ``option`` to ``lease``.

        Raises:
            RuntimeError: the lease was released (or lost) while it waited.
        """
        waiter = Waiter((rank, next(self._seq)), lease, option, leave)
        bisect.insort(self._waiters, waiter)
        self.wake()
        try:
            await waiter.event.wait()
        except trio.Cancelled:
            if waiter.state == _WAITING:
                waiter.state = _GONE
                self._remove(waiter)
            raise
        if waiter.state != _GRANTED:
            raise RuntimeError(f"{lease!r} ended while it waited for a limit")

    def _remove(self, waiter: Waiter) -> None:
        i = bisect.bisect_left(self._waiters, waiter)
        if i < len(self._waiters) and self._waiters[i] is waiter:
            del self._waiters[i]

    def drop_lease(self, lease: Lease) -> None:
        """Wake the waiters of a released lease with an error (their prompt is over)."""
        for waiter in [w for w in self._waiters if w.lease is lease]:
            waiter.state = _GONE
            self._remove(waiter)
            waiter.event.set()

    async def run_pass(self, attempt: Attempt, *, chunk_size: int = 1) -> int:
        """Try the waiters in order; returns how many were granted.

        Waiters are tried in chunks tried concurrently: one waiter first, then twice as many after a
        chunk that was granted whole, up to ``chunk_size`` (a shared coordinator, given
        :data:`PASS_CHUNK`, sends one chunk in one script call in the waiters' order, so a freed seat
        goes to the first of them, and one freed seat costs each replica one attempt; in-process
        attempts go one by one); a
        waiter needing a limit refused earlier in the pass is skipped, a class-share refusal being
        remembered per class. :class:`CoordinatorUnavailable` ends the pass (waiters keep waiting).
        """
        granted = 0
        refused: set[str] = set()
        unavailable = False
        chunk: list[Waiter] = []
        size = 1

        async def one(waiter: Waiter) -> None:
            nonlocal granted, unavailable
            try:
                await attempt(waiter.lease, waiter.option, waiter.leave, waiter.key)
            except LimitRefused as exc:
                refused.add(exc.name)
                return
            except CoordinatorUnavailable:
                unavailable = True
                return
            if waiter.state == _WAITING:
                waiter.state = _GRANTED
                self._remove(waiter)
                waiter.event.set()
                granted += 1
            # else: the waiter was cancelled during the attempt; its caller releases the lease.

        async def run(chunk: list[Waiter]) -> None:
            if len(chunk) == 1:
                await one(chunk[0])
                return
            async with trio.open_nursery() as nursery:
                for waiter in chunk:
                    nursery.start_soon(one, waiter)

        for waiter in list(self._waiters):
            if waiter.state != _WAITING:
                continue
            if not waiter.lease.active:
                waiter.state = _GONE
                self._remove(waiter)
                waiter.event.set()
                continue
            if refused.intersection(waiter.option.names()):
                continue
            chunk.append(waiter)
            if len(chunk) >= size:
                before = granted
                await run(chunk)
                size = min(chunk_size, size * 2) if granted - before == len(chunk) else 1
                chunk = []
                if unavailable:
                    return granted
        if chunk:
            await run(chunk)
        return granted
