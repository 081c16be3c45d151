"""The Redis coordinator: limits shared by every replica on one Redis, through Lua scripts.

Every check-and-take is one call of ``lua/acquire.lua`` over keys of one hash tag (see
:mod:`~acp_server.coordinator.scripts`), so replicas never both see a free seat and both take it.

**Leases.** A lease is a member of each limit's sorted set, scored by its expiry in Redis time; its
holder renews every lease it holds in one ``renew.lua`` call every TTL/3 (which is also the replica's
heartbeat). A replica that dies stops renewing, and its leases stop counting within one TTL of their
last renewal. A release is queued and sent by a background task, retried while Redis does not answer:
the caller never waits for it. An acquire that is cancelled or times out may still run on the server,
so what it may have taken is given back at once (shielded, bounded by the timeout) with a tombstone
for that attempt, so a late arrival of the call cannot take anything.

**Wake-ups.** Every script that frees room publishes on ``{p}:freed``; each replica subscribes and runs
a pass over its waiters (:mod:`~acp_server.coordinator.waiters`), with a re-check every
:data:`~acp_server.coordinator.base.RECHECK_S` as the safety net (an expiry announces nothing).

**When Redis is away** (a call unanswered within ``timeout_ms``): the coordinator is *down*; a monitor
pings with a backoff doubling up to 2 s. Meanwhile running prompts go on; an acquire raises
:class:`~acp_server.coordinator.base.CoordinatorUnavailable` (``failure="closed"``) or is taken against a
local share ``ceil(cap / N)`` (``failure="local"``; N = ``expected_replicas``, else the live replicas last
seen), which counts the shared leases this replica still runs. When Redis answers again every held lease
is re-asserted before anything new is admitted here (arrivals wait for it, bounded by the timeout): one
still whole is renewed, one that expired (or was taken locally) is re-taken if its limits allow, and the
rest are lost (:attr:`Lease.lost`, ``lease_lost`` for the prompt). The replica then publishes ``up`` on
``{p}:freed``, so the others still down try their reconnect at once: the cluster's re-assert is one round.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Final

import anyio
import coredis
import trio
from coredis.retry import NoRetryPolicy

from .base import (
    RECHECK_S,
    CoordinatorStatistics,
    CoordinatorUnavailable,
    FailureMode,
    Lease,
    LimitRefused,
    Need,
    Option,
    new_lease_id,
)
from .local import LocalCoordinator, default_replica_id
from .readout import cluster_statistics, read_cluster, redis_now_ms
from .redis_claims import RedisClaims
from .redis_wire import _ERRORS, ARRIVAL, _Down, _Release
from .scripts import Keys
from .waiters import PASS_CHUNK, WaitQueue

__all__ = ["RedisCoordinator", "cluster_statistics", "read_cluster", "redis_now_ms"]

log = logging.getLogger("acp_server.coordinator")

#: The longest pause between two reconnect attempts.
BACKOFF_MAX_S: Final = 2.0
_BACKOFF_MIN_S: Final = 0.05
#: Leases renewed per ``renew.lua`` call.
_RENEW_BATCH: Final = 200


class RedisCoordinator(RedisClaims):
    """Shared limits on one Redis. Use inside ``async with coordinator.running():``.

    Args:
        url: ``redis://HOST:PORT/DB`` or ``rediss://`` (TLS).
        prefix: the hash tag of every key: replicas with the same Redis and prefix share their limits.
        replica_id: this replica's id (default ``host:pid``).
        lease_ttl_s: a lease not renewed for this long stops counting; renewed every third of it.
        timeout_ms: a call unanswered for this long means Redis is away.
        failure: ``"closed"`` (refuse while away) or ``"local"`` (admit against a local share).
        expected_replicas: N of the local share (0: the live replicas last seen in Redis).
        recheck_s: how often waiters re-check with no wake-up (the safety net under pub/sub).
    """

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "acp-server",
        replica_id: str | None = None,
        lease_ttl_s: float = 30.0,
        timeout_ms: int = 500,
        failure: FailureMode = "closed",
        expected_replicas: int = 0,
        recheck_s: float = RECHECK_S,
    ) -> None:
        super().__init__(url, Keys(prefix), replica_id or default_replica_id(), lease_ttl_s, timeout_ms, failure)
        self._expected = expected_replicas
        self._recheck_s = recheck_s
        self._leases: dict[str, Lease] = {}
        self._local = LocalCoordinator(self._replica_id, replicas=max(1, expected_replicas))
        self._queue = WaitQueue()
        #: waiters' attempts sent and not answered yet: until they are, this replica stays in {p}:waiting
        self._wait_inflight = 0
        self._live = 1
        self._acquired = self._refused = self._released = self._lost = 0
        self._reasserted = 0
        self._renew_last = self._renew_max = 0.0

    @property
    def replica_id(self) -> str:
        return self._replica_id

    @property
    def up(self) -> bool:
        """True while Redis answers."""
        return self._up

    def new_lease(self) -> Lease:
        return Lease(new_lease_id())

    async def wait_up(self) -> None:
        """Wait until Redis answers and every held lease was re-asserted."""
        await self._up_event.wait()

    # --- calls ------------------------------------------------------------------------------------

    async def acquire(
        self, lease: Lease, *options: Option, leave: Sequence[str] = (), _order: tuple[int, int] = ARRIVAL,
        _wait: bool = False,
    ) -> int:
        """See :meth:`~acp_server.coordinator.base.Coordinator.acquire` (``_order``: a waiter's place,
        so a pass's attempts reach the script in queue order; ``_wait``: a waiter's attempt, whose refusal
        puts this replica in ``{p}:waiting`` so that rooms freed elsewhere are announced)."""
        if not lease.active:
            raise RuntimeError(f"{lease!r} is over; take a new lease")
        if not options:
            raise ValueError("acquire needs at least one option")
        await trio.lowlevel.checkpoint_if_cancelled()
        if lease.where == "local" and lease.state == "held":
            self._count_shared_in_share()
            return self._local.try_acquire(lease, *options, leave=leave)  # re-asserted with the rest later
        if not self._up:
            if self._failure == "local" and lease.state == "new":
                return self._local_acquire(lease, options, leave)
            raise self._unavailable()
        if not self._up_event.is_set():
            # Redis answers again and this replica re-asserts its leases: they go first, so a new
            # arrival cannot take the seat of a lease that is about to be re-taken.
            with trio.move_on_after(self._timeout_s):
                await self._up_event.wait()
            if not self._up_event.is_set():
                raise self._unavailable()
        leaving = lease._leaving
        if leaving is not None:
            # A limit this lease left with leave_nowait is still in Redis until that release lands;
            # taking it again before would be answered "held" and then undone by the release.
            with trio.move_on_after(self._timeout_s):
                await leaving.wait()
            if not leaving.is_set():
                raise self._unavailable()
            lease._leaving = None
        return await self._shared_acquire(lease, options, leave, token=lease.token, order=_order, wait=_wait)

    def _local_acquire(self, lease: Lease, options: Sequence[Option], leave: Sequence[str]) -> int:
        self._local.replicas = self._expected or self._live
        self._count_shared_in_share()
        number = self._local.try_acquire(lease, *options, leave=leave)
        self._acquired += 1
        return number

    def _count_shared_in_share(self) -> None:
        """The local share bounds everything this replica runs: its shared leases still running while
        Redis is away count against it (else a replica would run its share on top of them)."""
        base: dict[str, int] = {}
        for held in self._leases.values():
            if held.active:
                for name in held.holds:
                    base[name] = base.get(name, 0) + 1
        self._local.base = base

    async def _shared_acquire(
        self, lease: Lease, options: Sequence[Option], leave: Sequence[str], *, token: int,
        order: tuple[int, int] = ARRIVAL, wait: bool = False,
    ) -> int:
        lease._attempts += 1
        attempt = lease._attempts
        names, keys, args = self._acquire_request(lease, options, leave, attempt, token, wait)
        was_new = lease.state == "new"
        lease._inflight += 1
        self._wait_inflight += wait
        # A cancel is seen once the answer is known (_batched_acquire waits for it shielded, bounded by
        # the timeout, and returns it), so what the call took is given back exactly at the checkpoints
        # below (a call torn mid-way would leave its outcome unknown).
        try:
            result = await self._batched_acquire(keys, args, order)
        except _Down:
            # No answer: the call may still run on the server. Its attempt gets a tombstone, and
            # whatever it may have taken is given back.
            self._enqueue_release(self._compensation(lease, options, attempt, was_new))
            result = None
        finally:
            lease._inflight -= 1
            self._wait_inflight -= wait
        if result is None:
            await trio.lowlevel.checkpoint_if_cancelled()
            if self._failure == "local" and was_new:
                return self._local_acquire(lease, options, leave)
            raise self._unavailable()
        code = int(result[0])
        if code <= 0:
            self._refused += 1
            if wait and code == 0:
                self._waiting_sent = True  # the script put this replica in {p}:waiting
            await trio.lowlevel.checkpoint_if_cancelled()
            if code == -1:
                raise LimitRefused("tombstone", 0, 0)  # a release of this lease came first
            name = names[int(result[1]) - 1]
            raise LimitRefused(name, int(result[2]), int(result[3]), soft=bool(int(result[4])))
        option = options[code - 1]
        if not lease.active:
            # Released while the call was on its way: give back what the call took (the release's
            # tombstone refused it if the release came first).
            self._enqueue_release(_Release(lease.id, option.names(), True, None, trio.current_time()))
            await trio.lowlevel.checkpoint_if_cancelled()
            raise RuntimeError(f"{lease!r} was released during its acquire")
        taken = [n.name for n in option.needs if n.name not in lease.holds]
        for need in option.needs:
            lease.holds[need.name] = need.cap
        for name in leave:
            lease.holds.pop(name, None)
        lease._changes += 1
        lease.token = int(result[1])
        lease.where = "shared"
        if leave and len(self._queue):
            self._queue.wake()  # a room left: a class may borrow now (no announcement to this replica)
        if lease.state == "new":
            lease.state = "held"
            lease.acquired_at = trio.current_time()
        self._leases[lease.id] = lease
        self._acquired += 1
        try:
            await trio.lowlevel.checkpoint_if_cancelled()
        except trio.Cancelled:
            # Cancelled during the call: give back what it took.
            if was_new:
                self.release(lease)
            else:
                for name in taken:
                    lease.holds.pop(name, None)
                self._enqueue_release(_Release(lease.id, tuple(taken), False, None, trio.current_time()))
            raise
        return code - 1

    def _compensation(self, lease: Lease, options: Sequence[Option], attempt: int, was_new: bool) -> _Release:
        names: list[str] = []
        for option in options:
            for need in option.needs:
                if need.name not in lease.holds and need.name not in names:
                    names.append(need.name)
        return _Release(lease.id, tuple(names), was_new, attempt, trio.current_time())

    async def wait_acquire(self, lease: Lease, option: Option, *, rank: int = 1, leave: Sequence[str] = ()) -> None:
        """See :meth:`~acp_server.coordinator.base.Coordinator.wait_acquire`."""
        try:
            if not len(self._queue):
                try:
                    await self.acquire(lease, option, leave=leave, _wait=True)
                    return
                except LimitRefused as exc:
                    if exc.name == "tombstone":
                        raise RuntimeError(f"{lease!r} was released") from None
                except CoordinatorUnavailable:
                    pass  # an accepted prompt waits: the dispatcher tries again once Redis answers
            await self._queue.wait(lease, option, rank, leave)
        finally:
            self._check_waiting()

    async def _attempt(self, lease: Lease, option: Option, leave: Sequence[str], order: tuple[int, int]) -> None:
        await self.acquire(lease, option, leave=leave, _order=order, _wait=True)

    def _may_unregister(self) -> bool:
        return not len(self._queue) and not self._wait_inflight

    def _check_waiting(self) -> None:
        """Once this replica has no waiter (and none's attempt is on its way), it leaves
        ``{p}:waiting`` with the next release call: releases elsewhere stop announcing themselves."""
        if self._waiting_sent and self._may_unregister():
            self._unregister = True
            self._release_wake.set()

    # --- leave and release ------------------------------------------------------------------------

    async def leave(self, lease: Lease, names: Sequence[str]) -> None:
        """See :meth:`~acp_server.coordinator.base.Coordinator.leave`."""
        names = tuple(n for n in names if n in lease.holds)
        if not names or not lease.active:
            return
        if lease.where == "local":
            self._local.leave_nowait(lease, names)
            await trio.lowlevel.checkpoint()
            return
        for name in names:
            lease.holds.pop(name, None)
        lease._changes += 1
        item = _Release(lease.id, names, False, None, trio.current_time())
        if not self._up:
            self._enqueue_release(item)
            await trio.lowlevel.checkpoint()
            return
        with trio.CancelScope(shield=True):
            try:
                await self._call("release", *self._release_call([item]))
            except _Down:
                self._enqueue_release(item)
        self._queue.wake()

    def leave_nowait(self, lease: Lease, names: Sequence[str]) -> None:
        """See :meth:`~acp_server.coordinator.base.Coordinator.leave_nowait`."""
        names = tuple(n for n in names if n in lease.holds)
        if not names or not lease.active:
            return
        if lease.where == "local":
            self._local.leave_nowait(lease, names)
            return
        for name in names:
            lease.holds.pop(name, None)
        lease._changes += 1
        sent = lease._leaving = trio.Event()
        self._enqueue_release(_Release(lease.id, names, False, None, trio.current_time(), sent))
        self._queue.wake()

    def release(self, lease: Lease) -> None:
        """See :meth:`~acp_server.coordinator.base.Coordinator.release`."""
        if lease.state in ("released",) or (lease.state == "lost" and not lease.holds):
            return
        if lease.where == "local":
            self._local.release(lease)
        else:
            tomb = lease._attempts if lease._inflight else None
            names = tuple(lease.holds)
            if names or tomb is not None or lease.state != "new":
                self._enqueue_release(_Release(lease.id, names, True, tomb, trio.current_time()))
        self._leases.pop(lease.id, None)
        if lease.state != "lost":
            lease.state = "released"
            self._released += 1
        lease.holds.clear()
        self._queue.drop_lease(lease)
        self._queue.wake()

    # --- renewal, outages, re-assert --------------------------------------------------------------

    async def _renew(self, leases: Sequence[Lease]) -> list[Lease]:
        """Renew ``leases`` (and heartbeat); returns the ones that were not whole any more."""
        lost: list[Lease] = []
        start = trio.current_time()
        batches = [leases[i : i + _RENEW_BATCH] for i in range(0, max(1, len(leases)), _RENEW_BATCH)]
        # With waiters here, the entry in {p}:waiting is kept alive (a waiter refused long ago).
        waiting = bool(len(self._queue))
        if waiting:
            self._waiting_sent = True
        calls = []
        changes: list[list[int]] = []
        for batch in batches:
            keys = [self.keys.replicas, self.keys.waiting]
            args: list[str | int] = [self._replica_id, self._ttl_ms, len(batch), "1" if waiting else "0"]
            seen = []
            for lease in batch:
                names = list(lease.holds)
                keys.append(self.keys.lease(lease.id))
                keys.extend(self.keys.limit(n) for n in names)
                args.extend((lease.id, len(names)))
                seen.append(lease._changes)
            calls.append((keys, args))
            changes.append(seen)
        # Every batch in one round trip: a renewal of many leases costs one wait, not one per batch.
        results = await self._call_many("renew", calls)
        for batch, seen, result in zip(batches, changes, results, strict=True):
            self._live = max(1, int(result[1]))
            for n in result[2:]:
                lease = batch[int(n) - 1]
                # A lease whose limits changed while the call was on its way was judged on an old list
                # (a waiter that left the waiting room): the next renewal judges it.
                if lease._changes == seen[int(n) - 1] and not lease._inflight:
                    lost.append(lease)
        took = (trio.current_time() - start) * 1000
        self._renew_last = took
        self._renew_max = max(self._renew_max, took)
        return lost

    async def _retake(self, lease: Lease) -> None:
        """Take an expired (or locally taken) lease again with the caps it holds, or mark it lost."""
        if not lease.active:
            return
        holds = dict(lease.holds)
        option = Option(tuple(Need(name, cap) for name, cap in holds.items()))
        was_local = lease.where == "local"
        if was_local:
            self._local.forget(lease)
        lease.holds.clear()
        try:
            await self._shared_acquire(lease, [option], (), token=0)
        except LimitRefused:
            lease.holds.update(holds)
            self._lose(lease)
            return
        except RuntimeError:
            return  # its holder released it meanwhile: what the call took was given back
        self._reasserted += 1

    def _lose(self, lease: Lease) -> None:
        self._lost += 1
        names = tuple(lease.holds)
        self._leases.pop(lease.id, None)
        self._enqueue_release(_Release(lease.id, names, True, None, trio.current_time()))
        log.warning("lease %s (token %d) lost: it could not be re-taken within the limits", lease.id, lease.token)
        lease._mark_lost()

    async def _reassert(self) -> None:
        """Renew or re-take every lease held, the local ones included; lose what does not fit."""
        shared = [lease for lease in self._leases.values() if lease.active and lease.where == "shared"]
        for lease in await self._renew(shared):
            await self._retake(lease)
        for lease in self._local.leases():
            if lease.active:
                await self._retake(lease)
        self._reasserted += len(shared)

    async def _renewer(self) -> None:
        while True:
            await trio.sleep(self._ttl_ms / 3000)
            if not self._up:
                continue
            leases = [lease for lease in self._leases.values() if lease.active and lease.where == "shared"]
            try:
                for lease in await self._renew(leases):
                    if lease.active:
                        await self._retake(lease)
            except _Down:
                continue

    async def _connect(self) -> bool:
        """One reconnect attempt: a ping (with the scripts' loading), then the re-assert round, then up."""
        try:
            await self._hello()
        except _ERRORS:
            return False
        self._up = True  # calls may go out; nothing new is admitted until the re-assert is done
        try:
            self._caps_sent.clear()  # Redis may have restarted empty
            self._shapes.clear()
            # Releases first: a compensation queued for a lease id must not undo its re-take.
            await self._drain_releases()
            await self._reassert()
        except _Down:
            return False
        self._down_event = trio.Event()
        self._up_event.set()
        self._waiting_sent = True  # not known after an outage: left at the next release if no waiter
        self._check_waiting()
        log.warning("coordinator %s answers; %d leases re-asserted", self.url, self._reasserted)
        try:
            # The other replicas' subscriptions hear it and try their reconnect now rather than at
            # the end of their backoff: the cluster's re-assert round is one round, not two seconds.
            assert self._client is not None
            with trio.fail_after(self._timeout_s):
                await self._client.publish(self.keys.freed, "up")
        except _ERRORS:
            pass
        self._queue.wake()
        self._release_wake.set()
        return True

    async def _monitor(self) -> None:
        backoff = _BACKOFF_MIN_S
        while True:
            if self._up:
                await self._down_event.wait()
                backoff = _BACKOFF_MIN_S
            self._next_attempt = trio.current_time() + backoff
            with trio.move_on_after(backoff):
                await self._poke.wait()
            if await self._connect():
                continue
            self._up = False
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def _subscriber(self) -> None:
        """Wake the waiters on each message on ``{p}:freed`` (coredis' own pub/sub, on a connection of
        its own); an ``up`` from another replica while this one is down tries the reconnect at once."""
        assert self._client is not None
        while True:
            try:
                async with self._client.pubsub(
                    channels=[self.keys.freed], ignore_subscribe_messages=True, retry_policy=None
                ) as ps:
                    async for _ in ps:
                        self._queue.wake()
                        if not self._up:
                            self._poke.set()  # Redis answers (another replica published)
            except* (*_ERRORS, anyio.ClosedResourceError, anyio.BrokenResourceError) as group:
                # The subscription's own connection closes on a cancel too (then Cancelled follows).
                log.debug("coordinator subscription ended (%r); resubscribing", group.exceptions[0])
            await trio.sleep(_BACKOFF_MIN_S)

    async def _dispatcher(self) -> None:
        while True:
            await self._queue.woken(self._recheck_s)
            if len(self._queue) and self._up:
                await self._queue.run_pass(self._attempt, chunk_size=PASS_CHUNK)
                self._check_waiting()

    # --- statistics ------------------------------------------------------------------------------

    def statistics(self) -> CoordinatorStatistics:
        local = len(self._local.leases())
        return CoordinatorStatistics(
            kind="redis", replica_id=self._replica_id, up=self._up, failure_mode=self._failure,
            live_replicas=self._live, leases=len(self._leases) + local, local_leases=local,
            acquired_total=self._acquired, refused_total=self._refused, released_total=self._released,
            lost_total=self._lost, failures_total=self._failures, outages_total=self._outages,
            releases_queued=len(self._releases), reasserted_total=self._reasserted,
            renew_ms_last=round(self._renew_last, 3), renew_ms_max=round(self._renew_max, 3),
            waiters=len(self._queue),
        )

    # --- lifetime ---------------------------------------------------------------------------------

    @asynccontextmanager
    async def running(self) -> AsyncIterator[RedisCoordinator]:
        """Connect (or start down, reconnecting), run the background tasks; on exit release every lease
        still held and wait (bounded by the timeout) for the releases to reach Redis."""
        client: coredis.Redis[bytes] = coredis.Redis.from_url(
            self.url, connect_timeout=self._timeout_s, retry_policy=NoRetryPolicy(), verify_version=False,
            decode_responses=False,
        )
        async with client:
            self._client = client
            self._register_scripts(client)
            try:
                async with trio.open_nursery() as nursery:
                    self._up = True  # so a first failure counts as an outage
                    try:
                        await self._hello()
                    except _ERRORS as exc:
                        self._failures += 1
                        self._mark_down(exc)
                    else:
                        try:
                            await self._renew([])
                            self._up_event.set()
                        except _Down:
                            self._up = False
                    for task in (
                        self._monitor, self._renewer, self._releaser,
                        self._subscriber, self._dispatcher,
                    ):
                        nursery.start_soon(task)
                    try:
                        yield self
                    finally:
                        for lease in list(self._leases.values()) + self._local.leases():
                            self.release(lease)
                        with trio.move_on_after(max(self._timeout_s * 2, 1.0)) as scope:
                            scope.shield = True
                            if self._up:
                                await self.flush()
                        nursery.cancel_scope.cancel()
            finally:
                self._client = None
