"""The admission policy engine: global seats, tenant caps, priority shares, fair queuing, aging, deadlines.

One :class:`PolicyEngine` per server decides, for each prompt at the head of its session, whether it
runs now, waits in the global waiting room, or is refused. It knows nothing of JSON-RPC or sessions
beyond the ids it is handed. Every bound is a field of :class:`PolicyLimits`, and every one defaults to
off: with nothing limited :attr:`PolicyEngine.enabled` is False and the bridge can skip the engine
entirely (:meth:`~PolicyEngine.decide` then returns one shared no-op seat without any bookkeeping).

**Seats.** ``max_running_prompts`` prompts run at once across the server. A seat is held for one prompt
and released after it, so busy sessions take turns. Seats are shared between the priority classes
``critical > interactive > background > bulk`` by ``class_shares`` (largest-remainder rounding, so the
shares sum to the seats: 12/5/2/1 interactive/background/critical/bulk at 20 seats). A freed seat goes
to the highest-ranked class that is below its share and has waiters; when none is, the idle seat is
lent to the highest-ranked class with waiters, which makes bulk borrow only when no other class waits.
Within a class the :class:`~acp_server.admission.policy_queue.WaitingRoom` rotates over tenants (FIFO
within a tenant) and ages background and bulk waiters up one rank every ``aging_s``.

**Tenants.** ``tenant_max_running`` (and ``tenant_overrides``) cap the seats one tenant holds.

**Decision at arrival** (:meth:`PolicyEngine.decide`, synchronous, for a prompt arriving at a session
with nothing pending): the tenant at its cap -> :class:`~acp_server.errors.AdmissionDeferredError`;
less than ``min_deadline_left_ms`` of its deadline left -> refused ``deadline_unreachable``; a free seat
-> a :class:`Seat`; otherwise a :class:`Queued` ticket when the waiting room has room
(``max_queued_prompts``) and the estimated wait fits the deadline and, for interactive prompts,
``interactive_max_wait_ms``; else :class:`~acp_server.errors.CapacityUnavailableError` with reason
``queue_full``, ``deadline_unreachable`` or ``wait_too_long``. The estimated wait is the waiters ahead
in the prompt's class divided by that class's observed drain rate (seats serving the class / the
observed mean seat hold time); before any seat was released there is no estimate and the prompt may
queue. ``retryAfterMs`` is derived from the same drain rates, clamped to [1 s, 32 s].

**Accepted prompts are never refused later.** A prompt admitted behind others in its session's FIFO
calls :meth:`PolicyEngine.enqueue` (synchronous) and, given a :class:`Queued` ticket, its ``wait``
when it reaches the head: it waits for the seat the fair queue gives it, whatever the room's size. A
waiter whose deadline leaves less than ``min_deadline_left_ms`` is removed and its ``wait`` raises
:class:`WaitDeadlineExpired`; the caller reports ``prompt_deadline_exceeded``.

**Observe mode** (``mode="observe"``) admits everything at once but counts and logs what enforce mode
would have done. Every decision other than "run" is logged on ``logging.getLogger("acp_server.admission")``;
refusals carry the ``requestId`` that their error payload has.

Typical use by the bridge::

    engine = PolicyEngine(limits)
    if engine.enabled:                                   # else: no policy, no cost
        got = engine.decide(tenant=t, priority=p, deadline=d, session_id=s)  # may raise (refusals)
        seat = got if isinstance(got, Seat) else await got.wait()           # WaitDeadlineExpired
        with seat:                                       # released whatever the exit
            await run_prompt()

:class:`Queued.wait` is grant-or-cancel safe like trio's ``CapacityLimiter``: a waiter cancelled before
its grant leaves the queue; one whose grant won the race returns the seat, and sees the cancel at its
next checkpoint. A ticket abandoned without ``wait`` must be given up with :meth:`Queued.cancel`.
"""

from __future__ import annotations

import bisect
import logging
import math
import secrets
from collections.abc import Callable
from typing import Final

import outcome
import trio
from trio.lowlevel import enable_ki_protection

from ..errors import RETRY_AFTER_MS, AdmissionDeferredError, CapacityUnavailableError
from .policy_limits import (
    DECISION_KEYS,
    DEFAULT_CLASS_SHARES,
    QUEUE_WAIT_BOUNDS,
    RETRY_AFTER_MAX_MS,
    RETRY_AFTER_MIN_MS,
    ClassStatistics,
    PolicyLimits,
    PolicyStatistics,
    Reason,
    TenantStatistics,
    WaitHistogram,
    seat_shares,
)
from .policy_queue import INTERACTIVE, PRIORITIES, Discipline, Priority, QueueEntry, WaitingRoom, rank_of
from .seats import _CANCELLED, _EXPIRED, _FREE_SEAT, _GRANTED, _QUEUED, Queued, Seat, WaitDeadlineExpired

__all__ = [
    "DECISION_KEYS",
    "DEFAULT_CLASS_SHARES",
    "PRIORITIES",
    "ClassStatistics",
    "PolicyEngine",
    "PolicyLimits",
    "PolicyStatistics",
    "Priority",
    "Queued",
    "Seat",
    "QUEUE_WAIT_BOUNDS",
    "TenantStatistics",
    "WaitDeadlineExpired",
    "WaitHistogram",
    "seat_shares",
]

logger = logging.getLogger("acp_server.admission")

#: Weight of the newest seat hold time in the running mean.
_HOLD_ALPHA: Final = 0.2


class PolicyEngine:
    """The admission policy of one server instance (see the module docstring).

    Args:
        limits: the bounds; the default limits nothing.
        clock: the time source of decisions, aging and hold times; deadlines are on the same clock,
            which must be trio's for :meth:`Queued.wait` to time out at the right moment.
        discipline: ``"fair"`` (rotate over tenants within a class) or ``"fifo"`` (tests only).
    """

    def __init__(
        self,
        limits: PolicyLimits | None = None,
        *,
        clock: Callable[[], float] = trio.current_time,
        discipline: Discipline = "fair",
    ) -> None:
        self._limits = limits = limits if limits is not None else PolicyLimits()
        self._clock = clock
        self._enabled = limits.enabled
        self._observe = limits.mode == "observe"
        self._seats = limits.max_running_prompts or None
        self._shares = seat_shares(self._seats, limits.class_shares) if self._seats else (0,) * len(PRIORITIES)
        self._max_queued = limits.max_queued_prompts
        self._max_wait_s = limits.interactive_max_wait_ms / 1000
        self._min_left_s = limits.min_deadline_left_ms / 1000
        self._default_cap = limits.tenant_max_running
        self._overrides = dict(limits.tenant_overrides)
        self._capped = bool(self._default_cap or any(self._overrides.values()))
        self._room = WaitingRoom(discipline, limits.aging_s)
        self._running = 0
        self._class_running = [0] * len(PRIORITIES)
        self._tenant_running: dict[str, int] = {}  # only tenants holding a seat: bounded by the seats
        self._hold: list[float | None] = [None] * len(PRIORITIES)  # running mean seat hold, per class
        self._hold_all: float | None = None
        self._decisions = dict.fromkeys(DECISION_KEYS, 0)
        self._admitted_total = 0
        self._granted_total = 0
        self._released_total = 0
        self._expired_total = 0
        self._cancelled_total = 0
        self._retry_served = 0
        self._retry_ms_total = 0
        self._wait_counts = [[0] * len(QUEUE_WAIT_BOUNDS) for _ in PRIORITIES]
        #: per class, the sum of the grant times of the seats held now (their mean age, cheaply)
        self._granted_sum = [0.0] * len(PRIORITIES)
        #: per class, the hold time of the seat released last (a slowdown shows there at once)
        self._last_hold = [0.0] * len(PRIORITIES)
        self._wait_sum = [0.0] * len(PRIORITIES)

    def __repr__(self) -> str:
        seats = self._seats or "unlimited"
        return f"<PolicyEngine {self._limits.mode}: {self._running}/{seats} running, {len(self._room)} waiting>"

    @property
    def enabled(self) -> bool:
        """False when nothing is limited: :meth:`decide` returns a shared no-op seat at once."""
        return self._enabled

    @property
    def limits(self) -> PolicyLimits:
        return self._limits

    @property
    def shares(self) -> dict[str, int]:
        """Each class's share of the global seats (all 0 without global seats)."""
        return dict(zip(PRIORITIES, self._shares, strict=True))

    # --- entry points ---------------------------------------------------------------------------------

    @enable_ki_protection
    def decide(
        self,
        *,
        tenant: str = "default",
        priority: str = "interactive",
        deadline: float | None = None,
        session_id: str = "",
    ) -> Seat | Queued:
        """Decide a prompt at arrival, without blocking.

        Args:
            tenant: whose prompt this is.
            priority: its class, one of :data:`PRIORITIES`.
            deadline: when it must be done, on the engine clock (``None`` or ``inf``: no deadline).
            session_id: named in tickets, seats and log lines.

        Returns:
            A held :class:`Seat` (run now), or a :class:`Queued` ticket to ``wait`` on.

        Raises:
            AdmissionDeferredError: the tenant holds its cap of seats (enforce mode).
            CapacityUnavailableError: refused with reason ``queue_full``, ``deadline_unreachable`` or
                ``wait_too_long`` (enforce mode). A refusal changes no gauge, only its counters.
            ValueError: ``priority`` is not a class name.
        """
        if not self._enabled:
            return _FREE_SEAT
        rank = rank_of(priority)
        now = self._clock()
        expires_at = math.inf if deadline is None else deadline - self._min_left_s
        # The checks in the order: tenant cap, deadline, free seat, room, estimated wait.
        reason: Reason | None = None
        retry_s: float | None = None
        ahead = 0
        cap = self._cap(tenant)
        if cap and self._tenant_running.get(tenant, 0) >= cap:
            reason = "tenant_limit"
            if self._hold_all is not None:
                retry_s = self._hold_all / self._tenant_running[tenant]
        elif expires_at - now <= (hold := self._expected_hold(rank, now)):
            reason, retry_s = "deadline_unreachable", 0.0  # it could not finish even if it ran now
        elif self._seats is not None and self._running >= self._seats:
            ahead = self._room.count(rank)
            wait_s = self._estimated_wait(rank, ahead)
            if len(self._room) >= self._max_queued:
                reason = "queue_full"
                if self._hold_all is not None:
                    retry_s = (len(self._room) - self._max_queued + 1) * self._hold_all / self._running
            elif wait_s is not None and wait_s + hold > expires_at - now:
                reason, retry_s = "deadline_unreachable", wait_s + hold - (expires_at - now)
            elif wait_s is not None and rank == INTERACTIVE and self._max_wait_s and wait_s > self._max_wait_s:
                reason, retry_s = "wait_too_long", wait_s - self._max_wait_s
        if reason is not None:
            key = self._refuse(reason, retry_s, tenant, rank, session_id)  # raises unless observing
        elif self._seats is None or self._running < self._seats:
            # A free seat means nobody eligible waits: every release hands seats on at once.
            key = "run"
            self._decisions[key] += 1
        else:
            key = "queued"
            self._decisions[key] += 1
            if self._observe:
                self._log_observed("queued", None, tenant, rank, session_id)
        if key != "queued" or self._observe:
            self._admitted_total += 1
            seat = self._new_seat(tenant, rank, session_id, now)
            seat.decision = key
            return seat
        self._admitted_total += 1
        ticket = Queued(self, tenant, rank, session_id, expires_at, ahead + 1)
        self._room.push(ticket, now)
        return ticket

    @enable_ki_protection
    def enqueue(
        self,
        *,
        tenant: str = "default",
        priority: str = "interactive",
        deadline: float | None = None,
        session_id: str = "",
    ) -> Seat | Queued:
        """Give a seat, or a place in the room, to a prompt accepted earlier: never refused.

        For a prompt that reached the head of its session's FIFO after being admitted behind others.
        It runs now when its tenant is below its cap and a seat is free; otherwise it waits whatever
        the room's size. A deadline already too close gives a ticket whose ``wait`` raises
        :class:`WaitDeadlineExpired`.
        """
        if not self._enabled:
            return _FREE_SEAT
        rank = rank_of(priority)
        now = self._clock()
        self._admitted_total += 1
        expires_at = math.inf if deadline is None else deadline - self._min_left_s
        doomed = expires_at - now <= self._expected_hold(rank, now)
        if self._observe or (
            not doomed and (self._seats is None or self._running < self._seats) and not self._at_cap(tenant)
        ):
            return self._new_seat(tenant, rank, session_id, now)
        ticket = Queued(self, tenant, rank, session_id, expires_at, self._room.count(rank) + 1)
        if doomed:  # nothing starts without enough deadline left
            ticket._state = _EXPIRED
            self._expired_total += 1
        else:
            self._room.push(ticket, now)
        return ticket

    def statistics(self) -> PolicyStatistics:
        """A frozen snapshot of the gauges and counters."""
        now = self._clock() if self._room else 0.0
        classes: dict[str, ClassStatistics] = {}
        for rank, name in enumerate(PRIORITIES):
            oldest = self._room.oldest(rank)
            classes[name] = ClassStatistics(
                share=self._shares[rank],
                running=self._class_running[rank],
                waiting=self._room.count(rank),
                oldest_wait_ms=0 if oldest is None else round((now - oldest) * 1000),
            )
        return PolicyStatistics(
            enabled=self._enabled,
            mode=self._limits.mode,
            max_running_prompts=self._seats or 0,
            running=self._running,
            waiting=len(self._room),
            tenants_running=len(self._tenant_running),
            classes=classes,
            decisions=dict(self._decisions),
            admitted_total=self._admitted_total,
            granted_total=self._granted_total,
            released_total=self._released_total,
            expired_total=self._expired_total,
            cancelled_total=self._cancelled_total,
            retry_after_served=self._retry_served,
            retry_after_ms_total=self._retry_ms_total,
            queue_wait={name: self._wait_histogram(rank) for rank, name in enumerate(PRIORITIES)},
            tenants=self._tenant_statistics(),
        )

    def _wait_histogram(self, rank: int) -> WaitHistogram:
        buckets: list[tuple[float, int]] = []
        total = 0
        for bound, count in zip(QUEUE_WAIT_BOUNDS, self._wait_counts[rank], strict=True):
            total += count
            buckets.append((bound, total))
        return WaitHistogram(buckets=buckets, sum=self._wait_sum[rank], count=total)

    def _tenant_statistics(self) -> dict[str, TenantStatistics]:
        waiting = self._room.tenant_counts() if self._room else {}
        tenants = set(self._tenant_running) | set(waiting)
        return {
            t: TenantStatistics(running=self._tenant_running.get(t, 0), waiting=waiting.get(t, 0))
            for t in sorted(tenants)
        }

    @enable_ki_protection
    def revoke(self, got: Seat | Queued) -> None:
        """Undo an arrival decision whose prompt was refused after it (the backend pool's lease): all or
        nothing. Counters and gauges go back as if :meth:`decide` had not been called; a revoked seat
        does not count as a hold time."""
        if not self._enabled:
            return
        if isinstance(got, Queued):
            if got._state != _QUEUED:
                raise RuntimeError(f"only a ticket still waiting can be revoked; {got!r} is not")
            self._room.remove(got)
            got._state = _CANCELLED
            self._decisions["queued"] -= 1
        else:
            if got.released:
                raise RuntimeError(f"{got!r} was released already")
            got._released = True
            self._vacate(got)
            self._granted_total -= 1
            if got.decision:
                self._decisions[got.decision] -= 1
            if self._room:
                self._dispatch(self._clock())
        self._admitted_total -= 1

    # --- seats ----------------------------------------------------------------------------------------

    def _cap(self, tenant: str) -> int:
        return self._overrides.get(tenant, self._default_cap) if self._capped else 0

    def _at_cap(self, tenant: str) -> bool:
        cap = self._cap(tenant)
        return bool(cap) and self._tenant_running.get(tenant, 0) >= cap

    def _eligible(self, tenant: str) -> bool:
        return not self._at_cap(tenant)

    def _new_seat(self, tenant: str, rank: int, session_id: str, now: float) -> Seat:
        self._running += 1
        self._class_running[rank] += 1
        self._tenant_running[tenant] = self._tenant_running.get(tenant, 0) + 1
        self._granted_total += 1
        self._granted_sum[rank] += now
        return Seat(self, tenant, rank, session_id, now)

    def _vacate(self, seat: Seat) -> None:
        """Take a seat out of the gauges (the reverse of :meth:`_new_seat`'s)."""
        self._running -= 1
        self._class_running[seat.rank] -= 1
        self._granted_sum[seat.rank] -= seat.granted_at
        left = self._tenant_running[seat.tenant] - 1
        if left:
            self._tenant_running[seat.tenant] = left
        else:
            del self._tenant_running[seat.tenant]

    def _release(self, seat: Seat) -> None:
        now = self._clock()
        held = max(now - seat.granted_at, 0.0)
        mean = self._hold[seat.rank]
        self._hold[seat.rank] = held if mean is None else mean + _HOLD_ALPHA * (held - mean)
        self._last_hold[seat.rank] = held
        self._hold_all = held if self._hold_all is None else self._hold_all + _HOLD_ALPHA * (held - self._hold_all)
        self._vacate(seat)
        self._released_total += 1
        if self._room:
            self._dispatch(now)

    def _dispatch(self, now: float) -> None:
        """Hand free seats to waiters until no seat is free or no eligible waiter is left."""
        room = self._room
        room.age(now)
        while room and (self._seats is None or self._running < self._seats):
            ticket = self._pick()
            if ticket is None:
                return
            room.take(ticket)
            assert isinstance(ticket, Queued)
            if ticket._expires_at - now <= self._expected_hold(ticket.rank, now):
                # Nothing starts without enough deadline left: a seat given to a prompt its deadline
                # will cut is a seat wasted (the slow-dependency drill measured ~50% goodput so).
                ticket._state = _EXPIRED
                self._expired_total += 1
                ticket._wake(outcome.Error(WaitDeadlineExpired(f'the deadline of session "{ticket.session_id}" ran out')))
                continue
            ticket._seat = self._new_seat(ticket.tenant, ticket.rank, ticket.session_id, now)
            ticket._state = _GRANTED
            waited = max(now - ticket.enqueued_at, 0.0)
            self._wait_sum[ticket.rank] += waited
            self._wait_counts[ticket.rank][bisect.bisect_left(QUEUE_WAIT_BOUNDS, waited)] += 1
            ticket._wake(outcome.Value(None))

    def _pick(self) -> QueueEntry | None:
        """The next waiter: the highest class below its share, else the highest class with waiters."""
        eligible = self._eligible if self._capped else None
        fallback: QueueEntry | None = None
        for rank in range(len(PRIORITIES)):
            if not self._room.count(rank):
                continue
            ticket = self._room.peek(rank, eligible)
            if ticket is None:
                continue
            if self._class_running[rank] < self._shares[rank]:
                return ticket
            if fallback is None:
                fallback = ticket  # borrowing an idle seat; bulk only gets here when nobody else waits
        return fallback

    def _expected_hold(self, rank: int, now: float) -> float:
        """The deadline a prompt of class ``rank`` needs left to start: at least ``min_deadline_left_ms``,
        and at least how long seats are held: the longest of the running mean of releases, the last
        release (a slowdown shows there at once) and the mean age of the seats held now (it shows
        there before any slow seat is released)."""
        hold = self._hold[rank] if self._hold[rank] is not None else self._hold_all
        running = self._class_running[rank]
        age = now - self._granted_sum[rank] / running if running else 0.0
        return max(self._min_left_s, hold or 0.0, self._last_hold[rank], age) - self._min_left_s

    def _estimated_wait(self, rank: int, ahead: int) -> float | None:
        """Seconds until ``ahead`` waiters of class ``rank`` have left, or ``None`` before any drain."""
        hold = self._hold[rank] if self._hold[rank] is not None else self._hold_all
        if hold is None:
            return None
        seats = max(self._class_running[rank], self._shares[rank], 1)
        return ahead * hold / seats

    # --- refusals -------------------------------------------------------------------------------------

    def _refuse(self, reason: Reason, retry_s: float | None, tenant: str, rank: int, session_id: str) -> str:
        """Count the refusal and raise it; in observe mode only count and log it, and return its key."""
        outcome_name = "deferred" if reason == "tenant_limit" else "rejected"
        key = f"{outcome_name}.{reason}"
        self._decisions[key] += 1
        if self._observe:
            self._log_observed(outcome_name, reason, tenant, rank, session_id)
            return key
        retry_ms = RETRY_AFTER_MS if retry_s is None else math.ceil(retry_s * 1000)
        retry_ms = min(max(retry_ms, RETRY_AFTER_MIN_MS), RETRY_AFTER_MAX_MS)
        self._retry_served += 1
        self._retry_ms_total += retry_ms
        if reason == "tenant_limit":
            logger.info(
                "admission deferred: tenant_limit tenant=%s priority=%s session=%s retryAfterMs=%d",
                tenant, PRIORITIES[rank], session_id, retry_ms,
            )
            raise AdmissionDeferredError(
                reason=reason, tenant_id=tenant, retry_after_ms=retry_ms, safe_to_retry=True
            )
        request_id = f"adm_{secrets.token_hex(8)}"
        logger.info(
            "admission rejected: %s requestId=%s tenant=%s priority=%s session=%s running=%d waiting=%d"
            " retryAfterMs=%d",
            reason, request_id, tenant, PRIORITIES[rank], session_id, self._running, len(self._room), retry_ms,
        )
        raise CapacityUnavailableError(
            reason=reason, retry_after_ms=retry_ms, request_id=request_id, safe_to_retry=True
        )

    def _log_observed(self, outcome_name: str, reason: str | None, tenant: str, rank: int, session_id: str) -> None:
        logger.info(
            "admission observe: would be %s%s tenant=%s priority=%s session=%s running=%d",
            outcome_name, f" ({reason})" if reason else "", tenant, PRIORITIES[rank], session_id, self._running,
        )
