"""Servers that share their limits through one Redis: in-process replicas, each with its own bridge and
coordinator, driven over in-memory connections. The backend counts the calls running across replicas
and checks each call's fencing token with Redis."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import coredis
import trio

from acp_server.admission.policy import PolicyLimits
from acp_server.admission.pool import PoolLimits
from acp_server.admission.shared import SharedAdmission, shared_plan
from acp_server.backends.base import Turn
from acp_server.backends.echo import EchoBackend
from acp_server.coordinator.redis import RedisCoordinator
from acp_server.server import Server

from .helpers import RawClient, connect, scaled
from .redis_server import RedisServer, redis_server  # noqa: F401


class Counting(EchoBackend):
    """Echo, holding each call a little, counting the calls running across every replica, and checking
    that the call's fencing token is its lease's live token in Redis."""

    running = 0
    peak = 0
    calls = 0
    stale = 0
    redis: coredis.Redis[bytes] | None = None

    def __init__(self, hold_s: float) -> None:
        super().__init__(name="echo")
        self.hold_s = hold_s

    async def prompt(self, turn: Turn) -> Any:
        cls = type(self)
        meta = turn.meta or {}
        assert cls.redis is not None
        record = await cls.redis.get("{x}:lease:" + meta["leaseId"])
        if record is None or record.split(b"|")[0] != str(meta["fencingToken"]).encode():
            cls.stale += 1
        cls.running += 1
        cls.peak = max(cls.peak, cls.running)
        cls.calls += 1
        try:
            await trio.sleep(self.hold_s * random.random())
            return await super().prompt(turn)
        finally:
            cls.running -= 1


@asynccontextmanager
async def replicas(
    server: RedisServer, n: int, policy: PolicyLimits, pools: dict[str, PoolLimits] | None = None, hold_s: float = 0.01
) -> AsyncIterator[list[Server]]:
    Counting.running = Counting.peak = Counting.calls = Counting.stale = 0
    async with AsyncExitStack() as stack:
        Counting.redis = await stack.enter_async_context(coredis.Redis.from_url(server.url))
        nursery = await stack.enter_async_context(trio.open_nursery())
        out = []
        for i in range(n):
            coord = await stack.enter_async_context(
                RedisCoordinator(server.url, prefix="x", replica_id=f"r{i}", lease_ttl_s=1.5).running()
            )
            shared = SharedAdmission(coord, shared_plan(policy, pools or {}))
            srv = Server(None, Counting(hold_s), policy=policy, shared=shared)
            await nursery.start(srv.bridge.run)
            out.append(srv)
        yield out
        nursery.cancel_scope.cancel()


async def test_replicas_never_run_more_than_the_clusters_seats(redis_server: RedisServer) -> None:  # noqa: F811
    policy = PolicyLimits(max_running_prompts=3, max_queued_prompts=1000)
    prompts = scaled(400, 60)
    # each turn held 50 ms: long against a Redis round trip on a loaded machine, so 12 clients fill the 3 seats
    async with replicas(redis_server, 3, policy, hold_s=0.05) as servers, trio.open_nursery() as nursery:
        clients: list[RawClient] = [await connect(s, nursery) for s in servers for _ in range(4)]
        answered = 0

        async def client_loop(client: RawClient) -> None:
            nonlocal answered
            session_id, _ = await client.new_session()
            for _ in range(prompts // len(clients)):
                result = await client.prompt(session_id, "hi")
                assert result["stopReason"] == "end_turn"
                answered += 1

        async with trio.open_nursery() as inner:
            for client in clients:
                inner.start_soon(client_loop, client)
        nursery.cancel_scope.cancel()
    assert answered == (prompts // len(clients)) * len(clients)
    assert Counting.peak == 3  # reached, never passed
    assert Counting.stale == 0
    for srv in servers:
        stats = srv.stats_snapshot()["coordinator"]
        assert stats["leases"] == 0


async def test_refusals_keep_their_kinds_with_the_clusters_figures(redis_server: RedisServer) -> None:  # noqa: F811
    policy = PolicyLimits(max_running_prompts=1, max_queued_prompts=0)
    async with replicas(redis_server, 2, policy, hold_s=0) as (a, b), trio.open_nursery() as nursery:
        ca, cb = await connect(a, nursery), await connect(b, nursery)
        sa, _ = await ca.new_session()
        sb, _ = await cb.new_session()
        held = a.bridge.shared
        assert held is not None
        # hold the only seat from replica a, through the coordinator itself
        lease = held.coordinator.new_lease()
        await held.coordinator.acquire(lease, *held.plan.arrival("default", 1, "echo"))
        reply = await cb.call_raw("session/prompt", {"sessionId": sb, "prompt": [{"type": "text", "text": "x"}]})
        assert reply["error"]["data"]["errorKind"] == "capacity_unavailable"
        assert reply["error"]["data"]["reason"] == "queue_full"
        held.coordinator.release(lease)
        await held.coordinator.flush()
        result = await cb.prompt(sb, "y")
        assert result["stopReason"] == "end_turn"
        nursery.cancel_scope.cancel()


async def test_the_same_idempotency_key_on_two_replicas_runs_once(redis_server: RedisServer) -> None:  # noqa: F811
    policy = PolicyLimits(max_running_prompts=4)
    async with replicas(redis_server, 2, policy, hold_s=0.3) as (a, b), trio.open_nursery() as nursery:
        ca, cb = await connect(a, nursery), await connect(b, nursery)
        sid, _ = await ca.new_session()
        # Sessions live on one replica; here b holds one under the same id, as a shared store would
        # restore it there.
        other, _ = await cb.new_session()
        session = b.bridge.sessions.pop(other)
        session.session_id = sid
        b.bridge.sessions[sid] = session
        params = {"sessionId": sid, "prompt": [{"type": "text", "text": "once"}], "_meta": {"idempotencyKey": "k1"}}
        rid, first = ca.start_request("session/prompt", params)
        await ca.send({"jsonrpc": "2.0", "id": rid, "method": "session/prompt", "params": params})
        await trio.sleep(0.1)
        dup = await cb.call_raw("session/prompt", params)
        assert dup["error"]["data"]["errorKind"] == "duplicate_in_flight"
        assert dup["error"]["data"]["replicaId"] == "r0"
        changed = {**params, "prompt": [{"type": "text", "text": "other"}]}
        conflict = await cb.call_raw("session/prompt", changed)
        assert conflict["error"]["data"]["errorKind"] == "idempotency_key_conflict"
        assert (await first.receive())["result"]["stopReason"] == "end_turn"
        assert Counting.calls == 1
        # Ended: the claim is marked done in Redis, naming r0 (which has the outcome) ...
        claim_key = "{x}:idem:" + f"{len(sid)}:{sid}:k1"
        with trio.fail_after(5):
            while b"|done|" not in redis_server.command("GET", claim_key):  # noqa: ASYNC110 - settled in the background
                await trio.sleep(0.02)
        assert b"|r0|done|" in redis_server.command("GET", claim_key)
        # ... so b answers the same prompt with duplicate_in_flight naming r0, and runs nothing
        after = await cb.call_raw("session/prompt", params)
        assert after["error"]["data"]["errorKind"] == "duplicate_in_flight"
        assert after["error"]["data"]["replicaId"] == "r0"
        conflict = await cb.call_raw("session/prompt", changed)
        assert conflict["error"]["data"]["errorKind"] == "idempotency_key_conflict"
        # a itself answers the same key from its own table, with the same outcome
        again = await ca.call_raw("session/prompt", params)
        assert again["result"]["stopReason"] == "end_turn"
        assert Counting.calls == 1
        nursery.cancel_scope.cancel()


async def test_stats_and_metrics_show_the_coordinator(redis_server: RedisServer) -> None:  # noqa: F811
    from prometheus_client.parser import text_string_to_metric_families

    from acp_server.metrics import render_metrics

    policy = PolicyLimits(max_running_prompts=2)
    async with replicas(redis_server, 2, policy, hold_s=0) as (a, _b), trio.open_nursery() as nursery:
        client = await connect(a, nursery)
        sid, _ = await client.new_session()
        await client.prompt(sid, "hi")
        with trio.fail_after(5):
            while a.stats_snapshot()["coordinator"]["liveReplicas"] < 2:  # noqa: ASYNC110 - seen at a renewal
                await trio.sleep(0.05)
        stats = await client.call("_acp_server/stats")
        coord = stats["coordinator"]
        assert coord["kind"] == "redis" and coord["up"] is True and coord["liveReplicas"] == 2
        assert coord["acquiredTotal"] >= 1
        families = {f.name: f for f in text_string_to_metric_families(render_metrics(a.stats_snapshot()).decode())}
        assert families["acp_server_coordinator_up"].samples[0].value == 1.0
        assert families["acp_server_coordinator_live_replicas"].samples[0].value == 2.0
        redis_server.pause()
        try:
            with trio.fail_after(5):
                while a.stats_snapshot()["coordinator"]["up"]:  # noqa: ASYNC110 - the renewal finds it away
                    await trio.sleep(0.05)
        finally:
            redis_server.resume()
        families = {f.name: f for f in text_string_to_metric_families(render_metrics(a.stats_snapshot()).decode())}
        assert families["acp_server_coordinator_up"].samples[0].value == 0.0
        nursery.cancel_scope.cancel()
