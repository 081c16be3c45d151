"""``acp_server.bridge.runner``: forks at the head of the FIFO, the backend call, policy seats, and the
bridge's lifecycle hooks around them (limits, agent exits, backend close)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import trio
import trio.testing

from acp_server.admission import Limits, PolicyEngine, PolicyLimits, Seat
from acp_server.backends.base import SessionSetup
from acp_server.bridge import SessionBridge
from acp_server.errors import AgentError, BackendUnavailableError, InternalError, SessionLimitExceededError

from .fakes import (
    FakeBackend,
    FakePeer,
    admit_ticket,
    hang_guard,
    open_session,
    prompt_outcome,
    running_bridge,
    text_blocks,
)


async def test_a_prompt_needs_the_bridge_running() -> None:
    bridge = SessionBridge(FakeBackend())
    async with hang_guard(), trio.open_nursery() as nursery:
        await nursery.start(bridge.run)
        session, _ = await open_session(bridge, None)
        nursery.cancel_scope.cancel()
    with pytest.raises(InternalError):
        admit_ticket(bridge, session.session_id, text_blocks("x"), peer=None)


def test_the_default_backend_must_be_in_the_table() -> None:
    with pytest.raises(ValueError, match="default_backend 'c' is not one of"):
        SessionBridge({"a": FakeBackend("a"), "b": FakeBackend("b")}, default_backend="c")


async def test_a_fork_over_max_sessions_fails_without_calling_the_backend() -> None:
    backend = FakeBackend()
    async with running_bridge(backend, Limits(max_sessions=1)) as bridge:
        peer = FakePeer()
        session, _ = await open_session(bridge, peer)
        ticket = bridge.admit_fork(session.session_id, peer, None)
        with pytest.raises(SessionLimitExceededError):
            await bridge.fork_outcome(ticket)
        assert backend.fork_calls == [] and list(bridge.sessions) == [session.session_id]


@pytest.mark.parametrize(
    ("error", "expected"),
    [(AgentError(backend_id="fake", agent_code=-1, agent_message="no"), AgentError), (RuntimeError("bug"), InternalError)],
)
async def test_a_failed_backend_fork_makes_no_session(
    error: Exception, expected: type[Exception], caplog: pytest.LogCaptureFixture
) -> None:
    backend = FakeBackend()
    backend.fail_forks(error)
    async with running_bridge(backend) as bridge:
        peer = FakePeer()
        session, _ = await open_session(bridge, peer)
        with caplog.at_level(logging.ERROR, logger="acp_server.bridge"):
            with pytest.raises(expected):
                await bridge.fork_outcome(bridge.admit_fork(session.session_id, peer, None))
        assert list(bridge.sessions) == [session.session_id]
        assert ("backend fork of" in caplog.text) == (expected is InternalError), "only a bug is logged"
        ticket = admit_ticket(bridge, session.session_id, text_blocks("after"), peer=peer)
        assert (await prompt_outcome(bridge, ticket)).stop_reason == "end_turn", "the FIFO goes on"


class _SlowOpen(FakeBackend):
    """``open_session`` waits for :attr:`gate`; ``close_session`` fails."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = trio.Event()

    async def open_session(self, session_id: str, cwd: str, mcp_servers: list[dict[str, Any]], emit: Any,
                           meta: dict[str, Any] | None = None) -> SessionSetup:
        self.lifecycle.append(("open_session", session_id))
        await self.gate.wait()
        return SessionSetup(modes={"currentModeId": "plan", "availableModes": []})

    async def close_session(self, session_id: str) -> None:
        self.lifecycle.append(("close_session", session_id))
        await trio.lowlevel.checkpoint()
        raise RuntimeError("the agent refuses")


async def test_sessions_opened_at_once_are_counted_again_after_the_backend_answers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two session/new racing for the last slot: the later one is refused after its backend call, and
    its agent-side session is closed (the agent's failure to close is only logged)."""
    caplog.set_level(logging.INFO, logger="acp_server.bridge")
    backend = _SlowOpen()
    async with running_bridge(backend, Limits(max_sessions=1)) as bridge:
        results: list[Any] = []

        async def open_one() -> None:
            try:
                results.append((await open_session(bridge, None))[0])
            except SessionLimitExceededError as exc:
                results.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(open_one)
            nursery.start_soon(open_one)
            await trio.testing.wait_all_tasks_blocked()
            backend.gate.set()
        await trio.testing.wait_all_tasks_blocked()
        live, refused = sorted(results, key=lambda r: isinstance(r, Exception))
        assert isinstance(refused, SessionLimitExceededError) and list(bridge.sessions) == [live.session_id]
        assert live.mode_id == "plan"
        opened = [sid for kind, sid in backend.lifecycle if kind == "open_session"]
        closed = [sid for kind, sid in backend.lifecycle if kind == "close_session"]
        assert len(opened) == 2 and closed == [sid for sid in opened if sid != live.session_id]
        assert "could not close" in caplog.text


async def test_an_agent_exit_fails_only_the_prompts_on_that_backend() -> None:
    a, b = FakeBackend("a"), FakeBackend("b")
    a.hold("on a")
    b.hold("on b")
    a.on_exit = None  # type: ignore[attr-defined]
    b.on_exit = None  # type: ignore[attr-defined]
    bridge = SessionBridge({"a": a, "b": b})
    async with hang_guard(), trio.open_nursery() as nursery:
        await nursery.start(bridge.run)
        peer = FakePeer()
        on_a, _, _ = await bridge.open_session("/tmp", [], peer, backend=a)
        on_b, _, _ = await bridge.open_session("/tmp", [], peer, backend=b)
        ta = admit_ticket(bridge, on_a.session_id, text_blocks("on a"), peer=peer)
        tb = admit_ticket(bridge, on_b.session_id, text_blocks("on b"), peer=peer)
        await a.started("on a")
        await b.started("on b")
        a.on_exit("a", 9)  # type: ignore[attr-defined]
        with pytest.raises(BackendUnavailableError) as info:
            await prompt_outcome(bridge, ta)
        assert (info.value.payload.reason, info.value.payload.exit_code) == ("exited", 9)
        assert not tb.settled
        b.release_all()
        assert (await prompt_outcome(bridge, tb)).stop_reason == "end_turn"
        a.release_all()
        nursery.cancel_scope.cancel()


async def test_heartbeat_without_a_client_id_reports_now() -> None:
    async with running_bridge(FakeBackend()) as bridge:
        session, _ = await open_session(bridge, None)
        before = trio.current_time()
        assert bridge.heartbeat(session, None) > 0
        assert session.last_activity >= before


async def test_a_seat_granted_to_a_prompt_that_settled_meanwhile_goes_back() -> None:
    """The runner waits in the waiting room; the prompt is cancelled as the seat is granted: the seat
    is released at once and the next waiter gets it."""
    backend = FakeBackend()
    backend.hold("holder")
    bridge = SessionBridge(backend, policy=PolicyEngine(PolicyLimits(max_running_prompts=1)))
    async with hang_guard(), trio.open_nursery() as nursery:
        await nursery.start(bridge.run)
        peer = FakePeer()
        first, _ = await open_session(bridge, peer)
        second, _ = await open_session(bridge, peer)
        third, _ = await open_session(bridge, peer)
        holder = admit_ticket(bridge, first.session_id, text_blocks("holder"), peer=peer)
        await backend.started("holder")
        victim = admit_ticket(bridge, second.session_id, text_blocks("victim"), peer=peer)
        after = admit_ticket(bridge, third.session_id, text_blocks("after"), peer=peer)
        await trio.testing.wait_all_tasks_blocked()
        # The holder's call gives its seat to the victim's waiting runner (woken, not yet running);
        # the holder's answer, in the same step, cancels the victim before that runner runs.
        bridge.waiter(holder).subscribe(lambda result, error: bridge.cancel_session(second.session_id, peer))
        backend.release("holder")
        assert (await prompt_outcome(bridge, holder)).stop_reason == "end_turn"
        assert (await prompt_outcome(bridge, victim)).stop_reason == "cancelled"
        assert (await prompt_outcome(bridge, after)).stop_reason == "end_turn"
        await trio.testing.wait_all_tasks_blocked()
        assert backend.calls_of("victim") == []
        stats = bridge.policy.statistics()
        assert (stats.running, stats.waiting) == (0, 0)
        assert isinstance(admit_ticket(bridge, first.session_id, text_blocks("next"), peer=peer).seat, Seat)
        nursery.cancel_scope.cancel()
