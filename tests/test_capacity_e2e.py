"""Per-backend capacity through the server: ``max_active``/``max_waiting`` pools seen by clients.

A scripted :class:`~tests.fakes.FakeBackend` (``fake``) gets ``max_active=1, max_waiting=1``; an echo
backend beside it has no limits, hence no pool. Everything runs in memory, on trio's clock.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio
import trio.testing

from acp_server.admission import Limits
from acp_server.admission.pool import CapacityManager, PoolLimits
from acp_server.backends import EchoBackend
from acp_server.errors import BackendUnavailableError
from acp_server.server import Server

from .fakes import FakeBackend, send_prompt
from .helpers import RawClient, assert_error_valid, connect

FAKE = "fake"
IDLE = {"active": 0, "waiting": 0, "leased": 0}


@asynccontextmanager
async def capacity_server(
    limits: Limits | None = None,
) -> AsyncIterator[tuple[Server, trio.Nursery, FakeBackend, RawClient]]:
    """A server over ``fake`` (max_active=1, max_waiting=1, the default) and an unlimited ``echo``."""
    backend = FakeBackend(FAKE)
    server = Server(
        limits,
        {FAKE: backend, "echo": EchoBackend()},
        default_backend=FAKE,
        capacity=CapacityManager({FAKE: PoolLimits(max_active=1, max_waiting=1)}),
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(server.bridge.run)
        client = await connect(server, nursery)
        yield server, nursery, backend, client
        nursery.cancel_scope.cancel()


async def pool_stats(client: RawClient) -> dict[str, Any]:
    result: dict[str, Any] = (await client.call("_acp_server/stats"))["pools"][FAKE]
    return result


def counts(pool: dict[str, Any]) -> dict[str, int]:
    return {key: pool[key] for key in IDLE}


def max_concurrent(backend: FakeBackend) -> int:
    """The most backend calls that ever ran at once (from the fake's start/end log)."""
    running = peak = 0
    for kind, _ in backend.order:
        running += 1 if kind == "start" else -1 if kind == "end" else 0
        peak = max(peak, running)
    return peak


async def test_capacity_third_session_gets_capacity_exceeded() -> None:
    """With max_active=1, max_waiting=1, prompts on three sessions: one runs, one waits, the third is
    refused with a schema-valid capacity_exceeded that changes no counter; one call runs at a time."""
    with trio.fail_after(10):
        async with capacity_server() as (server, nursery, backend, client):
            s1, _ = await client.new_session()
            s2, _ = await client.new_session()
            s3, _ = await client.new_session()
            backend.hold("one", "two")
            first = await send_prompt(client, nursery, s1, "one")
            await backend.started("one")
            second = await send_prompt(client, nursery, s2, "two")
            await trio.testing.wait_all_tasks_blocked()
            assert [c.text for c in backend.calls] == ["one"]  # "two" waits for the permit
            before = await client.call("_acp_server/stats")
            assert counts(before["pools"][FAKE]) == {"active": 1, "waiting": 1, "leased": 2}

            reply = await client.call_raw(
                "session/prompt", {"sessionId": s3, "prompt": [{"type": "text", "text": "three"}]}
            )
            error = reply["error"]
            assert error["code"] == -32005
            assert error["data"] == {
                "errorKind": "capacity_exceeded",
                "backendId": FAKE,
                "sessionId": s3,
                "limit": 2,
                "activeCount": 1,
                "waitingCount": 1,
                "retryAfterMs": 5000,
            }
            assert_error_valid(error)
            assert s3 in error["message"] and FAKE in error["message"]

            after = await client.call("_acp_server/stats")
            assert server.bridge.sessions[s3].pending_count == 0
            assert after["pools"][FAKE] == {
                **before["pools"][FAKE],
                "refusedTotal": before["pools"][FAKE]["refusedTotal"] + 1,
                "oldestWaitMs": after["pools"][FAKE]["oldestWaitMs"],  # the waiter's age goes on
            }
            assert after["pools"][FAKE]["oldestWaitMs"] >= before["pools"][FAKE]["oldestWaitMs"]
            bridge_before, bridge_after = before["bridge"], after["bridge"]
            assert bridge_after["refusedTotal"] == bridge_before["refusedTotal"] + 1
            assert {k: v for k, v in bridge_after.items() if k != "refusedTotal"} == {
                k: v for k, v in bridge_before.items() if k != "refusedTotal"
            }

            backend.release("one")
            assert (await first.wait())["result"]["stopReason"] == "end_turn"
            await backend.started("two")
            # A freed place admits the retried prompt (it waits behind "two").
            third = await send_prompt(client, nursery, s3, "three")
            backend.release("two")
            assert (await second.wait())["result"]["stopReason"] == "end_turn"
            assert (await third.wait())["result"]["stopReason"] == "end_turn"
            assert backend.texts_started() == ["one", "two", "three"]
            assert max_concurrent(backend) == 1
            await trio.testing.wait_all_tasks_blocked()
            assert counts(await pool_stats(client)) == IDLE


async def test_capacity_limits_advertised_and_pools_reported() -> None:
    """_acp_server/capabilities lists each backend's limits (null: unlimited); _acp_server/stats has a
    pool for the limited backend only, and a prompt on the unlimited one touches no pool."""
    with trio.fail_after(10):
        async with capacity_server() as (_, _nursery, _backend, client):
            caps = await client.call("_acp_server/capabilities")
            assert caps["defaultBackend"] == FAKE
            assert caps["backends"] == {
                FAKE: {"kind": "acp", "maxActive": 1, "maxWaiting": 1},
                "echo": {"kind": "echo", "maxActive": None, "maxWaiting": None},
            }
            stats = await client.call("_acp_server/stats")
            assert set(stats["pools"]) == {FAKE}
            assert stats["pools"][FAKE] == {
                **IDLE,
                "admittedTotal": 0,
                "refusedTotal": 0,
                "maxActive": 1,
                "maxWaiting": 1,
                "oldestWaitMs": 0,
            }
            echo_sid, _ = await client.new_session(backend="echo")
            assert (await client.prompt(echo_sid, "no pool here"))["stopReason"] == "end_turn"
            sid, _ = await client.new_session()
            assert (await client.prompt(sid, "pooled"))["stopReason"] == "end_turn"
            await trio.testing.wait_all_tasks_blocked()
            pool = await pool_stats(client)
            assert pool["admittedTotal"] == 1 and counts(pool) == IDLE


async def test_capacity_lease_released_on_every_path(autojump_clock: trio.testing.MockClock) -> None:
    """The lease goes back whatever ends the prompt: success, session/cancel (running, waiting for a
    permit, or queued in its session), the deadline (once the abandoned call ends), a backend failure
    (backend_unavailable) and a plain crash (internal); the pool is idle after each."""
    with trio.fail_after(60):
        async with capacity_server() as (server, nursery, backend, client):
            s1, _ = await client.new_session()
            s2, _ = await client.new_session()

            async def idle() -> None:
                await trio.testing.wait_all_tasks_blocked()
                assert counts(await pool_stats(client)) == IDLE
                assert server.bridge.statistics().pending_prompts == 0

            # success
            assert (await client.prompt(s1, "fine"))["stopReason"] == "end_turn"
            await idle()

            # cancel: one running, one waiting for the permit on another session, one queued behind
            backend.hold("running")
            running = await send_prompt(client, nursery, s1, "running")
            await backend.started("running")
            queued = await send_prompt(client, nursery, s1, "queued")
            # s1's two prompts (one running, one queued in its session) hold both leases
            refused = await client.call_raw(
                "session/prompt", {"sessionId": s2, "prompt": [{"type": "text", "text": "x"}]}
            )
            assert refused["error"]["data"]["errorKind"] == "capacity_exceeded"
            await client.notify("session/cancel", {"sessionId": s1})
            assert (await running.wait())["result"]["stopReason"] == "cancelled"
            assert (await queued.wait())["result"]["stopReason"] == "cancelled"
            await idle()

            backend.hold("holder")
            holder = await send_prompt(client, nursery, s1, "holder")
            await backend.started("holder")
            parked = await send_prompt(client, nursery, s2, "parked")
            await trio.testing.wait_all_tasks_blocked()
            assert counts(await pool_stats(client)) == {"active": 1, "waiting": 1, "leased": 2}
            await client.notify("session/cancel", {"sessionId": s2})
            assert (await parked.wait())["result"]["stopReason"] == "cancelled"
            await trio.testing.wait_all_tasks_blocked()
            assert counts(await pool_stats(client)) == {"active": 1, "waiting": 0, "leased": 1}
            assert backend.calls_of("parked") == []  # cancelled while waiting: never called
            backend.release("holder")
            assert (await holder.wait())["result"]["stopReason"] == "end_turn"
            await idle()

            # deadline: answered at the deadline; the permit is held until the abandoned call ends
            backend.ignore_cancel("stuck")
            reply = await client.call_raw(
                "session/prompt",
                {
                    "sessionId": s1,
                    "prompt": [{"type": "text", "text": "stuck"}],
                    "_meta": {"deadlineMs": 500},
                },
            )
            assert reply["error"]["data"]["errorKind"] == "prompt_deadline_exceeded"
            await trio.testing.wait_all_tasks_blocked()
            assert counts(await pool_stats(client)) == {"active": 1, "waiting": 0, "leased": 1}
            backend.release("stuck")
            await idle()

            # the backend fails (an agent that died), or crashes with a bug
            backend.fail(
                "dies", BackendUnavailableError(backend_id=FAKE, session_id=s1, reason="exited", exit_code=1)
            )
            backend.crash("bug")
            reply = await client.call_raw(
                "session/prompt", {"sessionId": s1, "prompt": [{"type": "text", "text": "dies"}]}
            )
            assert reply["error"]["data"]["errorKind"] == "backend_unavailable"
            reply = await client.call_raw(
                "session/prompt", {"sessionId": s2, "prompt": [{"type": "text", "text": "bug"}]}
            )
            assert reply["error"]["data"]["errorKind"] == "internal"
            await idle()

            # the connection that sent a running prompt leaves
            other = await connect(server, nursery)
            sid, _ = await other.new_session()
            backend.hold("orphan")
            await send_prompt(other, nursery, sid, "orphan")
            await backend.started("orphan")
            await other.stream.aclose()
            await idle()
            assert backend.calls_of("orphan")[0].outcome == "cancelled"
