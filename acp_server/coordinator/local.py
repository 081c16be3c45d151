"""The in-process coordinator: the same limits, counted in this process only.

:class:`LocalCoordinator` keeps every limit as a set of lease ids and checks an option exactly as
``lua/acquire.lua`` does (hard caps, then soft caps, then the class rule), so a single replica, or a
replica admitting against its local share while Redis is away, follows the cluster's rules. Its leases
never expire (the holder dies with the process); :meth:`~LocalCoordinator.release` is synchronous and
hands the freed room to the waiters at the next pass.
"""

from __future__ import annotations

import itertools
import os
import socket
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import trio

from .base import (
    RECHECK_S,
    ClaimResult,
    ClassRule,
    ClusterStatistics,
    CoordinatorStatistics,
    Lease,
    LimitCount,
    LimitRefused,
    Option,
    ReplicaInfo,
    local_share,
    new_lease_id,
)
from .waiters import WaitQueue

__all__ = ["LocalCoordinator", "default_replica_id"]


def default_replica_id() -> str:
    """``host:pid``, the default ``--replica-id``."""
    return f"{socket.gethostname()}:{os.getpid()}"


class LocalCoordinator:
    """Shared-limit semantics without sharing: counters in this process.

    Args:
        replica_id: named in claims and statistics.
        replicas: caps are divided by this (``ceil(cap / replicas)``): a replica's local share of the
            cluster's limits while the shared coordinator is away (1: the caps as given).
    """

    def __init__(self, replica_id: str | None = None, *, replicas: int = 1) -> None:
        self._replica_id = replica_id or default_replica_id()
        self.replicas = replicas
        self._sets: dict[str, dict[str, None]] = {}
        self._caps: dict[str, int] = {}
        self._leases: dict[str, Lease] = {}
        self._claims: dict[tuple[str, str], tuple[str, str, str, float]] = {}
        self._fence = itertools.count(1)
        self._queue = WaitQueue()
        self._acquired = self._refused = self._released = 0
        #: holders counted beside this coordinator's own, per limit: a replica's shared leases still
        #: running while it admits against its local share (so the share bounds all it runs)
        self.base: dict[str, int] = {}

    @property
    def replica_id(self) -> str:
        return self._replica_id

    def new_lease(self) -> Lease:
        lease = Lease(new_lease_id())
        lease.where = "local"
        return lease

    # --- the check, as in acquire.lua -------------------------------------------------------------

    def _count(self, name: str) -> int:
        members = self._sets.get(name)
        return (len(members) if members else 0) + self.base.get(name, 0)

    def _holds(self, name: str, lease_id: str) -> bool:
        members = self._sets.get(name)
        return bool(members) and lease_id in members  # type: ignore[operator]

    def _class_refusal(self, rule: ClassRule, lease_id: str) -> LimitRefused | None:
        r = rule.rank
        seat_name = rule.seat_names[r]
        if self._holds(seat_name, lease_id):
            return None
        in_room = False
        seated: list[int] = []
        waiting: list[int] = []
        for d in range(len(rule.shares)):
            seated.append(self._count(rule.seat_names[d]))
            w = self._count(rule.room_names[d])
            if self._holds(rule.room_names[d], lease_id):
                w -= 1
                in_room = True
            waiting.append(w)
        refusal = LimitRefused(seat_name, seated[r], local_share(rule.shares[r], self.replicas), soft=True)
        if not in_room and waiting[r] > 0:
            return refusal
        shares = [local_share(s, self.replicas) for s in rule.shares]
        if seated[r] < shares[r]:
            return None
        for d in range(len(shares)):
            if d != r and waiting[d] > 0 and seated[d] < shares[d]:
                return refusal
        return None

    def _check(self, option: Option, lease_id: str) -> LimitRefused | None:
        soft: LimitRefused | None = None
        for need in option.needs:
            cap = local_share(need.cap, self.replicas)
            if cap > 0 and not self._holds(need.name, lease_id):
                count = self._count(need.name)
                if count >= cap:
                    if not need.soft:
                        return LimitRefused(need.name, count, cap)
                    soft = soft or LimitRefused(need.name, count, cap, soft=True)
        if soft is not None:
            return soft
        if option.classes is not None:
            return self._class_refusal(option.classes, lease_id)
        return None

    def try_acquire(self, lease: Lease, *options: Option, leave: Sequence[str] = (), token: int = 0) -> int:
        """:meth:`acquire` without a checkpoint (this coordinator never waits to answer).

        Args:
            token: the fencing token to keep (0: draw a new one).
        """
        if not lease.active:
            raise RuntimeError(f"{lease!r} is over; take a new lease")
        refusal: LimitRefused | None = None
        for number, option in enumerate(options):
            refusal = self._check(option, lease.id)
            if refusal is None:
                for need in option.needs:
                    self._sets.setdefault(need.name, {})[lease.id] = None
                    lease.holds[need.name] = need.cap
                    if need.cap > 0:
                        self._caps[need.name] = need.cap
                left = self._leave(lease, leave)
                if lease.state == "new":
                    lease.state = "held"
                    lease.acquired_at = trio.current_time()
                lease.token = token or lease.token or next(self._fence)
                lease.where = "local"
                self._leases[lease.id] = lease
                self._acquired += 1
                if left:
                    self._queue.wake()
                return number
            if not refusal.soft:
                break
        self._refused += 1
        assert refusal is not None
        raise refusal

    def _leave(self, lease: Lease, names: Sequence[str]) -> int:
        left = 0
        for name in names:
            members = self._sets.get(name)
            if members is not None and lease.id in members:
                del members[lease.id]
                left += 1
                if not members:
                    del self._sets[name]
            lease.holds.pop(name, None)
        return left

    # --- the Protocol ----------------------------------------------------------------------------

    async def acquire(self, lease: Lease, *options: Option, leave: Sequence[str] = ()) -> int:
        """See :meth:`Coordinator.acquire`; the answer is immediate."""
        await trio.lowlevel.checkpoint_if_cancelled()
        number = self.try_acquire(lease, *options, leave=leave)
        await trio.lowlevel.cancel_shielded_checkpoint()
        return number

    async def wait_acquire(self, lease: Lease, option: Option, *, rank: int = 1, leave: Sequence[str] = ()) -> None:
        """See :meth:`Coordinator.wait_acquire`."""
        if not len(self._queue):
            try:
                await self.acquire(lease, option, leave=leave)
                return
            except LimitRefused:
                pass
        await self._queue.wait(lease, option, rank, leave)

    async def _attempt(self, lease: Lease, option: Option, leave: Sequence[str], order: tuple[int, int]) -> None:
        self.try_acquire(lease, option, leave=leave)

    async def leave(self, lease: Lease, names: Sequence[str]) -> None:
        """See :meth:`Coordinator.leave`."""
        self.leave_nowait(lease, names)
        await trio.lowlevel.checkpoint()

    def leave_nowait(self, lease: Lease, names: Sequence[str]) -> None:
        """:meth:`leave` without a checkpoint."""
        if self._leave(lease, names):
            self._queue.wake()

    def release(self, lease: Lease) -> None:
        """See :meth:`Coordinator.release`."""
        if not lease.active and lease.state != "lost":
            return
        self._leave(lease, list(lease.holds))
        self._leases.pop(lease.id, None)
        if lease.state != "lost":
            lease.state = "released"
            self._released += 1
        self._queue.drop_lease(lease)
        self._queue.wake()

    def forget(self, lease: Lease) -> None:
        """Take a lease out of this coordinator's books without ending it (it moved to the shared store)."""
        self._leave(lease, list(self._sets_of(lease)))
        self._leases.pop(lease.id, None)
        self._queue.wake()

    def _sets_of(self, lease: Lease) -> list[str]:
        return [name for name, members in self._sets.items() if lease.id in members]

    def leases(self) -> list[Lease]:
        """The leases held here now."""
        return list(self._leases.values())

    async def flush(self) -> None:
        await trio.lowlevel.checkpoint()

    async def claim(self, session_id: str, key: str, fingerprint: str, prompt_id: str, ttl_s: float) -> ClaimResult:
        """See :meth:`Coordinator.claim` (claims live in this process)."""
        await trio.lowlevel.checkpoint()
        now = trio.current_time()
        held = self._claims.get((session_id, key))
        if held is None or held[3] <= now:
            self._claims[(session_id, key)] = (fingerprint, "running", prompt_id, now + ttl_s)
            return ClaimResult(
                claimed=True, fingerprint=fingerprint, replica_id=self._replica_id, state="running",
                prompt_id=prompt_id, ttl_ms=round(ttl_s * 1000),
            )
        return ClaimResult(
            claimed=False, fingerprint=held[0], replica_id=self._replica_id, state=held[1],
            prompt_id=held[2], ttl_ms=max(0, round((held[3] - now) * 1000)),
        )

    async def settle_claim(self, session_id: str, key: str, prompt_id: str, *, drop: bool) -> None:
        """See :meth:`Coordinator.settle_claim`."""
        await trio.lowlevel.checkpoint()
        held = self._claims.get((session_id, key))
        if held is None or held[2] != prompt_id:
            return
        if drop:
            del self._claims[(session_id, key)]
        else:
            self._claims[(session_id, key)] = (held[0], "done", held[2], held[3])

    def counts(self) -> list[LimitCount]:
        """Every limit with a cap, and its holders here."""
        names = sorted(set(self._caps) | set(self._sets))
        return [LimitCount(name=n, cap=self._caps.get(n, 0), count=self._count(n)) for n in names]

    async def cluster(self) -> ClusterStatistics:
        await trio.lowlevel.checkpoint()
        return ClusterStatistics(
            prefix="",
            replicas=[ReplicaInfo(replica_id=self._replica_id, last_renew_ms_ago=0, live=True)],
            limits=self.counts(),
        )

    def statistics(self) -> CoordinatorStatistics:
        return CoordinatorStatistics(
            kind="local", replica_id=self._replica_id, up=True, failure_mode="local",
            live_replicas=1, leases=len(self._leases), local_leases=len(self._leases),
            acquired_total=self._acquired, refused_total=self._refused, released_total=self._released,
            lost_total=0, failures_total=0, outages_total=0, releases_queued=0, reasserted_total=0,
            renew_ms_last=0.0, renew_ms_max=0.0, waiters=len(self._queue),
        )

    async def dispatch_forever(self) -> None:
        """Run passes over the waiters on every wake-up (and every :data:`RECHECK_S`)."""
        while True:
            await self._queue.woken(RECHECK_S)
            if len(self._queue):
                await self._queue.run_pass(self._attempt)

    @asynccontextmanager
    async def running(self) -> AsyncIterator[LocalCoordinator]:
        """Run the waiters' dispatcher; on exit release every lease still held."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.dispatch_forever)
            try:
                yield self
            finally:
                nursery.cancel_scope.cancel()
                for lease in list(self._leases.values()):
                    self.release(lease)
