"""Per-backend capacity pools: admission leases and FIFO generation permits, shaped like trio's CapacityLimiter.

One :class:`CapacityManager` per server instance holds one :class:`CapacityPool` per backend that has
limits; a backend without limits has no pool, and its prompts skip this module entirely. A pool bounds
two things:

- **leases** (admission): the bridge takes a lease in the same synchronous step that admits a prompt,
  with :meth:`CapacityPool.try_lease` (no await). At most ``max_active + max_waiting`` leases exist at
  once; past that the prompt is refused with :class:`~acp_server.errors.CapacityExceededError`, and the
  refusal changes no admission counter. The lease covers the prompt from admission through queueing,
  every backend call, every retry and every exit, and is released exactly once (``release`` is
  idempotent; a lease is also a context manager).
- **permits** (generation): each backend call made under a lease holds a permit, at most ``max_active``
  at once. Waiters are served strictly FIFO: a released permit is handed to the oldest waiter inside
  ``release_permit`` itself, so a newcomer can never barge past the queue. A waiter cancelled before
  its grant leaves the queue and never calls the backend; one whose grant won the race owns the permit
  and sees the cancel at its next checkpoint (trio's grant-or-cancel rule: no permit lost or freed twice).

Typical use by the bridge::

    pool = manager.pool(backend_id)              # None: unlimited, no pool, no locking
    lease = pool.try_lease(session_id) if pool else None   # raises CapacityExceededError
    ...
    with lease:                                  # released whatever the exit
        for attempt in range(retries):
            async with lease.permit():           # FIFO, at most max_active at once
                await backend.prompt(...)
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from types import TracebackType
from typing import Final

import msgspec
import outcome
import trio
from trio.lowlevel import enable_ki_protection

from ..errors import RETRY_AFTER_MS, CapacityExceededError
from ..parking import ParkingSpot
from .limits import check_non_negative_int, check_positive_int

__all__ = ["CapacityManager", "CapacityPool", "Lease", "Permit", "PoolLimits", "PoolStatistics"]


class PoolLimits(msgspec.Struct, frozen=True, kw_only=True):
    """The bounds of one backend's capacity pool. ``None`` means unlimited.

    Attributes:
        max_active: backend calls running at once (``None``: no pool at all).
        max_waiting: admitted prompts beyond ``max_active`` (0: no waiting room; ``None``: unbounded).
        retry_after_ms: the retry hint sent when the pool refuses a prompt.
    """

    max_active: int | None = None
    max_waiting: int | None = None
    retry_after_ms: int = RETRY_AFTER_MS

    def __post_init__(self) -> None:
        if self.max_active is not None:
            check_positive_int("max_active", self.max_active)
        if self.max_waiting is not None:
            check_non_negative_int("max_waiting", self.max_waiting, zero="0 means no waiting room")
            if self.max_active is None:
                raise ValueError(
                    "max_waiting needs max_active: with unlimited active calls nothing ever waits"
                    " (set max_active, or leave max_waiting unset)"
                )
        check_positive_int("retry_after_ms", self.retry_after_ms)

    @property
    def unlimited(self) -> bool:
        """True when these limits bound nothing, so the backend gets no pool."""
        return self.max_active is None

    @property
    def admission_limit(self) -> int | None:
        """The most leases held at once (``max_active + max_waiting``), ``None`` when unbounded."""
        if self.max_active is None or self.max_waiting is None:
            return None
        return self.max_active + self.max_waiting


class PoolStatistics(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """A snapshot of one pool, like ``trio.CapacityLimiter.statistics()``.

    Attributes:
        active: permits held: backend calls running now.
        waiting: tasks parked in the FIFO for a permit.
        leased: leases held: admitted prompts not yet finished (running, queued or between retries).
        admitted_total: leases granted since the pool was made.
        refused_total: prompts refused since the pool was made.
        max_active: the permit bound.
        max_waiting: the waiting room beyond ``max_active`` (``None``: unbounded).
        oldest_wait_ms: how long the oldest waiter for a permit has waited (0: none waits).
    """

    active: int
    waiting: int
    leased: int
    admitted_total: int
    refused_total: int
    max_active: int
    max_waiting: int | None
    oldest_wait_ms: int = 0


# A lease's permit state: it runs one backend call at a time.
_IDLE: Final = 0
_WAITING: Final = 1
_HOLDING: Final = 2


class CapacityPool:
    """The capacity of one backend: leases bounded by ``max_active + max_waiting``, permits by ``max_active``.

    Args:
        backend_id: the backend this pool guards (named in refusals).
        limits: its bounds; ``limits.max_active`` must be set (unlimited backends get no pool).
    """

    def __init__(self, backend_id: str, limits: PoolLimits) -> None:
        if limits.max_active is None:
            raise ValueError(f'backend "{backend_id}" has no max_active: an unlimited backend gets no pool')
        self._backend_id = backend_id
        self._limits = limits
        self._max_active: int = limits.max_active
        self._admission_limit = limits.admission_limit
        self._active = 0
        self._leased = 0
        self._admitted_total = 0
        self._refused_total = 0
        # Leases whose call is parked for a permit, oldest first. One leaves exactly once: granted
        # (popped in _release_permit), aborted by its cancel, or thrown out by its own release.
        self._waiters: collections.OrderedDict[Lease, None] = collections.OrderedDict()

    def __repr__(self) -> str:
        return (
            f"<CapacityPool {self._backend_id!r}: {self._active}/{self._max_active} active,"
            f" {len(self._waiters)} waiting, {self._leased} leased>"
        )

    @property
    def backend_id(self) -> str:
        return self._backend_id

    @property
    def limits(self) -> PoolLimits:
        return self._limits

    @enable_ki_protection
    def try_lease(self, session_id: str) -> Lease:
        """Admit one prompt of ``session_id``, without blocking.

        Returns:
            The prompt's lease; release it exactly when the prompt is finished.

        Raises:
            CapacityExceededError: ``max_active + max_waiting`` leases are held. Only
                ``refused_total`` counts the refusal; nothing else changes.
        """
        limit = self._admission_limit
        if limit is not None and self._leased >= limit:
            self._refused_total += 1
            raise CapacityExceededError(
                backend_id=self._backend_id,
                session_id=session_id,
                limit=limit,
                active_count=self._active,
                waiting_count=self._leased - self._active,
                retry_after_ms=self._limits.retry_after_ms,
            )
        self._leased += 1
        self._admitted_total += 1
        return Lease(self, session_id)

    def statistics(self) -> PoolStatistics:
        """A frozen snapshot of the pool's counters and bounds."""
        oldest = 0
        if self._waiters and trio.lowlevel.in_trio_run():
            first = next(iter(self._waiters))
            oldest = max(0, round((trio.current_time() - first._since) * 1000))
        return PoolStatistics(
            oldest_wait_ms=oldest,
            active=self._active,
            waiting=len(self._waiters),
            leased=self._leased,
            admitted_total=self._admitted_total,
            refused_total=self._refused_total,
            max_active=self._max_active,
            max_waiting=self._limits.max_waiting,
        )

    # The permit machinery. Every method is synchronous up to the one park, so no other task can run
    # between a permit being freed and it being handed to the oldest waiter.

    def _take_permit_nowait(self, lease: Lease) -> None:
        # No barging: a free permit with tasks queued cannot exist (releases hand it over), but the
        # queue check keeps the rule explicit.
        if self._active < self._max_active and not self._waiters:
            self._active += 1
            lease._permit = _HOLDING
        else:
            raise trio.WouldBlock

    async def _park(self, lease: Lease) -> None:
        self._waiters[lease] = None
        lease._permit = _WAITING
        lease._since = trio.current_time()

        def abort() -> None:
            # Runs only while the task is still parked: a grant wakes it first, and then the cancel
            # is seen at the caller's next checkpoint instead.
            del self._waiters[lease]
            lease._permit = _IDLE

        await lease._spot.park(abort)

    def _release_permit(self, lease: Lease) -> None:
        lease._permit = _IDLE
        if self._waiters:
            # Hand the permit straight to the oldest waiter: ``active`` does not move.
            heir, _ = self._waiters.popitem(last=False)
            heir._permit = _HOLDING
            heir._spot.wake()
        else:
            self._active -= 1

    def _drop_waiter(self, lease: Lease) -> None:
        # The lease was released while its task was parked: wake the task with an error so it
        # neither waits forever nor calls the backend.
        del self._waiters[lease]
        lease._permit = _IDLE
        woke = lease._spot.wake(
            outcome.Error(
                RuntimeError(
                    f'the lease of session "{lease.session_id}" was released while this call waited for'
                    " a permit; take a new lease to call the backend"
                )
            )
        )
        assert woke, "a waiting lease has a parked call"


class Lease:
    """One admitted prompt's claim on a :class:`CapacityPool`; made only by :meth:`CapacityPool.try_lease`.

    The lease runs one backend call at a time, each under a permit; it may take permits any number of
    times in sequence (retries) while it is held. ``release`` returns any permit it still holds.
    """

    __slots__ = ("__weakref__", "_permit", "_pool", "_released", "_since", "_spot", "session_id")

    def __init__(self, pool: CapacityPool, session_id: str) -> None:
        self._pool = pool
        self.session_id = session_id
        self._released = False
        self._permit: int = _IDLE
        self._spot = ParkingSpot()
        self._since = 0.0  # when it started waiting for a permit

    def __repr__(self) -> str:
        state = "released" if self._released else ("idle", "waiting", "holding")[self._permit]
        return f"<Lease {self._pool.backend_id!r} session {self.session_id!r} {state}>"

    @property
    def backend_id(self) -> str:
        return self._pool.backend_id

    @property
    def released(self) -> bool:
        return self._released

    @property
    def holds_permit(self) -> bool:
        """True while a backend call runs under this lease."""
        return self._permit == _HOLDING

    @property
    def waiting(self) -> bool:
        """True while a call under this lease waits in the FIFO for a permit."""
        return self._permit == _WAITING

    def _check_can_acquire(self) -> None:
        if self._released:
            raise RuntimeError(f'the lease of session "{self.session_id}" is released; take a new lease')
        if self._permit != _IDLE:
            raise RuntimeError(
                f'the lease of session "{self.session_id}" already holds or awaits a permit;'
                " a lease runs one backend call at a time"
            )

    @enable_ki_protection
    def acquire_permit_nowait(self) -> None:
        """Take a permit for one backend call, without blocking.

        Raises:
            trio.WouldBlock: ``max_active`` calls run, or others wait first.
            RuntimeError: the lease is released, or already holds or awaits a permit.
        """
        self._check_can_acquire()
        self._pool._take_permit_nowait(self)

    @enable_ki_protection
    async def acquire_permit(self) -> None:
        """Take a permit for one backend call, waiting in FIFO order behind earlier callers.

        Cancelled while waiting, the call leaves the queue holding nothing. If the permit was granted
        in the same tick as the cancel, this returns holding it and the cancel arrives at the next
        checkpoint: release it as usual.

        Raises:
            RuntimeError: the lease is released (also when that happens during the wait), or already
                holds or awaits a permit.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_can_acquire()
        try:
            self._pool._take_permit_nowait(self)
        except trio.WouldBlock:
            await self._pool._park(self)
        else:
            await trio.lowlevel.cancel_shielded_checkpoint()

    @enable_ki_protection
    def release_permit(self) -> None:
        """Return the permit, handing it to the oldest waiter if any.

        A no-op once the lease is released (its release returned the permit).

        Raises:
            RuntimeError: the lease is held but holds no permit.
        """
        if self._released:
            return
        if self._permit != _HOLDING:
            raise RuntimeError(f'the lease of session "{self.session_id}" holds no permit to release')
        self._pool._release_permit(self)

    def permit(self) -> Permit:
        """``async with lease.permit():`` holds a permit for the block, released on any exit."""
        return Permit(self)

    @enable_ki_protection
    def release(self) -> None:
        """Give the lease back, with any permit it holds. Idempotent: later calls do nothing.

        A call still waiting for a permit under this lease is woken with RuntimeError.
        """
        if self._released:
            return
        if self._permit == _HOLDING:
            self._pool._release_permit(self)
        elif self._permit == _WAITING:
            self._pool._drop_waiter(self)
        self._released = True
        self._pool._leased -= 1

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


class Permit:
    """The async context manager of :meth:`Lease.permit`: one backend call's permit."""

    __slots__ = ("_lease",)

    def __init__(self, lease: Lease) -> None:
        self._lease = lease

    async def __aenter__(self) -> Lease:
        await self._lease.acquire_permit()
        return self._lease

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._lease.release_permit()


class CapacityManager:
    """The capacity pools of one server instance, one per backend with limits.

    Servers in one process each hold their own manager, so their capacity is independent.

    Args:
        limits_by_backend: backend id -> its limits. Backends absent here, or with unlimited limits,
            get no pool: :meth:`pool` returns ``None`` and their prompts take no lock.
    """

    def __init__(self, limits_by_backend: Mapping[str, PoolLimits] | None = None) -> None:
        self._pools: dict[str, CapacityPool] = {}
        for backend_id, limits in (limits_by_backend or {}).items():
            if not isinstance(limits, PoolLimits):
                raise TypeError(f'limits of backend "{backend_id}" must be a PoolLimits; got {limits!r}')
            if not limits.unlimited:
                self._pools[backend_id] = CapacityPool(backend_id, limits)

    def __repr__(self) -> str:
        return f"<CapacityManager {sorted(self._pools)}>"

    @property
    def pools(self) -> dict[str, CapacityPool]:
        """The limited backends' pools by backend id (the manager's own table: read, do not change)."""
        return self._pools

    def pool(self, backend_id: str) -> CapacityPool | None:
        """The pool of ``backend_id``, or ``None`` when that backend is unlimited."""
        return self._pools.get(backend_id)

    def statistics(self) -> dict[str, PoolStatistics]:
        """A snapshot of every pool, by backend id (unlimited backends have none)."""
        return {backend_id: pool.statistics() for backend_id, pool in self._pools.items()}
