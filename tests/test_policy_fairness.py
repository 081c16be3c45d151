"""The admission policy under simulated load: fair queuing against plain FIFO, class shares and
borrowing, tenant rotation, and aging. Each scenario drives a :class:`PolicyEngine` with simulated
prompts (tasks that hold a seat for a scripted time) on trio's autojump clock, so simulated minutes
take milliseconds; the pure waiting room is tested first."""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field

import pytest
import trio
import trio.testing

from acp_server.admission import PolicyEngine, PolicyLimits, Queued, Seat
from acp_server.admission.policy_queue import PRIORITIES, Discipline, QueueEntry, WaitingRoom, rank_of

from .helpers import scaled
from .test_policy import assert_settled

#: Prompt times cycled by every simulated user (each user starts at a different offset), in seconds.
DURATIONS = (0.08, 0.1, 0.12, 0.09, 0.11)


# --- the waiting room alone -------------------------------------------------------------------------


def drain_room(room: WaitingRoom, rank: int) -> list[str]:
    taken = []
    while (entry := room.peek(rank)) is not None:
        room.take(entry)
        taken.append(entry.tenant)
    return taken


def test_room_rotates_over_tenants_fifo_within_each() -> None:
    """Fair queuing serves tenants in turn (FIFO within a tenant); plain FIFO serves arrival order."""
    arrivals = ["a", "a", "a", "a", "b", "c", "b"]
    fair, fifo = WaitingRoom("fair"), WaitingRoom("fifo")
    for room in (fair, fifo):
        for t, tenant in enumerate(arrivals):
            room.push(QueueEntry(tenant, 1), float(t))
    assert drain_room(fair, 1) == ["a", "b", "c", "a", "b", "a", "a"]
    assert drain_room(fifo, 1) == arrivals
    assert len(fair) == len(fifo) == 0


def test_room_skips_ineligible_tenants_and_keeps_their_turn() -> None:
    """A tenant the engine reports at its cap is skipped and keeps its place; removal (cancel) does
    not move the rotation."""
    room = WaitingRoom("fair")
    entries = {name: QueueEntry(name[0], 1) for name in ("a1", "b1", "c1", "a2")}
    for entry in entries.values():
        room.push(entry, 0.0)
    assert room.peek(1, lambda tenant: tenant != "a") is entries["b1"]
    room.take(entries["b1"])
    room.remove(entries["c1"])
    assert room.peek(1) is entries["a1"] and room.count(1) == 2 and room.tenants_waiting(1) == 1


def test_room_ages_low_classes_one_rank_per_period() -> None:
    """Bulk climbs to background after aging_s and to interactive after twice that, never to critical;
    interactive and critical waiters never move; with aging 0 nothing moves."""
    room = WaitingRoom("fair", aging_s=30.0)
    bulk, background, interactive = (QueueEntry("t", rank_of(p)) for p in ("bulk", "background", "interactive"))
    for entry in (bulk, background, interactive):
        room.push(entry, 0.0)
    assert room.age(29.9) == 0 and bulk.rank == 3
    assert room.age(30.0) == 2 and (bulk.rank, background.rank) == (2, 1)
    assert room.age(1000.0) == 1 and bulk.rank == 1 and interactive.rank == 1
    assert [room.count(r) for r in range(4)] == [0, 3, 0, 0]
    assert room.oldest(1) == 0.0 and room.oldest(3) is None
    still = WaitingRoom("fair", aging_s=0)
    entry = QueueEntry("t", 3)
    still.push(entry, 0.0)
    assert still.age(1e9) == 0 and entry.rank == 3


# --- the simulation harness -------------------------------------------------------------------------


@dataclass
class Sim:
    """A simulated load on one engine: every seat held is recorded as (tenant, class, start, end)."""

    engine: PolicyEngine
    intervals: list[tuple[str, str, float, float]] = field(default_factory=list)
    waiting: set[Queued] = field(default_factory=set)
    #: per class, the queue grants in order: (tenant, other tenants of that class waiting at the time)
    grants: dict[int, list[tuple[str, frozenset[str]]]] = field(default_factory=lambda: defaultdict(list))

    def release(self, seat: Seat) -> None:
        """Release ``seat`` and record which waiter it went to, with who else waited in that class."""
        before = {(t, t.rank, t.tenant) for t in self.waiting}
        seat.release()
        granted = [t for t in self.waiting if not t.waiting]
        assert len(granted) <= 1, granted  # one release frees one seat
        for ticket in granted:
            self.waiting.discard(ticket)
            others = frozenset(tenant for t, rank, tenant in before if rank == ticket.rank and t is not ticket)
            self.grants[ticket.rank].append((ticket.tenant, others - {ticket.tenant}))

    async def prompt(self, tenant: str, priority: str, duration: float) -> None:
        got = self.engine.decide(tenant=tenant, priority=priority, session_id=tenant)
        if isinstance(got, Queued):
            self.waiting.add(got)
            got = await got.wait()
        start = trio.current_time()
        try:
            await trio.sleep(duration)
        finally:
            self.release(got)
        self.intervals.append((tenant, got.priority, start, trio.current_time()))

    async def user(self, tenant: str, priority: str, offset: int, stop_at: float) -> None:
        """A closed-loop user: a new prompt as soon as the last one ends, until ``stop_at``."""
        for n in itertools.count(offset):
            if trio.current_time() >= stop_at:
                return
            await self.prompt(tenant, priority, DURATIONS[n % len(DURATIONS)])

    def seat_time(self, by: str, t0: float, t1: float) -> dict[str, float]:
        """Time-averaged seats held in [t0, t1], by tenant (``by="tenant"``) or class (``by="class"``)."""
        held: dict[str, float] = defaultdict(float)
        for tenant, cls, start, end in self.intervals:
            overlap = min(end, t1) - max(start, t0)
            if overlap > 0:
                held[tenant if by == "tenant" else cls] += overlap
        return {key: total / (t1 - t0) for key, total in held.items()}


def max_min_fair(demands: dict[str, float], capacity: float) -> dict[str, float]:
    """Water-filling: every tenant gets min(demand, level), the level using up the capacity."""
    share: dict[str, float] = {}
    left, open_ = capacity, dict(demands)
    while open_:
        level = left / len(open_)
        small = {t: d for t, d in open_.items() if d <= level}
        if not small:
            share.update(dict.fromkeys(open_, level))
            break
        share.update(small)
        left -= sum(small.values())
        for t in small:
            del open_[t]
    return share


async def run_tenants(engine: PolicyEngine, users: dict[str, int], priority: str, stop_at: float) -> Sim:
    sim = Sim(engine)
    async with trio.open_nursery() as nursery:
        offset = 0
        for tenant, count in users.items():
            for _ in range(count):
                nursery.start_soon(sim.user, tenant, priority, offset, stop_at)
                offset += 1
    return sim


# --- fairness ---------------------------------------------------------------------------------------


async def fairness_deviation(discipline: Discipline, stop_at: float) -> float:
    """8 tenants on 8 seats, one with 10x the others' closed-loop demand: the largest relative gap
    between a tenant's time-averaged seats and its max-min fair share."""
    users = {"heavy": 20, **{f"light{i}": 2 for i in range(7)}}
    engine = PolicyEngine(PolicyLimits(max_running_prompts=8), discipline=discipline)
    sim = await run_tenants(engine, users, "interactive", stop_at)
    fair = max_min_fair({t: float(n) for t, n in users.items()}, 8)
    assert fair == dict.fromkeys(users, 1.0)
    got = sim.seat_time("tenant", 5.0, stop_at)
    s = engine.statistics()
    assert s.decisions["queued"] > 0 and s.decisions["rejected.wait_too_long"] == 0
    assert_settled(engine)
    return max(abs(got.get(t, 0.0) - share) / share for t, share in fair.items())


async def test_fair_queuing_gives_max_min_fair_shares(autojump_clock: trio.testing.MockClock) -> None:
    """With fair queuing the tenant sending 10x the demand gets no more than the others: every tenant
    is within 3% of its max-min fair share of the seats."""
    assert await fairness_deviation("fair", scaled(120, 40)) <= 0.03


async def test_plain_fifo_is_unfair_by_more_than_25_percent(autojump_clock: trio.testing.MockClock) -> None:
    """The same load with plain FIFO instead of fair queuing lets the heavy tenant crowd the others
    out: some tenant is more than 25% off its fair share (the fairness check can fail)."""
    assert await fairness_deviation("fifo", scaled(120, 40)) > 0.25


async def test_no_tenant_is_granted_twice_while_another_waits(autojump_clock: trio.testing.MockClock) -> None:
    """Over a minute of uneven demand in two classes, no queue grant goes to the tenant granted just
    before in its class while another tenant of that class waits; under FIFO it does."""
    disciplines: tuple[Discipline, ...] = ("fair", "fifo")
    for discipline in disciplines:
        engine = PolicyEngine(PolicyLimits(max_running_prompts=3, aging_s=0), discipline=discipline)
        sim = Sim(engine)
        stop_at = trio.current_time() + scaled(60, 20)
        async with trio.open_nursery() as nursery:
            offset = 0
            for tenant, priority, count in (("a", "interactive", 6), ("b", "interactive", 2),
                                            ("c", "interactive", 1), ("x", "background", 4), ("y", "background", 1)):
                for _ in range(count):
                    nursery.start_soon(sim.user, tenant, priority, offset, stop_at)
                    offset += 1
        violations = 0
        for rank in (rank_of("interactive"), rank_of("background")):
            grants = sim.grants[rank]
            assert len(grants) > 50 and len({tenant for tenant, _ in grants}) >= 2
            for (prev, _), (tenant, others) in itertools.pairwise(grants):
                if tenant == prev and others:
                    violations += 1
        assert violations == 0 if discipline == "fair" else violations > 10, (discipline, violations)
        assert_settled(engine)


# --- shares, borrowing, aging -----------------------------------------------------------------------


async def test_class_shares_hold_under_saturating_demand(autojump_clock: trio.testing.MockClock) -> None:
    """At 20 seats with every class saturating, the time-averaged running seats are 12/5/2/1
    (interactive/background/critical/bulk) within 0.5."""
    engine = PolicyEngine(PolicyLimits(max_running_prompts=20))
    sim = Sim(engine)
    stop_at = trio.current_time() + scaled(60, 20)
    async with trio.open_nursery() as nursery:
        offset = 0
        for priority in PRIORITIES:
            for tenant in range(3):
                for _ in range(10):
                    nursery.start_soon(sim.user, f"{priority}{tenant}", priority, offset, stop_at)
                    offset += 1
    seats = sim.seat_time("class", 2.0, stop_at)
    assert engine.statistics().decisions["rejected.wait_too_long"] == 0
    for name, share in {"interactive": 12, "background": 5, "critical": 2, "bulk": 1}.items():
        assert seats[name] == pytest.approx(share, abs=0.5), seats
    assert_settled(engine)


async def test_bulk_alone_takes_every_seat_within_one_release_cycle(autojump_clock: trio.testing.MockClock) -> None:
    """Bulk waits while interactive holds all 20 seats, and borrows each seat as it frees once no other
    class waits: 20/20 by the end of one prompt time."""
    engine = PolicyEngine(PolicyLimits(max_running_prompts=20))
    sim = Sim(engine)
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for i in range(20):
            nursery.start_soon(sim.prompt, f"i{i}", "interactive", 0.5 + i / 40)  # the last ends at 0.975 s
        await trio.testing.wait_all_tasks_blocked()
        for i in range(40):
            nursery.start_soon(sim.prompt, f"b{i}", "bulk", 5.0)
        await trio.testing.wait_all_tasks_blocked()
        s = engine.statistics()
        assert (s.classes["interactive"].running, s.classes["bulk"].running, s.classes["bulk"].waiting) == (20, 0, 40)
        await trio.sleep_until(start + 0.975)
        await trio.testing.wait_all_tasks_blocked()
        s = engine.statistics()
        assert (s.classes["interactive"].running, s.classes["bulk"].running, s.classes["bulk"].waiting) == (0, 20, 20)
    assert_settled(engine)


async def aging_scenario(aging_s: float, overload_s: float) -> tuple[float, float]:
    """4 seats saturated by interactive users until ``overload_s``; one bulk prompt arrives at 5 s.
    Returns (when it started after arriving, when the overload ended after its arrival)."""
    engine = PolicyEngine(PolicyLimits(max_running_prompts=4, aging_s=aging_s, interactive_max_wait_ms=0))
    assert engine.shares["bulk"] == 0
    sim = Sim(engine)
    t0 = trio.current_time()
    started: list[float] = []

    async def bulk() -> None:
        await trio.sleep(5.0)
        got = engine.decide(tenant="batch", priority="bulk")
        assert isinstance(got, Queued)
        sim.waiting.add(got)
        seat = await got.wait()
        started.append(trio.current_time() - t0 - 5.0)
        await trio.sleep(1.0)
        sim.release(seat)

    async with trio.open_nursery() as nursery:
        for i in range(12):
            nursery.start_soon(sim.user, f"u{i % 3}", "interactive", i, t0 + overload_s)
        nursery.start_soon(bulk)
    assert_settled(engine)
    return started[0], overload_s - 5.0


async def test_aging_lets_bulk_start_within_aging_plus_one_prompt(autojump_clock: trio.testing.MockClock) -> None:
    """With 4 seats (bulk's share rounds to 0) and saturating interactive demand, a bulk prompt starts
    after aging_s and within aging_s + one prompt time, long before the overload ends."""
    waited, overload_left = await aging_scenario(30.0, 120.0)
    assert 30.0 <= waited <= 30.0 + max(DURATIONS)
    assert overload_left > waited + 60


async def test_without_aging_bulk_waits_out_the_overload(autojump_clock: trio.testing.MockClock) -> None:
    """With aging off the same bulk prompt does not start while interactive demand saturates the seats."""
    waited, overload_left = await aging_scenario(0.0, scaled(300, 120))
    assert waited >= overload_left
