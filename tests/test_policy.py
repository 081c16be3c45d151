"""The admission policy engine, driven directly: limits, shares, the fast path, decisions and their error
payloads, retry hints, observe mode, deadlines, grant-or-cancel, tenant caps and the statistics."""

from __future__ import annotations

import logging
import math
import re
from typing import Any, Literal

import msgspec
import pytest
import trio
import trio.testing

import acp_server.admission as admission
from acp_server.admission import PolicyEngine, PolicyLimits, Queued, Seat, WaitDeadlineExpired
from acp_server.admission.policy import DECISION_KEYS, seat_shares
from acp_server.errors import REGISTRY, AdmissionDeferredError, CapacityUnavailableError, OverloadError

from .helpers import assert_error_valid

wait_all_tasks_blocked = trio.testing.wait_all_tasks_blocked


def error_object(err: AdmissionDeferredError | CapacityUnavailableError) -> dict[str, Any]:
    return {"code": err.code, "message": err.message, "data": msgspec.to_builtins(err.payload)}


async def seat_for(engine: PolicyEngine, **kwargs: Any) -> Seat:
    """A seat for a prompt accepted earlier, as the bridge's runner takes one: :meth:`PolicyEngine.enqueue`,
    then the ticket's ``wait`` when it got one."""
    got = engine.enqueue(**kwargs)
    if isinstance(got, Seat):
        await trio.lowlevel.cancel_shielded_checkpoint()
        return got
    return await got.wait()


def assert_settled(engine: PolicyEngine) -> None:
    """Every gauge is back at 0 and every admitted prompt had exactly one outcome."""
    s = engine.statistics()
    assert (s.running, s.waiting, s.tenants_running) == (0, 0, 0), s
    assert all((c.running, c.waiting, c.oldest_wait_ms) == (0, 0, 0) for c in s.classes.values()), s
    assert s.granted_total == s.released_total, s
    assert s.admitted_total == s.granted_total + s.expired_total + s.cancelled_total, s


def seat(got: Seat | Queued) -> Seat:
    assert isinstance(got, Seat), got
    return got


def queued(got: Seat | Queued) -> Queued:
    assert isinstance(got, Queued), got
    return got


async def observe_hold(engine: PolicyEngine, seconds: float, *, priority: str = "interactive", n: int = 1) -> None:
    """Run ``n`` prompts of ``seconds`` each at once so the engine observes its seat hold time."""
    seats = [seat(engine.decide(priority=priority, session_id=f"warm{i}")) for i in range(n)]
    await trio.sleep(seconds)
    for s in seats:
        s.release()


# --- limits, shares, exports ------------------------------------------------------------------------


def test_policy_limits_validate_naming_the_field() -> None:
    """Bad limits are refused with a message naming the field and the rule."""
    with pytest.raises(ValueError, match="max_running_prompts must be a non-negative integer"):
        PolicyLimits(max_running_prompts=-1)
    with pytest.raises(TypeError, match="max_queued_prompts"):
        PolicyLimits(max_queued_prompts=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r'tenant_overrides\["acme"\]'):
        PolicyLimits(tenant_overrides={"acme": -2})
    with pytest.raises(ValueError, match="aging_s must be a non-negative number of seconds"):
        PolicyLimits(aging_s=-1)
    with pytest.raises(ValueError, match="class_shares keys must be among critical, interactive"):
        PolicyLimits(class_shares={"urgent": 5})
    with pytest.raises(ValueError, match=r'class_shares\["bulk"\] must be a non-negative number'):
        PolicyLimits(class_shares={"bulk": float("nan")})
    with pytest.raises(ValueError, match="at least one class a positive share"):
        PolicyLimits(class_shares={"bulk": 0})
    with pytest.raises(ValueError, match='mode must be "enforce" or "observe"'):
        PolicyLimits(mode="audit")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="interactive_max_wait_ms"):
        PolicyLimits(interactive_max_wait_ms=-5)
    defaults = PolicyLimits()
    assert not defaults.enabled and defaults.max_queued_prompts == 200 and defaults.aging_s == 30
    assert defaults.interactive_max_wait_ms == 2000 and defaults.mode == "enforce"
    assert PolicyLimits(max_running_prompts=1).enabled
    assert PolicyLimits(tenant_max_running=1).enabled
    assert PolicyLimits(tenant_overrides={"a": 2}).enabled and not PolicyLimits(tenant_overrides={"a": 0}).enabled
    assert PolicyLimits(tenant_max_running=3, tenant_overrides={"a": 5}).tenant_cap("a") == 5
    assert PolicyLimits(tenant_max_running=3, tenant_overrides={"a": 5}).tenant_cap("b") == 3


def test_seat_shares_use_largest_remainder() -> None:
    """Default shares give 12/5/2/1 (interactive/background/critical/bulk) at 20 seats, bulk nothing
    at 4, and always sum to the seats; ties in the remainder go to the higher class."""
    shares = PolicyLimits().class_shares
    assert seat_shares(20, shares) == (2, 12, 5, 1)
    assert seat_shares(4, shares) == (1, 2, 1, 0)
    assert seat_shares(1, shares) == (0, 1, 0, 0)
    for seats in range(1, 101):
        parts = seat_shares(seats, shares)
        assert sum(parts) == seats and min(parts) >= 0
        for part, pct in zip(parts, (10, 60, 25, 5), strict=True):
            assert abs(part - seats * pct / 100) < 1
    assert seat_shares(3, {"interactive": 1, "bulk": 1}) == (0, 2, 0, 1)
    engine = PolicyEngine(PolicyLimits(max_running_prompts=20))
    assert engine.shares == {"critical": 2, "interactive": 12, "background": 5, "bulk": 1}


def test_policy_names_are_exported_and_errors_registered() -> None:
    """The engine's public names come from ``acp_server.admission``; the two new kinds are registered,
    retryable overload errors with the codes of the issue."""
    for name in ("PolicyEngine", "PolicyLimits", "PolicyStatistics", "ClassStatistics", "Queued", "Seat",
                 "WaitDeadlineExpired"):
        assert name in admission.__all__ and hasattr(admission, name)
    assert REGISTRY["admission_deferred"] is AdmissionDeferredError and AdmissionDeferredError.code == -32010
    assert REGISTRY["capacity_unavailable"] is CapacityUnavailableError and CapacityUnavailableError.code == -32011
    assert issubclass(AdmissionDeferredError, OverloadError) and AdmissionDeferredError.retryable
    assert issubclass(CapacityUnavailableError, OverloadError) and CapacityUnavailableError.retryable


# --- the fast path ----------------------------------------------------------------------------------


def test_everything_off_is_a_fast_path() -> None:
    """With nothing limited the engine is disabled: decide and enqueue hand out one shared no-op seat
    without reading the clock or touching a counter (even in observe mode), and releasing it is free."""

    def clock() -> float:
        raise AssertionError("a disabled engine must not read the clock")

    modes: tuple[Literal["enforce", "observe"], ...] = ("enforce", "observe")
    for mode in modes:
        engine = PolicyEngine(PolicyLimits(mode=mode, max_queued_prompts=0), clock=clock)
        assert not engine.enabled
        first = engine.decide(tenant="t", priority="bulk", deadline=0.0, session_id="s")
        assert isinstance(first, Seat)
        assert engine.enqueue(tenant="u", priority="critical") is first
        assert engine.decide() is first
        first.release()
        first.release()
        s = engine.statistics()
        assert not s.enabled and s.running == 0 and s.admitted_total == 0 and s.granted_total == 0
        assert s.decisions == dict.fromkeys(DECISION_KEYS, 0)


# --- decisions --------------------------------------------------------------------------------------


async def test_free_seat_runs_then_queues_with_position_hints(autojump_clock: trio.testing.MockClock) -> None:
    """Prompts run while seats are free, then queue with 1-based position hints in their class; each
    release hands the seat straight to the next waiter (the running count never dips), first to a
    class below its share."""
    engine = PolicyEngine(PolicyLimits(max_running_prompts=2))
    a, b = seat(engine.decide(session_id="a")), seat(engine.decide(session_id="b"))
    tickets = [queued(engine.decide(session_id=f"q{i}")) for i in range(3)]
    assert [t.position_hint for t in tickets] == [1, 2, 3]
    other = queued(engine.decide(priority="background", session_id="bg"))
    assert other.position_hint == 1
    s = engine.statistics()
    assert (s.running, s.waiting) == (2, 4)
    assert s.classes["interactive"].waiting == 3 and s.classes["background"].waiting == 1
    assert s.decisions["run"] == 2 and s.decisions["queued"] == 4
    a.release()  # background is below its share of 1 seat: it goes first
    assert engine.statistics().running == 2 and not other.waiting and tickets[0].waiting
    b.release()
    assert not tickets[0].waiting and tickets[1].waiting
    got = await tickets[0].wait()
    assert got.session_id == "q0" and got.priority == "interactive"
    for held in (await other.wait(), got):
        held.release()
    for t in tickets[1:]:
        (await t.wait()).release()
    assert_settled(engine)


async def test_tenant_at_cap_is_deferred_with_a_valid_payload(autojump_clock: trio.testing.MockClock) -> None:
    """A tenant holding its cap is deferred (-32010, reason tenant_limit, safeToRetry) while another
    tenant still runs; overrides give a tenant its own cap; nothing is counted as admitted."""
    engine = PolicyEngine(PolicyLimits(max_running_prompts=10, tenant_max_running=2, tenant_overrides={"big": 3}))
    await observe_hold(engine, 0.1)
    held = [seat(engine.decide(tenant="acme")) for _ in range(2)]
    with pytest.raises(AdmissionDeferredError) as info:
        engine.decide(tenant="acme", session_id="s1")
    err = info.value
    assert err.code == -32010
    data = msgspec.to_builtins(err.payload)
    assert data == {
        "errorKind": "admission_deferred",
        "reason": "tenant_limit",
        "tenantId": "acme",
        "retryAfterMs": 1000,  # 0.1 s mean hold / 2 seats, clamped up to 1 s
        "safeToRetry": True,
    }
    assert_error_valid(error_object(err))
    held += [seat(engine.decide(tenant="big")) for _ in range(3)]
    with pytest.raises(AdmissionDeferredError):
        engine.decide(tenant="big")
    held.append(seat(engine.decide(tenant="other")))
    s = engine.statistics()
    assert s.decisions["deferred.tenant_limit"] == 2 and s.admitted_total == 1 + 6 and s.running == 6
    assert s.retry_after_served == 2
    for h in held:
        h.release()
    assert_settled(engine)


async def test_retry_after_is_clamped_and_follows_the_drain_rate(autojump_clock: trio.testing.MockClock) -> None:
    """retryAfterMs comes from the observed hold time of the queue concerned, clamped to [1 s, 32 s];
    with no drain observed yet it is the default 5 s hint."""
    engine = PolicyEngine(PolicyLimits(tenant_max_running=1))
    held = seat(engine.decide(tenant="t"))
    with pytest.raises(AdmissionDeferredError) as info:
        engine.decide(tenant="t")
    assert info.value.payload.retry_after_ms == 5000  # type: ignore[attr-defined]
    await trio.sleep(100.0)
    held.release()  # a 100 s hold: one seat frees in 100 s, clamped to 32 s
    held = seat(engine.decide(tenant="t"))
    with pytest.raises(AdmissionDeferredError) as info:
        engine.decide(tenant="t")
    assert info.value.payload.retry_after_ms == 32000  # type: ignore[attr-defined]
    held.release()
    s = engine.statistics()
    assert s.retry_after_served == 2 and s.retry_after_ms_total == 37000
    assert_settled(engine)


async def test_queue_full_is_rejected_with_a_logged_request_id(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A full waiting room refuses with capacity_unavailable (-32011, reason queue_full); the payload's
    requestId is in the decision's log line; with max_queued_prompts=0 nothing ever queues."""
    caplog.set_level(logging.INFO, logger="acp_server.admission")
    engine = PolicyEngine(PolicyLimits(max_running_prompts=1, max_queued_prompts=1))
    await observe_hold(engine, 2.0)
    running = seat(engine.decide())
    waiting = queued(engine.decide())
    with pytest.raises(CapacityUnavailableError) as info:
        engine.decide(tenant="acme", session_id="s9")
    err = info.value
    data = msgspec.to_builtins(err.payload)
    assert err.code == -32011 and data["reason"] == "queue_full" and data["safeToRetry"] is True
    assert data["retryAfterMs"] == 2000  # one waiter must leave: 2 s mean hold / 1 seat
    assert re.fullmatch(r"adm_[0-9a-f]{16}", data["requestId"])
    assert_error_valid(error_object(err))
    (line,) = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
    assert data["requestId"] in line and "queue_full" in line and "tenant=acme" in line and "session=s9" in line
    assert engine.statistics().decisions["rejected.queue_full"] == 1
    running.release()
    (await waiting.wait()).release()

    no_room = PolicyEngine(PolicyLimits(max_running_prompts=1, max_queued_prompts=0))
    only = seat(no_room.decide())
    with pytest.raises(CapacityUnavailableError, match="queue_full"):
        no_room.decide()
    only.release()
    assert_settled(engine)
    assert_settled(no_room)


async def test_estimated_wait_refuses_interactive_waits_and_deadlines(autojump_clock: trio.testing.MockClock) -> None:
    """Once a drain is observed, an interactive prompt whose estimated wait exceeds
    interactive_max_wait_ms is refused wait_too_long; any prompt whose estimate exceeds its deadline
    is refused deadline_unreachable; background is not held to the interactive bound."""
    engine = PolicyEngine(PolicyLimits(max_running_prompts=2, interactive_max_wait_ms=2000))
    assert engine.shares == {"critical": 0, "interactive": 1, "background": 1, "bulk": 0}
    await observe_hold(engine, 1.0, n=2)  # mean hold 1 s, 2 seats serve interactive: 0.5 s per waiter ahead
    held = [seat(engine.decide()) for _ in range(2)]
    waiting = [queued(engine.decide()) for _ in range(5)]  # estimates 0, 0.5, ..., 2.0 s: all fit 2 s
    with pytest.raises(CapacityUnavailableError) as info:
        engine.decide()  # 5 ahead: 2.5 s
    data = msgspec.to_builtins(info.value.payload)
    assert data["reason"] == "wait_too_long" and data["retryAfterMs"] == 1000  # 0.5 s over, clamped up
    assert_error_valid(error_object(info.value))
    # Background: one seat share, nothing of its own running, 1 s per waiter ahead.
    waiting += [queued(engine.decide(priority="background")) for _ in range(3)]
    waiting.append(queued(engine.decide(priority="background")))  # 3 s estimate: no interactive bound
    now = trio.current_time()
    with pytest.raises(CapacityUnavailableError) as info:
        engine.decide(priority="background", deadline=now + 2.0)  # 4 s wait + 1 s hold vs 1.9 s usable
    data = msgspec.to_builtins(info.value.payload)
    assert data["reason"] == "deadline_unreachable"
    assert data["retryAfterMs"] == pytest.approx(3000, abs=1)  # 4 s wait + 1 s hold vs 2 s left
    with pytest.raises(CapacityUnavailableError):  # the wait alone would fit: the prompt would not
        engine.decide(priority="background", deadline=now + 4.2)
    waiting.append(queued(engine.decide(priority="background", deadline=now + 5.2)))  # 4 s + 1 s fits 5.1 s
    s = engine.statistics()
    assert s.decisions["rejected.wait_too_long"] == 1 and s.decisions["rejected.deadline_unreachable"] == 2
    assert s.waiting == 10
    for h in held:
        h.release()

    async def drain(ticket: Queued) -> None:
        with await ticket.wait():
            await trio.sleep(1.0)

    async with trio.open_nursery() as nursery:
        for t in waiting:
            nursery.start_soon(drain, t)
    assert_settled(engine)


async def test_no_prompt_starts_without_enough_deadline_left(autojump_clock: trio.testing.MockClock) -> None:
    """A prompt with less than min_deadline_left_ms of its deadline left is refused deadline_unreachable
    even with free seats; before any drain a prompt with a deadline may queue."""
    engine = PolicyEngine(PolicyLimits(max_running_prompts=1, min_deadline_left_ms=100))
    now = trio.current_time()
    for deadline in (now - 1.0, now, now + 0.1):
        with pytest.raises(CapacityUnavailableError) as info:
            engine.decide(deadline=deadline)
        assert info.value.payload.reason == "deadline_unreachable"  # type: ignore[attr-defined]
    first = seat(engine.decide(deadline=now + 0.2))
    later = queued(engine.decide(deadline=now + 0.2))  # no estimate yet: it may queue
    first.release()
    (await later.wait()).release()
    assert_settled(engine)


async def test_waiter_leaves_when_its_deadline_runs_out(autojump_clock: trio.testing.MockClock) -> None:
    """A waiter leaves the queue exactly min_deadline_left_ms before its deadline (wait raises
    WaitDeadlineExpired); one whose ticket is not being awaited is skipped at the next grant and
    never starts; an accepted head prompt with no deadline left gets an expired ticket."""
    engine = PolicyEngine(PolicyLimits(max_running_prompts=1, min_deadline_left_ms=100))
    start = trio.current_time()
    held = seat(engine.decide())
    awaited = queued(engine.decide(deadline=start + 5.0))
    with pytest.raises(WaitDeadlineExpired):
        await awaited.wait()
    assert trio.current_time() - start == pytest.approx(4.9)
    assert engine.statistics().waiting == 0 and engine.statistics().expired_total == 1
    held.release()
    assert_settled(engine)

    # A fresh engine: the first one has seen a 4.9 s hold, so a 1 s deadline could not start there.
    engine = PolicyEngine(PolicyLimits(max_running_prompts=1, min_deadline_left_ms=100))
    held = seat(engine.decide())
    lazy = queued(engine.decide(deadline=trio.current_time() + 1.0))
    behind = queued(engine.decide())
    await trio.sleep(2.0)
    held.release()  # the lazy ticket's deadline passed: the seat goes to the next waiter
    with pytest.raises(WaitDeadlineExpired):
        await lazy.wait()
    got = await behind.wait()
    assert got.session_id == behind.session_id
    s = engine.statistics()
    assert s.expired_total == 1 and s.running == 1

    head = queued(engine.enqueue(deadline=trio.current_time() + 0.05))
    with pytest.raises(WaitDeadlineExpired):
        await head.wait()
    got.release()
    with pytest.raises(WaitDeadlineExpired):  # a free seat, but not enough deadline left to start
        await seat_for(engine, deadline=trio.current_time() + 0.05)
    assert_settled(engine)
    assert engine.statistics().expired_total == 3  # lazy, head and the last one


async def test_accepted_head_prompts_are_never_refused(autojump_clock: trio.testing.MockClock) -> None:
    """enqueue and a ticket's wait never refuse: not for a full room, a tenant at its cap or a long
    estimate; they wait for the seat the fair queue gives them."""
    engine = PolicyEngine(
        PolicyLimits(max_running_prompts=1, max_queued_prompts=0, tenant_max_running=1, interactive_max_wait_ms=1)
    )
    await observe_hold(engine, 10.0)
    held = seat(engine.decide(tenant="a"))
    order: list[str] = []

    async def head(tenant: str, name: str) -> None:
        with await seat_for(engine, tenant=tenant, session_id=name) as got:
            order.append(got.session_id)
            await trio.sleep(1.0)

    async with trio.open_nursery() as nursery:
        for i in range(3):
            for tenant in "ab":
                nursery.start_soon(head, tenant, f"{tenant}{i}")
                await wait_all_tasks_blocked()
        assert engine.statistics().waiting == 6
        held.release()
    assert order == ["a0", "b0", "a1", "b1", "a2", "b2"]
    assert engine.statistics().decisions["queued"] == 0
    assert_settled(engine)


async def test_tenant_cap_holds_waiters_without_global_seats(autojump_clock: trio.testing.MockClock) -> None:
    """With only a tenant cap, accepted prompts of a capped tenant wait for that tenant's own seats
    while other tenants run at once; the cap is never exceeded."""
    engine = PolicyEngine(PolicyLimits(tenant_max_running=2))
    peak = {"a": 0, "b": 0}
    now_running = {"a": 0, "b": 0}

    async def head(tenant: str) -> None:
        with await seat_for(engine, tenant=tenant):
            now_running[tenant] += 1
            peak[tenant] = max(peak[tenant], now_running[tenant])
            await trio.sleep(1.0)
            now_running[tenant] -= 1

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for _ in range(6):
            nursery.start_soon(head, "a")
        nursery.start_soon(head, "b")
    assert peak == {"a": 2, "b": 1}
    assert trio.current_time() - start == pytest.approx(3.0)
    assert_settled(engine)


# --- observe mode -----------------------------------------------------------------------------------


async def test_observe_mode_admits_everything_and_counts(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """In observe mode every prompt gets a seat at once, past every limit, while the decisions count
    what enforce mode would have done, with one log line per non-run decision and no retry hints."""
    caplog.set_level(logging.INFO, logger="acp_server.admission")
    engine = PolicyEngine(
        PolicyLimits(max_running_prompts=1, max_queued_prompts=1, tenant_max_running=2, mode="observe")
    )
    seats = [engine.decide(tenant="a", session_id=f"s{i}") for i in range(3)]  # run, queued, deferred
    seats += [engine.decide(tenant="b"), engine.decide(tenant="c")]  # queued (room of 1 not used), ...
    seats.append(engine.enqueue(tenant="a"))
    assert all(isinstance(s, Seat) for s in seats)
    s = engine.statistics()
    assert s.running == 6 and s.waiting == 0 and s.mode == "observe"
    assert s.decisions == {
        "run": 1,
        "queued": 3,
        "deferred.tenant_limit": 1,
        "rejected.queue_full": 0,
        "rejected.deadline_unreachable": 0,
        "rejected.wait_too_long": 0,
    }
    assert s.retry_after_served == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "acp_server.admission"]
    assert len(lines) == 4 and all(line.startswith("admission observe: would be") for line in lines)
    assert any("deferred (tenant_limit)" in line and "tenant=a" in line for line in lines)
    for got in seats:
        assert isinstance(got, Seat)
        got.release()
    assert_settled(engine)
    # An observed past-deadline prompt still runs and is counted.
    assert isinstance(engine.decide(deadline=trio.current_time() - 1), Seat)
    assert engine.statistics().decisions["rejected.deadline_unreachable"] == 1


# --- grant or cancel --------------------------------------------------------------------------------


async def test_cancelled_waiter_leaves_and_never_runs(autojump_clock: trio.testing.MockClock) -> None:
    """A waiter cancelled before its grant leaves the queue; the released seat goes to the next one."""
    engine = PolicyEngine(PolicyLimits(max_running_prompts=1))
    held = seat(engine.decide())
    doomed, next_one = queued(engine.decide(session_id="doomed")), queued(engine.decide(session_id="next"))
    ran: list[str] = []

    async def waiter(ticket: Queued) -> None:
        with await ticket.wait() as got:
            ran.append(got.session_id)

    async with trio.open_nursery() as nursery:
        with trio.CancelScope() as scope:
            nursery.start_soon(waiter, doomed)
            await wait_all_tasks_blocked()
            scope.cancel()
        nursery.cancel_scope.cancel()  # cancels the waiter task itself
    assert not doomed.waiting and engine.statistics().waiting == 1
    held.release()
    got = await next_one.wait()
    assert got.session_id == "next" and ran == []
    s = engine.statistics()
    assert s.cancelled_total == 1 and s.running == 1
    got.release()
    assert_settled(engine)


async def test_grant_that_wins_the_race_is_owned(autojump_clock: trio.testing.MockClock) -> None:
    """A grant in the same tick as the cancel wins: wait returns the seat, the cancel arrives at the
    next checkpoint, and the seat is released once; nothing is lost or freed twice."""
    engine = PolicyEngine(PolicyLimits(max_running_prompts=1))
    held = seat(engine.decide())
    ticket = queued(engine.decide())
    got: list[Seat] = []

    async def waiter(scope: trio.CancelScope) -> None:
        with scope:
            s = await ticket.wait()
            got.append(s)
            try:
                await trio.sleep(1)
            finally:
                s.release()

    scope = trio.CancelScope()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter, scope)
        await wait_all_tasks_blocked()
        held.release()  # grants the seat to the parked waiter (rescheduled) ...
        scope.cancel()  # ... and the cancel comes in the same tick
    assert len(got) == 1 and got[0].released
    assert engine.statistics().cancelled_total == 0
    assert_settled(engine)


async def test_cancel_gives_up_a_ticket_in_every_state(autojump_clock: trio.testing.MockClock) -> None:
    """Queued.cancel leaves the room (waking a parked wait with RuntimeError), releases a seat granted
    but not claimed (handing it on), and does nothing once claimed; a wait in a cancelled scope gives
    the ticket up too."""
    engine = PolicyEngine(PolicyLimits(max_running_prompts=1))
    held = seat(engine.decide())
    parked, unclaimed, last = (queued(engine.decide(session_id=n)) for n in ("parked", "unclaimed", "last"))
    errors: list[BaseException] = []

    async def waiter() -> None:
        try:
            await parked.wait()
        except RuntimeError as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await wait_all_tasks_blocked()
        parked.cancel()
    assert len(errors) == 1 and "cancelled" in str(errors[0])
    held.release()  # granted to "unclaimed", which nobody awaits
    assert engine.statistics().running == 1 and not unclaimed.waiting
    unclaimed.cancel()  # its seat goes to "last"
    unclaimed.cancel()
    with pytest.raises(RuntimeError):
        await unclaimed.wait()
    with trio.CancelScope() as scope:
        scope.cancel()
        await last.wait()  # granted already, but never claimed: cancelling releases it
    s = engine.statistics()
    assert s.cancelled_total == 1 and s.granted_total == 3
    assert_settled(engine)


async def test_unknown_priority_is_refused() -> None:
    """A priority outside the four classes is a ValueError naming them."""
    engine = PolicyEngine(PolicyLimits(max_running_prompts=1))
    with pytest.raises(ValueError, match="priority must be one of critical, interactive, background, bulk"):
        engine.decide(priority="urgent")
    assert engine.statistics().admitted_total == 0


async def test_statistics_report_oldest_wait_per_class(autojump_clock: trio.testing.MockClock) -> None:
    """statistics() gives per class its share, running seats, waiters and oldest wait; it is frozen."""
    engine = PolicyEngine(PolicyLimits(max_running_prompts=20))
    held = [seat(engine.decide(priority="bulk")) for _ in range(20)]
    first = queued(engine.decide(priority="critical"))
    await trio.sleep(1.5)
    second = queued(engine.decide(priority="critical"))
    s = engine.statistics()
    assert s.classes["critical"].waiting == 2 and s.classes["critical"].oldest_wait_ms == 1500
    assert s.classes["bulk"].running == 20 and s.classes["bulk"].share == 1
    assert s.max_running_prompts == 20 and s.tenants_running == 1
    with pytest.raises(AttributeError):
        s.running = 3  # type: ignore[misc]
    encoded = msgspec.json.decode(msgspec.json.encode(s))
    assert encoded["classes"]["critical"]["oldestWaitMs"] == 1500 and "retryAfterServed" in encoded
    for h in held:
        h.release()
    for t in (first, second):
        (await t.wait()).release()
    assert_settled(engine)
    assert math.isclose(engine.statistics().classes["critical"].oldest_wait_ms, 0)
