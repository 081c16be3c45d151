"""A model backend on replicas that share its pool through Redis: the permit (one slot of the pool's
``max_active`` across the cluster) is handed back while a call sleeps a backoff and taken again before
the retry, so a backing-off prompt holds no seat at the model server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import trio

from acp_server.admission.policy import PolicyLimits
from acp_server.admission.pool import PoolLimits
from acp_server.admission.shared import SharedAdmission, shared_plan
from acp_server.backends.openai import OpenAIBackend
from acp_server.coordinator.redis import RedisCoordinator
from acp_server.server import Server

from .helpers import connect
from .openai_server import ScriptedModel, Step, serve_model
from .redis_server import RedisServer, redis_server  # noqa: F401

TIMEOUT_S = 30
ACTIVE_KEY = "{o}:l:pool:local:active"


@asynccontextmanager
async def two_replicas(server: RedisServer, model: ScriptedModel) -> AsyncIterator[tuple[list[Server], trio.Nursery]]:
    """Two servers, each with an openai backend on ``model``, sharing ``max_active = 1`` through Redis."""
    policy = PolicyLimits(max_running_prompts=8)
    pools = {"local": PoolLimits(max_active=1)}
    async with AsyncExitStack() as stack:
        nursery = await stack.enter_async_context(trio.open_nursery())
        url = await nursery.start(serve_model, model)
        servers = []
        for i in range(2):
            coord = await stack.enter_async_context(
                RedisCoordinator(server.url, prefix="o", replica_id=f"r{i}", lease_ttl_s=3).running()
            )
            backend = OpenAIBackend("local", base_url=url, model="scripted", api_key="k", max_attempts=3)
            await nursery.start(backend.run)
            shared = SharedAdmission(coord, shared_plan(policy, pools))
            srv = Server(None, {"local": backend}, default_backend="local", policy=policy, shared=shared)
            await nursery.start(srv.bridge.run)
            servers.append(srv)
        yield servers, nursery
        nursery.cancel_scope.cancel()


def _active(server: RedisServer) -> int:
    return int(server.command("ZCARD", ACTIVE_KEY).split()[-1])


async def test_the_shared_permit_is_not_held_across_a_backoff(redis_server: RedisServer) -> None:  # noqa: F811
    """Replica a's call gets a 429 (retry in 800 ms); during that backoff replica b's prompt takes the
    cluster's only permit and finishes; then a's retry takes it again. Never two at the model at once."""
    model = ScriptedModel()
    model.push(Step(status=429, headers={"retry-after-ms": "800"}))
    with trio.fail_after(TIMEOUT_S):
        async with two_replicas(redis_server, model) as ((a, b), nursery):
            ca, cb = await connect(a, nursery), await connect(b, nursery)
            sid_a, sid_b = (await ca.new_session())[0], (await cb.new_session())[0]
            done: list[str] = []

            async def prompt_a() -> None:
                done.append((await ca.prompt(sid_a, "first"))["stopReason"])

            async with trio.open_nursery() as inner:
                inner.start_soon(prompt_a)
                await model.arrived.wait()  # a's first attempt, answered 429
                await trio.sleep(0.2)  # a sleeps its backoff now
                assert _active(redis_server) == 0  # a's permit went back to the cluster
                assert (await cb.prompt(sid_b, "second"))["stopReason"] == "end_turn"
                assert len(model.requests) == 2 and not done  # b's call ran inside a's backoff
            assert done == ["end_turn"]
            assert len(model.requests) == 3
            started = model.started_at
            assert started[1] - started[0] < 0.8 <= started[2] - started[0]
            assert model.peak == 1
            assert _active(redis_server) == 0
