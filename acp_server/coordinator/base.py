"""The shared-limits Protocol: what a coordinator is asked, and the records it answers with.

A *limit* is a named counter with a cap (``"seats"``, ``"tenant:acme"``, ``"pool:echo"``); a *lease*
is one holder's claim on several limits at once (one admitted prompt's seat, its tenant slot and its
backend pool slot). A lease joins the limits of one :class:`Option` all or nothing
(:meth:`Coordinator.acquire`), may leave some of them later (:meth:`Coordinator.leave`, a backend permit
returned) and is released exactly once (:meth:`Coordinator.release`, idempotent). Every lease has an id,
a fencing token (a number that only grows across the cluster, drawn each time a lease is taken anew)
and, with a shared coordinator, a TTL its holder renews.

Refusals are values the caller maps to its own errors: :class:`LimitRefused` names the full limit with
its cap and count; :class:`CoordinatorUnavailable` says the shared store does not answer.

    Coordinator (Protocol)
    ├── LocalCoordinator      in-process counters: one replica, or a replica's share while Redis is away
    └── RedisCoordinator      Lua scripts on one Redis (or one Redis Cluster slot), shared by replicas
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Final, Literal, Protocol

import msgspec
import trio

__all__ = [
    "ClaimResult",
    "ClassRule",
    "ClusterStatistics",
    "Coordinator",
    "CoordinatorStatistics",
    "CoordinatorUnavailable",
    "FailureMode",
    "Lease",
    "LeaseState",
    "LimitCount",
    "LimitRefused",
    "Need",
    "Option",
    "ReplicaInfo",
    "local_share",
    "new_lease_id",
]

FailureMode = Literal["closed", "local"]
LeaseState = Literal["new", "held", "released", "lost"]

#: How often a waiter re-checks its limits with no wake-up at all: the safety net under pub/sub (a seat
#: freed by a lease's expiry is announced by nobody).
RECHECK_S: Final = 0.5


def new_lease_id() -> str:
    """A fresh lease id, unique across replicas (random, 96 bits)."""
    return secrets.token_hex(12)


def local_share(cap: int, replicas: int) -> int:
    """One replica's share of a cluster cap while the coordinator is away: ``ceil(cap / replicas)``.

    A cap of 0 (count only) stays 0; the share of a positive cap is at least 1.
    """
    if cap <= 0:
        return cap
    return max(1, math.ceil(cap / max(1, replicas)))


class Need(msgspec.Struct, frozen=True):
    """One limit an option takes a place in.

    Attributes:
        name: the limit's name (``"seats"``, ``"tenant:acme"``); one namespace per coordinator prefix.
        cap: the most holders at once (0: counted, never refused).
        soft: a full soft limit lets the next option be tried (a full seat count sends an arrival to the
            waiting room); a full hard limit refuses at once.
    """

    name: str
    cap: int = 0
    soft: bool = False


class ClassRule(msgspec.Struct, frozen=True):
    """The class shares of the global seats, checked when a lease takes a seat of class ``rank``.

    A class below its share takes a free seat; a class at or above it borrows one only when no class
    below its share has a waiter. An arrival (a lease not in the waiting room) never takes a seat while
    a waiter of its own class waits: it queues behind it.

    Attributes:
        rank: the seat's class (0 = critical ... 3 = bulk).
        shares: seats of each class (summing to the seats).
        seat_names: the limit counting the seats held by each class.
        room_names: the limit counting the waiters of each class.
    """

    rank: int
    shares: tuple[int, ...]
    seat_names: tuple[str, ...]
    room_names: tuple[str, ...]


class Option(msgspec.Struct, frozen=True):
    """One way to admit: every :class:`Need` at once, and the class rule when it has one."""

    needs: tuple[Need, ...]
    classes: ClassRule | None = None

    def names(self) -> tuple[str, ...]:
        """Every limit this option reads, its needs first."""
        names = [n.name for n in self.needs]
        if self.classes is not None:
            for name in (*self.classes.seat_names, *self.classes.room_names):
                if name not in names:
                    names.append(name)
        return tuple(names)


class LimitRefused(Exception):
    """A limit is full: nothing was taken.

    Attributes:
        name: the full limit (for a class-share refusal, the class's seat limit).
        count: its holders when refused.
        cap: its cap (for a class-share refusal, the class's share).
        soft: True when every option was tried and the last one was refused softly.
    """

    def __init__(self, name: str, count: int, cap: int, *, soft: bool = False) -> None:
        super().__init__(f'limit "{name}" is full ({count}/{cap})')
        self.name = name
        self.count = count
        self.cap = cap
        self.soft = soft


class CoordinatorUnavailable(Exception):
    """The shared coordinator does not answer (``closed`` mode): nothing can be acquired now.

    Attributes:
        retry_after_ms: when the next reconnect attempt is due.
    """

    def __init__(self, detail: str, *, retry_after_ms: int) -> None:
        super().__init__(detail)
        self.retry_after_ms = retry_after_ms


class Lease:
    """One holder's claim on limits; made by :meth:`Coordinator.new_lease`, nothing taken yet.

    Attributes:
        id: unique across replicas; a lease that has to be taken again after a fallback gets a new one.
        token: the fencing token (0 until taken): a downstream refuses calls with a token older than the
            newest it saw for the same seat, or checks it with the coordinator.
        holds: limit name -> cap, for every limit the lease is in now.
        state: ``new`` -> ``held`` -> ``released`` (or ``lost``, when it expired and could not be re-taken).
        where: ``"shared"`` (in the coordinator's store) or ``"local"`` (a local share while it is away).
        lost: set when the lease is lost; its holder should stop (``lease_lost``).
    """

    __slots__ = (
        "_attempts", "_changes", "_inflight", "_leaving", "acquired_at", "holds", "id", "lost", "on_lost", "state",
        "token", "where",
    )

    def __init__(self, lease_id: str) -> None:
        self.id = lease_id
        self.token = 0
        self.holds: dict[str, int] = {}
        self.state: LeaseState = "new"
        self.where: Literal["shared", "local"] = "shared"
        self.lost = trio.Event()
        self.on_lost: Callable[[Lease], None] | None = None
        self.acquired_at = 0.0
        self._inflight = 0  # acquire calls of this lease on their way: a release then leaves a tombstone
        self._attempts = 0  # acquire calls made, numbering their tombstones
        self._changes = 0  # changes of its limits: a renewal built before one cannot judge it lost
        self._leaving: trio.Event | None = None  # set once its last leave_nowait reached the store

    def __repr__(self) -> str:
        return f"<Lease {self.id} {self.state} token={self.token} {sorted(self.holds)}>"

    @property
    def active(self) -> bool:
        """True until the lease is released or lost."""
        return self.state in ("new", "held")

    def _mark_lost(self) -> None:
        if not self.active:
            return
        self.state = "lost"
        self.holds.clear()
        self.lost.set()
        if self.on_lost is not None:
            self.on_lost(self)


class ClaimResult(msgspec.Struct, frozen=True, kw_only=True):
    """The answer to an idempotency claim.

    Attributes:
        claimed: True when this call holds the key now.
        fingerprint: the holder's prompt fingerprint (this call's when ``claimed``).
        replica_id: the replica that holds the key.
        state: ``"running"`` or ``"done"``.
        prompt_id: the holder's prompt id on its replica.
        ttl_ms: how long the claim lasts.
    """

    claimed: bool
    fingerprint: str
    replica_id: str
    state: str
    prompt_id: str
    ttl_ms: int


class ReplicaInfo(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """One replica as the registry sees it."""

    replica_id: str
    last_renew_ms_ago: int
    live: bool


class LimitCount(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """One limit's holders across the cluster, with its cap as last asserted."""

    name: str
    cap: int
    count: int


class ClusterStatistics(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """What ``acp-server cluster`` prints: the replicas and every limit's count."""

    prefix: str
    replicas: list[ReplicaInfo]
    limits: list[LimitCount]


class CoordinatorStatistics(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """A snapshot of one replica's coordinator.

    Attributes:
        kind: ``"local"`` or ``"redis"``.
        replica_id: this replica.
        up: the coordinator answers (always True for ``local``).
        failure_mode: ``closed`` or ``local``.
        live_replicas: replicas renewed within one TTL, as last seen (1 for ``local``).
        leases: leases held by this replica now (``local_leases`` of them against the local share).
        acquired_total, refused_total, released_total, lost_total: since start.
        failures_total: calls that failed or timed out.
        outages_total: times the coordinator went away.
        releases_queued: releases waiting for the coordinator to answer.
        reasserted_total: leases renewed or re-taken after an outage.
        renew_ms_last, renew_ms_max: the latency of the lease renewals.
        waiters: tasks of this replica waiting for a limit.
    """

    kind: str
    replica_id: str
    up: bool
    failure_mode: str
    live_replicas: int
    leases: int
    local_leases: int
    acquired_total: int
    refused_total: int
    released_total: int
    lost_total: int
    failures_total: int
    outages_total: int
    releases_queued: int
    reasserted_total: int
    renew_ms_last: float
    renew_ms_max: float
    waiters: int


class Coordinator(Protocol):
    """Shared limits, as the admission code asks for them. Never calls back into the bridge."""

    @property
    def replica_id(self) -> str:
        """This replica's id in the registry."""
        ...

    def new_lease(self) -> Lease:
        """A lease with a fresh id and nothing taken."""
        ...

    async def acquire(self, lease: Lease, *options: Option, leave: Sequence[str] = ()) -> int:
        """Take the first option whose limits all have room, in one atomic step; leave ``leave`` with it.

        Returns:
            The index of the option taken.

        Raises:
            LimitRefused: no option fits (nothing changed).
            CoordinatorUnavailable: the coordinator does not answer and the failure mode is ``closed``.

        Cancelled (or timed out) while the call is on its way, the lease is released at once, shielded
        and bounded, with a tombstone so the call cannot win afterwards.
        """
        ...

    async def wait_acquire(self, lease: Lease, option: Option, *, rank: int = 1, leave: Sequence[str] = ()) -> None:
        """Take ``option``, waiting for room (woken by releases anywhere in the cluster).

        Waiters of one replica are tried in ``rank`` order, FIFO within a rank. While the coordinator is
        away the wait goes on (an accepted prompt is never refused later).

        Raises:
            RuntimeError: the lease was released while it waited.
        """
        ...

    async def leave(self, lease: Lease, names: Sequence[str]) -> None:
        """Leave some limits and keep the lease (a backend permit returned). Never raises; queued when
        the coordinator does not answer."""
        ...

    def leave_nowait(self, lease: Lease, names: Sequence[str]) -> None:
        """:meth:`leave` without waiting (a backend permit returned from a ``finally``): the store is
        updated in the background, before any later acquisition of the same lease is sent."""
        ...

    def release(self, lease: Lease) -> None:
        """Release the whole lease, exactly once (later calls do nothing). Synchronous: the store is
        updated in the background, and retried while the coordinator does not answer."""
        ...

    async def flush(self) -> None:
        """Wait until every release queued so far reached the store (or was given up to its TTL)."""
        ...

    async def claim(self, session_id: str, key: str, fingerprint: str, prompt_id: str, ttl_s: float) -> ClaimResult:
        """Claim an idempotency key for one prompt across replicas.

        Raises:
            CoordinatorUnavailable: the store does not answer (``closed`` mode).
        """
        ...

    async def settle_claim(self, session_id: str, key: str, prompt_id: str, *, drop: bool) -> None:
        """Mark this replica's claim ended (it names this replica as the one with the outcome), or drop
        it (the prompt was refused after the claim). Never raises."""
        ...

    async def cluster(self) -> ClusterStatistics:
        """The replicas and the count of every limit across the cluster."""
        ...

    def statistics(self) -> CoordinatorStatistics:
        """This replica's view, without a call to the store."""
        ...

    def running(self) -> AbstractAsyncContextManager[Coordinator]:
        """``async with coordinator.running():`` runs its background tasks (renewal, releases, wake-ups)
        and, on exit, releases every lease still held."""
        ...
