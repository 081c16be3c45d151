"""What the admission policy hands out: a :class:`Seat` for a running prompt, or a :class:`Queued`
ticket for one waiting in the global waiting room (see :mod:`.policy` for the rules).
"""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING, Final

import outcome
import trio
from trio.lowlevel import enable_ki_protection

from ..parking import ParkingSpot
from .policy_queue import INTERACTIVE, PRIORITIES, Priority, QueueEntry

if TYPE_CHECKING:
    from .policy import PolicyEngine

__all__ = ["Queued", "Seat", "WaitDeadlineExpired"]


class WaitDeadlineExpired(Exception):
    """A waiter's deadline left less than ``min_deadline_left_ms``: it left the queue and holds nothing.

    The caller reports ``prompt_deadline_exceeded``.
    """


class Seat:
    """One running prompt's seat. Release it exactly when the prompt ends; ``release`` is idempotent.

    Attributes:
        tenant, session_id: whose prompt it is.
        priority: the class it was granted in (its own, or the one aging raised it to).
        granted_at: the engine clock when it was granted.
    """

    __slots__ = ("_engine", "_released", "decision", "granted_at", "priority", "rank", "session_id", "tenant")

    def __init__(self, engine: PolicyEngine | None, tenant: str, rank: int, session_id: str, now: float) -> None:
        self._engine = engine
        self._released = False
        self.tenant = tenant
        self.rank = rank
        self.priority: Priority = PRIORITIES[rank]
        self.session_id = session_id
        self.granted_at = now
        #: the arrival decision it came from (a key of ``decisions``; "" when not from :meth:`decide`)
        self.decision = ""

    def __repr__(self) -> str:
        state = "released" if self._released else "held"
        return f"<Seat {self.priority} tenant {self.tenant!r} session {self.session_id!r} {state}>"

    @property
    def released(self) -> bool:
        return self._released

    @enable_ki_protection
    def release(self) -> None:
        """Give the seat back, handing it to the next waiter if any. Later calls do nothing."""
        if self._released or self._engine is None:
            return
        self._released = True
        self._engine._release(self)

    def __enter__(self) -> Seat:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


#: The seat handed out when nothing is limited: no bookkeeping, ``release`` does nothing.
_FREE_SEAT: Final = Seat(None, "default", INTERACTIVE, "", 0.0)

# A ticket's life: in the room, then exactly one of granted (-> claimed by wait) / expired / cancelled.
_QUEUED: Final = 0
_GRANTED: Final = 1
_CLAIMED: Final = 2
_EXPIRED: Final = 3
_CANCELLED: Final = 4


class Queued(QueueEntry):
    """A prompt waiting in the room for a seat; made by :meth:`PolicyEngine.decide` or ``enqueue``.

    Attributes:
        position_hint: its 1-based place in its class when it entered (fair queuing may serve it sooner).
        session_id: whose prompt it is.
    """

    __slots__ = ("_engine", "_expires_at", "_seat", "_spot", "_state", "position_hint", "session_id")

    def __init__(
        self, engine: PolicyEngine, tenant: str, rank: int, session_id: str, expires_at: float, position: int
    ) -> None:
        super().__init__(tenant, rank)
        self._engine = engine
        self.session_id = session_id
        self._expires_at = expires_at
        self.position_hint = position
        self._state = _QUEUED
        self._seat: Seat | None = None
        self._spot = ParkingSpot()

    def __repr__(self) -> str:
        state = ("queued", "granted", "claimed", "expired", "cancelled")[self._state]
        return f"<Queued {PRIORITIES[self.rank]} tenant {self.tenant!r} session {self.session_id!r} {state}>"

    @property
    def waiting(self) -> bool:
        """True while it sits in the room."""
        return self._state == _QUEUED

    @enable_ki_protection
    async def wait(self) -> Seat:
        """Wait for the seat the fair queue gives this prompt, and return it (held: release it).

        Raises:
            WaitDeadlineExpired: the deadline ran out first; the ticket left the queue.
            trio.Cancelled: cancelled first; the ticket left the queue (a grant that came first is
                returned instead, and the cancel arrives at the next checkpoint).
            RuntimeError: waited twice, or the ticket was given up with :meth:`cancel`.
        """
        try:
            await trio.lowlevel.checkpoint_if_cancelled()
        except trio.Cancelled:
            self.cancel()
            raise
        if self._state == _QUEUED:
            if self._spot.parked:
                raise RuntimeError(f'the ticket of session "{self.session_id}" is already being waited for')
            try:
                with trio.CancelScope(deadline=self._expires_at) as scope:
                    await self._spot.park(self._left_by_cancel)
            except trio.Cancelled:
                self._engine._cancelled_total += 1  # the abort took it out of the room
                raise
            if scope.cancelled_caught:
                self._state = _EXPIRED
                self._engine._expired_total += 1
        else:
            await trio.lowlevel.cancel_shielded_checkpoint()
        if self._state == _GRANTED:
            assert self._seat is not None
            self._state = _CLAIMED
            return self._seat
        if self._state == _EXPIRED:
            raise WaitDeadlineExpired(f'the deadline of session "{self.session_id}" ran out while it waited for a seat')
        raise RuntimeError(f'the ticket of session "{self.session_id}" was cancelled or already claimed')

    def _left_by_cancel(self) -> None:
        # Runs only while still parked: a grant or expiry reschedules the task first.
        self._engine._room.remove(self)
        self._state = _CANCELLED

    @enable_ki_protection
    def cancel(self) -> None:
        """Give the ticket up: leave the room, or release a seat granted but not yet claimed by ``wait``.

        A task parked in :meth:`wait` is woken with RuntimeError. A no-op once claimed, expired or cancelled.
        """
        if self._state == _QUEUED:
            self._engine._room.remove(self)
            self._state = _CANCELLED
            self._engine._cancelled_total += 1
            self._wake(outcome.Error(RuntimeError(f'the ticket of session "{self.session_id}" was cancelled')))
        elif self._state == _GRANTED:
            assert self._seat is not None
            self._state = _CANCELLED
            self._seat.release()

    def _wake(self, value: outcome.Outcome[None]) -> None:
        self._spot.wake(value)
