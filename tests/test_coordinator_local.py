"""The in-process coordinator: the same rules as the scripts (caps, all or nothing, soft caps, class
shares), local shares, waiters served in rank order, claims."""

from __future__ import annotations

import subprocess
import sys

import pytest
import trio
import trio.testing

from acp_server.coordinator import LimitPlan, LimitRefused, LocalCoordinator, Need, Option, local_share


def test_local_share_is_the_ceiling_of_the_cap_over_the_replicas() -> None:
    assert [local_share(24, n) for n in (1, 2, 3, 5, 7, 100)] == [24, 12, 8, 5, 4, 1]
    assert local_share(0, 4) == 0  # counted only


async def test_caps_all_or_nothing_and_soft_fallthrough() -> None:
    coord = LocalCoordinator("r")
    plan = LimitPlan(seats=1, shares=(0, 1, 0, 0), room=1, tenant_max_running=5, pools={"e": (1, 1)})
    first, second, third = coord.new_lease(), coord.new_lease(), coord.new_lease()
    assert await coord.acquire(first, *plan.arrival("a", 1, "e")) == 0
    assert await coord.acquire(second, *plan.arrival("a", 1, "e")) == 1  # the seat is full: queued
    with pytest.raises(LimitRefused) as refused:
        await coord.acquire(third, *plan.arrival("a", 1, "e"))
    assert refused.value.name == "pool:e" and (refused.value.count, refused.value.cap) == (2, 2)
    assert third.holds == {} and {c.name: c.count for c in coord.counts()}["room"] == 1
    coord.release(first)
    await coord.acquire(second, plan.seat("a", 1), leave=plan.room_names(1))
    counts = {c.name: c.count for c in coord.counts()}
    assert counts["seats"] == 1 and counts["room"] == 0 and second.holds.keys() == {"seats", "seats:c1", "tenant:a", "pool:e"}


async def test_a_class_at_its_share_borrows_only_when_no_class_below_its_share_waits() -> None:
    coord = LocalCoordinator("r")
    plan = LimitPlan(seats=3, shares=(0, 2, 1, 0), room=5)
    bulk = coord.new_lease()
    assert await coord.acquire(bulk, *plan.arrival("t", 3, "e")) == 0  # borrows: nobody waits
    waiter = coord.new_lease()
    assert await coord.acquire(waiter, *plan.arrival("t", 2, "e")) == 0  # background below its share
    again = coord.new_lease()
    assert await coord.acquire(again, *plan.arrival("t", 2, "e")) == 0  # the last seat, borrowed
    queued = coord.new_lease()
    assert await coord.acquire(queued, *plan.arrival("t", 1, "e")) == 1  # interactive waits
    coord.release(bulk)
    # a bulk arrival may not borrow the freed seat while interactive (below its share) waits
    assert await coord.acquire(coord.new_lease(), *plan.arrival("t", 3, "e")) == 1
    await coord.acquire(queued, plan.seat("t", 1), leave=plan.room_names(1))


async def test_local_share_divides_every_cap() -> None:
    coord = LocalCoordinator("r", replicas=4)
    taken = []
    with pytest.raises(LimitRefused) as refused:
        for _ in range(10):
            lease = coord.new_lease()
            await coord.acquire(lease, Option((Need("seats", 10),)))
            taken.append(lease)
    assert len(taken) == 3 and refused.value.cap == 3


async def test_waiters_are_served_by_rank_then_arrival() -> None:
    coord = LocalCoordinator("r")
    seat = Option((Need("seats", 1),))
    order: list[str] = []
    async with coord.running():
        holder = coord.new_lease()
        await coord.acquire(holder, seat)

        async def wait(name: str, rank: int) -> None:
            lease = coord.new_lease()
            await coord.wait_acquire(lease, seat, rank=rank)
            order.append(name)
            await trio.sleep(0.01)
            coord.release(lease)

        async with trio.open_nursery() as nursery:
            for name, rank in (("bulk", 3), ("inter1", 1), ("crit", 0), ("inter2", 1)):
                nursery.start_soon(wait, name, rank)
                await trio.testing.wait_all_tasks_blocked()
            coord.release(holder)
    assert order == ["crit", "inter1", "inter2", "bulk"]


async def test_a_cancelled_waiter_takes_nothing() -> None:
    coord = LocalCoordinator("r")
    seat = Option((Need("seats", 1),))
    async with coord.running():
        holder = coord.new_lease()
        await coord.acquire(holder, seat)
        lease = coord.new_lease()
        with trio.move_on_after(0.05):
            await coord.wait_acquire(lease, seat)
        assert lease.holds == {} and coord.statistics().waiters == 0
        coord.release(holder)
        coord.release(holder)  # idempotent
        assert coord.statistics().released_total == 1


async def test_claims_in_process() -> None:
    coord = LocalCoordinator("r")
    assert (await coord.claim("s", "k", "fp", "p1", 10)).claimed
    held = await coord.claim("s", "k", "fp2", "p2", 10)
    assert not held.claimed and held.fingerprint == "fp" and held.prompt_id == "p1"
    await coord.settle_claim("s", "k", "p1", drop=True)
    assert (await coord.claim("s", "k", "fp2", "p2", 10)).claimed


def test_coredis_is_imported_only_for_a_redis_coordinator() -> None:
    code = (
        "import sys, acp_server.cli, acp_server.coordinator; assert 'coredis' not in sys.modules;"
        " from acp_server.coordinator import redis_coordinator;"
        " redis_coordinator('redis://127.0.0.1:1/0'); assert 'coredis' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
