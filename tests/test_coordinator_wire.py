"""The Redis coordinator's wire against a real redis-server: scripts loaded again after ``SCRIPT FLUSH``
(``NOSCRIPT``), a renewal of several batches sent as one pipeline with each reply matched to its batch,
and a release queue longer than one batch drained after an outage."""

from __future__ import annotations

import pytest
import trio

from acp_server.coordinator import CoordinatorUnavailable, Need, Option
from acp_server.coordinator.redis import RedisCoordinator

from .redis_server import RedisServer, redis_server  # noqa: F401

SEAT = Option((Need("seats", 10_000),))


async def _count(server: RedisServer, name: str) -> int:
    out = await trio.to_thread.run_sync(server.command, "ZCARD", "{w}:l:" + name)
    return int(out.split()[-1])


async def test_calls_after_script_flush_load_the_scripts_again(redis_server: RedisServer) -> None:  # noqa: F811
    async with RedisCoordinator(redis_server.url, prefix="w", timeout_ms=2000).running() as coord:
        first = coord.new_lease()
        await coord.acquire(first, SEAT)
        assert (await trio.to_thread.run_sync(redis_server.command, "SCRIPT", "FLUSH")).strip() == b"OK"
        second = coord.new_lease()
        await coord.acquire(second, SEAT)  # acquire.lua: NOSCRIPT, loaded, sent again
        assert second.state == "held" and await _count(redis_server, "seats") == 2
        assert await coord._renew([first, second]) == []  # renew.lua the same way
        coord.release(first)
        await coord.flush()
        assert await _count(redis_server, "seats") == 1
        assert coord.statistics().failures_total == 0 and coord.up


async def test_a_renewal_of_several_batches_matches_each_reply_to_its_batch(redis_server: RedisServer) -> None:  # noqa: F811
    async with RedisCoordinator(redis_server.url, prefix="w", timeout_ms=5000, lease_ttl_s=30.0).running() as coord:
        leases = []
        for _ in range(450):  # three renew.lua calls of at most 200 leases, one pipeline
            lease = coord.new_lease()
            await coord.acquire(lease, SEAT)
            leases.append(lease)
        gone = {leases[3], leases[250], leases[449]}  # one in each batch
        for lease in gone:
            await trio.to_thread.run_sync(redis_server.command, "DEL", "{w}:lease:" + lease.id)
        assert (await trio.to_thread.run_sync(redis_server.command, "SCRIPT", "FLUSH")).strip() == b"OK"
        lost = await coord._renew(leases)
        assert set(lost) == gone and len(lost) == 3
        assert coord.statistics().failures_total == 0


async def test_a_release_queue_longer_than_a_batch_is_drained_after_an_outage(redis_server: RedisServer) -> None:  # noqa: F811
    async with RedisCoordinator(redis_server.url, prefix="w", timeout_ms=200, lease_ttl_s=30.0).running() as coord:
        leases = []
        for _ in range(150):  # three release.lua calls of at most 64, one pipeline
            lease = coord.new_lease()
            await coord.acquire(lease, SEAT)
            leases.append(lease)
        assert await _count(redis_server, "seats") == 150
        redis_server.pause()
        try:
            with pytest.raises(CoordinatorUnavailable):  # the call times out: the coordinator is down
                await coord.acquire(coord.new_lease(), SEAT)
            assert not coord.up
            for lease in leases:
                coord.release(lease)
            assert coord.statistics().releases_queued >= 150
        finally:
            redis_server.resume()
        with trio.fail_after(10):
            await coord.wait_up()
            await coord.flush()
        assert await _count(redis_server, "seats") == 0
        assert coord.statistics().releases_queued == 0


async def _evalsha_calls(server: RedisServer) -> int:
    out = (await trio.to_thread.run_sync(server.command, "INFO", "commandstats")).decode()
    stat = next(line for line in out.splitlines() if line.startswith("cmdstat_evalsha:"))
    return int(stat.split("calls=")[1].split(",")[0])


async def test_a_release_queued_before_an_acquisition_is_applied_by_its_call(redis_server: RedisServer) -> None:  # noqa: F811
    one = Option((Need("one", 1),))
    async with RedisCoordinator(redis_server.url, prefix="w", timeout_ms=2000, lease_ttl_s=60.0).running() as coord:
        first = coord.new_lease()
        await coord.acquire(first, one)
        before = await _evalsha_calls(redis_server)
        coord.release(first)
        second = coord.new_lease()
        await coord.acquire(second, one)  # the only seat: there because first's release went first
        assert await _evalsha_calls(redis_server) - before == 1  # one call did both
        assert second.state == "held" and second.token > first.token
        await coord.flush()
        assert coord.statistics().releases_queued == 0
        # with no acquisition after it, a release goes out on its own
        coord.release(second)
        with trio.fail_after(5):
            await coord.flush()
        assert await _count(redis_server, "one") == 0
