"""Retries of refusals for capacity: against the real server on trio's autojump clock (the waits are
``retryAfterMs``, the budget goes out as ``_meta.deadlineMs``, one idempotency key per logical
prompt), and the policy itself (what is retryable, the jittered backoff) on synthetic errors."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing

from acp_server.admission import Limits
from acp_server.client import (
    Attempt,
    PendingPromptLimitError,
    RetryPolicy,
    RpcError,
    SessionClient,
    is_retryable,
    retrying,
)
from acp_server.errors import RETRY_AFTER_MS

from .fakes import FakeBackend
from .helpers import running_server
from .test_client_session import Recorder, client_for

RETRY_AFTER_S = RETRY_AFTER_MS / 1000


class Full:
    """A session whose server-side queue (limit 1) is held full by another client's prompt."""

    def __init__(self, backend: FakeBackend, rec: Recorder, session: SessionClient) -> None:
        self.backend = backend
        self.rec = rec
        self.session = session


@asynccontextmanager
async def full_session() -> AsyncIterator[Full]:
    backend = FakeBackend()
    backend.hold("blocker")
    async with running_server(Limits(max_pending_prompts_per_session=1), backend=backend) as (server, nursery):
        async with client_for(server, nursery) as blocker, client_for(server, nursery) as client:
            session = await client.new_session("/tmp")
            other = await blocker.resume_session(session.session_id, "/tmp")
            blocked = trio.Event()

            async def block() -> None:
                await other.prompt("blocker")
                blocked.set()

            nursery.start_soon(block)
            await backend.started("blocker")
            rec = Recorder(server, "session/prompt")
            yield Full(backend, rec, session)
            backend.release("blocker")
            await blocked.wait()


async def test_retry_waits_retry_after_and_keeps_the_idempotency_key(autojump_clock: trio.testing.MockClock) -> None:
    """A refused prompt is sent again no sooner than ``retryAfterMs`` later, with the same
    idempotency key, and then succeeds."""
    with trio.fail_after(60):
        async with full_session() as full:
            call = full.session.prompt_call("patient", retry=RetryPolicy())

            async def free_after_refusal() -> None:
                await full.rec.wait_for("session/prompt", 1)
                full.backend.release("blocker")

            async with trio.open_nursery() as tasks:
                tasks.start_soon(free_after_refusal)
                result = await call.run()
            assert result.stop_reason == "end_turn"
            assert call.attempts == 2
            first, second = full.rec.times["session/prompt"]
            assert second - first >= RETRY_AFTER_S
            keys = {m["idempotencyKey"] for m in full.rec.metas("session/prompt")}
            assert keys == {call.idempotency_key}
            assert full.session.pending_prompts == 0


async def test_attempts_are_bounded_and_each_carries_the_remaining_budget(autojump_clock: trio.testing.MockClock) -> None:
    """At most 3 attempts by default, ``retryAfterMs`` apart; each sends what is left of the budget
    as ``_meta.deadlineMs``; the last refusal is raised with the server's figures."""
    with trio.fail_after(120):
        async with full_session() as full:
            start = trio.current_time()
            with pytest.raises(PendingPromptLimitError) as info:
                await full.session.prompt("hopeless", retry=RetryPolicy(), budget_s=60)
            assert not info.value.local and info.value.retry_after_ms == RETRY_AFTER_MS
            assert full.rec.count("session/prompt") == 3
            times = [t - start for t in full.rec.times["session/prompt"]]
            assert times[1] - times[0] >= RETRY_AFTER_S and times[2] - times[1] >= RETRY_AFTER_S
            budgets = [m["deadlineMs"] for m in full.rec.metas("session/prompt")]
            assert budgets == [60_000 - round(t * 1000) for t in times]
            assert len({m["idempotencyKey"] for m in full.rec.metas("session/prompt")}) == 1


@pytest.mark.parametrize("how", ["budget", "trio_deadline"])
async def test_retry_gives_up_at_once_when_the_wait_would_cross_the_deadline(
    how: str, autojump_clock: trio.testing.MockClock
) -> None:
    """With 2 s left and a 5 s ``retryAfterMs``, the refusal is raised at once: no sleep, no second
    attempt (the deadline is the ``budget_s`` or an enclosing trio deadline)."""
    with trio.fail_after(60):
        async with full_session() as full:
            start = trio.current_time()
            with pytest.raises(PendingPromptLimitError):
                if how == "budget":
                    await full.session.prompt("in a hurry", retry=RetryPolicy(), budget_s=2)
                else:
                    with trio.move_on_after(2):
                        await full.session.prompt("in a hurry", retry=RetryPolicy())
            assert trio.current_time() - start < 0.5
            assert full.rec.count("session/prompt") == 1
            assert full.rec.metas("session/prompt")[0]["deadlineMs"] == 2000


async def test_non_retryable_errors_are_raised_after_one_attempt(autojump_clock: trio.testing.MockClock) -> None:
    """An error the registry does not mark retryable (a missing session) is not sent again."""
    with trio.fail_after(60):
        async with running_server() as (server, nursery):
            rec = Recorder(server, "session/prompt")
            async with client_for(server, nursery) as client:
                ghost = client.use_session("sess_gone", client_id=None, cwd="/tmp")
                with pytest.raises(RpcError) as info:
                    await ghost.prompt("x", retry=RetryPolicy(max_attempts=5))
                assert info.value.kind == "session_not_found"
                assert rec.count("session/prompt") == 1


# --- the policy on synthetic errors ------------------------------------------------------------------


def _overload(kind: str = "capacity_exceeded", **data: Any) -> RpcError:
    return RpcError(-32005, "busy", {"errorKind": kind, **data})


@pytest.mark.parametrize(
    ("error", "retryable"),
    [
        (_overload(), True),
        (_overload("prompt_queue_full", retryAfterMs=10), True),
        (_overload(safeToRetry=True), True),
        (_overload(safeToRetry=False), False),
        (RpcError(-32002, "gone", {"errorKind": "session_not_found"}), False),
        (RpcError(-32099, "new", {"errorKind": "some_future_kind"}), False),
        (RpcError(-32603, "no kind"), False),
        (PendingPromptLimitError("s", 1, 1), True),
    ],
)
def test_only_registry_retryable_kinds_are_retried(error: RpcError, retryable: bool) -> None:
    """Retryable means: the kind's registry entry says so, and ``safeToRetry`` is not false."""
    assert is_retryable(error) is retryable


async def test_backoff_is_full_jitter_without_retry_after(autojump_clock: trio.testing.MockClock) -> None:
    """Without ``retryAfterMs`` the waits are uniform in ``[0, base * 2**(n-1)]`` (capped), and every
    attempt sees the same key."""
    waits: list[float] = []
    seen: list[Attempt] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        await trio.sleep(seconds)

    async def attempt(a: Attempt) -> str:
        seen.append(a)
        if a.number < 5:
            raise _overload()
        return "ok"

    policy = RetryPolicy(max_attempts=5, base_delay_s=1.0, max_delay_s=3.0, rng=random.Random(7))
    assert await retrying(attempt, policy, sleep=sleep) == "ok"
    ceilings = [1.0, 2.0, 3.0, 3.0]
    assert len(waits) == 4 and all(0 <= w <= c for w, c in zip(waits, ceilings, strict=True))
    assert len({a.idempotency_key for a in seen}) == 1 and [a.number for a in seen] == [1, 2, 3, 4, 5]
    assert all(a.remaining_ms() is None for a in seen)


async def test_unsafe_retry_is_not_attempted(autojump_clock: trio.testing.MockClock) -> None:
    """An error saying ``safeToRetry: false`` is raised after one attempt, whatever its kind."""
    calls = 0

    async def attempt(a: Attempt) -> None:
        nonlocal calls
        calls += 1
        raise _overload(safeToRetry=False, retryAfterMs=1)

    with pytest.raises(RpcError):
        await retrying(attempt, RetryPolicy(max_attempts=3))
    assert calls == 1


def test_policy_refuses_nonsense() -> None:
    """Attempts are a positive integer, delays non-negative seconds."""
    for bad in ({"max_attempts": 0}, {"max_attempts": 1.5}, {"base_delay_s": -1}, {"max_delay_s": float("nan")}):
        with pytest.raises(ValueError):
            RetryPolicy(**bad)
