"""``/health?ready=1`` on the HTTP listener of a replica with a coordinator: 503 with the registry's
``capacity_unavailable`` body (``coordinator_unavailable``) while a real Redis is stopped in ``closed``
mode, 200 in ``local`` mode (it still admits) and once Redis answers again; plain ``/health`` stays 200."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import httpx
import pytest
import trio

from acp_server.admission.policy import PolicyLimits
from acp_server.admission.shared import SharedAdmission, shared_plan
from acp_server.coordinator.base import FailureMode
from acp_server.coordinator.redis import RedisCoordinator
from acp_server.server import ListenAddress, Server
from acp_server.transports.http import HttpOptions, serve_http

from .http_helpers import check_error_body, eventually
from .redis_server import RedisServer, redis_server  # noqa: F401


@asynccontextmanager
async def replica(redis: RedisServer, failure: FailureMode) -> AsyncIterator[tuple[RedisCoordinator, str]]:
    policy = PolicyLimits(max_running_prompts=4)
    async with AsyncExitStack() as stack:
        coord = await stack.enter_async_context(
            RedisCoordinator(redis.url, prefix="h", lease_ttl_s=1.0, timeout_ms=300, failure=failure).running()
        )
        nursery = await stack.enter_async_context(trio.open_nursery())
        server = Server(None, policy=policy, shared=SharedAdmission(coord, shared_plan(policy, {})))
        await nursery.start(server.bridge.run)
        url = await nursery.start(serve_http, server.handle_stream, ListenAddress("tcp", host="127.0.0.1", port=0), HttpOptions())
        yield coord, url
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("failure", ["closed", "local"])
async def test_ready_is_503_while_the_coordinator_is_down_in_closed_mode(redis_server: RedisServer, failure: FailureMode) -> None:  # noqa: F811
    with trio.fail_after(30):
        async with replica(redis_server, failure) as (coord, url), httpx.AsyncClient(base_url=url) as http:
            await eventually(lambda: coord.up, 10)  # a first call slower than the timeout on a loaded machine
            ready = await http.get("/health", params={"ready": "1"})
            assert ready.status_code == 200 and ready.json() == {"status": "ok"}
            redis_server.pause()
            try:
                await eventually(lambda: not coord.up, 10)  # the renewal (every TTL/3) finds it away
                ready = await http.get("/health", params={"ready": "1"})
                plain = await http.get("/health")
            finally:
                redis_server.resume()
            assert plain.status_code == 200
            if failure == "closed":
                assert ready.status_code == 503
                body = check_error_body(ready)  # the registry's shape
                assert body["code"] == "capacity_unavailable" and body["reason"] == "coordinator_unavailable"
                assert body["retryAfterMs"] >= 1
            else:
                assert ready.status_code == 200
            await eventually(lambda: coord.up, 10)
            assert (await http.get("/health", params={"ready": "1"})).status_code == 200
