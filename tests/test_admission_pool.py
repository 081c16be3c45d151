"""The per-backend capacity pool: synchronous lease admission, FIFO permits, grant-or-cancel, statistics."""

from __future__ import annotations

import functools
import gc
import inspect
import json
import random
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import pytest
import trio
import trio.testing

import acp_server.admission as admission
from acp_server.admission import CapacityManager, CapacityPool, Lease, PoolLimits, PoolStatistics
from acp_server.errors import REGISTRY, RETRY_AFTER_MS, CapacityExceededError, OverloadError

from .helpers import SCHEMAS, assert_error_valid, scaled

wait_all_tasks_blocked = trio.testing.wait_all_tasks_blocked
AsyncTest = TypeVar("AsyncTest", bound=Callable[..., Awaitable[None]])


def deadlock_fails(test: AsyncTest) -> AsyncTest:
    """Bound an async test in virtual time: under the autojump clock a deadlocked pool (tasks parked
    forever) jumps straight to the limit and fails at once instead of hanging the run."""

    @functools.wraps(test)
    async def bounded(*args: Any, **kwargs: Any) -> None:
        with trio.fail_after(1_000_000):
            await test(*args, **kwargs)

    return bounded  # type: ignore[return-value]


def make_pool(max_active: int = 1, max_waiting: int | None = None, backend_id: str = "b") -> CapacityPool:
    return CapacityPool(backend_id, PoolLimits(max_active=max_active, max_waiting=max_waiting))


def counters(pool: CapacityPool) -> tuple[int, int, int]:
    s = pool.statistics()
    return s.active, s.waiting, s.leased


async def call(lease: Lease, log: list[str], name: str, *, hold: float = 1.0) -> None:
    """One prompt: a backend call under ``lease`` that logs its start and holds the permit for ``hold``
    seconds, then the lease released."""
    with lease:
        async with lease.permit():
            log.append(name)
            await trio.sleep(hold)


# --- limits, manager, fast path ---------------------------------------------------------------------


def test_pool_limits_validate_with_named_messages() -> None:
    """Bad bounds are refused naming the field; max_waiting without max_active makes no sense."""
    with pytest.raises(ValueError, match="max_active must be a positive integer"):
        PoolLimits(max_active=0)
    with pytest.raises(TypeError, match="max_active"):
        PoolLimits(max_active=True)
    with pytest.raises(ValueError, match="max_waiting must be a non-negative integer"):
        PoolLimits(max_active=1, max_waiting=-1)
    with pytest.raises(ValueError, match="max_waiting needs max_active"):
        PoolLimits(max_waiting=3)
    with pytest.raises(ValueError, match="retry_after_ms"):
        PoolLimits(max_active=1, retry_after_ms=0)
    assert PoolLimits().unlimited and PoolLimits().admission_limit is None
    assert PoolLimits(max_active=2).admission_limit is None
    assert PoolLimits(max_active=2, max_waiting=0).admission_limit == 2
    assert PoolLimits(max_active=2, max_waiting=3).admission_limit == 5
    with pytest.raises(ValueError, match="no pool"):
        CapacityPool("u", PoolLimits())


def test_unlimited_backend_has_no_pool() -> None:
    """A backend without limits (or not named at all) gets no pool object: its fast path has nothing to lock."""
    manager = CapacityManager({"limited": PoolLimits(max_active=1), "free": PoolLimits()})
    assert manager.pool("free") is None
    assert manager.pool("unknown") is None
    assert isinstance(manager.pool("limited"), CapacityPool)
    assert set(manager.statistics()) == {"limited"}
    assert CapacityManager().statistics() == {}
    with pytest.raises(TypeError, match='backend "x" must be a PoolLimits'):
        CapacityManager({"x": {"max_active": 1}})  # type: ignore[dict-item]


@deadlock_fails
async def test_managers_and_backends_are_independent(autojump_clock: trio.testing.MockClock) -> None:
    """Two managers (two servers) with the same backend id, and two backends of one manager, never share capacity."""
    limits = {"a": PoolLimits(max_active=1, max_waiting=0), "b": PoolLimits(max_active=1, max_waiting=0)}
    first, second = CapacityManager(limits), CapacityManager(limits)
    a1, b1, a2 = first.pool("a"), first.pool("b"), second.pool("a")
    assert a1 is not None and b1 is not None and a2 is not None
    assert len({id(a1), id(b1), id(a2)}) == 3
    held = a1.try_lease("s")
    held.acquire_permit_nowait()
    with pytest.raises(CapacityExceededError):
        a1.try_lease("s")
    # the full pool a of the first manager blocks neither its pool b nor the second manager's pool a
    for other in (b1, a2):
        with other.try_lease("s") as lease:
            lease.acquire_permit_nowait()
            assert lease.holds_permit
    assert first.statistics()["a"].leased == 1 and first.statistics()["a"].active == 1
    assert first.statistics()["b"].admitted_total == 1 and first.statistics()["b"].leased == 0
    assert second.statistics()["a"].admitted_total == 1 and second.statistics()["a"].refused_total == 0
    held.release()
    assert counters(a1) == (0, 0, 0)


# --- admission: leases ------------------------------------------------------------------------------


def test_try_lease_is_synchronous_and_bounded_by_active_plus_waiting() -> None:
    """try_lease needs no event loop; the (max_active + max_waiting + 1)-th lease is refused."""
    assert not inspect.iscoroutinefunction(CapacityPool.try_lease)
    pool = make_pool(max_active=2, max_waiting=3)
    leases = [pool.try_lease(f"s{i}") for i in range(5)]
    with pytest.raises(CapacityExceededError) as info:
        pool.try_lease("late")
    assert info.value.payload.limit == 5
    leases[0].release()
    leases.append(pool.try_lease("late"))  # a released lease makes room at once
    assert pool.statistics().leased == 5


def test_no_waiting_room_and_unbounded_waiting_room() -> None:
    """max_waiting=0 admits exactly max_active prompts; max_waiting=None never refuses."""
    tight = make_pool(max_active=2, max_waiting=0)
    tight.try_lease("a"), tight.try_lease("b")
    with pytest.raises(CapacityExceededError) as info:
        tight.try_lease("c")
    assert info.value.payload.limit == 2
    roomy = make_pool(max_active=1, max_waiting=None)
    for i in range(1000):
        roomy.try_lease(f"s{i}")
    assert roomy.statistics().leased == 1000 and roomy.statistics().refused_total == 0


def test_refusal_changes_no_counter_and_payload_validates() -> None:
    """A refusal leaves active, waiting, leased and admitted_total as they were (refused_total counts it),
    and its error is a retryable OverloadError whose payload validates against the generated schemas."""
    pool = make_pool(max_active=1, max_waiting=1)
    running = pool.try_lease("s1")
    running.acquire_permit_nowait()
    pool.try_lease("s2")
    before = pool.statistics()
    for _ in range(3):
        with pytest.raises(CapacityExceededError) as info:
            pool.try_lease("s3")
    after = pool.statistics()
    assert msgspec.structs.replace(after, refused_total=before.refused_total) == before
    assert after.refused_total == before.refused_total + 3

    err = info.value
    assert isinstance(err, OverloadError) and err.retryable
    assert err.code == -32005 and err.kind == "capacity_exceeded"
    data = msgspec.to_builtins(err.payload)
    assert data == {
        "errorKind": "capacity_exceeded",
        "backendId": "b",
        "sessionId": "s3",
        "limit": 2,
        "activeCount": 1,
        "waitingCount": 1,
        "retryAfterMs": RETRY_AFTER_MS,
    }
    assert "s3" in err.message and '"b"' in err.message
    assert_error_valid({"code": err.code, "message": err.message, "data": data})
    assert_error_valid(err.to_dict())
    # the schema really checks the payload: a wrong code or a missing field fails
    with pytest.raises(Exception, match="valid"):
        assert_error_valid({"code": -32001, "message": err.message, "data": data})
    with pytest.raises(Exception, match="valid"):
        assert_error_valid({"code": -32005, "message": "m", "data": {k: v for k, v in data.items() if k != "limit"}})


def test_retry_hint_comes_from_the_pool_limits() -> None:
    pool = CapacityPool("slow", PoolLimits(max_active=1, max_waiting=0, retry_after_ms=120_000))
    pool.try_lease("a")
    with pytest.raises(CapacityExceededError) as info:
        pool.try_lease("b")
    assert info.value.payload.retry_after_ms == 120_000


def test_capacity_exceeded_is_registered() -> None:
    """The class, REGISTRY and the committed codes.json agree on kind, code, retryability and fields."""
    assert REGISTRY["capacity_exceeded"] is CapacityExceededError
    codes = json.loads((SCHEMAS / "errors" / "codes.json").read_text())["errors"]
    (entry,) = [e for e in codes if e["errorKind"] == "capacity_exceeded"]
    assert entry["code"] == -32005 and entry["retryable"] is True
    assert entry["class"] == "CapacityExceededError"
    assert entry["dataFields"] == [
        "errorKind", "backendId", "sessionId", "limit", "activeCount", "waitingCount", "retryAfterMs",
    ]
    assert (SCHEMAS / "errors" / "capacity_exceeded.json").exists()


def test_lease_release_is_idempotent_and_a_context_manager() -> None:
    """Releasing twice frees one slot; ``with`` releases on an exception."""
    pool = make_pool(max_active=1, max_waiting=1)
    lease = pool.try_lease("s")
    other = pool.try_lease("t")
    lease.release()
    lease.release()
    assert pool.statistics().leased == 1 and lease.released
    with pytest.raises(ZeroDivisionError), pool.try_lease("u"):
        assert pool.statistics().leased == 2
        1 / 0  # noqa: B018
    assert pool.statistics().leased == 1
    other.release()
    assert counters(pool) == (0, 0, 0)


def test_statistics_is_a_frozen_record() -> None:
    pool = make_pool(max_active=3, max_waiting=4)
    stats = pool.statistics()
    assert isinstance(stats, PoolStatistics)
    assert stats == PoolStatistics(
        active=0, waiting=0, leased=0, admitted_total=0, refused_total=0, max_active=3, max_waiting=4
    )
    with pytest.raises(AttributeError):
        stats.active = 1  # type: ignore[misc]


def test_public_exports() -> None:
    for name in ("CapacityManager", "CapacityPool", "Lease", "Permit", "PoolLimits", "PoolStatistics"):
        assert name in admission.__all__ and hasattr(admission, name)


# --- permits ----------------------------------------------------------------------------------------


@deadlock_fails
async def test_fifo_handoff_order(autojump_clock: trio.testing.MockClock) -> None:
    """Waiters get the permit in arrival order, each handed over inside the previous release."""
    pool = make_pool(max_active=1)
    holder = pool.try_lease("h")
    await holder.acquire_permit()
    log: list[str] = []
    names = [f"w{i}" for i in range(8)]
    async with trio.open_nursery() as nursery:
        for name in names:
            nursery.start_soon(call, pool.try_lease(name), log, name)
            await wait_all_tasks_blocked()
        assert counters(pool) == (1, 8, 9)
        holder.release_permit()
        # the handoff is synchronous: the permit already belongs to w0, nothing is free
        assert counters(pool) == (1, 7, 9)
        holder.release()
    assert log == names
    assert counters(pool) == (0, 0, 0)


@deadlock_fails
async def test_no_barging_at_the_moment_of_release(autojump_clock: trio.testing.MockClock) -> None:
    """A caller arriving in the same tick as a release cannot grab the permit while others wait."""
    pool = make_pool(max_active=2)
    holders = [pool.try_lease(f"h{i}") for i in range(2)]
    for lease in holders:
        lease.acquire_permit_nowait()
    log: list[str] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(call, pool.try_lease("waiter"), log, "waiter")
        await wait_all_tasks_blocked()
        newcomer = pool.try_lease("newcomer")
        holders[0].release_permit()
        with pytest.raises(trio.WouldBlock):
            newcomer.acquire_permit_nowait()
        nursery.start_soon(call, newcomer, log, "newcomer")  # queues behind, does not barge
        holders[1].release_permit()
    assert log == ["waiter", "newcomer"]
    assert pool.statistics().active == 0


@deadlock_fails
async def test_cancelled_waiter_is_removed_and_never_runs(autojump_clock: trio.testing.MockClock) -> None:
    """A waiter cancelled in the queue leaves it at once, never calls the backend, and the permit skips it."""
    pool = make_pool(max_active=1)
    holder = pool.try_lease("h")
    await holder.acquire_permit()
    log: list[str] = []
    scopes = {name: trio.CancelScope() for name in ("a", "b", "c")}

    async def waiter(name: str) -> None:
        with scopes[name], pool.try_lease(name) as lease:
            await call(lease, log, name)

    async with trio.open_nursery() as nursery:
        for name in scopes:
            nursery.start_soon(waiter, name)
            await wait_all_tasks_blocked()
        scopes["b"].cancel()
        assert counters(pool) == (1, 2, 4)  # removed from the queue synchronously by the cancel
        await wait_all_tasks_blocked()
        assert counters(pool) == (1, 2, 3)  # and its lease released on the way out
        holder.release()
    assert log == ["a", "c"]
    assert counters(pool) == (0, 0, 0)


@deadlock_fails
async def test_cancelled_waiter_is_not_retained(autojump_clock: trio.testing.MockClock) -> None:
    """After a cancelled wait the pool keeps no reference to the waiter's task or lease."""
    pool = make_pool(max_active=1)
    holder = pool.try_lease("h")
    holder.acquire_permit_nowait()
    refs: list[weakref.ref[Any]] = []
    scope = trio.CancelScope()

    async def waiter() -> None:
        lease = pool.try_lease("w")
        refs.append(weakref.ref(trio.lowlevel.current_task()))
        refs.append(weakref.ref(lease))
        with scope, lease:
            await lease.acquire_permit()
            raise AssertionError("a cancelled waiter got a permit")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await wait_all_tasks_blocked()
        assert pool.statistics().waiting == 1
        scope.cancel()
    gc.collect()
    assert [r() for r in refs] == [None, None]
    assert counters(pool) == (1, 0, 1)
    holder.release()


async def racing_call(lease: Lease, scope: trio.CancelScope, log: list[str], seen_cancel: list[bool]) -> None:
    """The race's loser-or-winner: a prompt whose call is cancelled around the moment it is granted."""
    with scope, lease:
        async with lease.permit():
            log.append("racer")
            try:
                await trio.sleep(1)  # the backend call: the cancel lands at its first checkpoint
            except trio.Cancelled:
                seen_cancel.append(True)
                raise
            raise AssertionError("the racer's cancel was lost")


@deadlock_fails
async def test_grant_cancel_race_loses_no_permit(autojump_clock: trio.testing.MockClock) -> None:
    """The oldest waiter is cancelled in the same tick its permit is handed over, in both orders, many times.

    Cancel first: it leaves the queue and the permit goes to the next waiter. Grant first: it owns the
    permit, enters its call, sees the cancel at its next checkpoint and hands the permit on. Either way
    every later waiter runs in FIFO order and the pool ends with nothing held or leaked.
    """
    pool = make_pool(max_active=1)
    rng = random.Random(1234)
    admitted = 0
    for i in range(scaled(10_000, 1_000)):
        release_first = i % 2 == 0
        behind = [f"w{j}" for j in range(1 + rng.randrange(3))]
        log: list[str] = []
        seen_cancel: list[bool] = []
        racer_scope = trio.CancelScope()
        holder = pool.try_lease("h")
        holder.acquire_permit_nowait()
        async with trio.open_nursery() as nursery:
            racer = pool.try_lease("r")
            nursery.start_soon(racing_call, racer, racer_scope, log, seen_cancel)
            await wait_all_tasks_blocked()
            for name in behind:
                nursery.start_soon(functools.partial(call, pool.try_lease(name), log, name, hold=rng.random()))
                await wait_all_tasks_blocked()
            assert counters(pool) == (1, 1 + len(behind), 2 + len(behind))

            if release_first:
                holder.release_permit()
                racer_scope.cancel()
                assert racer.holds_permit  # the grant won: the racer owns the permit
            else:
                racer_scope.cancel()
                assert not racer.waiting and not racer.holds_permit
                holder.release_permit()
                assert not racer.holds_permit
            assert counters(pool)[:2] == (1, len(behind) - (0 if release_first else 1))
            holder.release()
            holder.release()
        assert log == (["racer"] if release_first else []) + behind
        assert seen_cancel == ([True] if release_first else []) and racer_scope.cancelled_caught
        assert counters(pool) == (0, 0, 0)
        admitted += 2 + len(behind)
    assert pool.statistics().admitted_total == admitted


@deadlock_fails
async def test_exception_releases_the_permit(autojump_clock: trio.testing.MockClock) -> None:
    """A backend call that raises hands its permit to the next waiter; the lease stays held."""
    pool = make_pool(max_active=1)
    lease = pool.try_lease("s")
    log: list[str] = []
    async with trio.open_nursery() as nursery:
        with pytest.raises(ValueError, match="backend failed"):
            async with lease.permit():
                nursery.start_soon(call, pool.try_lease("next"), log, "next")
                await wait_all_tasks_blocked()
                assert counters(pool) == (1, 1, 2)
                raise ValueError("backend failed")
        assert not lease.holds_permit and not lease.released
        assert counters(pool) == (1, 0, 2)  # the permit now belongs to "next"
    assert log == ["next"]
    assert counters(pool) == (0, 0, 1)
    lease.release()
    assert counters(pool) == (0, 0, 0)


@deadlock_fails
async def test_one_lease_across_retries(autojump_clock: trio.testing.MockClock) -> None:
    """A retry loop takes a permit per attempt under one lease; each retry queues behind earlier waiters."""
    pool = make_pool(max_active=1, max_waiting=3)
    log: list[str] = []
    attempts = 0

    async def prompt_with_retries(lease: Lease) -> None:
        nonlocal attempts
        with lease:
            for _ in range(3):
                try:
                    async with lease.permit():
                        attempts += 1
                        log.append(f"retrying#{attempts}")
                        assert pool.statistics().leased <= 4
                        await trio.sleep(1)
                        if attempts < 3:
                            raise ConnectionError("transient")
                    return
                except ConnectionError:
                    continue

    async with trio.open_nursery() as nursery:
        retrying = pool.try_lease("r")
        nursery.start_soon(prompt_with_retries, retrying)
        await wait_all_tasks_blocked()
        for name in ("x", "y"):
            nursery.start_soon(call, pool.try_lease(name), log, name)
            await wait_all_tasks_blocked()
        stats = pool.statistics()
        assert stats.leased == 3 and stats.admitted_total == 3
    # x and y queued while attempt 1 ran, so attempt 2 waits behind both
    assert log == ["retrying#1", "x", "y", "retrying#2", "retrying#3"]
    stats = pool.statistics()
    assert stats.admitted_total == 3 and stats.leased == 0 and stats.active == 0


@deadlock_fails
async def test_lease_misuse_is_refused(autojump_clock: trio.testing.MockClock) -> None:
    """Permits on a released lease, two permits on one lease, or a stray release_permit raise RuntimeError."""
    pool = make_pool(max_active=2)
    lease = pool.try_lease("s")
    with pytest.raises(RuntimeError, match="holds no permit"):
        lease.release_permit()
    lease.acquire_permit_nowait()
    with pytest.raises(RuntimeError, match="one backend call at a time"):
        lease.acquire_permit_nowait()
    with pytest.raises(RuntimeError, match="one backend call at a time"):
        await lease.acquire_permit()
    assert pool.statistics().active == 1
    lease.release()  # returns the permit with the lease
    assert counters(pool) == (0, 0, 0)
    lease.release_permit()  # a no-op once released: the permit went back with the lease
    assert counters(pool) == (0, 0, 0)
    with pytest.raises(RuntimeError, match="is released"):
        await lease.acquire_permit()
    with pytest.raises(RuntimeError, match="is released"):
        lease.acquire_permit_nowait()


@deadlock_fails
async def test_releasing_a_lease_releases_its_permit_or_its_wait(autojump_clock: trio.testing.MockClock) -> None:
    """Releasing a holding lease hands its permit on; releasing a waiting lease wakes its call with an error."""
    pool = make_pool(max_active=1)
    holder = pool.try_lease("h")
    holder.acquire_permit_nowait()
    log: list[str] = []
    errors: list[BaseException] = []
    doomed = pool.try_lease("doomed")

    async def doomed_call() -> None:
        try:
            await call(doomed, log, "doomed")
        except RuntimeError as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(doomed_call)
        await wait_all_tasks_blocked()
        nursery.start_soon(functools.partial(call, pool.try_lease("next"), log, "next", hold=0))
        await wait_all_tasks_blocked()
        doomed.release()
        assert counters(pool) == (1, 1, 2)
        holder.release()  # while holding: the permit goes to "next"
        assert counters(pool) == (1, 0, 1)
    assert log == ["next"]
    assert len(errors) == 1 and "released while this call waited" in str(errors[0])
    assert counters(pool) == (0, 0, 0)


# --- the whole picture ------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
@deadlock_fails
async def test_random_prompts_never_exceed_the_bounds(autojump_clock: trio.testing.MockClock, seed: int) -> None:
    """1,000 random prompts over 50 sessions (per-session FIFO runners, retries, failures, deadlines):
    never more than max_active backend calls at once, never more than max_active + max_waiting leases,
    and every counter back to zero at the end."""
    max_active, max_waiting, sessions, prompts = 8, 24, 50, 1000
    pool = make_pool(max_active=max_active, max_waiting=max_waiting)
    rng = random.Random(seed)
    running = peak = peak_leased = retries = 0
    outcomes = {"done": 0, "failed": 0, "timed_out": 0}

    async def run_prompt(lease: Lease, attempts: int, deadline: float) -> None:
        nonlocal running, peak, retries
        with lease, trio.move_on_after(deadline) as scope:
            for attempt in range(attempts):
                try:
                    async with lease.permit():
                        running += 1
                        retries += attempt > 0
                        peak = max(peak, running)
                        assert running <= max_active
                        try:
                            await trio.sleep(rng.uniform(0.05, 1.0))
                            if rng.random() < 0.2:
                                raise ConnectionError("flaky backend")
                        finally:
                            running -= 1
                    outcomes["done"] += 1
                    return
                except ConnectionError:
                    if attempt == attempts - 1:
                        outcomes["failed"] += 1
        if scope.cancelled_caught:
            outcomes["timed_out"] += 1

    async def session_runner(queue: trio.MemoryReceiveChannel[tuple[Lease, int, float]]) -> None:
        async with queue:
            async for lease, attempts, deadline in queue:
                await run_prompt(lease, attempts, deadline)

    async with trio.open_nursery() as nursery:
        senders = []
        for _ in range(sessions):
            send, receive = trio.open_memory_channel[tuple[Lease, int, float]](float("inf"))
            senders.append(send)
            nursery.start_soon(session_runner, receive)
        for _ in range(prompts):
            await trio.sleep(rng.expovariate(20.0))
            session = rng.randrange(sessions)
            try:
                lease = pool.try_lease(f"s{session}")
            except CapacityExceededError as exc:
                assert exc.payload.active_count + exc.payload.waiting_count == max_active + max_waiting
                continue
            leased = pool.statistics().leased
            assert leased <= max_active + max_waiting
            peak_leased = max(peak_leased, leased)
            senders[session].send_nowait((lease, rng.randint(1, 3), rng.choice([0.5, 30.0, 30.0, 30.0])))
        for send in senders:
            send.close()

    stats = pool.statistics()
    assert stats.admitted_total + stats.refused_total == prompts
    assert sum(outcomes.values()) == stats.admitted_total
    assert (stats.active, stats.waiting, stats.leased) == (0, 0, 0)
    # the run really hit both bounds and every exit path, or it would prove nothing
    assert peak == max_active and peak_leased == max_active + max_waiting
    assert stats.refused_total > 0 and retries > 0
    assert all(count > 0 for count in outcomes.values()), outcomes
