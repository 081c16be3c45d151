"""The Redis coordinator against a real redis-server: shared caps, wake-ups across replicas, cancelled
acquires, outages (SIGSTOP) in both failure modes, re-assert, a replica killed with SIGKILL, claims."""

from __future__ import annotations

import random
import re
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import coredis
import pytest
import trio

from acp_server.coordinator import CoordinatorUnavailable, Lease, LimitPlan, LimitRefused, Need, Option
from acp_server.coordinator.redis import RedisCoordinator

from .helpers import scaled
from .redis_server import RedisServer, redis_server  # noqa: F401

SEAT = Option((Need("seats", 3),))


@asynccontextmanager
async def replicas(server: RedisServer, n: int, **kw: Any) -> AsyncIterator[list[RedisCoordinator]]:
    """``n`` coordinators on one Redis and prefix, as ``n`` replicas would be.

    A test that is not about Redis being away gets a generous call timeout: on a loaded machine a burst
    of calls can wait past the default 500 ms, which would read as an outage."""
    kw.setdefault("timeout_ms", 5000)
    async with AsyncExitStack() as stack:
        out = []
        for i in range(n):
            c = RedisCoordinator(server.url, prefix="t", replica_id=f"r{i}", **kw)
            out.append(await stack.enter_async_context(c.running()))
        yield out


async def _count(server: RedisServer, name: str) -> int:
    out = await trio.to_thread.run_sync(server.command, "ZCARD", "{t}:l:" + name)
    return int(out.split()[-1])


async def test_replicas_share_one_cap(redis_server: RedisServer) -> None:  # noqa: F811
    async with replicas(redis_server, 3) as (a, b, c):
        held: list[Lease] = []
        for coord in (a, b, c):
            lease = coord.new_lease()
            await coord.acquire(lease, SEAT)
            held.append(lease)
        with pytest.raises(LimitRefused) as refused:
            await a.acquire(a.new_lease(), SEAT)
        assert (refused.value.name, refused.value.count, refused.value.cap) == ("seats", 3, 3)
        b.release(held[1])
        await b.flush()
        await a.acquire(a.new_lease(), SEAT)
        assert await _count(redis_server, "seats") == 3
        stats = await a.cluster()
        assert {r.replica_id for r in stats.replicas} == {"r0", "r1", "r2"}
        assert [(x.name, x.cap, x.count) for x in stats.limits] == [("seats", 3, 3)]


async def test_concurrent_acquires_never_pass_the_cap(redis_server: RedisServer) -> None:  # noqa: F811
    cap, holding, peak, done = 5, 0, 0, 0
    total = scaled(3000, 300)

    async with replicas(redis_server, 3) as coords, coredis.Redis.from_url(redis_server.url) as check:

        async def worker(coord: RedisCoordinator) -> None:
            nonlocal holding, peak, done
            while done < total:
                lease = coord.new_lease()
                await coord.wait_acquire(lease, Option((Need("seats", cap),)))
                holding += 1
                peak = max(peak, holding)
                assert await check.zcard("{t}:l:seats") <= cap
                await trio.sleep(random.random() / 200)
                holding -= 1
                done += 1
                coord.release(lease)

        async with trio.open_nursery() as nursery:
            for i in range(24):
                nursery.start_soon(worker, coords[i % 3])
        for coord in coords:
            await coord.flush()
    assert peak == cap  # the cap was reached, and never passed
    assert await _count(redis_server, "seats") == 0


async def test_a_seat_freed_on_one_replica_wakes_a_waiter_on_another(redis_server: RedisServer) -> None:  # noqa: F811
    await check_a_freed_seat_wakes_a_waiter_on_another_replica(redis_server)


async def check_a_freed_seat_wakes_a_waiter_on_another_replica(server: RedisServer) -> None:
    """Two replicas, one seat: the second waits, and the first's release wakes it over pub/sub (the
    re-check is an hour, so nothing else can); then it leaves the waiting set. Shared by the plain and
    the TLS tests (``test_coordinator_tls.py``)."""
    async with replicas(server, 2, recheck_s=3600) as (a, b):
        holder = a.new_lease()
        await a.acquire(holder, Option((Need("seats", 1),)))
        waiter = b.new_lease()
        got = trio.Event()

        async def wait() -> None:
            await b.wait_acquire(waiter, Option((Need("seats", 1),)))
            got.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await trio.sleep(0.2)
            assert not got.is_set(), "one seat: the second replica waits"
            # b's refused attempt put it among the waiting replicas, so a's release is announced
            assert await _waiting(server) == {"r1"}
            a.release(holder)
            with trio.fail_after(5):
                await got.wait()
        assert waiter.state == "held" and waiter.token > holder.token
        # b has no waiter any more: it leaves the set, and releases are no longer announced
        for _ in range(500):
            if not await _waiting(server):
                break
            await trio.sleep(0.01)
        assert not await _waiting(server)
        b.release(waiter)
        await b.flush()
        assert await _count(server, "seats") == 0


async def _waiting(server: RedisServer) -> set[str]:
    out = await trio.to_thread.run_sync(server.command, "ZRANGE", "{t}:waiting", "0", "-1")
    return set(re.findall(r'"([^"]*)"', out.decode()))  # redis-cli --no-raw: 1) "r1"


async def test_cancelled_acquires_leave_nothing_behind(redis_server: RedisServer) -> None:  # noqa: F811
    kept: list[Lease] = []
    async with replicas(redis_server, 1) as (coord,):
        for _ in range(scaled(1500, 150)):
            lease = coord.new_lease()
            with trio.move_on_after(random.random() / 1000):
                await coord.acquire(lease, Option((Need("seats", 0), Need("pool:e", 0))))
                kept.append(lease)
        await coord.flush()
        assert await _count(redis_server, "seats") == len(kept)
        assert await _count(redis_server, "pool:e") == len(kept)
        for lease in kept:
            coord.release(lease)
        await coord.flush()
        assert await _count(redis_server, "seats") == 0


async def test_cancelled_acquires_sharing_a_call_leave_nothing_behind(redis_server: RedisServer) -> None:  # noqa: F811
    # Acquisitions gathered into one call, some of them cancelled while it is on its way (the task that
    # sent it among them): every uncancelled one is answered (not refused as unavailable), the cancelled
    # ones keep nothing, and Redis counts exactly the leases kept.
    kept: list[Lease] = []

    async def one(cancel: bool) -> None:
        lease = coord.new_lease()
        with trio.CancelScope() as scope:
            if cancel:
                scope.deadline = trio.current_time() + random.random() / 1000
            await coord.acquire(lease, Option((Need("seats", 0), Need("pool:e", 0))))
            kept.append(lease)
        if not cancel:
            assert lease in kept and lease.state == "held"

    async with replicas(redis_server, 1) as (coord,):
        for _ in range(scaled(200, 30)):
            async with trio.open_nursery() as nursery:
                for i in range(8):
                    nursery.start_soon(one, i % 2 == 0)
        assert coord.statistics().outages_total == 0
        await coord.flush()
        assert await _count(redis_server, "seats") == len(kept)
        assert await _count(redis_server, "pool:e") == len(kept)
        for lease in kept:
            coord.release(lease)
        await coord.flush()
        assert await _count(redis_server, "seats") == 0


async def test_outage_closed_refuses_new_and_keeps_running_leases(redis_server: RedisServer) -> None:  # noqa: F811
    async with replicas(redis_server, 1, lease_ttl_s=3.0, timeout_ms=100) as (coord,):
        running = coord.new_lease()
        await coord.acquire(running, SEAT)
        redis_server.pause()
        try:
            with pytest.raises(CoordinatorUnavailable) as away:
                await coord.acquire(coord.new_lease(), SEAT)
            assert not coord.up and away.value.retry_after_ms >= 100
            with trio.fail_after(1):  # refused at once now, no call waits for the timeout
                with pytest.raises(CoordinatorUnavailable):
                    await coord.acquire(coord.new_lease(), SEAT)
            coord.release(running)  # queued
            assert coord.statistics().releases_queued >= 1
        finally:
            redis_server.resume()
        with trio.fail_after(10):
            await coord.wait_up()
            await coord.flush()
        assert await _count(redis_server, "seats") == 0
        stats = coord.statistics()
        assert stats.outages_total == 1 and stats.lost_total == 0


async def test_outage_local_admits_against_a_local_share(redis_server: RedisServer) -> None:  # noqa: F811
    async with replicas(redis_server, 1, timeout_ms=100, failure="local", expected_replicas=3) as (coord,):
        redis_server.pause()
        try:
            taken = []
            with pytest.raises(LimitRefused) as refused:
                for _ in range(5):
                    lease = coord.new_lease()
                    await coord.acquire(lease, Option((Need("seats", 8),)))
                    taken.append(lease)
            assert len(taken) == 3 and refused.value.cap == 3  # ceil(8 / 3)
            assert all(lease.where == "local" for lease in taken)
        finally:
            redis_server.resume()
        with trio.fail_after(10):
            await coord.wait_up()
        # re-asserted: the local leases are in Redis now
        assert all(lease.where == "shared" and lease.state == "held" for lease in taken)
        assert await _count(redis_server, "seats") == 3


async def test_the_local_share_counts_the_shared_leases_still_running(redis_server: RedisServer) -> None:  # noqa: F811
    """Two shared seats held when Redis goes away, a share of ceil(8 / 3) = 3: one more local seat,
    not three more (the share bounds all this replica runs)."""
    seats = Option((Need("seats", 8),))
    async with replicas(redis_server, 1, timeout_ms=100, failure="local", expected_replicas=3) as (coord,):
        held = [coord.new_lease(), coord.new_lease()]
        for lease in held:
            await coord.acquire(lease, seats)
        redis_server.pause()
        try:
            local = []
            with pytest.raises(LimitRefused) as refused:
                for _ in range(4):
                    lease = coord.new_lease()
                    await coord.acquire(lease, seats)
                    local.append(lease)
            assert len(local) == 1 and local[0].where == "local"
            assert (refused.value.count, refused.value.cap) == (3, 3)
            coord.release(held[0])  # a shared seat ends during the outage: its room is this replica's again
            await coord.acquire(coord.new_lease(), seats)
        finally:
            redis_server.resume()


async def test_an_outage_longer_than_the_ttl_loses_leases_that_no_longer_fit(redis_server: RedisServer) -> None:  # noqa: F811
    opt = Option((Need("seats", 1),))
    async with replicas(redis_server, 1, lease_ttl_s=0.6, timeout_ms=100) as (coord,):
        survivor = coord.new_lease()
        await coord.acquire(survivor, Option((Need("pool:e", 1),)))
        doomed = coord.new_lease()
        await coord.acquire(doomed, opt)
        lost: list[Lease] = []
        doomed.on_lost = lost.append
        redis_server.pause()
        await trio.sleep(0.3)
        redis_server.resume()
        # Redis' clock moved on while it was stopped: the leases expired.
        redis_server.pause()
        await trio.sleep(1.0)
        # another replica takes the seat the moment Redis is back (before this one re-asserts)
        redis_server.resume()
        async with replicas(redis_server, 1, lease_ttl_s=0.6) as (other,):
            thief = other.new_lease()
            await other.acquire(thief, opt)
            with trio.fail_after(10):
                await doomed.lost.wait()
            assert lost == [doomed] and doomed.state == "lost"
            assert survivor.state == "held"  # re-taken: its limit had room
            assert coord.statistics().lost_total == 1


KILLED_REPLICA = textwrap.dedent(
    """
    import sys, trio
    from acp_server.coordinator.redis import RedisCoordinator
    from acp_server.coordinator import Need, Option

    async def main():
        coord = RedisCoordinator(sys.argv[1], prefix="t", replica_id="doomed", lease_ttl_s=1.0)
        async with coord.running():
            for _ in range(2):
                await coord.acquire(coord.new_lease(), Option((Need("seats", 2),)))
            print("held", flush=True)
            await trio.sleep_forever()

    trio.run(main)
    """
)


async def test_a_killed_replica_frees_its_leases_within_one_ttl(redis_server: RedisServer) -> None:  # noqa: F811
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-c", KILLED_REPLICA, redis_server.url], stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        with trio.fail_after(30):
            line = b""
            while not line.endswith(b"\n"):
                line += await proc.stdout.receive_some()
        assert line.strip() == b"held"
        async with replicas(redis_server, 1) as (coord,):
            with pytest.raises(LimitRefused):
                await coord.acquire(coord.new_lease(), Option((Need("seats", 2),)))
            proc.send_signal(signal.SIGKILL)
            killed_at = trio.current_time()
            lease = coord.new_lease()
            await coord.wait_acquire(lease, Option((Need("seats", 2),)))
            # one TTL after the last renewal (renewals every TTL/3), plus a re-check
            assert trio.current_time() - killed_at < 1.0 + 0.6 + 0.5
    finally:
        proc.kill()
        await proc.wait()
        if proc.stdout is not None:
            await proc.stdout.aclose()


async def test_a_claim_is_held_by_one_replica(redis_server: RedisServer) -> None:  # noqa: F811
    async with replicas(redis_server, 2) as (a, b):
        first = await a.claim("s1", "k1", "fp", "prompt_1", 30)
        second = await b.claim("s1", "k1", "fp", "prompt_7", 30)
        assert first.claimed and not second.claimed
        assert (second.replica_id, second.state, second.prompt_id) == ("r0", "running", "prompt_1")
        await a.settle_claim("s1", "k1", "prompt_1", drop=False)
        assert (await b.claim("s1", "k1", "other", "prompt_8", 30)).state == "done"
        await a.settle_claim("s1", "k1", "prompt_1", drop=True)
        assert (await b.claim("s1", "k1", "fp", "prompt_9", 30)).claimed


async def test_two_replicas_race_for_one_key(redis_server: RedisServer) -> None:  # noqa: F811
    async with replicas(redis_server, 2) as coords:
        results: list[bool] = []

        async def claim(coord: RedisCoordinator, i: int) -> None:
            results.append((await coord.claim("s", "race", "fp", f"p{i}", 30)).claimed)

        async with trio.open_nursery() as nursery:
            for i in range(20):
                nursery.start_soon(claim, coords[i % 2], i)
        assert results.count(True) == 1


async def test_the_plan_admits_then_queues_then_refuses(redis_server: RedisServer) -> None:  # noqa: F811
    plan = LimitPlan(seats=2, shares=(0, 2, 0, 0), room=1, pools={"echo": (2, 1)})
    arrive: Callable[[], tuple[Option, ...]] = lambda: plan.arrival("t", 1, "echo")  # noqa: E731
    async with replicas(redis_server, 2) as (a, b):
        leases = [a.new_lease(), b.new_lease(), a.new_lease()]
        assert [await c.acquire(lease, *arrive()) for c, lease in zip((a, b, a), leases, strict=True)] == [0, 0, 1]
        with pytest.raises(LimitRefused) as refused:
            await b.acquire(b.new_lease(), *arrive())
        assert refused.value.name == "pool:echo" and refused.value.cap == 3
        # the waiter takes its seat when one is freed, and leaves the room in the same call
        b.release(leases[1])
        with trio.fail_after(5):
            await a.wait_acquire(leases[2], plan.seat("t", 1), leave=plan.room_names(1))
        assert sorted(leases[2].holds) == ["pool:echo", "seats", "seats:c1"]
        assert await _count(redis_server, "room") == 0
        assert await _count(redis_server, "seats") == 2


async def test_a_limit_left_without_waiting_and_taken_again_is_held_in_redis(redis_server: RedisServer) -> None:  # noqa: F811
    """leave_nowait (a permit handed back in a ``finally``) then an acquire of the same limit at once: the
    acquire goes out after the leave, so the lease ends up a member of the set, not removed by a leave
    that landed late."""
    permit = Option((Need("pool:e:active", 1),))
    async with replicas(redis_server, 2) as (a, b):
        lease = a.new_lease()
        await a.acquire(lease, SEAT, permit)
        for _ in range(20):
            a.leave_nowait(lease, ["pool:e:active"])
            assert "pool:e:active" not in lease.holds
            await a.acquire(lease, permit)
            assert "pool:e:active" in lease.holds
            assert await _count(redis_server, "pool:e:active") == 1
        with pytest.raises(LimitRefused):  # the other replica sees it taken
            await b.acquire(b.new_lease(), permit)
        a.leave_nowait(lease, ["pool:e:active"])
        await a.flush()
        assert await _count(redis_server, "pool:e:active") == 0
        assert await _count(redis_server, "seats") == 1
        a.release(lease)


async def test_a_pass_serves_one_replicas_waiters_in_rank_then_arrival_order(redis_server: RedisServer) -> None:  # noqa: F811
    """Eight waiters on one replica, one seat freed at a time: a pass tries them in one script call,
    and the seat goes to the first by rank, then by arrival."""
    seat = Option((Need("seats", 1),))
    async with replicas(redis_server, 2, recheck_s=3600) as (a, b):
        holder = a.new_lease()
        await a.acquire(holder, seat)
        order: list[int] = []
        ranks = [3, 1, 2, 1, 0, 3, 2, 0]

        async def wait(i: int) -> None:
            lease = b.new_lease()
            await b.wait_acquire(lease, seat, rank=ranks[i])
            order.append(i)
            await trio.sleep(0.01)
            b.release(lease)

        async with trio.open_nursery() as nursery:
            for i in range(len(ranks)):
                nursery.start_soon(wait, i)
                await trio.sleep(0.01)  # arrival order = index
            a.release(holder)
        assert order == sorted(range(len(ranks)), key=lambda i: (ranks[i], i))
