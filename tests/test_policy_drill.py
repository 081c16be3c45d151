"""The slow-dependency drill of issue G, with our own client SDK and its retry.

An in-process server (``max_running_prompts`` seats, a small waiting room) serves four tenants of
unequal weight over in-memory streams, every session a closed loop of logical prompts sent with
:meth:`SessionClient.prompt` (retry on, ``budget_s`` sent as ``_meta.deadlineMs``). The backend's
latency goes 50 ms -> 2 s -> 50 ms (:attr:`FakeBackend.latency_s`, read when a call starts). All on
trio's MockClock (``autojump_clock``): simulated seconds cost no wall time.

What is measured, per phase:

- **refusals**: every refusal the admission policy logs, with its trio time; they must begin within
  1 s of the slowdown.
- **goodput**: completed prompts, a call straddling the window's edge counted for the part of it
  inside, over **capacity** = seats / latency x window. Windows: the fast phase, the slow phase, and
  the recovered phase from one slow latency after the switch back (calls issued at 2 s before the
  switch still take 2 s: that is the dependency, not the server). Goal: >= 90% in each.
- **attempts per logical prompt after recovery**: the server's ``admittedTotal + refusedTotal``
  growth from the switch back to the end, over the logical prompts the clients started meanwhile
  (the retries of prompts refused during the slowdown count against it). Goal: <= 1.1. That figure
  cannot see a storm *during* the slowdown (an SDK retrying every millisecond still scores ~1.05),
  so the slow phase's refusals are also bounded by what ``retryAfterMs`` (>= 1 s) allows.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest
import trio
import trio.testing

from acp_server.admission import Limits
from acp_server.admission.policy import RETRY_AFTER_MIN_MS, PolicyLimits
from acp_server.client import Client, RetryPolicy, RpcError, connect
from acp_server.server import Server

from .fakes import Call, FakeBackend, hang_guard
from .helpers import scaled

ADMISSION_LOGGER = "acp_server.admission"

SEATS = 8
ROOM = 8
FAST_S = 0.05
SLOW_S = 2.0
#: sessions per tenant: one heavy tenant and three light ones
TENANTS = {"heavy": 8, "t2": 6, "t3": 6, "t4": 6}
THINK_MAX_S = 0.2  # each client thinks uniformly 0..0.2 s between logical prompts
RETRY = RetryPolicy(max_attempts=8, rng=random.Random(7))

#: simulated seconds of each phase (full in make test-full)
PHASE_FAST_S = scaled(6, 3)
PHASE_SLOW_S = scaled(16, 8)
PHASE_RECOVERED_S = scaled(8, 4)


class _RefusalTimes(logging.Handler):
    """Records the trio time of every refusal the admission policy logs."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.times: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(("admission rejected", "admission deferred")):
            self.times.append(trio.current_time())


@contextmanager
def _recording_refusals() -> Iterator[_RefusalTimes]:
    """Record the policy's refusals, kept out of pytest's log capture (thousands of lines).

    Entered in the test's body: pytest attaches its capture to loggers that are non-propagating
    when a test phase starts, not to one that becomes so during it.
    """
    logger = logging.getLogger(ADMISSION_LOGGER)
    handler = _RefusalTimes()
    level, propagate = logger.level, logger.propagate
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


@dataclass
class _Load:
    """What the clients did: when each logical prompt started (trio time), and how they ended."""

    started: list[float] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)

    def ended(self, how: str) -> None:
        self.outcomes[how] = self.outcomes.get(how, 0) + 1


async def _tenant_client(client: Client, tenant: str) -> None:
    # The SDK has no tenant option: initialize by hand with _meta.tenantId.
    result = await client.connection.call(
        "initialize",
        {"protocolVersion": 1, "clientCapabilities": {}, "_meta": {"tenantId": tenant}},
    )
    client.init_result = result


async def _session_loop(client: Client, load: _Load, stop_at: float, rng: random.Random, budget_s: float) -> None:
    session = await client.new_session("/tmp")
    while True:
        await trio.sleep(rng.uniform(0, THINK_MAX_S))
        now = trio.current_time()
        if now >= stop_at:
            return
        load.started.append(now)
        call = session.prompt_call("work", retry=RETRY, budget_s=budget_s)
        try:
            result = await call.run()
        except RpcError as exc:
            load.ended(exc.kind or "error")
        else:
            load.ended(result.stop_reason)


def _useful_seat_s(calls: list[Call], start: float, end: float) -> float:
    """Seat-seconds inside [start, end] spent in backend calls that completed (``end_turn``)."""
    total = 0.0
    for call in calls:
        if call.outcome == "end_turn" and call.ended_at is not None:
            total += max(0.0, min(call.ended_at, end) - max(call.started_at, start))
    return total


@dataclass
class _Figures:
    goodput: dict[str, float]
    capacity: dict[str, float]
    first_refusal_after_slowdown_s: float
    refusals: dict[str, int]
    fast_prompts: int
    slow_prompts: int
    attempts_per_prompt_after_recovery: float
    logical: int
    outcomes: dict[str, int]
    #: seat-seconds of the slow phase spent in calls cut by their deadline, of seats x phase
    wasted_slow_seat_s: tuple[float, float]

    def __str__(self) -> str:
        ratios = {k: f"{self.goodput[k]:.1f}/{self.capacity[k]:.1f} = {self.goodput[k] / self.capacity[k]:.1%}" for k in self.goodput}
        return (
            f"goodput {ratios}; first refusal {self.first_refusal_after_slowdown_s:.3f} s after the slowdown;"
            f" refusals per phase {self.refusals} ({self.fast_prompts} logical prompts in the fast phase);"
            f" attempts per logical prompt after recovery {self.attempts_per_prompt_after_recovery:.3f};"
            f" {self.logical} logical prompts, outcomes {self.outcomes}; slow-phase seat-s spent on calls cut by"
            f" their deadline {self.wasted_slow_seat_s[0]:.1f} of {self.wasted_slow_seat_s[1]:.0f}"
        )


async def _drill(refusals: _RefusalTimes, budget_s: float) -> _Figures:
    backend = FakeBackend()
    backend.latency_s = FAST_S
    policy = PolicyLimits(max_running_prompts=SEATS, max_queued_prompts=ROOM)
    server = Server(Limits(), backend, policy=policy)
    load = _Load()
    t0 = trio.current_time()
    t_slow = t0 + PHASE_FAST_S
    t_back = t_slow + PHASE_SLOW_S
    t_end = t_back + PHASE_RECOVERED_S
    marks: dict[str, int] = {}
    rng = random.Random(20261129)

    async with trio.open_nursery() as nursery:
        await nursery.start(server.bridge.run)

        async def tenant(name: str, sessions: int, seed: int) -> None:
            client_end, server_end = trio.testing.memory_stream_pair()
            nursery.start_soon(server.handle_stream, server_end, name)
            async with connect(client_end, initialize=False) as client:
                await _tenant_client(client, name)
                async with trio.open_nursery() as loops:
                    for i in range(sessions):
                        loops.start_soon(_session_loop, client, load, t_end, random.Random(seed * 100 + i), budget_s)

        async def conductor() -> None:
            await trio.sleep_until(t_slow)
            backend.latency_s = SLOW_S
            await trio.sleep_until(t_back)
            backend.latency_s = FAST_S
            bridge = server.stats_snapshot()["bridge"]
            marks["attempts"] = bridge["admittedTotal"] + bridge["refusedTotal"]
            marks["logical"] = len(load.started)

        async with trio.open_nursery() as clients:
            clients.start_soon(conductor)
            for seed, (name, sessions) in enumerate(TENANTS.items()):
                clients.start_soon(tenant, name, sessions, seed + rng.randrange(1000))
        await trio.testing.wait_all_tasks_blocked()
        end = server.stats_snapshot()
        nursery.cancel_scope.cancel()

    # After the scenario every gauge is back to 0, and every admitted prompt had one outcome.
    adm = end["admission"]
    assert (adm["running"], adm["waiting"], adm["tenants"]) == (0, 0, {}), adm
    assert adm["grantedTotal"] == adm["releasedTotal"]
    assert adm["admittedTotal"] == adm["grantedTotal"] + adm["expiredTotal"] + adm["cancelledTotal"]
    assert end["bridge"]["pendingPrompts"] == 0
    assert end["bridge"]["settledTotal"] == end["bridge"]["admittedTotal"]
    assert sum(load.outcomes.values()) == len(load.started)

    calls = backend.calls
    windows = {
        "fast": (t0, t_slow, FAST_S),
        "slow": (t_slow, t_back, SLOW_S),
        "recovered": (t_back + SLOW_S, t_end, FAST_S),
    }
    # Completed prompts, a call straddling an edge counted for its part inside: useful seat-time / latency.
    goodput = {k: _useful_seat_s(calls, a, b) / lat for k, (a, b, lat) in windows.items()}
    capacity = {k: SEATS * (b - a) / lat for k, (a, b, lat) in windows.items()}
    wasted = sum(
        c.ended_at - c.started_at
        for c in calls
        if c.outcome != "end_turn" and c.ended_at is not None and t_slow <= c.started_at < t_back
    )
    after = [t - t_slow for t in refusals.times if t >= t_slow]
    attempts = end["bridge"]["admittedTotal"] + end["bridge"]["refusedTotal"] - marks["attempts"]
    logical_after = len(load.started) - marks["logical"]
    return _Figures(
        goodput=goodput,
        capacity=capacity,
        first_refusal_after_slowdown_s=after[0] if after else math.inf,
        refusals={
            "fast": sum(1 for t in refusals.times if t < t_slow),
            "slow": sum(1 for t in refusals.times if t_slow <= t < t_back),
            "recovered": sum(1 for t in refusals.times if t >= t_back),
        },
        fast_prompts=sum(1 for t in load.started if t < t_slow),
        slow_prompts=sum(1 for t in load.started if t_slow <= t < t_back),
        attempts_per_prompt_after_recovery=attempts / max(logical_after, 1),
        logical=len(load.started),
        outcomes=dict(load.outcomes),
        wasted_slow_seat_s=(wasted, SEATS * PHASE_SLOW_S),
    )


#: The budget of each logical prompt (``_meta.deadlineMs``), in slow latencies.
GENEROUS = 5 * SLOW_S
TIGHT = 1.5 * SLOW_S


@pytest.mark.slow
@pytest.mark.parametrize(
    "budget_s",
    [
        pytest.param(GENEROUS, id="budget-5x-latency"),
        # Tight: prompts whose deadline is shorter than the seat hold must not start (they would
        # waste their seat); before the engine required the observed hold, goodput fell to ~50%.
        pytest.param(TIGHT, id="budget-1.5x-latency"),
    ],
)
async def test_slow_dependency_drill(budget_s: float, autojump_clock: trio.testing.MockClock) -> None:
    """Backend latency 50 ms -> 2 s -> 50 ms under mixed-tenant load with the SDK's retry: refusals
    begin within 1 s of the slowdown (and are rare before it), goodput stays >= 90% of capacity in
    every phase, and after recovery there are at most 1.1 attempts per logical prompt."""
    with _recording_refusals() as refusals:
        async with hang_guard(60):
            figures = await _drill(refusals, budget_s)
    print(f"budget {budget_s} s: {figures}")
    assert figures.refusals["fast"] <= 0.01 * figures.fast_prompts, str(figures)
    assert figures.first_refusal_after_slowdown_s <= 1.0, str(figures)
    for phase, done in figures.goodput.items():
        assert done >= 0.9 * figures.capacity[phase], f"{phase}: {figures}"
    assert figures.attempts_per_prompt_after_recovery <= 1.1, str(figures)
    # No retry storm during the slowdown either (the figure above cannot see one: it ends with the
    # slowdown): a client retries at most once per retryAfterMs (>= 1 s), so each session is refused
    # at most once per second it waits, plus once per logical prompt it starts.
    storm_bound = sum(TENANTS.values()) * (PHASE_SLOW_S / (RETRY_AFTER_MIN_MS / 1000) + 1) + figures.slow_prompts
    assert figures.refusals["slow"] <= storm_bound, f"retry storm: bound {storm_bound}; {figures}"
