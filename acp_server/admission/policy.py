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
calls :meth:`PolicyEngine.wait_for_seat` (or the synchronous :meth:`PolicyEngine.enqueue` + ``wait``)
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
from fractions import Fraction
from types import TracebackType
from typing import Final, Literal

import msgspec
import outcome
import trio
from trio.lowlevel import Abort, RaiseCancelT, Task, enable_ki_protection

from ..errors import RETRY_AFTER_MS, AdmissionDeferredError, CapacityUnavailableError
from .limits import check_non_negative_int
from .policy_queue import INTERACTIVE, PRIORITIES, Discipline, Priority, QueueEntry, WaitingRoom, rank_of

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

#: Default shares of the global seats, in percent.
DEFAULT_CLASS_SHARES: Final[dict[str, float]] = {"critical": 10, "interactive": 60, "background": 25, "bulk": 5}
#: The bounds of every ``retryAfterMs`` the engine serves.
RETRY_AFTER_MIN_MS: Final = 1000
RETRY_AFTER_MAX_MS: Final = 32000
#: Weight of the newest seat hold time in the running mean.
_HOLD_ALPHA: Final = 0.2
#: Upper bounds (seconds) of the queue-wait histogram's buckets; the last one catches everything.
QUEUE_WAIT_BOUNDS: Final[tuple[float, ...]] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, math.inf,
)

Mode = Literal["enforce", "observe"]
Reason = Literal["tenant_limit", "queue_full", "deadline_unreachable", "wait_too_long"]

#: The keys of :attr:`PolicyStatistics.decisions`: ``outcome`` or ``outcome.reason``.
DECISION_KEYS: Final = (
    "run",
    "queued",
    "deferred.tenant_limit",
    "rejected.queue_full",
    "rejected.deadline_unreachable",
    "rejected.wait_too_long",
)


def _check_seconds(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative number of seconds (0 turns it off); got {value!r}")


class PolicyLimits(msgspec.Struct, frozen=True, kw_only=True):
    """The bounds of the admission policy. Every limit defaults to off.

    Attributes:
        max_running_prompts: prompts running at once across the server (0: no global seats).
        max_queued_prompts: prompts waiting for a seat, decided at arrival (0: no waiting room);
            only used with ``max_running_prompts``.
        tenant_max_running: seats one tenant holds at once (0: no cap).
        tenant_overrides: tenant id -> its own cap instead of ``tenant_max_running`` (0: no cap).
        class_shares: priority class -> its share of the seats (any positive scale, e.g. percent);
            a class left out has no share and only borrows idle seats.
        interactive_max_wait_ms: the longest estimated wait an interactive prompt is queued for (0: any).
        aging_s: seconds of waiting that move a background or bulk waiter up one rank (0: no aging).
        min_deadline_left_ms: a prompt with a deadline starts only with this much of it left, and a
            waiter leaves the queue when less remains.
        mode: ``"enforce"``, or ``"observe"`` to admit everything and only count what would happen.
    """

    max_running_prompts: int = 0
    max_queued_prompts: int = 200
    tenant_max_running: int = 0
    tenant_overrides: dict[str, int] = msgspec.field(default_factory=dict)
    class_shares: dict[str, float] = msgspec.field(default_factory=lambda: dict(DEFAULT_CLASS_SHARES))
    interactive_max_wait_ms: int = 2000
    aging_s: float = 30.0
    min_deadline_left_ms: int = 100
    mode: Mode = "enforce"

    def __post_init__(self) -> None:
        check_non_negative_int("max_running_prompts", self.max_running_prompts)
        check_non_negative_int("max_queued_prompts", self.max_queued_prompts, zero="0 means no waiting room")
        check_non_negative_int("tenant_max_running", self.tenant_max_running)
        for tenant, cap in self.tenant_overrides.items():
            if not isinstance(tenant, str):
                raise TypeError(f"tenant_overrides keys must be tenant id strings; got {tenant!r}")
            check_non_negative_int(f'tenant_overrides["{tenant}"]', cap)
        check_non_negative_int("interactive_max_wait_ms", self.interactive_max_wait_ms)
        check_non_negative_int("min_deadline_left_ms", self.min_deadline_left_ms, zero="0 means any time left")
        _check_seconds("aging_s", self.aging_s)
        for name, share in self.class_shares.items():
            if name not in PRIORITIES:
                raise ValueError(f"class_shares keys must be among {', '.join(PRIORITIES)}; got {name!r}")
            if isinstance(share, bool) or not isinstance(share, (int, float)) or not share >= 0 or math.isinf(share):
                raise ValueError(f'class_shares["{name}"] must be a non-negative number; got {share!r}')
        if not sum(self.class_shares.values()) > 0:
            raise ValueError("class_shares must give at least one class a positive share")
        if self.mode not in ("enforce", "observe"):
            raise ValueError(f'mode must be "enforce" or "observe"; got {self.mode!r}')

    @property
    def enabled(self) -> bool:
        """True when anything is limited; False makes the engine a no-op fast path."""
        return bool(self.max_running_prompts or self.tenant_max_running or any(self.tenant_overrides.values()))

    def tenant_cap(self, tenant: str) -> int:
        """The seats ``tenant`` may hold at once (0: no cap)."""
        return self.tenant_overrides.get(tenant, self.tenant_max_running)


def seat_shares(seats: int, shares: dict[str, float]) -> tuple[int, ...]:
    """Split ``seats`` by ``shares`` with largest-remainder rounding, in rank order (critical first).

    The parts sum to ``seats``; remainders that tie go to the higher-ranked class.
    """
    weights = [Fraction(shares.get(name, 0)) for name in PRIORITIES]
    total = sum(weights)
    exact = [seats * w / total for w in weights]
    parts = [math.floor(q) for q in exact]
    by_remainder = sorted(range(len(PRIORITIES)), key=lambda r: (-(exact[r] - parts[r]), r))
    for rank in by_remainder[: seats - sum(parts)]:
        parts[rank] += 1
    return tuple(parts)


class ClassStatistics(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """One priority class in :class:`PolicyStatistics`.

    Attributes:
        share: its seats when all classes are busy (0 without global seats).
        running: seats it holds now (aged waiters count in the class they were granted in).
        waiting: prompts waiting in it now (aged waiters count in the class they climbed to).
        oldest_wait_ms: how long its oldest waiter has waited (0: nobody waits).
    """

    share: int
    running: int
    waiting: int
    oldest_wait_ms: int


class WaitHistogram(msgspec.Struct, frozen=True, kw_only=True):
    """Seconds waited for a seat by the waiters granted in one class (Prometheus-style, cumulative).

    Attributes:
        buckets: ``[upper bound in seconds, waiters granted within it]``, the last bound ``inf``.
        sum: seconds waited in all; count: waiters granted.
    """

    buckets: list[tuple[float, int]]
    sum: float
    count: int


class TenantStatistics(msgspec.Struct, frozen=True, kw_only=True):
    running: int
    waiting: int


class PolicyStatistics(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """A snapshot of the engine, like ``trio.CapacityLimiter.statistics()``.

    Attributes:
        enabled: anything is limited (False: every other figure stays 0).
        mode: ``"enforce"`` or ``"observe"``.
        max_running_prompts: the global seats (0: none).
        running: seats held now; waiting: prompts in the waiting room now.
        tenants_running: tenants holding at least one seat.
        classes: per priority class, by name.
        decisions: arrival decisions by :data:`DECISION_KEYS` (in observe mode: what would have happened).
        admitted_total: prompts given a seat or a ticket (decided "run" or "queued", and every enqueue).
        granted_total, released_total: seats handed out and given back.
        expired_total: waiters removed because their deadline ran out; cancelled_total: waiters that left.
        retry_after_served: refusals sent with a ``retryAfterMs``; retry_after_ms_total: the sum of those.
        queue_wait: per class, how long its granted waiters waited.
        tenants: per tenant holding a seat or waiting: its seats and waiters (for metrics with tenant labels).
    """

    enabled: bool
    mode: str
    max_running_prompts: int
    running: int
    waiting: int
    tenants_running: int
    classes: dict[str, ClassStatistics]
    decisions: dict[str, int]
    admitted_total: int
    granted_total: int
    released_total: int
    expired_total: int
    cancelled_total: int
    retry_after_served: int
    retry_after_ms_total: int
    queue_wait: dict[str, WaitHistogram]
    tenants: dict[str, TenantStatistics]


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

    __slots__ = ("_engine", "_expires_at", "_seat", "_state", "_task", "position_hint", "session_id")

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
        self._task: Task | None = None

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
            if self._task is not None:
                raise RuntimeError(f'the ticket of session "{self.session_id}" is already being waited for')
            try:
                with trio.CancelScope(deadline=self._expires_at) as scope:
                    await self._park()
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

    async def _park(self) -> None:
        self._task = trio.lowlevel.current_task()

        def abort(_: RaiseCancelT) -> Abort:
            # Runs only while still parked: a grant or expiry reschedules the task first.
            self._engine._room.remove(self)
            self._state = _CANCELLED
            self._task = None
            return Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)

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
        task, self._task = self._task, None
        if task is not None:
            trio.lowlevel.reschedule(task, value)


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

    async def wait_for_seat(
        self,
        *,
        tenant: str = "default",
        priority: str = "interactive",
        deadline: float | None = None,
        session_id: str = "",
    ) -> Seat:
        """:meth:`enqueue`, then wait for the seat (see :meth:`Queued.wait` for what it raises)."""
        got = self.enqueue(tenant=tenant, priority=priority, deadline=deadline, session_id=session_id)
        if isinstance(got, Seat):
            await trio.lowlevel.cancel_shielded_checkpoint()  # the seat is owned: a cancel comes next
            return got
        return await got.wait()

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
