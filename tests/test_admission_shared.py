"""Admission against shared limits on a real Redis: two replicas, one set of limits; refusals keep their
kinds with the cluster's figures; a queued prompt takes its seat when one is freed on the other replica."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from acp_server.admission.shared import SharedAdmission, SharedHold
from acp_server.coordinator import LimitPlan
from acp_server.coordinator.redis import RedisCoordinator
from acp_server.errors import AdmissionDeferredError, CapacityExceededError, CapacityUnavailableError

from .redis_server import RedisServer, redis_server  # noqa: F401

PLAN = LimitPlan(seats=2, shares=(0, 2, 0, 0), room=1, tenant_max_running=2, pools={"echo": (2, 2)})


@asynccontextmanager
async def two(server: RedisServer, plan: LimitPlan = PLAN) -> AsyncIterator[tuple[SharedAdmission, SharedAdmission]]:
    a = RedisCoordinator(server.url, prefix="s", replica_id="a", timeout_ms=200)
    b = RedisCoordinator(server.url, prefix="s", replica_id="b", timeout_ms=200)
    async with a.running(), b.running():
        yield SharedAdmission(a, plan), SharedAdmission(b, plan)


async def _admit(adm: SharedAdmission, tenant: str = "t1", first: bool = True) -> SharedHold:
    return await adm.admit(tenant=tenant, priority="interactive", backend="echo", session_id="s1", first=first)


async def test_seats_then_the_room_then_queue_full_across_replicas(redis_server: RedisServer) -> None:  # noqa: F811
    async with two(redis_server) as (a, b):
        h1 = await _admit(a, "t1")
        h2 = await _admit(b, "t2")
        h3 = await _admit(a, "t3")
        assert [h.state for h in (h1, h2, h3)] == ["seated", "seated", "queued"]
        with pytest.raises(CapacityUnavailableError) as full:
            await _admit(b, "t4")
        assert full.value.payload.reason == "queue_full"
        # a seat freed on b reaches a's waiter
        got = trio.Event()

        async def wait() -> None:
            await h3.take_seat()
            got.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await trio.sleep(0.05)
            assert not got.is_set()
            h2.release()
            with trio.fail_after(5):
                await got.wait()
        assert h3.seated and h3.fencing_token > 0


async def test_a_tenant_at_its_cap_is_deferred_and_a_full_pool_is_capacity_exceeded(redis_server: RedisServer) -> None:  # noqa: F811
    plan = LimitPlan(seats=10, shares=(0, 10, 0, 0), room=10, tenant_max_running=1, pools={"echo": (1, 1)})
    async with two(redis_server, plan) as (a, b):
        await _admit(a, "t1")
        with pytest.raises(AdmissionDeferredError) as deferred:
            await _admit(b, "t1")
        assert deferred.value.payload.tenant_id == "t1"
        await _admit(b, "t2", first=False)  # behind others in its session: the pool slot only
        with pytest.raises(CapacityExceededError) as exceeded:
            await _admit(b, "t3")
        p = exceeded.value.payload
        assert (p.limit, p.active_count, p.waiting_count) == (2, 1, 1)


async def test_coordinator_away_and_draining_refuse_with_their_reasons(redis_server: RedisServer) -> None:  # noqa: F811
    draining = False
    coord = RedisCoordinator(redis_server.url, prefix="s", replica_id="a", timeout_ms=100)
    async with coord.running():
        adm = SharedAdmission(coord, PLAN, lambda: draining)
        redis_server.pause()
        try:
            with pytest.raises(CapacityUnavailableError) as away:
                await _admit(adm)
            assert away.value.payload.reason == "coordinator_unavailable" and away.value.payload.retry_after_ms >= 100
        finally:
            redis_server.resume()
        await coord.wait_up()
        draining = True
        with pytest.raises(CapacityUnavailableError) as drain:
            await _admit(adm)
        assert drain.value.payload.reason == "draining"


async def test_permits_are_the_pools_max_active_across_replicas(redis_server: RedisServer) -> None:  # noqa: F811
    plan = LimitPlan(pools={"echo": (1, 5)})
    async with two(redis_server, plan) as (a, b):
        ha, hb = await _admit(a), await _admit(b)
        await ha.acquire_permit()
        with trio.move_on_after(0.3) as blocked:
            await hb.acquire_permit()
        assert blocked.cancelled_caught
        ha.release_permit()
        with trio.fail_after(5):
            await hb.acquire_permit()
        ha.release()
        hb.release()
        ha.release()  # idempotent
