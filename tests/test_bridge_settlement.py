"""``acp_server.bridge.settlement``: one outcome per prompt, forks failed or cancelled in the FIFO,
and a caller's cancel."""

from __future__ import annotations

import trio
import trio.testing

from acp_server.bridge.session import ForkTicket
from acp_server.errors import RequestCancelledError
from acp_server.types.acp import PromptResult

from .fakes import (
    FakeBackend,
    FakePeer,
    admit_ticket,
    open_session,
    prompt_outcome,
    running_bridge,
    text_blocks,
)


async def test_a_prompt_settles_once_and_later_outcomes_change_nothing() -> None:
    backend = FakeBackend()
    backend.hold("held")
    async with running_bridge(backend) as bridge:
        peer = FakePeer()
        session, _ = await open_session(bridge, peer)
        ticket = admit_ticket(bridge, session.session_id, text_blocks("held"), peer=peer)
        await backend.started("held")
        first = PromptResult(stop_reason="refusal", meta={"promptId": ticket.prompt_id})
        assert bridge.settlement.settle(ticket, first, None)
        assert not bridge.settlement.settle(ticket, None, RequestCancelledError())
        assert ticket.result is first and ticket.error is None and session.pending_count == 0
        assert bridge.statistics().settled_total == 1
        assert (await prompt_outcome(bridge, ticket)).stop_reason == "refusal"


async def test_cancelling_a_session_cancels_a_fork_waiting_behind_its_prompt() -> None:
    """In the step that queued them (no call abandoned): the prompt ends cancelled, the fork too."""
    backend = FakeBackend()
    async with running_bridge(backend) as bridge:
        peer = FakePeer()
        session, _ = await open_session(bridge, peer)
        prompt = admit_ticket(bridge, session.session_id, text_blocks("queued"), peer=peer)
        fork = bridge.admit_fork(session.session_id, peer, None)
        bridge.cancel_session(session.session_id, peer)
        assert prompt.settled and fork.settled
        assert isinstance(fork.error, RequestCancelledError) and fork.done.is_set()
        await trio.testing.wait_all_tasks_blocked()
        assert backend.fork_calls == [] and backend.calls == [], "neither reaches the backend"


async def test_shutdown_cancels_every_prompt_of_every_session() -> None:
    backend = FakeBackend()
    backend.hold("a", "b1", "b2")
    async with running_bridge(backend) as bridge:
        peer = FakePeer()
        one, _ = await open_session(bridge, peer)
        two, _ = await open_session(bridge, peer)
        tickets = [
            admit_ticket(bridge, one.session_id, text_blocks("a"), peer=peer),
            admit_ticket(bridge, two.session_id, text_blocks("b1"), peer=peer),
            admit_ticket(bridge, two.session_id, text_blocks("b2"), peer=peer),
        ]
        await backend.started("b1")
        bridge.cancel_all()
        assert [(await prompt_outcome(bridge, t)).stop_reason for t in tickets] == ["cancelled"] * 3
        assert sorted(backend.texts_started()) == ["a", "b1"], "the queued one never started"


async def test_a_prompt_runs_on_when_its_sender_left_and_another_connection_watches() -> None:
    backend = FakeBackend()
    backend.hold("long")
    async with running_bridge(backend) as bridge:
        sender, watcher = FakePeer(), FakePeer()
        session, _ = await open_session(bridge, sender)
        bridge.register(session, watcher)
        ticket = admit_ticket(bridge, session.session_id, text_blocks("long"), peer=sender)
        waiter = bridge.waiter(ticket)
        answers: list[object] = []
        waiter.subscribe(lambda result, error: answers.append(error))
        await backend.started("long")
        sender.closed = True
        bridge.peer_closed(sender)
        waiter.cancel(connection_lost=True)
        assert not ticket.settled and answers == [], "it runs on, and the gone request gets no answer"
        backend.release("long")
        await ticket.done.wait()
        assert ticket.result is not None and ticket.result.stop_reason == "end_turn"


async def test_a_forks_requester_cancelled_while_it_waits_leaves_it_settled() -> None:
    backend = FakeBackend()
    backend.hold_forks()
    async with running_bridge(backend) as bridge:
        peer = FakePeer()
        session, _ = await open_session(bridge, peer)
        ticket = bridge.admit_fork(session.session_id, peer, None)
        assert isinstance(ticket, ForkTicket)
        with trio.move_on_after(0.01) as scope:
            await bridge.fork_outcome(ticket)
        assert scope.cancelled_caught
        assert ticket.settled and isinstance(ticket.error, RequestCancelledError)
        backend.release_forks()
