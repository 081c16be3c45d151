"""The admission policy wired into the server: seats, refusals, tenants and turn states on the wire.

The engine alone is covered by ``test_policy.py`` and ``test_policy_fairness.py``; here a whole
:class:`~acp_server.server.Server` over a scripted :class:`~tests.fakes.FakeBackend` is driven through
in-memory connections, and every scenario ends with :func:`assert_quiet`: every gauge back to 0 and
every admitted prompt given exactly one outcome. Time is trio's MockClock (``mock_clock`` stands
still until a test jumps it; ``autojump_clock`` where a deadline must pass).
"""

from __future__ import annotations

import copy
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing
from trio.testing import wait_all_tasks_blocked

from acp_server.admission import Limits
from acp_server.admission.policy import DECISION_KEYS, PRIORITIES, PolicyEngine, PolicyLimits, Queued, Seat
from acp_server.admission.pool import CapacityManager, PoolLimits
from acp_server.bridge import SessionBridge
from acp_server.errors import BackendUnavailableError
from acp_server.server import Server
from acp_server.types.ext import TERMINAL_TURN_STATES

from .fakes import (
    FakeBackend,
    FakePeer,
    Pending,
    admit_ticket,
    hang_guard,
    open_session,
    responses_by_id,
    send_prompt,
    text_blocks,
)
from .helpers import RawClient, RpcError, connect

FAKE = "fake"
ADMISSION_LOGGER = "acp_server.admission"


# --- harness ---------------------------------------------------------------------------------------


@asynccontextmanager
async def policy_server(
    policy: PolicyLimits | None = None,
    *,
    limits: Limits | None = None,
    capacity: CapacityManager | None = None,
) -> AsyncIterator[tuple[Server, trio.Nursery, FakeBackend]]:
    """A server over a :class:`FakeBackend` named ``fake`` with ``policy``, its bridge running."""
    backend = FakeBackend(FAKE)
    server = Server(limits, backend, capacity=capacity, policy=policy)
    async with hang_guard(), trio.open_nursery() as nursery:
        await nursery.start(server.bridge.run)
        try:
            yield server, nursery, backend
        finally:
            backend.release_all()
        nursery.cancel_scope.cancel()


async def connect_as(server: Server, nursery: trio.Nursery, tenant: str) -> RawClient:
    """A connection initialized as ``tenant`` (``initialize`` ``_meta.tenantId``)."""
    client = await connect(server, nursery, initialize=False)
    await client.call(
        "initialize", {"protocolVersion": 1, "clientCapabilities": {}, "_meta": {"tenantId": tenant, "turnStates": True}}
    )
    return client


def states(client: RawClient, session_id: str) -> list[tuple[str, Any]]:
    """``(state, positionHint or reason)`` of every turn state ``client`` got for the session, in order."""
    return [
        (ts["state"], ts.get("positionHint", ts.get("reason")))
        for ts in client.turn_states
        if ts["sessionId"] == session_id
    ]


def prompt_ids(client: RawClient, session_id: str) -> list[str]:
    """The promptId of every prompt of the session ``client`` saw accepted, in order."""
    return [ts["promptId"] for ts in client.turn_states if ts["sessionId"] == session_id and ts["state"] == "accepted"]


def states_of(client: RawClient, prompt_id: str) -> list[tuple[str, Any]]:
    return [
        (ts["state"], ts.get("positionHint", ts.get("reason"))) for ts in client.turn_states if ts["promptId"] == prompt_id
    ]


async def prompt_error(client: RawClient, session_id: str, text: str, **meta: Any) -> dict[str, Any]:
    """Send a prompt that must be refused; its JSON-RPC error (schema-checked by the client)."""
    params: dict[str, Any] = {"sessionId": session_id, "prompt": [{"type": "text", "text": text}]}
    if meta:
        params["_meta"] = meta
    reply = await client.call_raw("session/prompt", params)
    assert "error" in reply, f"{text!r} was not refused: {reply}"
    error: dict[str, Any] = reply["error"]
    return error


async def hold_one(
    server: Server, backend: FakeBackend, client: RawClient, nursery: trio.Nursery, session_id: str
) -> tuple[Pending, dict[str, Any]]:
    """Prompt "x" runs held on ``session_id``: its pending call, and the stats once it holds its seat."""
    backend.hold("x")
    pending = await send_prompt(client, nursery, session_id, "x")
    await backend.started("x")
    await wait_all_tasks_blocked()
    return pending, server.stats_snapshot()


async def result_of(pending: Pending) -> dict[str, Any]:
    response = await pending.wait()
    assert "result" in response, response
    result: dict[str, Any] = response["result"]
    return result


def admission(server: Server) -> dict[str, Any]:
    snapshot: dict[str, Any] = server.stats_snapshot()["admission"]
    return snapshot


def assert_admission_untouched(snapshot: dict[str, Any]) -> None:
    """Every admission gauge and counter of ``stats_snapshot()["admission"]`` is 0 (the policy is off)."""
    assert snapshot["enabled"] is False
    assert snapshot["maxRunningPrompts"] == 0
    for key in ("running", "waiting", "tenantsRunning", "admittedTotal", "grantedTotal", "releasedTotal",
                "expiredTotal", "cancelledTotal", "retryAfterServed", "retryAfterMsTotal"):
        assert snapshot[key] == 0, key
    assert snapshot["tenants"] == {}
    assert snapshot["decisions"] == dict.fromkeys(DECISION_KEYS, 0)
    assert set(snapshot["classes"]) == set(PRIORITIES)
    for figures in snapshot["classes"].values():
        assert figures == {"share": 0, "running": 0, "waiting": 0, "oldestWaitMs": 0}
    for histogram in snapshot["queueWait"].values():
        assert histogram["count"] == 0 and histogram["sum"] == 0


async def assert_quiet(server: Server, *clients: RawClient) -> None:
    """After a scenario: every gauge is back to 0, and every admitted prompt had exactly one outcome.

    - admission: nothing running or waiting, no tenant listed, every seat granted was released, and
      every admission (decided or enqueued) ended granted, expired or cancelled;
    - bridge: nothing pending, every admitted prompt settled; pools: nothing active, waiting or leased;
    - the wire: every request got exactly one response, every prompt one terminal turn state per
      connection that saw it, and the prompts with a terminal state are exactly the admitted ones.
    """
    await wait_all_tasks_blocked()
    snapshot = server.stats_snapshot()
    adm = snapshot["admission"]
    assert (adm["running"], adm["waiting"], adm["tenantsRunning"], adm["tenants"]) == (0, 0, 0, {}), adm
    for name, figures in adm["classes"].items():
        assert (figures["running"], figures["waiting"], figures["oldestWaitMs"]) == (0, 0, 0), name
    assert adm["grantedTotal"] == adm["releasedTotal"], adm
    assert adm["admittedTotal"] == adm["grantedTotal"] + adm["expiredTotal"] + adm["cancelledTotal"], adm
    bridge = snapshot["bridge"]
    assert (bridge["pendingPrompts"], bridge["runningPrompts"], bridge["queuedPrompts"]) == (0, 0, 0), bridge
    assert bridge["settledTotal"] == bridge["admittedTotal"], bridge
    for name, pool in snapshot["pools"].items():
        assert (pool["active"], pool["waiting"], pool["leased"]) == (0, 0, 0), name
    ended: set[str] = set()
    for client in clients:
        for rid, responses in responses_by_id(client).items():
            assert len(responses) == 1, f"request {rid!r} answered {len(responses)} times"
        terminal = Counter(ts["promptId"] for ts in client.turn_states if ts["state"] in TERMINAL_TURN_STATES)
        assert all(n == 1 for n in terminal.values()), terminal
        ended |= set(terminal)
    assert len(ended) == bridge["admittedTotal"], (sorted(ended), bridge)


def only_refusal_counted(before: dict[str, Any], after: dict[str, Any], decision: str, retry_after_ms: int) -> None:
    """A refusal changed nothing in the stats but its own counters (the bridge's refusals, the
    decision's count and the retry-after served)."""

    def rest(snapshot: dict[str, Any]) -> dict[str, Any]:
        out = copy.deepcopy(snapshot)
        del out["bridge"]["refusedTotal"], out["refusals"]
        for key in ("decisions", "retryAfterServed", "retryAfterMsTotal"):
            del out["admission"][key]
        return out

    assert rest(after) == rest(before)
    assert after["bridge"]["refusedTotal"] == before["bridge"]["refusedTotal"] + 1
    expected = dict(before["admission"]["decisions"])
    expected[decision] += 1
    assert after["admission"]["decisions"] == expected
    assert after["admission"]["retryAfterServed"] == before["admission"]["retryAfterServed"] + 1
    assert after["admission"]["retryAfterMsTotal"] == before["admission"]["retryAfterMsTotal"] + retry_after_ms


def logged_with(caplog: pytest.LogCaptureFixture, needle: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == ADMISSION_LOGGER and needle in r.getMessage()]


# --- 1. off by default -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "policy",
    [None, PolicyLimits(), PolicyLimits(max_queued_prompts=0, interactive_max_wait_ms=1, mode="observe")],
    ids=["none", "defaults", "nothing-limited"],
)
async def test_policy_off_by_default_refuses_nothing_new(policy: PolicyLimits | None, mock_clock: trio.testing.MockClock) -> None:
    """Without a seat or tenant limit the policy is off: prompts of many sessions all run at once,
    only the session's pending limit refuses, no turn state says queued, and every admission
    gauge and counter stays 0."""
    async with policy_server(policy) as (server, nursery, backend):
        assert server.policy.enabled is False
        client = await connect(server, nursery)
        sids = [(await client.new_session())[0] for _ in range(8)]
        texts = [f"p{i}" for i in range(8)]
        backend.hold(*texts, "more")
        pending = [await send_prompt(client, nursery, sid, text) for sid, text in zip(sids, texts, strict=True)]
        limit = Limits().max_pending_prompts_per_session
        pending += [await send_prompt(client, nursery, sids[0], "more") for _ in range(limit - 1)]
        await wait_all_tasks_blocked()
        assert sorted(backend.texts_started()) == texts  # all eight at once
        assert_admission_untouched(admission(server))
        error = await prompt_error(client, sids[0], "one too many")
        assert error["data"]["errorKind"] == "prompt_queue_full"  # the session's limit, nothing else

        backend.release_all()
        for p in pending:
            assert (await result_of(p))["stopReason"] == "end_turn"
        assert all(state not in ("queued", "waiting_for_dependency") for state, _ in states(client, sids[1]))
        assert states(client, sids[1]) == [("accepted", None), ("running", None), ("completed", "end_turn")]
        assert_admission_untouched(admission(server))
        await assert_quiet(server, client)


# --- 2. seats --------------------------------------------------------------------------------------


async def test_seats_queue_the_third_prompt_and_hand_it_the_first_freed_seat(mock_clock: trio.testing.MockClock) -> None:
    """``max_running_prompts=2``: three sessions with a held prompt each; two run, the third is
    accepted then queued (positionHint 1), and runs (turn state running) when one of the two ends."""
    async with policy_server(PolicyLimits(max_running_prompts=2)) as (server, nursery, backend):
        client = await connect(server, nursery)
        s1, s2, s3 = [(await client.new_session())[0] for _ in range(3)]
        backend.hold("a", "b", "c")
        pa = await send_prompt(client, nursery, s1, "a")
        pb = await send_prompt(client, nursery, s2, "b")
        pc = await send_prompt(client, nursery, s3, "c")
        await wait_all_tasks_blocked()
        assert backend.texts_started() == ["a", "b"]
        assert states(client, s3) == [("accepted", None), ("queued", 1)]
        adm = admission(server)
        assert (adm["running"], adm["waiting"], adm["decisions"]["run"], adm["decisions"]["queued"]) == (2, 1, 2, 1)
        assert adm["classes"]["interactive"]["waiting"] == 1
        assert adm["tenants"] == {"default": {"running": 2, "waiting": 1}}
        bridge = server.stats_snapshot()["bridge"]
        assert (bridge["runningPrompts"], bridge["queuedPrompts"]) == (2, 1)

        backend.release("a")
        assert (await result_of(pa))["stopReason"] == "end_turn"
        await wait_all_tasks_blocked()
        assert backend.texts_started() == ["a", "b", "c"]  # a's seat went to c
        assert states(client, s3) == [("accepted", None), ("queued", 1), ("running", None)]
        adm = admission(server)
        assert (adm["running"], adm["waiting"], adm["grantedTotal"], adm["releasedTotal"]) == (2, 0, 3, 1)
        assert adm["queueWait"]["interactive"]["count"] == 1

        backend.release("b", "c")
        for p in (pb, pc):
            assert (await result_of(p))["stopReason"] == "end_turn"
        await assert_quiet(server, client)


async def test_busy_sessions_take_turns_for_seats(mock_clock: trio.testing.MockClock) -> None:
    """A seat is released after every prompt: a session with a second prompt behind its first gives
    its seat to the waiter of another session, and its second prompt queues (turn state queued)."""
    async with policy_server(PolicyLimits(max_running_prompts=2)) as (server, nursery, backend):
        client = await connect(server, nursery)
        s1, s2, s3 = [(await client.new_session())[0] for _ in range(3)]
        backend.hold("a1", "a2", "b", "c")
        pa1 = await send_prompt(client, nursery, s1, "a1")
        pa2 = await send_prompt(client, nursery, s1, "a2")  # behind a1 in s1's FIFO
        pb = await send_prompt(client, nursery, s2, "b")
        pc = await send_prompt(client, nursery, s3, "c")  # both seats taken: queued
        await wait_all_tasks_blocked()
        assert backend.texts_started() == ["a1", "b"]
        a1_id, a2_id = prompt_ids(client, s1)
        assert states_of(client, a2_id) == [("accepted", None)]  # decided only at the head of s1
        assert states(client, s3) == [("accepted", None), ("queued", 1)]

        backend.release("a1")
        assert (await result_of(pa1))["stopReason"] == "end_turn"
        await wait_all_tasks_blocked()
        assert backend.texts_started() == ["a1", "b", "c"]  # the waiter first, not s1 again
        assert states_of(client, a2_id) == [("accepted", None), ("queued", 1)]

        backend.release("b")
        assert (await result_of(pb))["stopReason"] == "end_turn"
        await wait_all_tasks_blocked()
        assert backend.texts_started() == ["a1", "b", "c", "a2"]
        assert states_of(client, a2_id) == [("accepted", None), ("queued", 1), ("running", None)]
        backend.release("a2", "c")
        for p in (pa2, pc):
            assert (await result_of(p))["stopReason"] == "end_turn"
        assert states_of(client, a1_id)[-1] == ("completed", "end_turn")
        await assert_quiet(server, client)


# --- 3. deferred and rejected ----------------------------------------------------------------------


async def test_tenant_at_its_cap_is_deferred_and_other_tenants_run(mock_clock: trio.testing.MockClock) -> None:
    """``tenant_max_running=1``: tenant A's second session is deferred (-32010, tenant_limit, its
    tenantId, retryAfterMs in [1 s, 32 s], safe to retry); the refusal changes no gauge and sends no
    turn state; tenant B still runs; A runs again once its prompt ends."""
    async with policy_server(PolicyLimits(tenant_max_running=1)) as (server, nursery, backend):
        a = await connect_as(server, nursery, "tenant-a")
        b = await connect_as(server, nursery, "tenant-b")
        a1, _ = await a.new_session()
        a2, _ = await a.new_session()
        b1, _ = await b.new_session()
        px, before = await hold_one(server, backend, a, nursery, a1)
        seen = len(a.turn_states)

        error = await prompt_error(a, a2, "y")
        assert error["code"] == -32010
        data = error["data"]
        assert set(data) == {"errorKind", "reason", "tenantId", "retryAfterMs", "safeToRetry"}
        assert (data["errorKind"], data["reason"], data["tenantId"], data["safeToRetry"]) == (
            "admission_deferred", "tenant_limit", "tenant-a", True,
        )
        assert 1000 <= data["retryAfterMs"] <= 32000
        await wait_all_tasks_blocked()
        only_refusal_counted(before, server.stats_snapshot(), "deferred.tenant_limit", data["retryAfterMs"])
        assert len(a.turn_states) == seen and states(a, a2) == []
        assert server.bridge.sessions[a2].pending_count == 0

        assert (await b.prompt(b1, "z"))["stopReason"] == "end_turn"  # B is not capped by A
        assert admission(server)["tenants"] == {"tenant-a": {"running": 1, "waiting": 0}}
        backend.release("x")
        assert (await result_of(px))["stopReason"] == "end_turn"
        assert (await a.prompt(a2, "y"))["stopReason"] == "end_turn"
        await assert_quiet(server, a, b)


async def test_queue_full_is_rejected_with_the_request_id_it_logged(
    mock_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """``max_queued_prompts=0``: with every seat taken a new prompt is ``capacity_unavailable``
    (-32011, queue_full) whose ``requestId`` is in the decision's log line; nothing else changes."""
    caplog.set_level(logging.INFO, logger=ADMISSION_LOGGER)
    async with policy_server(PolicyLimits(max_running_prompts=1, max_queued_prompts=0)) as (server, nursery, backend):
        client = await connect(server, nursery)
        s1, _ = await client.new_session()
        s2, _ = await client.new_session()
        px, before = await hold_one(server, backend, client, nursery, s1)

        error = await prompt_error(client, s2, "y")
        assert error["code"] == -32011
        data = error["data"]
        assert set(data) == {"errorKind", "reason", "retryAfterMs", "requestId", "safeToRetry"}
        assert (data["errorKind"], data["reason"], data["safeToRetry"]) == ("capacity_unavailable", "queue_full", True)
        assert 1000 <= data["retryAfterMs"] <= 32000
        assert data["requestId"] in error["message"]
        [line] = logged_with(caplog, data["requestId"])
        assert "queue_full" in line and s2 in line
        await wait_all_tasks_blocked()
        only_refusal_counted(before, server.stats_snapshot(), "rejected.queue_full", data["retryAfterMs"])
        assert states(client, s2) == []

        backend.release("x")
        assert (await result_of(px))["stopReason"] == "end_turn"
        assert (await client.prompt(s2, "y"))["stopReason"] == "end_turn"  # a free seat: it runs
        await assert_quiet(server, client)


async def test_estimated_wait_refuses_short_deadlines_and_long_interactive_waits(
    mock_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Once a drain rate is observed (one seat held 1 s), a prompt whose ``deadlineMs`` is shorter
    than the estimated wait is ``deadline_unreachable`` (with a longer one it queues), and an
    interactive prompt facing more than ``interactive_max_wait_ms`` is ``wait_too_long`` (a
    background one queues). Each refusal is logged with its requestId and changes nothing else."""
    caplog.set_level(logging.INFO, logger=ADMISSION_LOGGER)
    policy = PolicyLimits(max_running_prompts=1, interactive_max_wait_ms=1500)
    async with policy_server(policy) as (server, nursery, backend):
        client = await connect(server, nursery)
        s1, s2, s3, s4 = [(await client.new_session())[0] for _ in range(4)]
        backend.hold("warm", "x", "y", "late", "bg")
        warm = await send_prompt(client, nursery, s1, "warm")
        await backend.started("warm")
        mock_clock.jump(1.0)  # the only seat is held for 1 s: 1 prompt per second drains
        backend.release("warm")
        assert (await result_of(warm))["stopReason"] == "end_turn"

        px = await send_prompt(client, nursery, s1, "x")
        py = await send_prompt(client, nursery, s2, "y")  # nobody ahead: queued whatever the estimate
        await wait_all_tasks_blocked()
        assert states(client, s2)[-1] == ("queued", 1)

        async def refused(sid: str, reason: str, **meta: Any) -> None:
            await wait_all_tasks_blocked()
            before = server.stats_snapshot()
            error = await prompt_error(client, sid, "refused", **meta)
            data = error["data"]
            assert (error["code"], data["errorKind"], data["reason"]) == (-32011, "capacity_unavailable", reason)
            assert 1000 <= data["retryAfterMs"] <= 32000 and data["safeToRetry"] is True
            assert len(logged_with(caplog, data["requestId"])) == 1
            await wait_all_tasks_blocked()
            only_refusal_counted(before, server.stats_snapshot(), f"rejected.{reason}", data["retryAfterMs"])

        # One waiter ahead at 1 s each: ~1 s of wait, more than 800 ms - 100 ms left to start.
        await refused(s3, "deadline_unreachable", deadlineMs=800)
        late = await send_prompt(client, nursery, s3, "late", deadlineMs=5000)
        await wait_all_tasks_blocked()
        assert states(client, s3) == [("accepted", None), ("queued", 2)]
        # Two interactive waiters ahead: ~2 s > 1.5 s; a background prompt has nobody ahead in its class.
        await refused(s4, "wait_too_long")
        bg = await send_prompt(client, nursery, s4, "bg", priority="background")
        await wait_all_tasks_blocked()
        assert states(client, s4) == [("accepted", None), ("queued", 1)]
        assert states(client, s3) == [("accepted", None), ("queued", 2)]  # refusals sent nothing

        backend.release_all()
        for p in (px, py, late, bg):
            assert (await result_of(p))["stopReason"] == "end_turn"
        await assert_quiet(server, client)


# --- 4. all or nothing with the backend pool --------------------------------------------------------


@pytest.mark.parametrize(("seats", "decision"), [(2, "run"), (1, "queued")])
async def test_pool_refusal_after_the_policy_decision_revokes_it(
    seats: int, decision: str, mock_clock: trio.testing.MockClock
) -> None:
    """A prompt the policy decided (a seat, or a place in the room) whose backend pool lease then
    fails gets ``capacity_exceeded``, and the policy's gauges and counters are as before."""
    capacity = CapacityManager({FAKE: PoolLimits(max_active=1, max_waiting=0)})
    async with policy_server(PolicyLimits(max_running_prompts=seats), capacity=capacity) as (server, nursery, backend):
        client = await connect(server, nursery)
        s1, _ = await client.new_session()
        s2, _ = await client.new_session()
        px, before = await hold_one(server, backend, client, nursery, s1)

        error = await prompt_error(client, s2, "y")
        assert (error["code"], error["data"]["errorKind"]) == (-32005, "capacity_exceeded")
        await wait_all_tasks_blocked()
        after = server.stats_snapshot()
        assert after["admission"] == before["admission"], f"the {decision!r} decision was not revoked"
        assert after["bridge"]["refusedTotal"] == before["bridge"]["refusedTotal"] + 1
        assert after["pools"][FAKE]["refusedTotal"] == before["pools"][FAKE]["refusedTotal"] + 1
        assert states(client, s2) == []

        backend.release("x")
        assert (await result_of(px))["stopReason"] == "end_turn"
        assert (await client.prompt(s2, "y"))["stopReason"] == "end_turn"
        await assert_quiet(server, client)


# --- 5. accepted prompts are never refused later ---------------------------------------------------


async def test_prompt_behind_in_its_session_waits_for_a_seat_even_when_arrivals_are_refused(
    mock_clock: trio.testing.MockClock,
) -> None:
    """A prompt accepted behind another in its session reaches the head while every seat is taken
    and the estimated wait refuses every new arrival: it queues (turn state queued) and runs."""
    policy = PolicyLimits(max_running_prompts=1, interactive_max_wait_ms=1500)
    async with policy_server(policy) as (server, nursery, backend):
        client = await connect(server, nursery)
        s1, s2, s3, s4 = [(await client.new_session())[0] for _ in range(4)]
        backend.hold("warm", "a1", "a2", "b1", "c1")
        warm = await send_prompt(client, nursery, s1, "warm")
        await backend.started("warm")
        mock_clock.jump(1.0)
        backend.release("warm")
        assert (await result_of(warm))["stopReason"] == "end_turn"  # seats drain at 1/s

        pa1 = await send_prompt(client, nursery, s1, "a1")
        pa2 = await send_prompt(client, nursery, s1, "a2")  # accepted behind a1
        pb1 = await send_prompt(client, nursery, s2, "b1")  # queued, nobody ahead
        pc1 = await send_prompt(client, nursery, s3, "c1")  # queued, ~1 s ahead (< 1.5 s)
        await wait_all_tasks_blocked()
        assert (await prompt_error(client, s4, "d"))["data"]["reason"] == "wait_too_long"  # ~2 s ahead
        _, _, a2_id = prompt_ids(client, s1)  # warm, a1, a2

        mock_clock.jump(10.0)  # a1 holds its seat 10 s: the estimate grows to ~2.8 s per waiter
        backend.release("a1")
        assert (await result_of(pa1))["stopReason"] == "end_turn"
        await wait_all_tasks_blocked()
        assert backend.texts_started() == ["warm", "a1", "b1"]
        # a2 is at the head now; arrival rules would refuse it (one waiter ahead, ~2.8 s > 1.5 s)...
        assert (await prompt_error(client, s4, "d"))["data"]["reason"] == "wait_too_long"
        # ...but it was accepted: it waits behind c1.
        assert states_of(client, a2_id) == [("accepted", None), ("queued", 2)]
        assert admission(server)["waiting"] == 2

        backend.release("b1")
        assert (await result_of(pb1))["stopReason"] == "end_turn"
        backend.release("c1")
        assert (await result_of(pc1))["stopReason"] == "end_turn"
        await backend.started("a2")
        backend.release("a2")
        assert (await result_of(pa2))["stopReason"] == "end_turn"
        assert states_of(client, a2_id) == [("accepted", None), ("queued", 2), ("running", None), ("completed", "end_turn")]
        assert backend.texts_started() == ["warm", "a1", "b1", "c1", "a2"]
        await assert_quiet(server, client)


async def test_accepted_prompt_whose_deadline_passes_while_it_waits_ends_deadline_exceeded(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A prompt accepted behind another, waiting at the head for a seat, leaves the waiting room
    when its deadline runs out: ``prompt_deadline_exceeded`` naming its promptId, turn state failed,
    never started; the seat's holder is untouched and the next prompt runs."""
    async with policy_server(PolicyLimits(max_running_prompts=1)) as (server, nursery, backend):
        client = await connect(server, nursery)
        s1, _ = await client.new_session()
        s2, _ = await client.new_session()
        backend.hold("a1", "b1")
        start = trio.current_time()
        pa1 = await send_prompt(client, nursery, s1, "a1")
        pa2 = await send_prompt(client, nursery, s1, "a2", deadlineMs=2000)
        pb1 = await send_prompt(client, nursery, s2, "b1")
        await trio.sleep(0.5)
        backend.release("a1")
        assert (await result_of(pa1))["stopReason"] == "end_turn"
        await wait_all_tasks_blocked()
        _, a2_id = prompt_ids(client, s1)
        assert states_of(client, a2_id) == [("accepted", None), ("queued", 1)]

        response = await pa2.wait()
        waited = trio.current_time() - start
        error = response["error"]
        assert (error["code"], error["data"]["errorKind"]) == (-32004, "prompt_deadline_exceeded")
        assert error["data"]["promptId"] == a2_id and error["data"]["deadlineMs"] == 2000
        assert 1.8 <= waited <= 2.0, waited  # nothing starts with less than min_deadline_left_ms left
        assert states_of(client, a2_id) == [("accepted", None), ("queued", 1), ("failed", "prompt_deadline_exceeded")]
        assert backend.calls_of("a2") == []
        adm = admission(server)
        assert (adm["expiredTotal"], adm["waiting"], adm["running"]) == (1, 0, 1)

        backend.release("b1")
        assert (await result_of(pb1))["stopReason"] == "end_turn"
        assert (await client.prompt(s1, "a3"))["stopReason"] == "end_turn"
        await assert_quiet(server, client)


# --- 6. cancel while queued ------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["session/cancel", "$/cancel_request"])
async def test_cancel_of_a_queued_prompt_leaves_the_waiting_room(how: str, mock_clock: trio.testing.MockClock) -> None:
    """A queued prompt cancelled (``session/cancel`` or ``$/cancel_request``) ends at once with turn
    state cancelled, leaves the waiting room and holds no ticket; the next waiter gets the seat."""
    async with policy_server(PolicyLimits(max_running_prompts=1)) as (server, nursery, backend):
        client = await connect(server, nursery)
        s1, s2, s3 = [(await client.new_session())[0] for _ in range(3)]
        backend.hold("a", "b", "c")
        pa = await send_prompt(client, nursery, s1, "a")
        pb = await send_prompt(client, nursery, s2, "b", id="b")
        pc = await send_prompt(client, nursery, s3, "c")
        await wait_all_tasks_blocked()
        assert admission(server)["waiting"] == 2
        [b_id] = prompt_ids(client, s2)

        if how == "session/cancel":
            await client.notify("session/cancel", {"sessionId": s2})
            result = await result_of(pb)
            assert result == {"stopReason": "cancelled", "_meta": {"promptId": b_id}}
            assert states_of(client, b_id) == [("accepted", None), ("queued", 1), ("cancelled", None)]
        else:
            await client.notify("$/cancel_request", {"requestId": "b"})
            assert (await pb.wait())["error"]["code"] == -32800
            assert states_of(client, b_id) == [("accepted", None), ("queued", 1), ("cancelled", "request_cancelled")]
        await wait_all_tasks_blocked()
        adm = admission(server)
        assert (adm["waiting"], adm["running"], adm["cancelledTotal"]) == (1, 1, 1)
        assert adm["tenants"] == {"default": {"running": 1, "waiting": 1}}
        session = server.bridge.sessions[s2]
        assert session.pending_count == 0 and not session.fifo

        backend.release("a")
        assert (await result_of(pa))["stopReason"] == "end_turn"
        await wait_all_tasks_blocked()
        assert backend.texts_started() == ["a", "c"]
        backend.release("c")
        assert (await result_of(pc))["stopReason"] == "end_turn"
        assert backend.calls_of("b") == []
        await assert_quiet(server, client)


@pytest.mark.parametrize("decided", ["run", "queued"])
async def test_prompt_settled_before_its_runner_starts_gives_its_decision_back(decided: str) -> None:
    """A prompt cancelled in the same step that admitted it (its runner never waited) gives back the
    seat or leaves the waiting room: nothing stays counted, and the next prompt gets the seat."""
    backend = FakeBackend()
    bridge = SessionBridge(backend, policy=PolicyEngine(PolicyLimits(max_running_prompts=1)))
    peer = FakePeer()
    async with hang_guard(), trio.open_nursery() as nursery:
        await nursery.start(bridge.run)
        backend.hold("holder")
        first, _ = await open_session(bridge, peer)
        second, _ = await open_session(bridge, peer)
        if decided == "queued":
            admit_ticket(bridge, first.session_id, text_blocks("holder"), peer=peer)
        target = second if decided == "queued" else first
        ticket = admit_ticket(bridge, target.session_id, text_blocks("victim"), peer=peer)
        assert isinstance(ticket.seat, Queued if decided == "queued" else Seat)
        bridge.cancel_session(target.session_id, peer)  # before any task ran
        assert ticket.settled and ticket.seat is None
        stats = bridge.policy.statistics()
        assert (stats.running, stats.waiting) == ((1, 0) if decided == "queued" else (0, 0))
        await wait_all_tasks_blocked()
        assert backend.calls_of("victim") == []
        backend.release("holder")
        await wait_all_tasks_blocked()
        after = admit_ticket(bridge, second.session_id, text_blocks("next"), peer=peer)
        assert isinstance(after.seat, Seat)  # the seat is free again
        await after.done.wait()
        await wait_all_tasks_blocked()
        stats = bridge.policy.statistics()
        assert (stats.running, stats.waiting, stats.granted_total) == (0, 0, stats.released_total)
        assert stats.admitted_total == stats.granted_total + stats.expired_total + stats.cancelled_total
        nursery.cancel_scope.cancel()


# --- 7. tenants ------------------------------------------------------------------------------------


async def test_sessions_belong_to_their_tenant(mock_clock: trio.testing.MockClock) -> None:
    """Another tenant gets ``session_not_found`` for every session call (a cancel has no effect) and
    does not list the session; the same tenant on another connection sees and uses it."""
    async with policy_server() as (server, nursery, backend):
        a = await connect_as(server, nursery, "acme")
        a_other = await connect_as(server, nursery, "acme")
        b = await connect_as(server, nursery, "globex")
        anon = await connect(server, nursery)  # tenant "default"
        sid, _ = await a.new_session()
        b_sid, _ = await b.new_session()
        backend.hold("work")
        work = await send_prompt(a, nursery, sid, "work")
        await backend.started("work")

        by_method = {
            "session/prompt": {"sessionId": sid, "prompt": [{"type": "text", "text": "steal"}]},
            "session/load": {"sessionId": sid, "cwd": "/tmp", "mcpServers": []},
            "session/resume": {"sessionId": sid, "cwd": "/tmp"},
            "session/set_mode": {"sessionId": sid, "modeId": "default"},
            "session/set_config_option": {"sessionId": sid, "configId": "model", "value": "x"},
            "session/close": {"sessionId": sid},
            "session/delete": {"sessionId": sid},
            "_acp_server/heartbeat": {"sessionId": sid},
            "_acp_server/detach": {"sessionId": sid},
            "_acp_server/fork": {"sessionId": sid},
        }
        for other in (b, anon):
            for method, params in by_method.items():
                with pytest.raises(RpcError) as info:
                    await other.call(method, params)
                assert (info.value.code, info.value.kind) == (-32002, "session_not_found"), method
                assert info.value.data["sessionId"] == sid
            await other.notify("session/cancel", {"sessionId": sid})
            listed = [s["sessionId"] for s in (await other.call("session/list", {}))["sessions"]]
            assert sid not in listed
        assert [s["sessionId"] for s in (await b.call("session/list", {}))["sessions"]] == [b_sid]
        await wait_all_tasks_blocked()
        assert backend.calls_of("work")[0].outcome is None  # the other tenants' cancels did nothing
        assert sid in server.bridge.sessions and not states(b, sid) and not states(anon, sid)

        assert [s["sessionId"] for s in (await a_other.call("session/list", {}))["sessions"]] == [sid]
        await a_other.call("session/load", {"sessionId": sid, "cwd": "/tmp", "mcpServers": []})
        queued = await send_prompt(a_other, nursery, sid, "from the same tenant")
        backend.release("work")
        assert (await result_of(work))["stopReason"] == "end_turn"
        assert (await result_of(queued))["stopReason"] == "end_turn"
        assert states(a_other, sid)[-1] == ("completed", "end_turn")
        await assert_quiet(server, a, a_other, b, anon)


@pytest.mark.parametrize("bad", [123, True, "", "x" * 129, "tab\there", ["acme"]])
async def test_bad_tenant_id_is_invalid_params_naming_it(bad: Any) -> None:
    async with policy_server() as (server, nursery, _):
        client = await connect(server, nursery, initialize=False)
        with pytest.raises(RpcError) as info:
            await client.call("initialize", {"protocolVersion": 1, "clientCapabilities": {}, "_meta": {"tenantId": bad}})
        assert (info.value.code, info.value.kind, info.value.data["path"]) == (-32602, "invalid_params", "_meta.tenantId")
        assert "_meta.tenantId" in info.value.error["message"]
        # Not initialized by the failed call: a good one works, as that tenant.
        await client.call("initialize", {"protocolVersion": 1, "clientCapabilities": {}, "_meta": {"tenantId": "x" * 128}})
        sid, _ = await client.new_session()
        assert server.bridge.sessions[sid].tenant == "x" * 128


async def test_initialize_again_cannot_change_the_tenant() -> None:
    async with policy_server() as (server, nursery, _):
        client = await connect_as(server, nursery, "acme")
        sid, _ = await client.new_session()
        with pytest.raises(RpcError) as info:
            await client.call("initialize", {"protocolVersion": 1, "clientCapabilities": {}, "_meta": {"tenantId": "globex"}})
        assert (info.value.kind, info.value.data["path"]) == ("invalid_params", "_meta.tenantId")
        assert "acme" in info.value.data["detail"]
        with pytest.raises(RpcError):
            await client.initialize()  # no tenantId: "default", another tenant too
        await client.call("initialize", {"protocolVersion": 1, "clientCapabilities": {}, "_meta": {"tenantId": "acme"}})
        assert [s["sessionId"] for s in (await client.call("session/list", {}))["sessions"]] == [sid]


@pytest.mark.parametrize("policy", [None, PolicyLimits(max_running_prompts=2)], ids=["off", "on"])
@pytest.mark.parametrize("bad", ["urgent", "", "INTERACTIVE", 1, ["bulk"]])
async def test_bad_priority_is_invalid_params_listing_the_classes(bad: Any, policy: PolicyLimits | None) -> None:
    async with policy_server(policy) as (server, nursery, _):
        client = await connect(server, nursery)
        sid, _ = await client.new_session()
        error = await prompt_error(client, sid, "x", priority=bad)
        assert (error["code"], error["data"]["errorKind"], error["data"]["path"]) == (-32602, "invalid_params", "_meta.priority")
        assert "critical, interactive, background, bulk" in error["data"]["detail"]
        assert server.stats_snapshot()["bridge"]["admittedTotal"] == 0
        for priority in PRIORITIES:
            assert (await client.prompt(sid, "x", priority=priority))["stopReason"] == "end_turn"
        await assert_quiet(server, client)


# --- 8. turn states --------------------------------------------------------------------------------


def session_events(client: RawClient, session_id: str) -> list[tuple[int, str, dict[str, Any]]]:
    """``(eventId, "turn_state" | sessionUpdate kind, params)`` of the session, in arrival order."""
    out: list[tuple[int, str, dict[str, Any]]] = []
    for msg in client.messages:
        for item in msg if isinstance(msg, list) else [msg]:
            params = item.get("params")
            if "id" in item or not isinstance(params, dict) or params.get("sessionId") != session_id:
                continue
            if item["method"] == "_acp_server/turn_state":
                out.append((params["_meta"]["eventId"], "turn_state", params))
            elif item["method"] == "session/update":
                out.append((params["_meta"]["eventId"], params["update"]["sessionUpdate"], params))
    return out


@pytest.mark.parametrize("policy", [None, PolicyLimits(max_running_prompts=4)], ids=["off", "on"])
async def test_turn_states_of_a_plain_prompt_reach_every_attached_connection(policy: PolicyLimits | None) -> None:
    """accepted, running, completed (reason end_turn) go to the sender and to another connection
    attached to the session, with epoch-ms ``at`` and eventIds that increase strictly, interleaved
    with the prompt's updates; the result's ``_meta.promptId`` is theirs."""
    async with policy_server(policy) as (server, nursery, _):
        sender = await connect(server, nursery)
        sid, _ = await sender.new_session()
        watcher = await connect(server, nursery)
        await watcher.call("session/load", {"sessionId": sid, "cwd": "/tmp", "mcpServers": []})
        t0 = int(time.time() * 1000)
        result = await sender.prompt(sid, "hello there world")
        await wait_all_tasks_blocked()
        t1 = int(time.time() * 1000)
        prompt_id = result["_meta"]["promptId"]

        streams: dict[int, list[tuple[int, str, dict[str, Any]]]] = {}
        for client in (sender, watcher):
            events = session_events(client, sid)
            ids = [e[0] for e in events]
            assert ids == sorted(set(ids)), ids  # strictly increasing in arrival order
            turn = [p for _, kind, p in events if kind == "turn_state"]
            assert [(p["state"], p.get("reason")) for p in turn] == [("accepted", None), ("running", None), ("completed", "end_turn")]
            assert {p["promptId"] for p in turn} == {prompt_id}
            assert all(isinstance(p["at"], int) and t0 <= p["at"] <= t1 for p in turn)
            assert [p["at"] for p in turn] == sorted(p["at"] for p in turn)
            kinds = [kind for _, kind, _ in events]
            # accepted, running, then the updates, then completed
            assert kinds[:2] == ["turn_state", "turn_state"] and kinds[-1] == "turn_state"
            assert "turn_state" not in kinds[2:-1] and "agent_message_chunk" in kinds[2:-1]
            streams[id(client)] = events
        watched = streams[id(watcher)]
        assert [e[0] for e in watched] == list(range(watched[0][0], watched[0][0] + len(watched)))  # no gap
        # The sender gets everything but its own prompt echoed back (whose eventId it skips).
        assert [e for e in watched if e[1] != "user_message_chunk"] == streams[id(sender)]
        assert [e[1] for e in watched].count("user_message_chunk") == 1
        await assert_quiet(server, sender, watcher)


@pytest.mark.parametrize("policy", [None, PolicyLimits(max_running_prompts=2)], ids=["off", "on"])
async def test_waiting_for_dependency_while_the_backend_pool_is_busy(policy: PolicyLimits | None) -> None:
    capacity = CapacityManager({FAKE: PoolLimits(max_active=1)})
    async with policy_server(policy, capacity=capacity) as (server, nursery, backend):
        client = await connect(server, nursery)
        s1, _ = await client.new_session()
        s2, _ = await client.new_session()
        backend.hold("one", "two")
        one = await send_prompt(client, nursery, s1, "one")
        await backend.started("one")
        two = await send_prompt(client, nursery, s2, "two")
        await wait_all_tasks_blocked()
        assert states(client, s2) == [("accepted", None), ("waiting_for_dependency", None)]
        backend.release("one")
        assert (await result_of(one))["stopReason"] == "end_turn"
        await backend.started("two")
        await wait_all_tasks_blocked()
        assert states(client, s2) == [("accepted", None), ("waiting_for_dependency", None), ("running", None)]
        backend.release("two")
        assert (await result_of(two))["stopReason"] == "end_turn"
        assert states(client, s1) == [("accepted", None), ("running", None), ("completed", "end_turn")]
        await assert_quiet(server, client)


async def test_paused_for_approval_while_a_permission_request_is_open() -> None:
    """The agent asks the sender for permission: every attached connection sees paused_for_approval
    while the request is open, then running again, then completed."""
    async with policy_server(PolicyLimits(max_running_prompts=1)) as (server, nursery, backend):
        sender = await connect(server, nursery)
        sid, _ = await sender.new_session()
        watcher = await connect(server, nursery)
        await watcher.call("session/load", {"sessionId": sid, "cwd": "/tmp", "mcpServers": []})
        backend.ask_permission("may I")
        pending = await send_prompt(sender, nursery, sid, "may I")
        for _ in range(50):
            if sender.requests_from_server:
                break
            await wait_all_tasks_blocked()
        [request] = sender.requests_from_server
        assert request["method"] == "session/request_permission"
        assert not watcher.requests_from_server  # asked of the sender only
        for client in (sender, watcher):
            assert states(client, sid) == [("accepted", None), ("running", None), ("paused_for_approval", None)]
        answer = {"outcome": {"outcome": "selected", "optionId": "allow"}}
        await sender.send({"jsonrpc": "2.0", "id": request["id"], "result": answer})
        assert (await result_of(pending))["stopReason"] == "end_turn"
        await wait_all_tasks_blocked()
        assert backend.calls_of("may I")[0].answers == [answer]
        for client in (sender, watcher):
            assert states(client, sid) == [
                ("accepted", None), ("running", None), ("paused_for_approval", None), ("running", None),
                ("completed", "end_turn"),
            ]
        await assert_quiet(server, sender, watcher)


async def test_failed_and_cancelled_turn_states_name_the_prompt() -> None:
    """failed carries the error kind as its reason (and the error its promptId); a session/cancel
    ends in cancelled; the promptId of a result is that of its turn states."""
    async with policy_server(PolicyLimits(max_running_prompts=2)) as (server, nursery, backend):
        client = await connect(server, nursery)
        sid, _ = await client.new_session()
        backend.fail("dies", BackendUnavailableError(backend_id=FAKE, session_id=sid, reason="exited", exit_code=1))
        backend.crash("bug")
        backend.hold("stop me")

        error = await prompt_error(client, sid, "dies")
        [dies_id] = prompt_ids(client, sid)
        assert (error["data"]["errorKind"], error["data"]["promptId"]) == ("backend_unavailable", dies_id)
        assert states_of(client, dies_id) == [("accepted", None), ("running", None), ("failed", "backend_unavailable")]

        error = await prompt_error(client, sid, "bug")
        bug_id = prompt_ids(client, sid)[-1]
        assert error["data"]["errorKind"] == "internal"
        assert states_of(client, bug_id) == [("accepted", None), ("running", None), ("failed", "internal")]

        pending = await send_prompt(client, nursery, sid, "stop me")
        await backend.started("stop me")
        await client.notify("session/cancel", {"sessionId": sid})
        result = await result_of(pending)
        stop_id = prompt_ids(client, sid)[-1]
        assert result == {"stopReason": "cancelled", "_meta": {"promptId": stop_id}}
        assert states_of(client, stop_id) == [("accepted", None), ("running", None), ("cancelled", None)]
        await assert_quiet(server, client)


# --- 9. observe mode -------------------------------------------------------------------------------


async def test_observe_mode_runs_everything_and_logs_what_it_would_have_done(
    mock_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """``mode="observe"`` with one seat and a tenant cap of 1: four prompts all run at once (no
    queued turn state, no refusal); the decisions count what enforce would have done, with one log
    line per decision other than run."""
    caplog.set_level(logging.INFO, logger=ADMISSION_LOGGER)
    policy = PolicyLimits(max_running_prompts=1, tenant_max_running=1, mode="observe")
    async with policy_server(policy) as (server, nursery, backend):
        a = await connect_as(server, nursery, "tenant-a")
        b = await connect_as(server, nursery, "tenant-b")
        c = await connect_as(server, nursery, "tenant-c")
        a1, _ = await a.new_session()
        a2, _ = await a.new_session()
        b1, _ = await b.new_session()
        c1, _ = await c.new_session()
        backend.hold("p1", "p2", "p3", "p4")
        pending = [
            await send_prompt(a, nursery, a1, "p1"),  # run
            await send_prompt(a, nursery, a2, "p2"),  # would be deferred: tenant-a at its cap
            await send_prompt(b, nursery, b1, "p3"),  # would be queued: the seat is taken
            await send_prompt(c, nursery, c1, "p4", deadlineMs=50),  # would be refused: < 100 ms left
        ]
        await wait_all_tasks_blocked()
        assert sorted(backend.texts_started()) == ["p1", "p2", "p3", "p4"]
        for client, sid in ((a, a1), (a, a2), (b, b1), (c, c1)):
            assert states(client, sid) == [("accepted", None), ("running", None)]
        adm = admission(server)
        assert (adm["mode"], adm["enabled"], adm["running"], adm["waiting"]) == ("observe", True, 4, 0)
        assert adm["decisions"] == {
            **dict.fromkeys(DECISION_KEYS, 0),
            "run": 1, "deferred.tenant_limit": 1, "queued": 1, "rejected.deadline_unreachable": 1,
        }
        assert (adm["retryAfterServed"], server.stats_snapshot()["bridge"]["refusedTotal"]) == (0, 0)
        lines = logged_with(caplog, "admission observe")
        assert len(lines) == 3, lines
        assert sum("would be deferred (tenant_limit)" in line and a2 in line for line in lines) == 1
        assert sum("would be queued" in line and b1 in line for line in lines) == 1
        assert sum("would be rejected (deadline_unreachable)" in line and c1 in line for line in lines) == 1

        backend.release_all()
        for p in pending:
            assert (await result_of(p))["stopReason"] == "end_turn"
        await assert_quiet(server, a, b, c)
